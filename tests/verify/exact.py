"""Exact enumeration for the verifier tests: small random distributions, every chain or tree a draft can draw with its
probability, and the exact distribution of what a verification rule emits (no sampling anywhere).

- `random_dist`, `random_tree_dists`: target p[prefix] and draft q[prefix] for all prefixes up to some length.
- `random_chain`: one drafted chain's rows and tokens, as the chain rules take them.
- `chain_outcomes`: a chain rule given as an outcome table (`rules.sps_neighbor` layout), over every drafted chain.
- `drafted_trees`: every tree of a given shape (children per layer) drawn by a drawing rule, with its probability.
- `tree_outcomes`: a tree rule given as (node, mass, bonus distribution) outcomes, over every drafted tree.
- `target_joint`: what both must equal, the target's own distribution of the first n + 1 tokens.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from arborspec.core.tree import DrawRule, TokenTree
from arborspec.verify.rules import expected_tokens

D = torch.float64


def random_dist(gen, vocab, zeros=True):
    x = torch.rand(vocab, generator=gen, dtype=D) ** 3
    if zeros:
        x[torch.rand(vocab, generator=gen) < 0.3] = 0
    if x.sum() == 0:
        x[int(torch.randint(vocab, (1,), generator=gen))] = 1
    return x / x.sum()


def random_chain(gen, n, vocab, peaked=False):
    """A drafted chain: draft rows q (n, vocab), target rows p (n + 1, vocab), the n tokens drawn from q's rows.

    peaked: sharp softmax rows with no zeros (logits of scale 6), for the log-space rules' numerics on a large
    vocabulary; otherwise `random_dist` rows, zeros included."""
    if peaked:
        q = (torch.randn(n, vocab, generator=gen, dtype=D) * 6).softmax(-1)
        p = (torch.randn(n + 1, vocab, generator=gen, dtype=D) * 6).softmax(-1)
    else:
        q = torch.stack([random_dist(gen, vocab) for _ in range(n)])
        p = torch.stack([random_dist(gen, vocab) for _ in range(n + 1)])
    return q, p, [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(n)]


def random_tree_dists(seed, vocab, n, zeros=True, same=False):
    """p[prefix] (target) for prefixes up to length n, q[prefix] (draft) up to n - 1."""
    gen = torch.Generator().manual_seed(seed)
    p, q = {}, {}
    for length in range(n + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            p[prefix] = random_dist(gen, vocab, zeros)
            if length < n:
                q[prefix] = p[prefix].clone() if same else random_dist(gen, vocab, zeros)
    return p, q


def target_joint(p, vocab, n):
    return {s: math.prod(float(p[s[:i]][s[i]]) for i in range(n + 1)) for s in itertools.product(range(vocab), repeat=n + 1)}


def extend(emitted: dict[tuple, float], p, vocab, n) -> dict[tuple, float]:
    """Distribution of the first n + 1 tokens when a step emits the sequences `emitted` (with their masses) and the
    target samples the rest."""
    out = {s: 0.0 for s in itertools.product(range(vocab), repeat=n + 1)}
    for e, mass in emitted.items():
        if mass <= 0:
            continue
        for rest in itertools.product(range(vocab), repeat=n + 1 - len(e)):
            s = e + rest
            out[s] += mass * math.prod(float(p[s[:i]][s[i]]) for i in range(len(e), n + 1))
    return out


def chain_outcomes(neighbor_fn, p, q, vocab, n):
    """Exact distribution of the first n + 1 tokens when one step verifies a drafted chain of n tokens and the target
    continues sampling afterwards; also the expected tokens per step and the per-chain full-acceptance probabilities."""
    emitted: dict[tuple, float] = {}
    expected, full = 0.0, {}
    for chain in itertools.product(range(vocab), repeat=n):
        prefixes = [chain[:i] for i in range(n + 1)]
        weight = math.prod(float(q[prefixes[i]][chain[i]]) for i in range(n))
        if weight == 0:
            continue
        neigh = neighbor_fn(list(chain), torch.stack([q[s] for s in prefixes[:n]]), torch.stack([p[s] for s in prefixes]))
        assert float(neigh.sum()) == pytest.approx(1.0, abs=1e-9)
        expected += weight * expected_tokens(neigh, list(chain))
        full[chain] = float(neigh[n - 1, chain[n - 1]])
        for (row, tok), mass in zip(itertools.product(range(n), range(vocab)), neigh.flatten().tolist()):
            if mass > 0:  # row n - 1 with the last drafted token is full acceptance; `extend` draws the bonus
                key = chain[:row] + (tok,)
                emitted[key] = emitted.get(key, 0.0) + weight * mass
    return extend(emitted, p, vocab, n), expected, full


# ---- drawing children ---------------------------------------------------------------------------------------------
def with_replacement_draws(q, k):
    for kids in itertools.product(range(len(q)), repeat=k):
        w = math.prod(float(q[y]) for y in kids)
        if w > 0:
            yield list(kids), w


def without_replacement_draws(q, k):
    support = [i for i in range(len(q)) if q[i] > 0]
    for kids in itertools.permutations(support, min(k, len(support))):
        w, left = 1.0, 1.0
        for y in kids:
            w *= float(q[y]) / left
            left -= float(q[y])
        yield list(kids), w


def greedy_draws(q, k):
    """GREEDY_TOPK_PLUS_ONE: the k-1 most probable tokens of q (ties to the lower id), then one sample from q off them;
    when q has no mass left, only the deterministic children."""
    support = sorted((i for i in range(len(q)) if q[i] > 0), key=lambda i: (-float(q[i]), i))
    fixed = support[: k - 1]
    rest = [i for i in support if i not in fixed]
    if not rest:
        yield fixed, 1.0
        return
    left = sum(float(q[i]) for i in rest)
    for z in rest:
        yield fixed + [z], float(q[z]) / left


DRAWS = {
    DrawRule.WITH_REPLACEMENT: with_replacement_draws,
    DrawRule.WITHOUT_REPLACEMENT: without_replacement_draws,
    DrawRule.GREEDY_TOPK_PLUS_ONE: greedy_draws,
}


def node_output(plan_fn, draws, p, q, k):
    """Exact distribution of the token a one-node rule emits, averaged over the draws of its k children."""
    out = torch.zeros_like(p)
    for kids, w in draws(q, k):
        out += w * plan_fn(p, q, kids).output_distribution(kids)
    return out


# ---- whole trees ----------------------------------------------------------------------------------------------------
def _structures(prefix, depth, branches, q, draws):
    """(weight, [(token, substructure), ...]) for every way the subtree under `prefix` can be drawn."""
    if depth == len(branches):
        yield 1.0, []
        return
    for kids, w in draws(q[prefix], branches[depth]):
        subs = [list(_structures(prefix + (y,), depth + 1, branches, q, draws)) for y in kids]
        for combo in itertools.product(*subs):
            yield w * math.prod(c[0] for c in combo), list(zip(kids, [c[1] for c in combo]))


def drafted_trees(q, branches: list[int], rule: DrawRule):
    """Every tree with branches[d] children per node at depth d drawn by `rule` from q: (weight, tree, prefix of each
    node). The root's token is 0 (it plays no part); the tree records q and the rule at every expanded node."""
    for weight, structure in _structures((), 0, branches, q, DRAWS[rule]):
        yield (weight, *build_tree(q, structure, rule))


