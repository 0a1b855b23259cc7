"""The seam between the engine / drafting policies and a model backend: one sequence's state on one model.

Every backend (tree attention on transformers in `hf.py`, STree for state-space models in `ssm.py`, llama.cpp)
implements this protocol, so every tree policy and verifier runs on every backend unchanged. A session holds

    [ committed prefix (`cached`) | speculative region: the nodes of the current tree forwarded this step ]

and a step is: one or more `forward` calls over nodes of one tree (a policy drafting layer by layer calls it once per
layer; the target calls it once for the whole tree), then `commit(path)`, which keeps the accepted root-to-node path
and drops every other node of the region.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..core.tree import TokenTree


@runtime_checkable
class Session(Protocol):
    role: str  # "target" or "draft", for messages
    cached: list[int]  # committed token ids whose state the session holds
    forwards: int  # model calls so far, for statistics

    def prefill(self, ids: list[int]) -> None:
        """Process committed tokens (the prompt) without computing logits over the vocabulary."""

    def forward(self, context: list[int], tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        """Logits (len(nodes), vocab), float32, for `nodes` of `tree`, whose root is context[-1]. Every ancestor of a
        node is in the region already or among `nodes` (parents first). Committed tokens the session has not seen
        yet (context[len(cached):-1]) ride along in front of the first forward of a step."""

    def has(self, node: int) -> bool:
        """Whether `node` of the current tree has been forwarded this step (its state is in the region)."""

    def renumber(self, kept: list[int]) -> None:
        """The policy renumbered its tree, keeping nodes `kept` (old indices in their new order: new node i is old
        node kept[i]; root first, parents before children). Follow suit: forget forwarded nodes that were dropped
        (their state may stay in the region until `commit`, which keeps only the path) and renumber the session's
        own copy of the tree (`tree.select(kept)`), because the next `commit` names nodes by their new numbers
        (WETAP prunes its tree after drafting and drafts no more on it)."""

    def commit(self, path: list[int]) -> None:
        """Keep the committed prefix plus the region's nodes on `path` (root first, a chain); drop the rest."""


class TreeRegion:
    """The bookkeeping every backend shares: `slot` maps each node of the current tree forwarded this step to where
    its state lives (a KV offset, a sequence id, ...), and `tree` is the tree those node numbers refer to."""

    slot: dict[int, int]
    tree: TokenTree | None

    def has(self, node: int) -> bool:
        return node in self.slot

    def renumber(self, kept: list[int]) -> None:
        """Follow the policy's renumbering (new node i is old node kept[i]); the state of dropped nodes stays where it
        is until `commit` drops it with the rest of the region."""
        self.slot = {new: self.slot[old] for new, old in enumerate(kept) if old in self.slot}
        if self.tree is not None:
            self.tree = self.tree.select(kept)


class VocabAligned:
    """A draft's session whose logits have the target's width `vocab`: cut (the draft's extra rows are padding past
    the shared tokenizer) or padded with -inf (the draft gives the target's padding ids probability 0). Models that
    share a tokenizer may pad their output tables differently (Qwen2.5's 7B has 152064 rows, its 0.5B 151936); the
    draft then proposed ids the target has no row for (an IndexError), or its distribution was narrower than the
    target's (a broadcast error in every sampled verifier). Everything else is the wrapped session's."""

    def __init__(self, session, vocab: int):
        self.session, self.vocab = session, vocab

    def forward(self, context: list[int], tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        logits = self.session.forward(context, tree, nodes)  # (len(nodes), the draft's rows)
        if logits.shape[-1] >= self.vocab:
            return logits[..., :self.vocab]
        return torch.nn.functional.pad(logits, (0, self.vocab - logits.shape[-1]), value=float("-inf"))

    def __getattr__(self, name: str):
        return getattr(self.session, name)


def vocab_aligned(session, draft_vocab: int, target_vocab: int):
    """`session` (a draft's), as VocabAligned to the target's width where the two differ."""
    return session if draft_vocab == target_vocab else VocabAligned(session, target_vocab)
