"""The objective of the auto policy: expected tokens per second of one step, under this machine's measured costs.

Costs (measured once per model, dtype, thread count and machine; cached, `costs.profile_model`): t(n), one target
forward over n tree tokens (root included), and d(w), one draft call over w nodes (the cost of drafting one layer).
A step whose draft calls forwarded w_1, ..., w_L nodes (w_1 = 1: the root) and which drafted N nodes takes

    T(S) = sum_l d(w_l) + t(1 + N) + c                                   (c: per-step overhead, measured online)

and commits, in expectation (linearity over the nodes; the bonus token always comes),

    E(S) = 1 + sum_{u in S} a(score_u),      a(score) = P(node u is on the accepted path | its score)

(a(.) is learned online: acceptance.py). The objective is the rate R(S) = E(S) / T(S), tokens per second (STree's
t/tau, eqs. 7-8, with tau = E). Plain decoding is the root-only tree: R_0 = 1 / (t(1) + c).

Why growing stops at the first layer that does not pay: adding a layer of gain g and cost D_l turns R = E/T into
(E + g)/(T + D_l), a weighted mean of R and g/D_l; it raises R iff g/D_l > R. When layer gains shrink and layer costs
do not (the usual case: values are products of probabilities), once g/D_l < R the next layer's ratio is smaller still
while R stays above it, so R is unimodal in the depth and the first non-paying layer is the optimum. Within a layer
the choice of how many children to add is exact (`best_prefix`). tests/drafting/test_auto.py checks both against
brute force on synthetic costs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...tuning.costs import CostCurve


@dataclass
class CostModel:
    """Predicted seconds of one step: draft layers + one target forward + a per-step overhead.

    T(tree) = draft_scale * sum_layers d(w_l) + verify_scale * t(1 + N) + overhead, where w_l is the number of nodes a
    draft call forwards (the root for layer 1), N the drafted nodes. A step without drafting costs
    verify_scale * t(1) + overhead. The scales follow measured step times (machine load, Python work around the
    model calls) when the policy adapts them; with scales 1 and no overhead it is the bare profile.
    """

    target: CostCurve  # t(n), n = tree tokens including the root
    draft: CostCurve  # d(w), w = nodes forwarded by one draft call
    overhead: float = 0.0
    draft_scale: float = 1.0
    verify_scale: float = 1.0
    sharing: int = 1  # requests whose steps share every forward (a batching round, backends/batching.py)

    def layer(self, w):
        return self.draft_scale * self.raw_draft(w)

    def verify(self, n):
        return self.verify_scale * self.raw_verify(n)

    # In a batching round of B = `sharing` requests, one forward runs every request's rows, and a row of one request
    # delays all B. Taking every request's tree to be like this one, the round commits B E tokens in the seconds of
    # forwards over B times the rows, so E / T with row counts times B is the round's rate over B: the objective
    # stays the same expression and ranks trees by what they do to the round. (Without it, trees that paid for one
    # request alone made four batched requests slower than plain batched decoding.)
    def raw_draft(self, w):
        """d(w) in this step's forward: the unscaled profile, at `sharing` times the rows."""
        return self.draft(self.sharing * np.asarray(w))

    def raw_verify(self, n):
        """t(n) in this step's forward: the unscaled profile, at `sharing` times the rows."""
        return self.target(self.sharing * np.asarray(n))

    def plain_step(self) -> float:
        """Predicted seconds per token of plain decoding (a root-only step)."""
        return self.verify(1) + self.overhead


def best_prefix(expected: float, draft_time: float, nodes: int, gains, costs: CostModel,
                max_add: int | None = None) -> tuple[int, float]:
    """How many of `gains` (expected accepted tokens of candidate nodes, best first) to add to a tree that already
    has `nodes` drafted nodes, `expected` tokens per step and `draft_time` seconds of draft calls, to maximise

        rate(m) = (expected + g_1 + ... + g_m) / (draft_time + t(1 + nodes + m) + overhead),   m = 0 .. len(gains).

    Returns (m*, rate(m*)); ties go to the smaller m (a node must strictly pay)."""
    g = np.asarray(gains, dtype=np.float64)[: max_add if max_add is not None else None]
    cum = np.concatenate([[0.0], np.cumsum(g)])
    m = np.arange(len(cum))
    rates = (expected + cum) / (draft_time + costs.verify(1 + nodes + m) + costs.overhead)
    best = int(np.argmax(rates))  # argmax returns the first maximum: the smallest m
    return best, float(rates[best])


def ceiling_rate(costs: CostModel, max_depth: int = 16) -> float:
    """The best rate any tree could reach if every drafted token were accepted: a chain of k nodes (k draft calls of
    one node, one target forward over k + 1 tokens), best k. Below plain decoding's 1 / (t(1) + c), no tree can pay
    for its draft calls on this machine, whatever the acceptance: the policy then leaves the draft model alone."""
    return max((1.0 + k) / (k * costs.layer(1) + costs.verify(1 + k) + costs.overhead) for k in range(1, max_depth + 1))


def expected_ceiling(costs: CostModel, acceptance, child_prob: float, max_depth: int = 16,
                     first_accept: float | None = None) -> float:
    """The best rate of a draft chain at the acceptance measured so far: node i of the chain has path probability
    child_prob ** i (child_prob: the draft's mean top-1 probability, the predictor c_1 of tree_builder.py) and is
    accepted with probability acceptance(child_prob ** i) (the calibration a(.)); best chain length k. Below
    `ceiling_rate`, which assumes every drafted token accepted.

    `first_accept` given (the measured rate at which the root's first child is accepted): node i is accepted with
    probability first_accept ** i instead, the chain of speculative sampling's analysis (each token accepted
    independently at the same rate). The policy passes it once MIN_FIRST_EVIDENCE drafted steps have measured the
    root's first child, at any temperature: at T > 0 a node's score says little about its acceptance and a(.) of the
    mean score fell far below the mean of a(.) (AutoPolicy._expected_rate)."""
    best, gain = 0.0, 1.0
    for k in range(1, max_depth + 1):
        gain += first_accept ** k if first_accept is not None else float(acceptance(child_prob ** k))
        best = max(best, gain / (k * costs.layer(1) + costs.verify(1 + k) + costs.overhead))
    return best


def tree_rate(gains, layer_widths, costs: CostModel) -> float:
    """E[tokens] / T for a tree whose nodes have acceptance probabilities `gains` and whose draft calls forwarded
    `layer_widths` nodes each: (1 + sum gains) / (sum d(w) + t(1 + N) + overhead)."""
    draft = float(sum(costs.layer(w) for w in layer_widths))
    return (1.0 + float(np.sum(gains))) / (draft + costs.verify(1 + len(gains)) + costs.overhead)
