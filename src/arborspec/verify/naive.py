"""Target-sampling verification ("naive"): sample the target's token at the node, and walk into the child carrying it.

Starting at the root, draw t from the target's (warped) distribution at the current node; if a child carries t, move
there and repeat; otherwise t is the bonus. Every committed token is a draw from the target given the text before it,
so this is exact for ANY tree, however its children were chosen (deterministic top-k, beams, samples). It accepts fewer
tokens than the rejection rules, which also use the draft's probabilities. Greedy verification is its temperature-0 case.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import TokenTree
from .base import TargetRows, Verdict, Verifier, child_with_token, draw


class NaiveVerifier(Verifier):
    name = "naive"
    summary = "target sampling: draw from the target, follow the child that carries the token (any tree)"
    reads_draft = False

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator) -> Verdict:
        p = TargetRows(target_logits, sampling)
        kids = tree.children_lists()
        node, path = 0, []
        while True:
            token = draw(p[node], generator)
            child = child_with_token(tree, kids[node], token)
            if child is None:
                return Verdict(path, token)
            path.append(child)
            node = child

    def expected_accepted(self, tree: TokenTree, p: torch.Tensor) -> float:
        """At each node the target's draw enters the first child carrying it: sum over distinct child tokens y of
        p(y) (1 + the child's own expectation)."""
        kids = tree.children_lists()

        def below(node: int) -> float:
            seen = {}
            for c in kids[node]:
                seen.setdefault(tree.tokens[c], c)
            return sum(float(p[node, y]) * (1.0 + below(c)) for y, c in seen.items())

        return below(0)
