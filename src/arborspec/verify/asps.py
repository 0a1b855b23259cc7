"""Accelerated speculative sampling (ASpS; Hu & Huang, "Accelerated Speculative Sampling Based on Tree Monte Carlo",
ICML 2024, Alg. 1) over a drafted chain.

Standard speculative sampling couples draft and target token by token; ASpS couples over the whole chain: the outcome
"stop after i drafted tokens and emit v" is drawn from one distribution over all (i, v) (`rules.asps_log_neighbor`,
computed in log space), which keeps the target distribution and accepts at least as many tokens in expectation
(Theorems 5.5-5.7). With one drafted token it is exactly standard speculative sampling. Exact for a chain whose
tokens were sampled from the recorded draft distributions.

Its outcome distribution is block verification's (`block.py`, Sun et al. 2025), chain by chain
(tests/verify/test_block.py): the same optimal single-chain rule, drawn from one table instead of n coin tosses.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import TokenTree
from .base import SAMPLED, Verdict, Verifier, drafted_chain, draw, expected_on_chain
from .rules import asps_expected_tokens_by_prefix, asps_log_neighbor, sample_neighbor


class ASpSVerifier(Verifier):
    name = "asps"
    summary = "accelerated speculative sampling (ASpS): one coupling over the whole chain, more tokens than sps"
    accepts = SAMPLED
    chain_only = True

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator) -> Verdict:
        p, nodes, tokens, q = drafted_chain(tree, target_logits, sampling, self.name)
        n = len(tokens)
        if n == 0:
            return Verdict([], draw(p[0], generator))
        row, token = sample_neighbor(asps_log_neighbor(tokens, q, p[nodes[:-1]]), generator)
        if row == n - 1 and token == tokens[-1]:  # the whole chain: the bonus comes from the target after it
            return Verdict(nodes[1:], draw(p[nodes[-1]], generator))
        return Verdict(nodes[1 : row + 1], token)

    def expected_accepted(self, tree: TokenTree, p: torch.Tensor) -> float:
        return expected_on_chain(tree, p, asps_expected_tokens_by_prefix, self.name)
