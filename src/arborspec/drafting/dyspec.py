"""DySpec (Xiong et al., 2024), Alg. 1: the greedy, heap-driven dynamic token tree with a fixed budget of m tokens.

Every *slot* is one future draw: "the next child of node u". Its value v is the probability (under the paper's
hypothesis "draft probability approximates acceptance") that verification ever tries that draw:

* the first child slot of a new node y, drawn from a slot of value v with residual R, is worth  v * R[y]
  (which is the path probability of y);
* the next sibling slot of y is worth  v * (1 - R[y]), and draws from R with y zeroed and renormalised
  (children of one node are drawn *without replacement*, so the tree is verified exactly by multi-branch rejection,
  `mbr`, at temperature > 0).

Alg. 1 pops the most valuable slot `m` times (drawing y ~ R first, then adding it: the listing has these two lines
swapped). Both children of a slot are worth at most the slot itself (they even sum to it), so the pops come out in
non-increasing value and the tree is the set of the m most valuable slots of the (left-child, right-sibling) slot
tree: App. D's greedy argument makes it the connected tree of size m with the largest total value.

At temperature 0 "drawing" takes the most likely remaining token, so the children of a node are its top tokens in
order (rule DETERMINISTIC) and values use the plain temperature-1 softmax of the draft.

Draft calls. The listing calls the draft once per node (`batch=False` does exactly that). Only a *child* slot needs
the draft (its node's distribution); a sibling slot reuses its parent's. `batch=True` runs the very same pops but
computes distributions lazily: when the top slot belongs to a node that has not been through the draft yet, one draft
call forwards that node together with every other not-yet-forwarded node that can still be expanded. Which are those?
Let r = m - size be the pops left and x_r the r-th largest value in the heap. The final threshold (the value of the
m-th pop) is at least x_r: Alg. 1 pops its maximum each time, so if the r-th pop were worth less than x_r, at least r
slots worth >= x_r would all have been popped before it. Hence no slot below x_r, and none of its descendants (worth
even less), is ever popped: those nodes are certainly leaves and are never forwarded. The converse does not hold: a
slot among the current top r is *not* certain to be popped, because slots that later pops create can outrank it (a
node whose draft distribution is nearly one-hot spawns a child slot almost as valuable as itself). So the batch is the
set of nodes that can still matter (a superset of what Alg. 1 expands, never more than r nodes); the nodes that turn
out not to be expanded are wasted draft rows, reported as `last_wasted`. The tree is identical to `batch=False` given
the same random draws: batching only moves *when* distributions are computed, never what is popped or drawn.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from ..core.options import check_int, opt, parse_bool
from ..core.sampling import SamplingConfig, sample
from ..core.tree import MAX_TREE_NODES, DrawRule, TokenTree
from .auto import AutoPolicy
from .base import DraftContext, Policy


def parse_budget(value, what: str = "budget"):
    """An integer >= 1, or 'auto' (size the tree from measured costs: drafting/auto/)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{what} must be an integer >= 1 or 'auto', got {value!r}") from None
    check_int(value, what, high=MAX_TREE_NODES)
    return value


@dataclass
class DySpecOptions:
    budget: int | str = opt(64, "drafted tokens per step (m in DySpec Alg. 1; the paper's guess length is 64), or "
                                "'auto': size each tree from measured costs (dyspec: like --method auto; other policies: "
                                "the budget is tuned from measured step rates, drafting/budget_tuner.py)")
    batch: bool = opt(True, "batch the draft calls (same tree as Alg. 1, fewer calls); false: one call per node")

    def __post_init__(self):
        self.budget = parse_budget(self.budget)
        self.batch = parse_bool(self.batch, "batch")


class DySpecPolicy(Policy):
    name = "dyspec"
    summary = "DySpec Alg. 1: grow the tree greedily from a heap of draws valued by draft probability (--budget)"
    Options = DySpecOptions
    handles_auto_budget = True  # budget="auto" is the auto policy, not drafting/budget_tuner.py
    sampled_rule = DrawRule.WITHOUT_REPLACEMENT  # verified exactly by mbr

    def __init__(self, **options):
        super().__init__(**options)
        self.last_values: list[float] = []  # per node of the last tree: the value of the slot it was drawn from
        self.last_calls = 0  # draft calls of the last tree
        self.last_wasted = 0  # nodes forwarded through the draft but never expanded
        # budget "auto": the auto policy, whose trees are DySpec-valued and sized from measured costs
        self.auto = AutoPolicy() if self.options.budget == "auto" else None

    @property
    def max_tree_depth(self) -> int:
        return self.auto.max_tree_depth if self.auto else self.options.budget

    def bind(self, target, draft, sampling: SamplingConfig, draft_sampling: SamplingConfig, tokenizer=None,
             verifier: str = "", ssm_tree: str = "packed") -> None:
        if self.auto:
            self.auto.bind(target, draft, sampling, draft_sampling, tokenizer, verifier, ssm_tree)

    def update(self, step) -> None:
        if self.auto:
            self.auto.update(step)

    def explain(self) -> dict:
        return self.auto.explain() if self.auto else {}

    def draft(self, ctx: DraftContext) -> TokenTree:
        if self.auto:
            return self.auto.draft(ctx)
        return _DySpecBuild(ctx, self.options.budget, self.options.batch).run(self)


