"""Greedy multi-draft verification (Hu, Zheng, Viswanathan, Chen, Rossi, Wu, Manocha, Huang, "Towards Optimal
Multi-draft Speculative Decoding", ICLR 2025): exact for children drawn GREEDY_TOPK_PLUS_ONE.

At a node with k children drawn that way, the first k-1 are the draft's k-1 most probable tokens (D, deterministic)
and the last, z, is one sample from the draft restricted to the other tokens, q' = norm(q off D). Verification emits
z with probability min(1, p(z) / q'(z)), else a draw from norm(max(p - q', 0)); if a child carries the emitted token
the walk moves into it and repeats there, otherwise the token is the bonus (`rules.greedy_draft_plan`). The target
mass on D is always matched, so a child is accepted with probability p(D) + sum_{x not in D} min(p(x), q'(x)), the
most any exact verifier can accept on these children (`rules.optimal_acceptance_greedy`; tests/verify/
test_greedy_draft.py checks it against the linear program). With k = 1 it is standard speculative sampling.

What a policy must do to draw this way is in docs/verifiers.md: record q (the full draft distribution the sample came
from) with DrawRule.GREEDY_TOPK_PLUS_ONE, add the deterministic children first and the sampled child last.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import DrawRule, TokenTree
from .base import TargetRows, Verdict, Verifier, expected_walk, multi_draft_walk
from .rules import greedy_draft_plan


class GreedyDraftVerifier(Verifier):
    name = "greedy-draft"
    summary = "optimal verification of greedy multi-draft children: k-1 top draft tokens + one sample (Hu et al. 2025)"
    accepts = frozenset({DrawRule.GREEDY_TOPK_PLUS_ONE})

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator) -> Verdict:
        return multi_draft_walk(tree, TargetRows(target_logits, sampling), greedy_draft_plan, self.name, generator)

    def expected_accepted(self, tree: TokenTree, p: torch.Tensor) -> float:
        return expected_walk(tree, p, greedy_draft_plan, self.name)
