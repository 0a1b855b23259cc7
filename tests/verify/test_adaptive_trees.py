"""Trees whose shape depends on the tokens drawn, as `auto` grows them: exact enumeration for mbr and traversal.

`auto` (drafting/auto/tree_builder.py) draws siblings one at a time without replacement and decides before each draw
whether to draw another from the siblings already known; which nodes get children of their own depends on every
node's score, so a child's subtree can depend on the tokens of its *later* siblings. The fixed-shape enumerations of
test_traversal.py / test_equivalence.py do not cover that. Here every tree such a process can draw is enumerated with
its probability, and the emitted tokens must follow the target's distribution exactly:

- siblings: another child is drawn while the draft mass of the drawn ones is below a bound (a stopping rule on the
  past draws, never on the next token);
- depth: only the sibling with the largest draft probability is expanded (a choice that sees all siblings).

This is what lets `auto` verify its sampled trees with traversal verification instead of mbr (drafting/auto/policy.py).
"""
import pytest
import torch

from arborspec.core.tree import DrawRule
from arborspec.verify.rules import mbr_plan
from arborspec.verify.traversal import traversal_plan
from tests.verify.exact import (
    build_tree,
    max_error,
    outcomes_over,
    random_tree_dists,
    sequential,
    target_joint,
    walk_outcomes,
)

WO = DrawRule.WITHOUT_REPLACEMENT


def sibling_draws(q, mass_bound, most):
    """Children drawn one at a time without replacement while their draft mass is below `mass_bound`: (kids, weight)."""

    def grow(kids, weight, left):
        drawn = 1.0 - left
        if kids and (drawn >= mass_bound or len(kids) == most or left <= 1e-15):
            yield kids, weight
            return
        for y in range(len(q)):
            if y not in kids and q[y] > 0:
                yield from grow(kids + [y], weight * float(q[y]) / left, left - float(q[y]))

    yield from grow([], 1.0, 1.0)


def adaptive_structures(q, prefix, depth, mass_bound, most):
    """(weight, [(token, substructure), ...]) for every tree under `prefix` down to `depth` more layers."""
    if depth == 0:
        yield 1.0, []
        return
    for kids, w in sibling_draws(q[prefix], mass_bound, most):
        best = max(kids, key=lambda y: (float(q[prefix][y]), -y))  # sees every sibling, later ones included
        for sub_w, sub in adaptive_structures(q, prefix + (best,), depth - 1, mass_bound, most):
            yield w * sub_w, [(y, sub if y == best else []) for y in kids]


def adaptive_trees(q, depth, mass_bound, most):
    for weight, structure in adaptive_structures(q, (), depth, mass_bound, most):
        yield (weight, *build_tree(q, structure, WO))


def traversal(tree, P):
    return sequential(traversal_plan(tree, P))


RULES = {"mbr": walk_outcomes(mbr_plan), "traversal": traversal}
CASES = [(0, 4, 3, 0.5, 3), (1, 3, 3, 0.7, 2), (2, 4, 2, 0.9, 3), (3, 3, 3, 0.3, 3)]  # seed, vocab, depth, bound, most


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("seed,vocab,depth,bound,most", CASES)
def test_adaptive_trees_emit_the_target_distribution(rule, seed, vocab, depth, bound, most):
    p, q = random_tree_dists(seed, vocab, depth)
    trees = list(adaptive_trees(q, depth, bound, most))
    assert sum(w for w, _, _ in trees) == pytest.approx(1.0, abs=1e-12)
    assert len({len(t) for _, t, _ in trees}) > 1  # the shapes really vary
    got, _ = outcomes_over(trees, RULES[rule], p, vocab, depth)
    assert max_error(got, target_joint(p, vocab, depth)) < 1e-12


def test_a_shape_that_peeks_at_the_drawn_token_is_caught():
    """The enumeration has power: a child kept only when its own token is the draft's favourite breaks mbr (whether
    a child exists may depend on the past draws, never on the child's own token)."""
    p, q = random_tree_dists(0, 4, 1, zeros=False)
    favourite = int(torch.argmax(q[()]))
    shapes = [(float(q[()][favourite]), [(favourite, [])]), (1.0 - float(q[()][favourite]), [])]
    trees = [(w, *build_tree(q, s, WO)) for w, s in shapes]
    got, _ = outcomes_over(trees, RULES["mbr"], p, 4, 1)
    assert max_error(got, target_joint(p, 4, 1)) > 1e-3


def test_traversal_accepts_at_least_as_much_as_mbr_on_adaptive_trees():
    gains = []
    for seed, vocab, depth, bound, most in CASES:
        p, q = random_tree_dists(seed, vocab, depth)
        trees = list(adaptive_trees(q, depth, bound, most))
        gains.append(outcomes_over(trees, traversal, p, vocab, depth)[1] - outcomes_over(trees, RULES["mbr"], p, vocab, depth)[1])
    assert min(gains) >= -1e-12 and max(gains) > 1e-3
