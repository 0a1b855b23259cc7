"""auto: hardware-aware trees. Each step grows a DySpec-valued tree one draft layer at a time while the next layer
raises the expected tokens per second *on this machine*, and a guard falls back to plain decoding when speculation
is measured slower than plain decoding.

One file per idea, in reading order:

- objective.py: the rate R = E[tokens] / T[seconds] of a step under the measured cost profiles, and why growing stops
  at the first layer that does not pay;
- acceptance.py: a(score), how often a drafted node with a given score is accepted, learned online;
- tree_builder.py: one step's tree, layer by layer (whether to call the draft, which children to add), and why the
  trees stay exact;
- guard.py: the fallback to plain decoding while speculation is measured slower;
- options.py: the policy's options;
- policy.py: the policy that wires them together, adapts the costs to measured step times and explains its choices.
"""
from .options import AutoOptions
from .policy import AutoPolicy

__all__ = ["AutoPolicy", "AutoOptions"]
