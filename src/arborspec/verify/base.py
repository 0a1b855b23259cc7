"""What a verifier promises: which drawing rules it is exact for, and whether it is exact at all.

`verify` walks the tree with the target's logits and returns the accepted nodes (a root-to-node path, root excluded)
and one more token drawn from the target (the "bonus"), so every step commits at least one token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..sampling import SamplingConfig
from ..tree import DrawRule, TokenTree


@dataclass
class Verdict:
    path: list[int]  # accepted node indices from depth 1 downwards (root excluded)
    bonus: int  # the token the target adds after the last accepted node


class Verifier:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    exact: ClassVar[bool] = True  # preserves the target distribution (token-identical under greedy)
    accepts: ClassVar[frozenset[DrawRule]] = frozenset(DrawRule)  # drawing rules it is exact for

    def verify(
        self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Verdict:
        """target_logits: (len(tree), vocab), row i = the target's next-token logits after node i's path."""
        raise NotImplementedError


def child_with_token(tree: TokenTree, kids: list[int], token: int) -> int | None:
    """The first child among `kids` that carries `token`, or None."""
    for c in kids:
        if tree.tokens[c] == token:
            return c
    return None
