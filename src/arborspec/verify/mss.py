"""SpecInfer's multi-step speculative sampling (Miao et al. 2024): exact for children drawn WITH replacement.

At a node whose children y_1..y_k were drawn i.i.d. from the draft's D: try them in order, accepting y with probability
min(1, R[y]/D[y]) (R starts as the target's p); after a rejection R <- norm(max(R - D, 0)) and D stays as it is. If
every child is rejected the bonus is drawn from R; an accepted child's own children are verified the same way.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import DrawRule, TokenTree
from .base import TargetRows, Verdict, Verifier, expected_walk, multi_draft_walk
from .rules import mss_plan


class MSSVerifier(Verifier):
    name = "mss"
    summary = "SpecInfer multi-step speculative sampling (children drawn with replacement)"
    accepts = frozenset({DrawRule.WITH_REPLACEMENT})

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator) -> Verdict:
        return multi_draft_walk(tree, TargetRows(target_logits, sampling), mss_plan, self.name, generator)

    def expected_accepted(self, tree: TokenTree, p: torch.Tensor) -> float:
        return expected_walk(tree, p, mss_plan, self.name)
