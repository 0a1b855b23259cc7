"""What a verifier promises: which drawing rules it is exact for, and whether it is exact at all.

`verify` walks the tree with the target's logits and returns the accepted nodes (a root-to-node path, root excluded)
and one more token drawn from the target (the "bonus"), so every step commits at least one token.

Which verifier fits which tree (`fits`): a verifier is exact for the drawing rules in its `accepts`, and a `chain_only`
verifier (sps, asps) only for trees with at most one child per node. A chain's single child is one draw, and one
draw is at once "with replacement", "without replacement" and "greedy top-k plus one" with k = 1 (no deterministic
children, one sample from q): the multi-draft rules (mss, mbr, greedy-draft) coincide on a single child (accept with
min(1, p/q), else draw from norm(max(p - q, 0))). So for a policy whose trees are chains, any of these sampled rules
satisfies any verifier that accepts one of them. Deterministic children stay deterministic: a chain of argmax tokens
is not a draw from q, and only rules accepting DETERMINISTIC fit it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.sampling import SamplingConfig, sample_one
from ..core.tree import DrawRule, TokenTree
from .rules import (
    acceptance_bound_without_replacement,
    optimal_acceptance_greedy,
    optimal_acceptance_iid,
    optimal_acceptance_one,
)


@dataclass
class Verdict:
    path: list[int]  # accepted node indices from depth 1 downwards (root excluded)
    bonus: int  # the token the target adds after the last accepted node


class Verifier:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    exact: ClassVar[bool] = True  # preserves the target distribution (token-identical under greedy)
    accepts: ClassVar[frozenset[DrawRule]] = frozenset(DrawRule)  # drawing rules it is exact for
    chain_only: ClassVar[bool] = False  # only handles trees with at most one child per node
    # reads the draft distribution each node's children were drawn from (TokenTree.child_dist): free branches'
    # nodes (n-gram, suffix, lookahead) have none, so it cannot judge a tree that has them, at any temperature
    reads_draft: ClassVar[bool] = True

    def verify(
        self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Verdict:
        """target_logits: (len(tree), vocab), row i = the target's next-token logits after node i's path."""
        raise NotImplementedError

    def expected_accepted(self, tree: TokenTree, p: torch.Tensor) -> float | None:
        """The exact expected number of drafted tokens this rule accepts on `tree` (bonus excluded), given the warped
        target distributions p (len(tree), vocab) float64; None where a rule has no closed form. Comparing rules on
        the same trees this way has no sampling noise (benchmarks/verifiers_same_trees.py)."""
        return None


SAMPLED = frozenset({DrawRule.WITH_REPLACEMENT, DrawRule.WITHOUT_REPLACEMENT})
ONE_DRAW = SAMPLED | {DrawRule.GREEDY_TOPK_PLUS_ONE}  # the rules that all mean "one sample from q" for a single child


def fits(verifier: type[Verifier], rules: set[DrawRule], chain: bool) -> bool:
    """Whether `verifier` is exact for trees whose children are drawn by `rules` (chains if `chain`)."""
    if verifier.chain_only and not chain:
        return False
    accepts = set(verifier.accepts)
    if chain and accepts & ONE_DRAW:
        accepts |= ONE_DRAW  # one draw is with and without replacement, and greedy top-k plus one with k = 1
    return set(rules) <= accepts


def chain_nodes(tree: TokenTree, who: str) -> list[int]:
    """The nodes of a chain tree from the root down (root included); refuses a node with several children."""
    kids = tree.children_lists()
    nodes = [0]
    while kids[nodes[-1]]:
        if len(kids[nodes[-1]]) > 1:
            raise ValueError(f"the {who} verifier needs a chain, but node {nodes[-1]} has {len(kids[nodes[-1]])} children")
        nodes.append(kids[nodes[-1]][0])
    return nodes


def draft_dist(tree: TokenTree, node: int, who: str) -> torch.Tensor:
    """The draft distribution `node`'s children were drawn from (float64)."""
    if node not in tree.child_dist:
        raise ValueError(f"the {who} verifier needs the draft distribution of node {node}'s children; the policy did "
                         "not record it (TokenTree.set_children_dist)")
    return tree.child_dist[node].to(torch.float64)


def drafted_chain(tree: TokenTree, target_logits: torch.Tensor, sampling, who: str):
    """What a chain verifier judges: (p, nodes, tokens, q) = the target's warped distributions at every node
    (n + 1, vocab), the chain's nodes root first, its n drafted tokens, and the draft distributions they were drawn
    from (n, vocab), float64."""
    p = target_probs(target_logits, sampling)
    nodes = chain_nodes(tree, who)
    tokens = [tree.tokens[c] for c in nodes[1:]]
    q = torch.stack([draft_dist(tree, node, who) for node in nodes[:-1]]) if tokens else None
    return p, nodes, tokens, q


