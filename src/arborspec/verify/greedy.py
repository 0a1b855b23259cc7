"""Greedy verification: follow the target's argmax down the tree as long as a child carries it.

Exact (token-identical to greedy decoding of the target) for any tree, however it was drawn.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import TokenTree
from .base import Verdict, Verifier, child_with_token


class GreedyVerifier(Verifier):
    name = "greedy"
    summary = "longest path matching the target's argmax (temperature 0)"
    reads_draft = False

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator) -> Verdict:
        if not sampling.greedy:
            raise ValueError("the greedy verifier only preserves the target distribution at temperature 0")
        best = target_logits.argmax(dim=-1).tolist()  # (n,) target's choice after each node
        kids = tree.children_lists()
        node, path = 0, []
        while (child := child_with_token(tree, kids[node], best[node])) is not None:
            path.append(child)
            node = child
        return Verdict(path, best[node])
