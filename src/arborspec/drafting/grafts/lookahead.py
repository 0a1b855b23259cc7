"""Lookahead branches: a Jacobi window and an n-gram pool built from the target's own outputs (Fu et al., ICML 2024,
arXiv 2402.02057), grafted onto any drafted tree at no draft-model cost.

Lookahead decoding keeps a window of guesses for the next tokens and improves them by Jacobi iteration inside the
verification forward: every guess is replaced by the target's prediction at its position, given the guesses before it.
The trajectories of these guesses are n-grams the target itself produced in context, and they are collected into a
pool keyed by their first token. Each step, the pool's n-grams that start with the last committed token are proposed
as draft branches and verified in the same forward.

The window is `ngram - 1` levels of `window` guesses each. Level 0's guesses fill positions 1..W after the root;
level l's guess of column j sits at position j + l + 1 and sees level 0's columns before j, then its column's guesses
on the levels above it (the paper's mask, Fig. 2). Each guess therefore sees exactly one token per earlier position,
so the window is a *tree*: level 0 a chain under the root, every column a diagonal chain hanging from its level-0
node. It rides in the engine's one target forward like any other branch, and its nodes are also proposals (level 0
is a draft chain the verifier may accept). After the forward:
- a new level: column j's guess is the target's argmax at the deepest node of column j;
- once the window is full (ngram - 1 levels), column j's tokens down the levels plus its new guess are an n-gram; the
  pool keeps, per first token, the `guesses` most recent distinct ones; the oldest level is dropped.
The window is not realigned when a step commits several tokens: its guesses only feed the pool and the proposals, so
a misaligned window costs acceptance, never exactness (the paper's implementation does the same).

Everything it proposes is a function of the target's earlier outputs, chosen deterministically, so its nodes are
DETERMINISTIC children: exact at T = 0 with any verifier, and at T > 0 only with verifiers exact for arbitrary
proposals (`naive`), which the engine's `fits` check enforces, as for suffix and n-gram branches. The guesses use the
target's argmax at any temperature: they are proposals, never samples.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ...core.tree import MAX_TREE_NODES, TokenTree
from .ngram import graft

SOURCE = "lookahead"


class Lookahead:
    """One request's Jacobi window and n-gram pool: `graft` adds its branches to a step's tree, `observe` reads the
    target's logits of that tree after the forward."""

    def __init__(self, window: int = 4, ngram: int = 3, guesses: int = 4):
        for name, value, low in (("window", window, 1), ("ngram", ngram, 2), ("guesses", guesses, 0)):
            if isinstance(value, bool) or int(value) != value or value < low:
                raise ValueError(f"lookahead {name} must be an integer >= {low}, got {value!r}")
        rows = (int(window) + int(guesses)) * (int(ngram) - 1)  # a full window and pool: 1000x1000 grew ~1M rows a step
        if rows > MAX_TREE_NODES:
            raise ValueError(f"lookahead (window {window} + guesses {guesses}) x (ngram {ngram} - 1) = {rows} tokens a "
                             f"step; a step's tree may hold at most {MAX_TREE_NODES}")
        self.window, self.ngram, self.guesses = int(window), int(ngram), int(guesses)
        self.levels: list[list[int]] = []  # level l: W guesses, column j at position j + l + 1 after the root
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}  # first token -> the n-grams' other tokens
        self.nodes: list[list[int]] = []  # this step's tree node of every window cell, per level ([] if not grafted)

    @property
    def span(self) -> int:
        """Tree depth the window needs: its deepest guess sits at position W + levels - 1."""
        return self.window + len(self.levels) - 1

    def graft(self, tree: TokenTree, context: list[int], room: int, nodes: int = MAX_TREE_NODES) -> TokenTree:
        """Add the pool's n-grams that start with the root token (most recent first), then the window, to `tree`;
        nothing deeper than `room`, at most `nodes` new nodes. The window is left out of a step without room for
        all of it."""
        if not self.levels:  # first step: guesses from the context, the tokens before the root, cycled
            tail = context[-self.window - 1:-1] or context
            self.levels = [[tail[j % len(tail)] for j in range(self.window)]]
        limit = len(tree) + nodes
        for cont in reversed(self.pool.get(context[-1], {})):
            if len(tree) + min(len(cont), room) <= limit:
                graft(tree, list(cont[:room]), SOURCE)
        self.nodes = []
        if room >= self.span and len(tree) + self.window * len(self.levels) <= limit:
            self.nodes.append(graft(tree, self.levels[0], SOURCE))
            for level in self.levels[1:]:
                below = self.nodes[-1]
                self.nodes.append([graft(tree, [tok], SOURCE, under=below[j])[0] for j, tok in enumerate(level)])
        return tree

    def skip(self) -> None:
        """This step's branch was left out of the tree (grafts/budget.py): no Jacobi step from its forward."""
        self.nodes = []

    def observe(self, logits: torch.Tensor) -> None:
        """The Jacobi step, from the target's logits of this step's tree (len(tree), vocab), rows in tree order."""
        if not self.nodes:
            return
        new = logits[self.nodes[-1]].argmax(dim=-1).tolist()  # the target's next guess for every column
        if len(self.levels) == self.ngram - 1:
            for j, first in enumerate(self.levels[0]):
                self._remember(first, tuple(level[j] for level in self.levels[1:]) + (new[j],))
            self.levels.pop(0)
        self.levels.append(new)

    def _remember(self, first: int, cont: tuple[int, ...]) -> None:
        grams = self.pool.setdefault(first, OrderedDict())
        grams[cont] = None
        grams.move_to_end(cont)
        while len(grams) > self.guesses:
            grams.popitem(last=False)  # the least recently produced
