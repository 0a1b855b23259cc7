"""Target sampling ("naive"), checked exactly: the real verifier runs once for every sequence of target draws it can
make (its `draw` replaced by a script), each weighted by the probability of those draws.

- On any tree (children drawn with or without replacement, or deterministic top-k) the emitted tokens follow the
  target's distribution exactly, and the bonus is the very token that matched no child.
- It walks as deep as the target's draws match children, and `expected_accepted` is that walk's exact mean.
"""
import pytest
import torch

import arborspec.verify.naive as naive
from arborspec.core.sampling import SamplingConfig
from arborspec.core.tree import DrawRule, TokenTree
from arborspec.verify.naive import NaiveVerifier
from tests.verify.exact import DRAWS, drafted_trees, max_error, random_tree_dists, target_joint, tree_outcomes

D = torch.float64
W, WO, DET = DrawRule.WITH_REPLACEMENT, DrawRule.WITHOUT_REPLACEMENT, DrawRule.DETERMINISTIC


class _Branch(Exception):
    """The scripted draws ran out: the verifier asked for one more, from `dist`."""

    def __init__(self, dist):
        self.dist = dist


def scripted_verdicts(tree, P, monkeypatch):
    """(path, bonus, probability) for every sequence of target draws NaiveVerifier.verify can make on `tree`."""
    script = []

    def draw(dist, generator):
        if len(script) > draw.used:
            draw.used += 1
            return script[draw.used - 1]
        raise _Branch(dist.to(D) / float(dist.sum()))  # rows are warped in float32

    monkeypatch.setattr(naive, "draw", draw)

    def explore(prefix, weight):
        script[:] = prefix
        draw.used = 0
        try:
            verdict = NaiveVerifier().verify(tree, P.log(), SamplingConfig(1.0), None)
        except _Branch as branch:
            for t in torch.nonzero(branch.dist > 0).flatten().tolist():
                yield from explore(prefix + [t], weight * float(branch.dist[t]))
            return
        yield verdict.path, verdict.bonus, weight

    return list(explore([], 1.0))


def naive_outcomes(monkeypatch, vocab):
    def outcomes(tree, P):
        for path, bonus, mass in scripted_verdicts(tree, P, monkeypatch):
            yield (path[-1] if path else 0), mass, torch.eye(vocab, dtype=D)[bonus]

    return outcomes


def top_children(q, k):
    """DETERMINISTIC: the k most probable draft tokens (weight 1)."""
    yield sorted(range(len(q)), key=lambda i: (-float(q[i]), i))[:k], 1.0


@pytest.mark.parametrize("rule", [W, WO, DET], ids=["with_replacement", "without_replacement", "deterministic"])
@pytest.mark.parametrize("seed,vocab,branches", [(0, 3, [2, 1]), (4, 3, [2, 1, 1])])
def test_naive_emits_the_target_distribution_on_any_tree(seed, vocab, branches, rule, monkeypatch):
    """Exact for any tree, however its children were chosen; the bonus is the draw that matched no child."""
    monkeypatch.setitem(DRAWS, DET, top_children)
    p, q = random_tree_dists(seed, vocab, len(branches))
    got, _ = tree_outcomes(naive_outcomes(monkeypatch, vocab), p, q, vocab, branches, rule)
    assert max_error(got, target_joint(p, vocab, len(branches))) < 1e-6


@pytest.mark.parametrize("rule", [W, WO])
def test_naive_walks_as_deep_as_the_draws_match_and_expected_accepted_is_its_mean(rule, monkeypatch):
    """Depth-3 trees (duplicate tokens included, with replacement): the exact mean of the accepted path length is
    `expected_accepted`, and some draws accept the whole depth-3 path."""
    p, q = random_tree_dists(4, 3, 3, zeros=False)
    deepest, checked = 0, 0
    for _, tree, prefixes in list(drafted_trees(q, [2, 1, 1], rule))[::5]:
        P = torch.stack([p[s] for s in prefixes])
        verdicts = scripted_verdicts(tree, P, monkeypatch)
        assert sum(m for *_, m in verdicts) == pytest.approx(1.0, abs=1e-12)
        want = sum(m * len(path) for path, _, m in verdicts)
        assert NaiveVerifier().expected_accepted(tree, P) == pytest.approx(want, abs=1e-6)
        deepest, checked = max(deepest, max(len(path) for path, *_ in verdicts)), checked + 1
    assert deepest == 3 and checked > 3


def test_naive_accepts_a_whole_chain_the_target_is_sure_of():
    """A target certain of every drafted token accepts all four, and the bonus comes from the last node's row."""
    tree, vocab = TokenTree.root(0), 3
    for node, y in enumerate([1, 2, 0, 1]):
        tree.add(node, y)
    P = torch.full((5, vocab), 1e-30, dtype=D)
    for node, y in enumerate([1, 2, 0, 1, 2]):
        P[node, y] = 1.0
    verdict = NaiveVerifier().verify(tree, P.log(), SamplingConfig(1.0), torch.Generator().manual_seed(0))
    assert verdict.path == [1, 2, 3, 4] and verdict.bonus == 2
