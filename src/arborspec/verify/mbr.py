"""Multi-branch rejection (DySpec Alg. 3, corrected as below; Sequoia): exact for children drawn WITHOUT
replacement.

At a node whose children y_1..y_k were drawn one after another without replacement from the draft's D: try them in
order, accepting y with probability min(1, R[y]/D[y]), c ~ U(0, 1) (the listing's N(0, 1) is a typo); after rejecting y:
R <- norm(max(R - D, 0)), D[y] <- 0, D <- norm(D); if D is all zero, stop and draw the bonus from R.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import DrawRule, TokenTree
from .base import TargetRows, Verdict, Verifier, expected_walk, multi_draft_walk
from .rules import mbr_plan


class MBRVerifier(Verifier):
    name = "mbr"
    summary = "multi-branch rejection, DySpec/Sequoia (children drawn without replacement)"
    accepts = frozenset({DrawRule.WITHOUT_REPLACEMENT})

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator) -> Verdict:
        return multi_draft_walk(tree, TargetRows(target_logits, sampling), mbr_plan, self.name, generator)

    def expected_accepted(self, tree: TokenTree, p: torch.Tensor) -> float:
        return expected_walk(tree, p, mbr_plan, self.name)
