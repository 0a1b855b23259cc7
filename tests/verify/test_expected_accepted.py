"""`Verifier.expected_accepted`: the exact expected accepted tokens each rule reaches on a given tree.

It is what benchmarks/verifiers_same_trees.py compares rules by, so each closed form is checked against something
computed another way: the walk rules and traversal against their exact outcome enumerations (tests/verify/exact.py),
the chain rules against their outcome tables, and naive (and one walk rule, as a check of the check) against the
mean of the real verifier's sampled paths.
"""
import importlib
import itertools

import pytest
import torch

from arborspec.core.sampling import SamplingConfig
from arborspec.core.tree import DrawRule, TokenTree
from arborspec.verify import VERIFIERS
from arborspec.verify.rules import (
    asps_neighbor,
    block_neighbor,
    expected_tokens,
    greedy_draft_plan,
    mbr_plan,
    mss_plan,
    sps_neighbor,
)
from arborspec.verify.traversal import traversal_plan
from tests.verify.exact import drafted_trees, random_tree_dists, sequential, walk_outcomes

W, WO, G = DrawRule.WITH_REPLACEMENT, DrawRule.WITHOUT_REPLACEMENT, DrawRule.GREEDY_TOPK_PLUS_ONE
OUTCOMES = {
    "mss": (W, walk_outcomes(mss_plan)),
    "mbr": (WO, walk_outcomes(mbr_plan)),
    "greedy-draft": (G, walk_outcomes(greedy_draft_plan)),
    "traversal": (WO, lambda tree, P: sequential(traversal_plan(tree, P))),
}


def some_trees(rule, seed=0, vocab=4, branches=(2, 2), count=12):
    p, q = random_tree_dists(seed, vocab, len(branches))
    for _, tree, prefixes in itertools.islice(drafted_trees(q, list(branches), rule), count):
        yield tree, prefixes, torch.stack([p[s] for s in prefixes])


@pytest.mark.parametrize("name", sorted(OUTCOMES))
def test_tree_rules_match_their_outcome_enumeration(name):
    rule, outcomes = OUTCOMES[name]
    checked = 0
    for tree, prefixes, P in some_trees(rule):
        want = sum(mass * len(prefixes[node]) for node, mass, _ in outcomes(tree, P))
        assert VERIFIERS[name]().expected_accepted(tree, P) == pytest.approx(want, abs=1e-12)
        checked += want > 0
    assert checked > 5


def spy_on_draws(verifier, monkeypatch) -> list[torch.Tensor]:
    """The distributions `verifier` draws its bonus tokens from, appended as it draws (the draws themselves run)."""
    given, modules = [], {"arborspec.verify.base", type(verifier).__module__}
    for module in map(importlib.import_module, modules):
        if not hasattr(module, "draw"):  # the walk rules draw in base's multi_draft_walk
            continue
        real = module.draw
        monkeypatch.setattr(module, "draw", lambda dist, gen, real=real: (given.append(dist), real(dist, gen))[1])
    return given