def expected_on_chain(tree: TokenTree, p: torch.Tensor, by_prefix, who: str) -> float:
    """A chain rule's expected accepted tokens from its `rules.*_expected_tokens_by_prefix` (tokens per step of every
    prefix, the bonus included): the whole chain's value minus the bonus."""
    nodes = chain_nodes(tree, who)
    tokens = [tree.tokens[c] for c in nodes[1:]]
    if not tokens:
        return 0.0
    q = torch.stack([draft_dist(tree, node, who) for node in nodes[:-1]])
    return by_prefix(tokens, q, p[nodes[:-1]])[-1] - 1.0


def child_with_token(tree: TokenTree, kids: list[int], token: int) -> int | None:
    """The first child among `kids` that carries `token`, or None."""
    for c in kids:
        if tree.tokens[c] == token:
            return c
    return None


def target_probs(target_logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The warped target distribution at every node, (n, vocab) float64: the distribution being preserved."""
    return sampling.probs(target_logits).to(torch.float64)


class TargetRows:
    """`target_probs` row by row, each warped and converted on first use: `rows[node]` is `target_probs(...)[node]`.
    Why: a walk that stops early reads a few rows of a large tree, and warping plus converting every row to float64
    took ~1.1 ms a step (a 20-node tree: 3M values) where traversal verification mostly reads one path's 3-6 rows
    (T = 1 on the default pair, native, Zen 4, 2026-11-26)."""

    def __init__(self, target_logits: torch.Tensor, sampling: SamplingConfig):
        self.logits, self.sampling, self.rows = target_logits, sampling, {}

    def __getitem__(self, node: int) -> torch.Tensor:  # (vocab,) float64
        if node not in self.rows:
            self.rows[node] = target_probs(self.logits[node:node + 1], self.sampling)[0]
        return self.rows[node]

    def __len__(self) -> int:
        return self.logits.shape[0]


def draw(dist: torch.Tensor, generator: torch.Generator | None) -> int:
    return sample_one(dist, generator)  # exact, and 30x cheaper than torch.multinomial over a whole vocabulary


# The best first-token acceptance of each sampled drawing rule, as a function of (p, q, number of children): exact
# closed forms, and for WITHOUT_REPLACEMENT an upper bound (rules.acceptance_bound_without_replacement).
ROOT_OPTIMUM = {
    DrawRule.WITH_REPLACEMENT: optimal_acceptance_iid,
    DrawRule.WITHOUT_REPLACEMENT: acceptance_bound_without_replacement,
    DrawRule.GREEDY_TOPK_PLUS_ONE: optimal_acceptance_greedy,
}


def root_optimum(tree: TokenTree, root_logits: torch.Tensor, sampling: SamplingConfig) -> float | None:
    """The highest probability with which any exact verifier accepts a first token of `tree`, given its root's draft
    distribution, drawing rule and number of children, and the target's logits at the root (vocab,) warped by
    `sampling`. None where the root's children were not sampled (deterministic or grafted children, T = 0, none).

    Every exact verifier emits a first token distributed as the warped target and accepts it only if a root child
    carries it, so its rate of accepting depth 1 is at most this, whatever it does deeper (block, traversal
    included). The bench sets the measured rate beside it ("root acc / opt")."""
    rule = tree.child_rule.get(0)
    kids = sum(1 for parent in tree.parents if parent == 0)
    if rule not in ROOT_OPTIMUM or kids == 0 or 0 not in tree.child_dist:
        return None
    p, q = target_probs(root_logits[None], sampling)[0], tree.child_dist[0]
    if kids == 1:
        return optimal_acceptance_one(p, q)
    return ROOT_OPTIMUM[rule](p, q, kids)


def expected_walk(tree: TokenTree, p: torch.Tensor, plan, who: str) -> float:
    """`multi_draft_walk`'s expected accepted tokens: at each node, child j is entered with the probability that the
    earlier children were rejected and it was accepted, and then contributes 1 plus its own expectation."""
    kids = tree.children_lists()

    def below(node: int) -> float:
        if not kids[node]:
            return 0.0
        result = plan(p[node], draft_dist(tree, node, who), [tree.tokens[c] for c in kids[node]])
        total, reach = 0.0, 1.0
        for child, a in zip(kids[node], result.accept):
            total += reach * a * (1.0 + below(child))
            reach *= 1.0 - a
        return total

    return below(0)


def multi_draft_walk(tree: TokenTree, p: TargetRows, plan, who: str, generator: torch.Generator | None) -> Verdict:
    """Walk down from the root: at each node try its children with `plan(p[node], q, children)` (a
    `rules.MultiDraftPlan`), move into an accepted child, else draw the bonus from the plan's fallback. `p`: the
    target's rows (TargetRows, or a (n, vocab) float64 tensor)."""
    kids = tree.children_lists()
    node, path = 0, []
    while kids[node]:
        children = kids[node]
        tokens = [tree.tokens[c] for c in children]
        result = plan(p[node], draft_dist(tree, node, who), tokens)
        for child, a in zip(children, result.accept):
            if a >= 1 or float(torch.rand((), generator=generator, dtype=torch.float64)) < a:
                break
        else:
            return Verdict(path, draw(result.fallback, generator))
        path.append(child)
        node = child
    return Verdict(path, draw(p[node], generator))
