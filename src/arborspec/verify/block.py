"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh, "Block Verification Accelerates
Speculative Decoding", ICLR 2025, Alg. 2) over a drafted chain.

Standard speculative sampling decides token by token and stops at the first rejection. Block verification decides on
the chain as a whole: it carries a weight w_i = min(1, w_{i-1} p(y_i) / q(y_i)) down the chain (a token the target
likes more than the draft can make up for an earlier one it liked less), then tries the longest prefix first: all n
tokens with probability w_n, else n-1 tokens with probability stop[n-1], and so on down to none, each with its own
uniform (`rules.block_plan`); the bonus after exactly i < n accepted tokens comes from norm(max(w_i p - q, 0)) at
position i + 1. It emits the target's distribution, accepts at least as many tokens as standard speculative sampling
in expectation over the draft's draws (per drafted chain it can accept fewer), and no exact verifier of one chain
that sees only the drafted tokens and the two models' conditionals along it accepts more. Exact for a chain whose
tokens were sampled from the recorded draft distributions (one draw per node: with or without replacement alike).

Its outcome distribution equals ASpS's (`asps`, Hu & Huang 2024) chain by chain (tests/verify/test_block.py), so the
two accept exactly the same; block verification draws it with n uniforms and one residual instead of one draw from
an (n, vocab) table. See docs/verifiers.md.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import TokenTree
from .base import SAMPLED, Verdict, Verifier, drafted_chain, draw, expected_on_chain
from .rules import block_expected_tokens_by_prefix, block_plan


class BlockVerifier(Verifier):
    name = "block"
    summary = "block verification: the drafted chain judged as a whole, longest prefix first (optimal for one chain)"
    accepts = SAMPLED
    chain_only = True

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator) -> Verdict:
        p, nodes, tokens, q = drafted_chain(tree, target_logits, sampling, self.name)
        n = len(tokens)
        if n == 0:
            return Verdict([], draw(p[0], generator))
        plan = block_plan(tokens, q, p[nodes[:-1]])
        kept = next(i for i in range(n, -1, -1)
                    if plan.stop[i] >= 1 or float(torch.rand((), generator=generator, dtype=torch.float64)) < plan.stop[i])
        if kept == n:
            return Verdict(nodes[1:], draw(p[nodes[-1]], generator))
        return Verdict(nodes[1 : kept + 1], draw(torch.from_numpy(plan.residual[kept]), generator))

    def expected_accepted(self, tree: TokenTree, p: torch.Tensor) -> float:
        return expected_on_chain(tree, p, block_expected_tokens_by_prefix, self.name)
