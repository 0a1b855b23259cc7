"""Traversal verification (Weng et al., "Traversal Verification for Speculative Tree Decoding", NeurIPS 2025): the tree
is checked from the leaves up, with sequence-level acceptance.

Token-wise rules (mss, mbr) walk down from the root and stop at the first rejected child, throwing away its subtree.
Traversal verification walks the tree in post-order instead (a node after all of its children, children in drawing
order) and tests each node with the *weight* of its whole path (`rules.weight_step`: alpha(child) = min(1,
alpha(parent) p(y) / q(y)), alpha(root) = 1), so a deep path the target likes can be accepted although one of its
tokens alone would have been rejected. A leaf is accepted with probability alpha and its bonus drawn from the target;
when a node's child is rejected (the child's whole subtree has been), the node's weight and target distribution become
those of `rules.reject_below` (alpha' = R / (R + 1 - alpha), p' = norm(max(alpha p - q, 0))), its later children are
weighed against p', and once all of them are rejected the node itself is tested with alpha' and its bonus drawn from
p'. The root's weight stays 1, so the walk always ends there at the latest. On a chain this is block verification
(`block.py`), the optimal rule for one chain; at the root it is SpecInfer's rule (`mss`).

Which trees it is exact for: the paper states it for children drawn i.i.d. from the draft (WITH replacement), where
the draft distribution stays as it is after a rejection. For children drawn WITHOUT replacement we remove the
rejected child's token from the draft distribution and renormalise (as multi-branch rejection, `mbr`, does); that
variant is ours, not the paper's, and it is exact: tests/verify/test_traversal.py enumerates every tree two to three
layers deep exactly, and the chi-square suite checks it on the static policy's trees. Deterministic children (top-k,
beams) are not draws from q, so it is not exact for them at temperature > 0.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import DrawRule, TokenTree
from .base import SAMPLED, TargetRows, Verdict, Verifier, draft_dist, draw
from .rules import normalize, reject_below, weight_step


def traversal_plan(tree: TokenTree, p: torch.Tensor, who: str = "traversal") -> Iterator[tuple[int, float, torch.Tensor]]:
    """The tests traversal verification makes, in order: (node, probability of accepting it if every earlier test
    failed, the distribution its bonus comes from). p: (len(tree), vocab) float64 target probabilities, a tensor or
    `TargetRows` (only p[node] is read).

    Every test depends only on the earlier ones having failed, so this sequence is fixed by the tree: the verifier
    stops at its first success, and the exact output distribution is a sum over the whole sequence (the tests use
    that). The last item is always the root, with probability 1.
    """
    kids = tree.children_lists()

    def visit(node: int, alpha: float) -> Iterator[tuple[int, float, torch.Tensor]]:
        target = p[node]
        if kids[node]:
            draft = draft_dist(tree, node, who)
            without = tree.child_rule.get(node) == DrawRule.WITHOUT_REPLACEMENT
            for child in kids[node]:
                y = tree.tokens[child]
                yield from visit(child, weight_step(alpha, float(target[y]), float(draft[y])))
                alpha, target = reject_below(alpha, target, draft)
                if without:  # the next child was drawn from what is left of the draft
                    draft = draft.clone()
                    draft[y] = 0
                    draft = normalize(draft)
                    if draft is None:  # the draft has no mass left: no further child can have been drawn
                        break
        yield node, alpha, target

    return visit(0, 1.0)


class TraversalVerifier(Verifier):
    name = "traversal"
    summary = "traversal verification: leaves to root, sequence-level acceptance (children drawn with/without replacement)"
    accepts = SAMPLED

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator) -> Verdict:
        p = TargetRows(target_logits, sampling)  # the walk reads a few rows: each warped when first read
        for node, accept, bonus in traversal_plan(tree, p, self.name):
            if accept >= 1 or float(torch.rand((), generator=generator, dtype=torch.float64)) < accept:
                return Verdict(tree.path(node)[1:], draw(bonus, generator))
        raise AssertionError("traversal verification always accepts the root")  # unreachable: the root's weight is 1

    def expected_accepted(self, tree: TokenTree, p: torch.Tensor) -> float:
        """The tests run in a fixed order and the first success wins: sum of P(reached) * accept * depth."""
        total, reach = 0.0, 1.0
        for node, accept, _ in traversal_plan(tree, p, self.name):
            total += reach * accept * (len(tree.path(node)) - 1)
            reach *= 1.0 - accept
        return total
