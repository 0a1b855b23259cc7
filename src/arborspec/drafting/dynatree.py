"""DynaTree (Chen, Liu, Li): confidence-aware branching, depth gating, probability pruning, history adaptation.

Drafting, breadth first, one draft call per layer (the paper's Alg. 1, App. D, batched by layer):

* a node u at depth d with cumulative draft probability p(u) is *expandable* iff
  ``d < D_max and p >= rho_stop and (d < D0 or p >= rho_deep)`` (and d < the context's depth limit);
* an expanded node gets the B(u) most likely draft tokens as children, where with the confidence
  c(u) = max softmax: ``B = B_min if c >= tau_h, B_max if c < tau_l, else B_mid``;
* probability pruning: a child whose cumulative probability is below `tau` is not added (the paper's "prune leaves
  with p < tau" applied as the tree grows; the root's most likely child is always kept, so every step drafts);
* node budget N_max (`budget`): drafting stops when the tree holds that many drafted tokens. Within a layer the
  expandable nodes are expanded most probable first, so the budget goes to the likeliest paths.

Children are the top tokens of the draft (rule DETERMINISTIC): greedy verification at temperature 0, target
sampling (`naive`) above it, which is exact for any tree.

History adaptation (the paper leaves the schedule open; this is ours). After each step, the acceptance statistic
``a = accepted / depth`` (the fraction of the drafted depth the target accepted, in [0, 1]) enters a history. Once
`window` (W) values are in, their mean a_bar decides:

* ``a_bar >= adapt_high``: draft more aggressively: D0 += 1 (at most D_max - 1) and tau_h -= adapt_step
  (at least tau_l + adapt_step), so more nodes count as confident and take a single child: deeper, narrower trees;
* ``a_bar <= adapt_low``: more conservatively: D0 -= 1 (at least 1) and tau_h += adapt_step (at most 0.99);
* otherwise nothing changes.

After an adjustment the history is cleared, so each change rests on W fresh steps (no run-away from stale values).
The adapted values live in `self.d0` and `self.tau_h` and persist across `generate` calls of the same decoder.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from ..core.options import check_int, opt, parse_bool
from ..core.tree import MAX_TREE_NODES, DrawRule, TokenTree
from .base import DraftContext, Policy


@dataclass
class DynaTreeOptions:
    budget: int = opt(64, "node budget N_max: maximum drafted tokens per step")
    b_min: int = opt(1, "children of a confident node (c >= tau_h)")
    b_mid: int = opt(2, "children of a node with tau_l <= c < tau_h")
    b_max: int = opt(3, "children of an unsure node (c < tau_l)")
    tau_h: float = opt(0.9, "confidence above which a node gets b_min children")
    tau_l: float = opt(0.4, "confidence below which a node gets b_max children")
    d0: int = opt(5, "base depth D0: deeper nodes expand only if their path probability >= rho_deep")
    d_max: int = opt(8, "hard maximum depth D_max")
    rho_stop: float = opt(0.02, "early stopping: nodes with path probability below this are not expanded")
    rho_deep: float = opt(0.3, "deep expansion: beyond D0 only nodes with path probability >= this expand")
    tau: float = opt(0.01, "pruning: children with path probability below this are not added")
    adapt: bool = opt(True, "history adaptation of D0 and tau_h")
    window: int = opt(8, "history window W (steps)")
    adapt_high: float = opt(0.7, "mean acceptance (accepted / depth) above which drafting gets more aggressive")
    adapt_low: float = opt(0.3, "mean acceptance below which drafting gets more conservative")
    adapt_step: float = opt(0.05, "how far one adjustment moves tau_h")

    def __post_init__(self):
        for name in ("budget", "b_min", "b_mid", "b_max", "d0", "d_max", "window"):
            check_int(getattr(self, name), name, high=MAX_TREE_NODES)
        if not self.b_min <= self.b_mid <= self.b_max:
            raise ValueError(f"need b_min <= b_mid <= b_max, got {self.b_min}, {self.b_mid}, {self.b_max}")
        if not 0 < self.tau_l < self.tau_h < 1:
            raise ValueError(f"need 0 < tau_l < tau_h < 1, got tau_l={self.tau_l!r}, tau_h={self.tau_h!r}")
        if not self.d0 < self.d_max:
            raise ValueError(f"need d0 < d_max, got d0={self.d0}, d_max={self.d_max}")
        if not 0 <= self.rho_stop <= self.rho_deep <= 1:
            raise ValueError(f"need 0 <= rho_stop <= rho_deep <= 1, got {self.rho_stop!r}, {self.rho_deep!r}")
        if not 0 <= self.tau < 1:
            raise ValueError(f"tau must be in [0, 1), got {self.tau!r}")
        if not 0 <= self.adapt_low < self.adapt_high <= 1:
            raise ValueError(f"need 0 <= adapt_low < adapt_high <= 1, got {self.adapt_low!r}, {self.adapt_high!r}")
        if not 0 < self.adapt_step < 1:
            raise ValueError(f"adapt_step must be in (0, 1), got {self.adapt_step!r}")
        self.adapt = parse_bool(self.adapt, "adapt")


class DynaTreePolicy(Policy):
    name = "dynatree"
    summary = "DynaTree: per-node branching from draft confidence, depth gating, pruning, history adaptation"
    Options = DynaTreeOptions

    def __init__(self, **options):
        super().__init__(**options)
        self.d0 = self.options.d0
        self.tau_h = self.options.tau_h
        self.history: collections.deque[float] = collections.deque(maxlen=self.options.window)
        # (d0, tau_h) after each of the last 256 adjustments, for inspection: a list grew by one a call, without end,
        # on a decoder kept for a session (the Python API, `arborspec chat`)
        self.adjustments: collections.deque[tuple[int, float]] = collections.deque(maxlen=256)

    @property
    def max_tree_depth(self) -> int:
        return self.options.d_max

    # ---- drafting --------------------------------------------------------------------------------------------
    def expandable(self, depth: int, p: float, max_depth: int) -> bool:
        o = self.options
        return depth < min(o.d_max, max_depth) and p >= o.rho_stop and (depth < self.d0 or p >= o.rho_deep)

    def branching(self, confidence: float) -> int:
        o = self.options
        if confidence >= self.tau_h:
            return o.b_min
        if confidence < o.tau_l:
            return o.b_max
        return o.b_mid

    def draft(self, ctx: DraftContext) -> TokenTree:
        o = self.options
        tree = TokenTree.root(ctx.context[-1])
        cum = [1.0]
        frontier = [0]
        while frontier and len(tree) - 1 < o.budget:
            left = o.budget - (len(tree) - 1)
            ready = [u for u in frontier if self.expandable(tree.depths[u], cum[u], ctx.max_depth)]
            ready = sorted(ready, key=lambda u: (-cum[u], u))[:left]  # each takes >= 1 token of the budget
            if not ready:
                break
            logits = ctx.session.forward(ctx.context, tree, ready)
            warped = ctx.sampling.probs(logits)
            plain = logits.float().softmax(dim=-1)
            frontier = []
            for i, u in enumerate(ready):
                if len(tree) - 1 >= o.budget:
                    break
                k = self.branching(float(plain[i].max()))
                top = torch.topk(plain[i], min(k, plain.shape[-1]))
                tree.set_children_dist(u, warped[i], DrawRule.DETERMINISTIC)
                for rank, (q, tok) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
                    if len(tree) - 1 >= o.budget:
                        break
                    p = cum[u] * q
                    if p < o.tau and not (u == 0 and rank == 0):
                        break  # the rest are even less likely
                    frontier.append(tree.add(u, tok, q))
                    cum.append(p)
        return tree

    # ---- history adaptation ----------------------------------------------------------------------------------
    def update(self, step) -> None:
        o = self.options
        if not o.adapt or step.depth <= 0:
            return
        self.history.append(min(1.0, step.accepted / step.depth))
        if len(self.history) < o.window:
            return
        mean = sum(self.history) / len(self.history)
        if mean >= o.adapt_high:
            self.d0 = min(self.d0 + 1, o.d_max - 1)
            self.tau_h = max(self.tau_h - o.adapt_step, min(self.tau_h, o.tau_l + o.adapt_step))
        elif mean <= o.adapt_low:
            self.d0 = max(self.d0 - 1, 1)
            self.tau_h = min(self.tau_h + o.adapt_step, max(self.tau_h, 0.99))
        else:
            return
        self.history.clear()
        self.adjustments.append((self.d0, self.tau_h))
