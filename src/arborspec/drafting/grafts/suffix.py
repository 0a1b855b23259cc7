"""Suffix drafts: token trees of what followed the context's suffix before, at no draft-model cost (SuffixDecoding).

Each step finds the longest suffix of the committed text that occurred earlier (in this request, or in earlier
outputs when the store is on) and drafts the most frequent continuations that followed it, as a tree: best-first by
empirical path probability (a product of count ratios), at most `budget` nodes and, sized by the match, at most
`factor` x match-length nodes (a long match is a confident one; Oliaro et al., arXiv 2411.04975). The structure and
its costs are in suffix_index.py: appending the committed tokens costs O(depth) each, a query is independent of the
context's length.

Two uses:
- the `suffix` policy: the whole tree comes from the index; no draft model is loaded or called;
- `graft_suffix_branches`: suffix continuations grafted onto a tree a draft model drafted (the successor of
  ngram.py's single prompt-lookup chain), merged with drafted children that carry the same token.

The children are chosen deterministically (counts, not samples), so every node that gets one is DETERMINISTIC:
greedy verification is exact for these trees at T = 0, and at T > 0 only the verifiers exact for any tree (`naive`)
are. Node `probs` hold the empirical probabilities, so budget logic can read them like draft probabilities.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.options import check_int, opt
from ...core.tree import MAX_TREE_NODES, DrawRule, TokenTree
from ..base import DraftContext, Policy
from .suffix_index import Speculation, SuffixIndex

AUTO_SUFFIX = 16  # suffix nodes `auto` may graft a step when the caller names no number (default_suffix_nodes)


def default_suffix_nodes(method: str | None) -> int:
    """How many suffix nodes a step of `method` grafts when the caller does not say: `AUTO_SUFFIX` for `auto`, else
    none.

    Why auto grafts them: where the answer repeats its prompt (code edits, quoting) they are the only drafts that pay
    on a CPU whose draft model cannot (docs/suffix.md), and auto's budget cuts each branch to the prefix whose
    measured acceptance pays for its rows, so where they miss little is grafted (grafts/budget.py). At T > 0 the
    engine grafts these default branches only onto the trees auto leaves bare, verified by naive, and keeps
    traversal for the drafted ones (engine/verifier_choice.py: `grafts_bare_trees_only`); `+suffixN` there asks for
    naive on every tree. Resolved in one place: branches.py, `suffix_nodes`."""
    return AUTO_SUFFIX if method == "auto" else 0


@dataclass
class SuffixOptions:
    budget: int = opt(16, "most drafted tokens per step")
    factor: float = opt(2.0, "at most factor x (match length) tokens per step; 0: always the budget")
    min_match: int = opt(1, "shortest suffix match that drafts anything")
    max_match: int = opt(16, "longest suffix looked up")
    max_depth: int = opt(8, "deepest drafted token")
    min_prob: float = opt(0.0, "leave out tokens whose empirical path probability is below this")
    store: int = opt(0, "tokens of earlier outputs kept for later requests (0: none; whole outputs, oldest evicted)")

    def __post_init__(self):
        for name in ("budget", "max_depth"):  # rows of a step's tree, as every policy's
            check_int(getattr(self, name), name, 1, MAX_TREE_NODES)
        check_int(self.max_match, "max_match", 1)
        for name in ("min_match", "store"):
            check_int(getattr(self, name), name, 0)
        if self.min_match > self.max_match:
            raise ValueError(f"min_match ({self.min_match}) must not exceed max_match ({self.max_match})")
        for name, top in (("factor", None), ("min_prob", 1.0)):  # (factor inf raised OverflowError mid-generation)
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < math.inf or (top is not None and value > top):
                raise ValueError(f"{name} must be a finite number >= 0{f' and <= {top}' if top else ''}, got "
                                 f"{value!r}")


class SuffixPolicy(Policy):
    name = "suffix"
    summary = "no draft model: the most frequent continuations of the longest earlier match of the text's suffix"
    Options = SuffixOptions
    needs_draft = False

    def __init__(self, **options):
        super().__init__(**options)
        opts = self.options
        self.index = SuffixIndex(opts.max_match, opts.max_depth, opts.store)  # lives as long as the policy: the store persists
        self.last = Speculation(0, [])
        self.steps = self.drafted = self.accepted = 0

    @property
    def max_tree_depth(self) -> int:
        return self.options.max_depth

    def draft(self, ctx: DraftContext) -> TokenTree:
        opts = self.options
        self.index.follow(ctx.context)
        self.last = self.index.speculate(opts.budget, min(opts.max_depth, ctx.max_depth), opts.min_match, opts.factor,
                                         opts.min_prob)
        return speculation_tree(ctx.context[-1], self.last)

    def update(self, step) -> None:
        self.steps += 1
        self.drafted += step.tree_size
        self.accepted += step.accepted

    def explain(self) -> dict:
        return {"match": self.last.match, "drafted": len(self.last.nodes), "steps": self.steps,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "store_tokens": self.index.store.tokens}


def speculation_tree(root_token: int, spec: Speculation) -> TokenTree:
    """The speculation as a TokenTree rooted at the last committed token (its node i + 1 is spec.nodes[i])."""
    tree = TokenTree.root(root_token)
    for c in spec.nodes:
        parent = c.parent + 1
        tree.add(parent, c.token, c.prob, source="suffix")
        tree.child_rule[parent] = DrawRule.DETERMINISTIC
    return tree


def graft_suffix_branches(tree: TokenTree, index: SuffixIndex, context: list[int], budget: int,
                          max_depth: int | None = None, min_match: int = 1, factor: float = 0.0,
                          min_prob: float = 0.0, scores: dict[int, float] | None = None) -> TokenTree:
    """Add the `budget` most probable suffix continuations of `context` to `tree` (drafted by any policy), reusing
    children that already carry the same token (they stay credited to their first source, core/tree.py; suffix goes to
    `also`); at most `budget` nodes are added, none deeper than `max_depth`. New nodes are added most probable
    first, parents before children, so every prefix of them is a tree; `scores`, if given, gets each new node's
    empirical path probability (what grafts/budget.py cuts the branch by).

    A node that gets a new child is marked DETERMINISTIC (its children are no longer all drawn from its draft
    distribution). A new node's prob is the draft's probability of its token where the parent recorded one (so the
    tree stays uniform for policies that size by draft probabilities), else the empirical one.
    """
    index.follow(context)
    spec = index.speculate(budget, max_depth, min_match, factor, min_prob)
    kids = tree.children_lists()
    where = []  # where[i] = the tree node of spec.nodes[i]
    for c in spec.nodes:
        parent = where[c.parent] if c.parent >= 0 else 0
        node = next((k for k in kids[parent] if tree.tokens[k] == c.token), None)
        if node is None:
            dist = tree.child_dist.get(parent)
            node = tree.add(parent, c.token, float(dist[c.token]) if dist is not None else c.prob, source="suffix")
            if scores is not None:
                scores[node] = c.path_prob
            tree.child_rule[parent] = DrawRule.DETERMINISTIC
            kids[parent].append(node)
            kids.append([])
        else:
            tree.propose_again(node, "suffix")
        where.append(node)
    return tree
