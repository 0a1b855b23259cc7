"""The free branches of one decoder behind one object: what the engine calls to graft them, to show them the
target's outputs, and to settle a step.

A decoder asks for prompt-lookup n-grams (ngram.py), suffix-tree continuations (suffix.py over suffix_index.py) and
lookahead's Jacobi window (lookahead.py) by number; `FreeBranches` resolves the method's default (auto grafts
suffix branches: `suffix_nodes`), checks the numbers, keeps the suffix index for the decoder's lifetime (its store
of earlier outputs lets later requests draft from earlier ones), and per generation (`start`) a fresh lookahead
window and graft budget (budget.py). Each step the engine calls

    tree = branches.graft(tree, context, room)   # n-gram, suffix, lookahead, in that order, what pays of each
    branches.observe(logits)                     # the target's rows for that tree: lookahead's Jacobi step
    branches.settle(step.sources, kept)          # the step's outcome: each source's acceptance, judged branches
"""
from __future__ import annotations

import copy

from ...core.options import check_int
from ...core.tree import MAX_TREE_NODES, TokenTree
from .budget import GraftBudget
from .lookahead import Lookahead
from .ngram import add_ngram_branch
from .suffix import default_suffix_nodes, graft_suffix_branches
from .suffix_index import SuffixIndex


def suffix_nodes(method: str | None, suffix: int | None) -> int:
    """The suffix-tree nodes a step of `method` may graft: `suffix` as asked, or for None the method's default
    (suffix.py: default_suffix_nodes); the one place that default is resolved (FreeBranches, and the bench's
    records through RunSpec.suffix_nodes)."""
    return default_suffix_nodes(method) if suffix is None else suffix


class FreeBranches:
    """The draft-free branches a decoder of `method` grafts (see the module docstring); false when it grafts none."""

    def __init__(self, method: str | None, ngram: int = 0, ngram_len: int = 8, suffix: int | None = None,
                 suffix_store: int = 0, lookahead: int = 0, lookahead_ngram: int = 3,
                 lookahead_guesses: int | None = None):
        # branches the caller did not ask for (auto's default suffix branches): at T > 0 the engine grafts them only
        # onto the trees the policy left bare (engine/verifier_choice.py: grafts_bare_trees_only)
        self.by_default = suffix is None and not ngram and not lookahead
        suffix = suffix_nodes(method, suffix)
        for name, value in (("ngram", ngram), ("suffix_store", suffix_store)):
            check_int(value, name, 0)
        for name, value in (("ngram_len", ngram_len), ("suffix", suffix)):  # rows of a step's tree
            check_int(value, name, 0, MAX_TREE_NODES)
        if ngram:  # 0 drafted no n-gram branch and said nothing
            check_int(ngram_len, "ngram_len", 1)
        self.ngram, self.ngram_len = int(ngram), int(ngram_len)  # prompt-lookup branches (ngram.py)
        # suffix branches (suffix.py): up to `suffix` nodes a step, as deep as that (a copied span is a chain)
        self.suffix = int(suffix)
        self.suffix_index = SuffixIndex(max_depth=max(8, self.suffix), store=int(suffix_store)) if suffix else None
        # lookahead branches (lookahead.py): a Jacobi window `lookahead` guesses wide, `lookahead_ngram`-grams, up to
        # `lookahead_guesses` pool n-grams a step (default: as many as the window is wide, the paper's G = W)
        check_int(lookahead, "lookahead", 0)
        lookahead_guesses = lookahead if lookahead_guesses is None else lookahead_guesses
        if lookahead:
            Lookahead(lookahead, lookahead_ngram, lookahead_guesses)  # checks the numbers now, not at the first step
        self.lookahead = (int(lookahead), int(lookahead_ngram), int(lookahead_guesses)) if lookahead else None
        self.policy, self.budget, self.window = None, None, None  # one generation's (`start`)

    def __bool__(self) -> bool:
        return bool(self.ngram or self.suffix or self.lookahead)

    def start(self, policy) -> FreeBranches:
        """These branches for one generation of `policy`: the same suffix index, a fresh lookahead window, and a
        budget that keeps only rows that pay under the policy's measured costs (all of them without costs)."""
        run = copy.copy(self)
        run.policy, run.budget = policy, GraftBudget(getattr(policy, "costs", None))
        run.window = Lookahead(*self.lookahead) if self.lookahead else None
        return run

    def graft(self, tree: TokenTree, context: list[int], room: int) -> TokenTree:
        """`tree` with the branches (n-gram, suffix, lookahead, in that order) that pay under the policy's measured
        costs, or all of them for a policy without costs; nothing deeper than `room` tokens, and no more drafted
        nodes in all than MAX_TREE_NODES (a 1024-node tree with a 1024-node suffix branch overflowed the tree room
        of a llama.cpp context near its window's end)."""
        estimate = self.policy.estimate()

        def spare() -> int:  # drafted nodes the tree may still take
            return max(MAX_TREE_NODES + 1 - len(tree), 0)
        if self.ngram and spare():
            tree, _ = self.budget.graft(tree, "ngram", lambda t: add_ngram_branch(
                t, context, self.ngram, min(self.ngram_len, room, spare())), estimate)
        if self.suffix and spare():
            scores: dict[int, float] = {}
            tree, _ = self.budget.graft(tree, "suffix", lambda t: graft_suffix_branches(
                t, self.suffix_index, context, min(self.suffix, spare()), room, scores=scores), estimate, scores)
        if self.window:
            tree, kept = self.budget.graft(tree, "lookahead", lambda t: self.window.graft(t, context, room, spare()),
                                           estimate)
            if not kept:
                self.window.skip()
        return tree

    def observe(self, logits) -> None:
        """The target's logits of this step's tree (len(tree), vocab), rows as drafted: lookahead's Jacobi step."""
        if self.window:
            self.window.observe(logits)

    def settle(self, sources: dict[str, dict[str, int]], committed: list[int]) -> None:
        """A finished step: its per-source counts (StepStats.sources) and the tokens it committed."""
        self.budget.observe(sources)
        self.budget.settle(committed)

    def describe(self) -> dict:
        """Each source's measured acceptance and the branches left out, for GenerationStats.policy["grafts"]."""
        return self.budget.describe()