class _DySpecBuild:
    """One run of Alg. 1 on one step's draft context."""

    def __init__(self, ctx: DraftContext, budget: int, batch: bool):
        self.ctx = ctx
        self.budget = budget
        self.batch = batch
        self.greedy = ctx.sampling.greedy
        self.tree = TokenTree.root(ctx.context[-1])
        self.values = [1.0]
        self.warped: dict[int, torch.Tensor] = {}  # node -> the draft distribution its children come from
        self.plain: dict[int, torch.Tensor] = {}
        self.residual: dict[int, torch.Tensor] = {}  # node -> R of its next child draw (float64)
        self.heap: list[tuple[float, int, int]] = []  # (-value, sequence number, node)
        self.seq = 0
        self.calls = 0
        self.forwarded: list[int] = []

    def run(self, policy: DySpecPolicy) -> TokenTree:
        tree = self.tree
        if self.budget >= 1 and self.ctx.max_depth >= 1:
            self._forward([0])
            self._push(0, 1.0)
            while len(tree) - 1 < self.budget and self.heap:
                neg, _, node = heapq.heappop(self.heap)
                value = -neg
                if node not in self.residual:  # batched mode: this node's distribution is not known yet
                    self._forward(self._batch_for(node))
                self._draw(node, value)
        expanded = {p for p in tree.parents[1:]}
        policy.last_values = self.values
        policy.last_calls = self.calls
        policy.last_wasted = sum(1 for n in self.forwarded if n not in expanded)
        return tree

    # ---- the two halves of one pop ---------------------------------------------------------------------------
    def _draw(self, node: int, value: float) -> None:
        """Draw the next child of `node` from its residual; push its sibling and child slots."""
        tree, R = self.tree, self.residual[node]
        if self.greedy:
            y = int(torch.argmax(R))
        else:
            (y,) = sample(R, self.ctx.generator)
        r = float(R[y])
        if node not in tree.child_rule:
            rule = DrawRule.DETERMINISTIC if self.greedy else DrawRule.WITHOUT_REPLACEMENT
            tree.set_children_dist(node, self.warped[node], rule)
        prob = float(self.plain[node][y]) if self.greedy else float(self.warped[node][y])
        child = tree.add(node, y, prob)
        self.values.append(value)
        # next sibling: R with y removed, renormalised
        rest = R.clone()
        rest[y] = 0.0
        mass = float(rest.sum())
        if mass > 0 and value * (1.0 - r) > 0:
            self.residual[node] = rest / mass
            self._push(node, value * (1.0 - r))
        else:
            self.residual[node] = rest  # exhausted: no slot is pushed for it
        # first child of the new node
        if tree.depths[child] < self.ctx.max_depth and value * r > 0:
            self._push(child, value * r)
            if not self.batch and len(tree) - 1 < self.budget:
                self._forward([child])  # Alg. 1 line 14: one draft call per new node

    def _push(self, node: int, value: float) -> None:
        heapq.heappush(self.heap, (-value, self.seq, node))
        self.seq += 1

    # ---- draft calls -----------------------------------------------------------------------------------------
    def _batch_for(self, node: int) -> list[int]:
        """`node` plus every unforwarded node whose slot is among the r best in the heap (r = pops left)."""
        left = self.budget - (len(self.tree) - 1)
        best = heapq.nsmallest(left - 1, self.heap) if left > 1 else []
        nodes = {node} | {n for _, _, n in best if n not in self.residual}
        return sorted(nodes)  # unforwarded nodes all have forwarded parents, so any order is parents-first

    def _forward(self, nodes: list[int]) -> None:
        logits = self.ctx.session.forward(self.ctx.context, self.tree, nodes)
        self.calls += 1
        warped = self.ctx.sampling.probs(logits)
        plain = logits.float().softmax(dim=-1)
        for i, n in enumerate(nodes):
            self.warped[n], self.plain[n] = warped[i], plain[i]
            base = plain[i] if self.greedy else warped[i]
            self.residual[n] = base.double()
            self.forwarded.append(n)
