"""Traversal verification (Weng et al., NeurIPS 2025), checked exactly by enumerating every tree a draft can draw.

- Children drawn WITH replacement (the paper's setting) and WITHOUT replacement (our variant: the rejected token
  leaves the draft distribution, as in mbr): the emitted tokens follow the target's distribution exactly.
- Deterministic children (top-k) at temperature > 0: it is not exact, which is why `accepts` leaves them out.
- A traversal that forgets to move the target to its residual after a rejection is caught.
- On a chain it is block verification; at a root whose children are leaves it is mss / mbr.
- It accepts at least as many tokens as mss / mbr in expectation on these trees.
"""
import pytest
import torch

from arborspec.core.tree import DrawRule, TokenTree
from arborspec.verify.base import draft_dist
from arborspec.verify.rules import block_neighbor, mbr_plan, mss_plan, reject_below, weight_step
from arborspec.verify.traversal import traversal_plan
from tests.verify.exact import (
    DRAWS,
    drafted_trees,
    max_error,
    random_chain,
    random_dist,
    random_tree_dists,
    sequential,
    target_joint,
    tree_outcomes,
    walk_outcomes,
)

D = torch.float64
W, WO = DrawRule.WITH_REPLACEMENT, DrawRule.WITHOUT_REPLACEMENT
SHAPES = [(0, 3, [2, 2]), (1, 3, [3, 1]), (2, 3, [1, 2]), (3, 4, [2, 1]), (4, 3, [2, 1, 1]), (6, 2, [2, 2, 1])]


def traversal(tree, P):
    return sequential(traversal_plan(tree, P))


def top_children(q, k):
    """DETERMINISTIC: the k most probable draft tokens (weight 1)."""
    yield sorted(range(len(q)), key=lambda i: (-float(q[i]), i))[:k], 1.0


@pytest.mark.parametrize("rule", [W, WO], ids=["with_replacement", "without_replacement"])
@pytest.mark.parametrize("seed,vocab,branches", SHAPES)
def test_traversal_emits_the_target_distribution(seed, vocab, branches, rule):
    p, q = random_tree_dists(seed, vocab, len(branches))
    got, _ = tree_outcomes(traversal, p, q, vocab, branches, rule)
    assert max_error(got, target_joint(p, vocab, len(branches))) < 1e-12


def test_traversal_is_not_exact_for_deterministic_children(monkeypatch):
    monkeypatch.setitem(DRAWS, DrawRule.DETERMINISTIC, top_children)
    p, q = random_tree_dists(0, 3, 2, zeros=False)
    got, _ = tree_outcomes(traversal, p, q, 3, [2, 2], DrawRule.DETERMINISTIC)
    want = target_joint(p, 3, 2)
    assert 0.5 * sum(abs(got[s] - want[s]) for s in want) > 0.02


def forgetful_traversal(tree, P):
    """Traversal verification that updates the weight after a rejection but keeps testing against the unchanged
    target (no residual correction)."""
    kids = tree.children_lists()

    def visit(node, alpha):
        for child in kids[node]:
            q = draft_dist(tree, node, "test")
            y = tree.tokens[child]
            yield from visit(child, weight_step(alpha, float(P[node, y]), float(q[y])))
            alpha, _ = reject_below(alpha, P[node], q)
        yield node, alpha, P[node]

    return sequential(visit(0, 1.0))


@pytest.mark.parametrize("rule", [W, WO], ids=["with_replacement", "without_replacement"])
def test_a_traversal_without_the_residual_is_caught(rule):
    p, q = random_tree_dists(0, 3, 2, zeros=False)
    got, _ = tree_outcomes(forgetful_traversal, p, q, 3, [2, 2], rule)
    want = target_joint(p, 3, 2)
    assert 0.5 * sum(abs(got[s] - want[s]) for s in want) > 0.02


def test_on_a_chain_traversal_is_block_verification():
    gen = torch.Generator().manual_seed(4)
    for _ in range(100):
        n, vocab = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(2, 7, (1,), generator=gen))
        q, p, ref = random_chain(gen, n, vocab)
        tree = TokenTree.root(0)
        for i, y in enumerate(ref):
            tree.set_children_dist(i, q[i], WO)
            tree.add(i, y)
        neigh = torch.zeros(n, vocab, dtype=D)
        for node, mass, bonus in traversal(tree, p):
            if node == n:
                neigh[n - 1, ref[-1]] += mass  # the whole chain; its bonus comes from p[n]
            else:
                neigh[node] += mass * bonus
        assert torch.allclose(neigh, block_neighbor(ref, q, p), atol=1e-12)


@pytest.mark.parametrize("rule,plan_fn", [(W, mss_plan), (WO, mbr_plan)], ids=["mss", "mbr"])
def test_at_the_root_traversal_is_the_token_wise_rule(rule, plan_fn):
    """Children that are leaves of the root: for every draw, the same emitted-token distribution as mss / mbr."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        vocab, k = 5, 3
        p, q = random_dist(gen, vocab), random_dist(gen, vocab)
        for kids, _ in DRAWS[rule](q, k):
            tree = TokenTree.root(0)
            tree.set_children_dist(0, q, rule)
            for y in kids:
                tree.add(0, y)
            out = torch.zeros(vocab, dtype=D)
            for node, mass, bonus in traversal(tree, p[None].expand(len(tree), vocab)):
                out += mass * (bonus if node == 0 else torch.eye(vocab, dtype=D)[tree.tokens[node]])
            assert torch.allclose(out, plan_fn(p, q, kids).output_distribution(kids), atol=1e-12)


@pytest.mark.parametrize("rule,plan_fn", [(W, mss_plan), (WO, mbr_plan)], ids=["mss", "mbr"])
def test_traversal_accepts_at_least_as_much_as_the_token_wise_rule(rule, plan_fn):
    gains = []
    for seed, vocab, branches in SHAPES:
        p, q = random_tree_dists(seed, vocab, len(branches))
        ours = tree_outcomes(traversal, p, q, vocab, branches, rule)[1]
        theirs = tree_outcomes(walk_outcomes(plan_fn), p, q, vocab, branches, rule)[1]
        gains.append(ours - theirs)
    print("\ntraversal minus " + plan_fn.__name__ + " accepted tokens per step: " + ", ".join(f"{g:+.4f}" for g in gains))
    assert min(gains) >= -1e-12 and max(gains) > 1e-3


def test_every_drafted_tree_ends_at_the_root_at_the_latest():
    p, q = random_tree_dists(6, 3, 3)
    for _, tree, prefixes in drafted_trees(q, [2, 1, 1], W):
        P = torch.stack([p[s] for s in prefixes])
        tests = list(traversal_plan(tree, P))
        assert tests[-1][0] == 0 and tests[-1][1] == 1.0
        assert sorted(t[0] for t in tests) == list(range(len(tree)))  # every node tested once, in post-order