def same_distribution(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = got.to(torch.float64), want.to(torch.float64)
    return torch.allclose(got / got.sum(), want / want.sum(), atol=1e-6)


@pytest.mark.parametrize("name", sorted(OUTCOMES))
def test_the_bonus_comes_from_the_rules_distribution_where_the_walk_ended(name, monkeypatch):
    """verify() draws its bonus token from what the rule's outcome enumeration gives the node where the walk ended
    (the residual after its rejected children, the target's own row at a leaf), read off each real draw. A bonus
    drawn from the target's plain row there keeps every path length right: only the slow chi-square tests saw it."""
    rule, outcomes = OUTCOMES[name]
    verifier = VERIFIERS[name]()
    given = spy_on_draws(verifier, monkeypatch)
    gen, ends = torch.Generator().manual_seed(4), set()
    p, q = random_tree_dists(7, 4, 2, zeros=False)  # every outcome possible: walks end everywhere
    trees = list(itertools.islice(drafted_trees(q, [2, 2], rule), 600))
    for _, tree, prefixes in trees[::max(len(trees) // 50, 1)]:
        P = torch.stack([p[s] for s in prefixes])
        want = {node: bonus for node, _, bonus in outcomes(tree, P)}
        for _ in range(20):
            given.clear()
            path = verifier.verify(tree, P.log(), SamplingConfig(1.0), gen).path
            end = path[-1] if path else 0
            assert same_distribution(given[-1], want[end]), (name, end)
            ends.add((end == 0, bool(tree.children_lists()[end])))
    assert ends >= {(True, True), (False, True), (False, False)}  # at the root, inside and at a leaf


@pytest.mark.parametrize("name,neighbor", [("sps", sps_neighbor), ("asps", asps_neighbor), ("block", block_neighbor)])
def test_chain_rules_match_their_outcome_tables(name, neighbor):
    for tree, prefixes, P in some_trees(W, seed=3, vocab=4, branches=(1, 1, 1)):
        tokens = list(prefixes[-1])
        q = torch.stack([tree.child_dist[n].to(torch.float64) for n in range(len(tokens))])
        want = expected_tokens(neighbor(tokens, q, P[: len(tokens)]), tokens) - 1.0
        assert VERIFIERS[name]().expected_accepted(tree, P) == pytest.approx(want, abs=1e-6)  # q is stored in float32


@pytest.mark.parametrize("name,neighbor", [("sps", sps_neighbor), ("block", block_neighbor)])
def test_a_chains_bonus_comes_from_its_rules_outcome_table(name, neighbor, monkeypatch):
    """The same for the chain rules whose bonus depends on the accepted count alone: after i < n accepted tokens it
    follows row i of the outcome table (less full acceptance, in the last row), after all n the target's row at the
    chain's end. (ASpS's row i mixes several ways to end with i tokens: its chi-square tests cover it.)"""
    verifier = VERIFIERS[name]()
    given, gen, kept_counts = spy_on_draws(verifier, monkeypatch), torch.Generator().manual_seed(4), set()
    p, q = random_tree_dists(7, 4, 3, zeros=False)
    chains = list(itertools.islice(drafted_trees(q, [1, 1, 1], W), 64))
    for _, tree, prefixes in chains[::4]:
        P, tokens = torch.stack([p[s] for s in prefixes]), list(prefixes[-1])
        table = neighbor(tokens, torch.stack([q[s] for s in prefixes[:-1]]), P)  # (n, vocab)
        for _ in range(20):
            kept = len(verifier.verify(tree, P.log(), SamplingConfig(1.0), gen).path)
            want = P[-1] if kept == len(tokens) else table[kept].clone()
            if kept == len(tokens) - 1:
                want[tokens[-1]] = 0  # that cell is full acceptance
            assert same_distribution(given[-1], want), (name, kept)
            kept_counts.add(kept)
    assert kept_counts == {0, 1, 2, 3}


@pytest.mark.parametrize("name,rule", [("naive", WO), ("naive", W), ("mbr", WO)])
def test_expectation_is_the_mean_of_the_sampled_verdicts(name, rule):
    verifier, gen, draws = VERIFIERS[name](), torch.Generator().manual_seed(1), 3000
    for tree, _, P in itertools.islice(some_trees(rule, seed=2, vocab=3, branches=(2, 1)), 3):
        lengths = torch.tensor([float(len(verifier.verify(tree, P.log(), SamplingConfig(1.0), gen).path))
                                for _ in range(draws)])
        want = verifier.expected_accepted(tree, P)
        assert abs(float(lengths.mean()) - want) < 4 * max(float(lengths.std()), 0.05) / draws**0.5


def test_a_rule_without_a_closed_form_says_so():
    tree, _, P = next(some_trees(WO))
    assert VERIFIERS["wetap"]().expected_accepted(tree, P) is None


@pytest.mark.parametrize("name,rule,want", [("mss", W, 1.0), ("mbr", WO, 0.4 + 0.6 * 5 / 9)])
def test_mss_and_mbr_expectations_worked_by_hand(name, rule, want):
    """Root children tokens 0 then 1, q = [.5, .3, .2], p = [.2, .4, .4]: token 0 is accepted with 0.4, after which
    R = [0, 1/3, 2/3]. MSS keeps q: token 1 passes with min(1, (1/3) / .3) = 1. MBR zeroes token 0 in D, D = [0, .6,
    .4]: 5/9. The rules' own enumerations above agree with each other on their drafted trees, so they cannot tell."""
    tree = TokenTree.root(0)
    tree.add(0, 0)
    tree.add(0, 1)
    tree.set_children_dist(0, torch.tensor([0.5, 0.3, 0.2]), rule)
    P = torch.tensor([[0.2, 0.4, 0.4]] * 3, dtype=torch.float64)
    assert VERIFIERS[name]().expected_accepted(tree, P) == pytest.approx(want, abs=1e-6)  # q is stored in float32
