"""Standard speculative sampling over a drafted chain (Leviathan et al. 2023; Chen et al. 2023).

At each drafted token y (drawn from the draft's q): accept with probability min(1, p(y)/q(y)); on the first rejection
the bonus is drawn from norm(max(p - q, 0)); when every drafted token is accepted the bonus is drawn from p at the
last node. Exact for a chain whose tokens were sampled from the recorded draft distributions.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import TokenTree
from .base import SAMPLED, Verdict, Verifier, chain_nodes, draft_dist, draw, expected_on_chain, target_probs
from .rules import accept_prob, residual, sps_expected_tokens_by_prefix


class SpSVerifier(Verifier):
    name = "sps"
    summary = "standard speculative sampling over a chain: accept min(1, p/q), else resample norm(max(p - q, 0))"
    accepts = SAMPLED
    chain_only = True

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator) -> Verdict:
        p = target_probs(target_logits, sampling)
        nodes = chain_nodes(tree, self.name)
        path = []
        for parent, child in zip(nodes, nodes[1:]):
            q = draft_dist(tree, parent, self.name)
            y = tree.tokens[child]
            a = accept_prob(float(p[parent, y]), float(q[y]))
            if a < 1 and float(torch.rand((), generator=generator, dtype=torch.float64)) >= a:
                return Verdict(path, draw(residual(p[parent], q), generator))
            path.append(child)
        return Verdict(path, draw(p[nodes[len(path)]], generator))

    def expected_accepted(self, tree: TokenTree, p: torch.Tensor) -> float:
        return expected_on_chain(tree, p, sps_expected_tokens_by_prefix, self.name)