def build_tree(q, structure, rule: DrawRule):
    """(tree, prefix of each node) for a drawn structure [(token, substructure), ...] under the root."""
    tree, prefixes = TokenTree.root(0), [()]

    def add(node, struct):
        if struct:
            tree.set_children_dist(node, q[prefixes[node]], rule)
        for y, sub in struct:
            child = tree.add(node, y)
            prefixes.append(prefixes[node] + (y,))
            add(child, sub)

    add(0, structure)
    return tree, prefixes


def tree_outcomes(outcomes_fn, p, q, vocab, branches, rule):
    """Exact distribution of the first len(branches) + 1 tokens when a step verifies every drafted tree with
    `outcomes_fn(tree, P)` (yielding (node, mass, bonus distribution), masses summing to 1 per tree) and the target
    continues sampling; also the expected accepted drafted tokens per step."""
    return outcomes_over(drafted_trees(q, branches, rule), outcomes_fn, p, vocab, len(branches))


def outcomes_over(trees, outcomes_fn, p, vocab, n):
    """`tree_outcomes` over any enumeration of drafted trees (weight, tree, prefixes), none deeper than n."""
    emitted: dict[tuple, float] = {}
    accepted = 0.0
    for weight, tree, prefixes in trees:
        P = torch.stack([p[s] for s in prefixes])
        total = 0.0
        for node, mass, bonus in outcomes_fn(tree, P):
            total += mass
            accepted += weight * mass * len(prefixes[node])
            for t in torch.nonzero(bonus > 0).flatten().tolist():
                key = prefixes[node] + (t,)
                emitted[key] = emitted.get(key, 0.0) + weight * mass * float(bonus[t])
        assert total == pytest.approx(1.0, abs=1e-12)
    return extend(emitted, p, vocab, n), accepted


def sequential(tests):
    """(node, mass, bonus) outcomes from a sequence of (node, accept if reached, bonus) tests such as
    `traversal_plan`'s: the first success wins."""
    reach = 1.0
    for node, a, bonus in tests:
        if reach * a > 0:
            yield node, reach * a, bonus
        reach *= 1 - a


def walk_outcomes(plan_fn):
    """(node, mass, bonus) outcomes of `base.multi_draft_walk` with `plan_fn`, as an `outcomes_fn` for tree_outcomes."""

    def outcomes(tree, P):
        kids = tree.children_lists()

        def visit(node, mass):
            if not kids[node]:
                yield node, mass, P[node]
                return
            tokens = [tree.tokens[c] for c in kids[node]]
            plan = plan_fn(P[node], tree.child_dist[node], tokens)
            reach = 1.0
            for child, a in zip(kids[node], plan.accept):
                yield from visit(child, mass * reach * a)
                reach *= 1 - a
            yield node, mass * reach, plan.fallback

        yield from (o for o in visit(0, 1.0) if o[1] > 0)

    return outcomes


def max_error(got: dict, want: dict) -> float:
    return max(abs(got[s] - want[s]) for s in want)
