"""A stand-in for the draft's session: logits are a seeded random function of (context + path), no model.

The drafting half of the `models.session.Session` protocol (`forward`, `has`, `renumber`), enforcing the same
contract: every ancestor of a node must have been forwarded in an earlier call of this step (same tree) or come
earlier in `nodes`. It counts calls (`forwards`) and rows (`rows`), and keeps each call's nodes with the tree's
size at that call (`calls`).
"""
from __future__ import annotations

import hashlib

import torch

from arborspec.core.sampling import SamplingConfig, make_generator
from arborspec.core.tree import TokenTree
from arborspec.drafting import DraftContext


class FakeSession:
    def __init__(self, vocab: int = 12, seed: int = 0, sharpness: float = 2.0):
        self.vocab, self.seed, self.sharpness = vocab, seed, sharpness
        self.forwards = 0
        self.rows = 0
        self.calls: list[tuple[list[int], int]] = []  # (nodes, len(tree)) of each forward
        self.tree: TokenTree | None = None
        self.slot: dict[int, int] = {}

    def logits_for(self, tokens: tuple[int, ...]) -> torch.Tensor:
        digest = hashlib.blake2b(repr((self.seed, tokens)).encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**62 - 1))
        return torch.randn(self.vocab, generator=gen) * self.sharpness

    def forward(self, context: list[int], tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        if not nodes:
            raise ValueError("forward needs at least one node")
        if tree.tokens[0] != context[-1]:
            raise ValueError("the tree's root must be the last committed token")
        if self.tree is not tree:
            self.tree, self.slot = tree, {}
        rows = []
        for j, node in enumerate(nodes):
            if node in self.slot or node in nodes[:j]:
                raise AssertionError(f"node {node} forwarded twice")
            for anc in tree.path(node)[:-1]:
                if anc not in self.slot and anc not in nodes[:j]:
                    raise AssertionError(f"node {node}'s ancestor {anc} has not been forwarded")
            path = tuple(tree.tokens[i] for i in tree.path(node)[1:])
            rows.append(self.logits_for(tuple(context) + path))
        for node in nodes:
            self.slot[node] = len(self.slot)
        self.forwards += 1
        self.calls.append((list(nodes), len(tree)))
        self.rows += len(nodes)
        return torch.stack(rows)

    def has(self, node: int) -> bool:
        return node in self.slot

    def renumber(self, kept: list[int]) -> None:
        self.slot = {new: self.slot[old] for new, old in enumerate(kept) if old in self.slot}
        self.tree = self.tree.select(kept) if self.tree is not None else None


def fake_context(session: FakeSession, context=(3, 1, 4), temperature: float = 0.0, max_depth: int = 100,
                 seed: int | None = 0, top_k: int = 0, top_p: float = 1.0) -> DraftContext:
    return DraftContext(session, list(context), SamplingConfig(temperature, top_k, top_p), make_generator(seed),
                        max_depth)
