"""WETAP: entropy -> width, pruning (App. D example), tree properties, equivalence."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arborspec.core.tree import DrawRule
from arborspec.drafting import POLICIES
from arborspec.drafting.wetap import next_width, prune
from tests.drafting.equivalence import check_distribution, check_greedy_equivalence, make_pair
from tests.drafting.fake_session import FakeSession, fake_context
from tests.drafting.properties import check_tree

# ---- App. D: length 4, widths 3, 5, 4, 4 (16 tokens), budget 12 --------------------------------------------------
# Tokens are numbered by probability rank within their layer (the paper's figure: "token 7 is under token 8 because
# of the orders of their parent tokens, but the probability of token 7 is higher"). The figure's numbers are not in
# the text, so these cumulative probabilities are ours, chosen to reproduce every step the text describes.
APP_D = {  # token: (parent, cumulative probability)
    1: (0, 0.50), 2: (0, 0.17), 3: (0, 0.15),
    4: (1, 0.30), 5: (2, 0.16), 6: (3, 0.10), 7: (3, 0.04), 8: (1, 0.03),
    9: (4, 0.20), 10: (5, 0.09), 11: (7, 0.035), 12: (6, 0.03),
    13: (9, 0.12), 14: (10, 0.05), 15: (11, 0.022), 16: (9, 0.02),
}


def app_d_tree():
    parents, depths, cum = [-1], [0], [1.0]
    for tok in range(1, 17):
        par, p = APP_D[tok]
        parents.append(par)
        depths.append(depths[par] + 1)
        cum.append(p)
    return parents, depths, cum


def test_app_d_layers_are_as_in_the_paper():
    parents, depths, cum = app_d_tree()
    assert [depths.count(d) for d in (1, 2, 3, 4)] == [3, 5, 4, 4]
    for tok, (par, p) in APP_D.items():
        assert p <= cum[par]  # a path is never more likely than its prefix
    for d in (1, 2, 3, 4):  # numbered by probability within the layer
        layer = [t for t in range(1, 17) if depths[t] == d]
        assert [cum[t] for t in layer] == sorted((cum[t] for t in layer), reverse=True)
    assert cum[7] > cum[8]  # "the probability of token 7 is higher than the probability of token 8"


def test_app_d_pruning_example():
    parents, depths, cum = app_d_tree()
    kept = prune(parents, depths, cum, budget=12, alpha=0.6)
    # the text: first prune to 12 by score; the parents 2, 3, 7 of kept tokens 5, 6, 11 are missing and come back
    # (15 > 12); drop leaf 12 (leaves shallow to deep); then the lowest probabilities, 15 and 16
    D = 4
    pmin, pmax = min(cum[1:]), max(cum[1:])
    score = {v: 0.6 * (cum[v] - pmin) / (pmax - pmin + 1e-6) + 0.4 * depths[v] / D for v in range(1, 17)}
    first = set(sorted(range(1, 17), key=lambda v: -score[v])[:12])
    assert first == {1, 4, 5, 6, 9, 10, 11, 12, 13, 14, 15, 16}
    assert {parents[v] for v in (5, 6, 11)} == {2, 3, 7} and not {2, 3, 7} & first
    assert kept == [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 13, 14]
    assert set(range(17)) - set(kept) == {8, 12, 15, 16}


@given(st.integers(2, 40), st.integers(1, 30), st.floats(0.0, 1.0), st.integers(0, 10**6))
@settings(max_examples=100, deadline=None)
def test_prune_keeps_a_tree_within_budget(n, budget, alpha, seed):
    import random

    rng = random.Random(seed)
    parents, depths, cum = [-1], [0], [1.0]
    for i in range(1, n):
        par = rng.randrange(i)
        parents.append(par)
        depths.append(depths[par] + 1)
        cum.append(cum[par] * rng.uniform(0.01, 1.0))
    kept = prune(parents, depths, cum, budget, alpha)
    assert kept[0] == 0 and len(kept) - 1 == min(budget, n - 1)
    assert all(parents[v] in kept for v in kept[1:])  # closed under parents
    if alpha == 1.0:  # probability only: the `budget` most likely nodes (connected automatically)
        assert sorted(cum[v] for v in kept[1:]) == sorted(cum[1:])[-len(kept) + 1 :] or len(kept) == 1


def test_width_from_entropy():
    assert next_width([0.5], 16, 128, 1.2) == 16  # one node: no entropy
    assert next_width([0.2] * 8, 16, 128, 1.2) == 128  # uniform layer: H = log W
    assert next_width([0.9, 1e-6, 1e-6], 16, 128, 1.2) == 16
    p = [0.5, 0.3, 0.2]
    h = -sum(x * math.log(x) for x in p) / math.log(3)
    assert next_width(p, 3, 6, 1.2) == round(3 + 3 * h**1.2)
    # a node of probability 0 counts in W (H / log 3) but adds no entropy: p' = (2/3, 0, 1/3),
    # H = -(2/3 log 2/3 + 1/3 log 1/3) = 0.6365, H / log 3 = 0.579, 4 + 4 * 0.579 = 6.32 -> 6
    assert next_width([1.0, 0.0, 0.5], 4, 8, 1.0) == 6


sessions = st.builds(FakeSession, vocab=st.integers(2, 14), seed=st.integers(0, 10**6),
                     sharpness=st.floats(0.3, 6.0))


@given(sessions, st.integers(1, 40), st.sampled_from([0.0, 1.0]), st.integers(0, 6),
       st.sampled_from([dict(w_min=2, w_max=6, length=4), dict(w_min=1, w_max=12, length=6, alpha=0.3),
                        dict(w_min=4, w_max=4, length=3, gamma=0.5)]))
@settings(max_examples=80, deadline=None)
def test_tree_properties(session, budget, temperature, max_depth, extra):
    policy = POLICIES["wetap"](budget=budget, **extra)
    ctx = fake_context(session, temperature=temperature, max_depth=max_depth)
    tree = policy.draft(ctx)
    check_tree(tree, budget=budget, max_depth=min(max_depth, extra["length"]), rules={DrawRule.DETERMINISTIC})
    assert session.forwards == min(max_depth, extra["length"])  # one draft call per constructed layer
    built = sum(policy.last_widths)
    assert len(tree) - 1 == min(budget, built)
    widths = policy.last_widths
    if widths:
        assert widths[0] == min(extra["w_min"], session.vocab)
        assert all(w <= extra["w_max"] for w in widths)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request):
    return make_pair(request.param)


@pytest.mark.parametrize("options", [dict(budget=8, w_min=2, w_max=4, length=4),
                                     dict(budget=20, w_min=3, w_max=8, length=5, alpha=0.3)])
def test_greedy_matches_ar(pair, options):
    check_greedy_equivalence(pair, "wetap", options)


def test_sampling_preserves_the_target_distribution():
    check_distribution("wetap", "naive", dict(budget=5, w_min=2, w_max=3, length=3))


# Small trees (alpha = 0: the score is depth / D alone, ties more likely first) whose pruning shows one rule each.
PRUNE_CASES = {
    # depth counts as depth / D: at alpha 0.5, node 1 (the most likely, depth 1) scores 0.5 + 0.5 * 1/2 = 0.75 and
    # node 3 (the least likely, depth 2 = D) 0 + 0.5 * 2/2 = 0.5, so node 1 is the one kept
    "depth-is-normalised": ([-1, 0, 0, 2], [1.0, 0.4, 0.2, 0.12], 1, 0.5, [0, 1]),
    # budget 2 keeps the deepest, 2 and 4; re-inserting 1 and 3 overshoots by 2; both leaves are in the deepest layer,
    # so stage 3 drops none and stage 4 drops the least likely leaf twice: 4 (0.25), then its parent 3 (0.5 < 0.54)
    "stage-3-spares-the-deepest-layer": ([-1, 0, 1, 0, 3], [1.0, 0.9, 0.54, 0.5, 0.25], 2, 0.0, [0, 1, 2]),
    # scores (alpha 0.5, D = 3): 3: 0.67, 5: 0.5, 1: 0.41, 2 = 4: 0.35 (2 earlier); re-inserting 4 overshoots by one:
    # of the leaves above depth 3, 3 (depth 1, likely) goes before 2 (depth 2, unlikely): shallowest first
    "stage-3-drops-the-shallowest-leaf": ([-1, 0, 1, 0, 1, 4], [1.0, 0.3, 0.12, 0.5, 0.12, 0.108], 4, 0.5,
                                          [0, 1, 2, 4, 5]),
    # budget 3 keeps 3 (the deepest), 2 and 4 (the likeliest of depth 1); re-inserting 1 overshoots by one: of the
    # depth-1 leaves 2 (0.9) and 4 (0.6) the least likely goes
    "stage-3-drops-the-least-likely-in-a-layer": ([-1, 0, 0, 1, 0], [1.0, 0.4, 0.9, 0.08, 0.6], 3, 0.0, [0, 1, 2, 3]),
}


def test_fixed_width_wetap_builds_the_beam_search_tree():
    """w_min = w_max = M: every layer holds the M most likely paths among the children of the last, as beam search
    with M beams; kept in the same order (grouped by parent, then by rank)."""
    session = FakeSession(vocab=9, seed=6, sharpness=1.0)
    a = POLICIES["wetap"](budget=64, w_min=3, w_max=3, length=4).draft(fake_context(session))
    b = POLICIES["beam"](steps=4, beams=3).draft(fake_context(FakeSession(vocab=9, seed=6, sharpness=1.0)))
    assert len(a) - 1 == 12 and a.tokens == b.tokens and a.parents == b.parents


# ---- pins found by mutating wetap.py --------------------------------------------------------------------------------
# Ties, each rule's own (parents, cumulative probabilities, budget, alpha, kept)
PRUNE_TIE_CASES = {
    # alpha 0: 1 and 2 score alike (depth 1); the more likely, 2, is kept
    "stage-1-ties-go-to-the-likelier": ([-1, 0, 0], [1.0, 0.4, 0.5], 1, 0.0, [0, 2]),
    # depths 1, 1, 2, 2; the deepest, 3 and 4, are kept, their parents come back (4 > 2); stage 3 spares depth 2;
    # stage 4 drops 4 (the later of two equal leaves), then of 3 (depth 2) and 2 (depth 1), equally likely, the deeper
    "stage-4-ties-drop-the-deeper": ([-1, 0, 0, 1, 2], [1.0, 0.4, 0.1, 0.1, 0.1], 2, 0.0, [0, 1, 2]),
    # 2 and 3 (depth 2, equally likely) are kept, 1 comes back; stage 4 drops the later leaf, 3
    "stage-4-ties-drop-the-later": ([-1, 0, 1, 1], [1.0, 0.1, 0.1, 0.1], 2, 0.0, [0, 1, 2]),
    # 4 (depth 2) is kept with the likelier depth-1 nodes 2 and 3 (0.4 each), and its parent 1 comes back: stage 3
    # drops one depth-1 leaf, of 2 and 3 the later
    "stage-3-ties-drop-the-later": ([-1, 0, 0, 0, 1], [1.0, 0.1, 0.4, 0.4, 0.1], 3, 0.0, [0, 1, 2, 4]),
    # alpha 0.3, D = 3: scores 2: 0.743, 4: 0.714, 5: 0.7, 1: 0.533, 3: 0.492. Keeping 2 and 4 brings back 1 and 3;
    # the deepest *kept* layer is 2 (5, at depth 3, was not kept), so stage 3 drops no leaf of depth 2 and stage 4
    # drops the least likely leaves, 4 (0.48) and then 3 (0.5)
    "stage-3-spares-the-deepest-kept-layer": ([-1, 0, 1, 0, 3, 4], [1.0, 0.57, 0.53, 0.5, 0.48, 0.06], 2, 0.3,
                                              [0, 1, 2]),
}


@pytest.mark.parametrize("case", [*PRUNE_CASES, *PRUNE_TIE_CASES])
def test_prune_rules_on_small_trees(case):
    """Each rule of the pruning, and how it breaks ties, on a tree small enough to work by hand (the comments)."""
    parents, cum, budget, alpha, kept = {**PRUNE_CASES, **PRUNE_TIE_CASES}[case]
    depths = [0]
    for v in range(1, len(parents)):
        depths.append(depths[parents[v]] + 1)
    assert prune(parents, depths, cum, budget, alpha) == kept


@pytest.mark.parametrize("bad, match", [(dict(w_max=2000), "w_max must be at most 1024"),
                                        (dict(w_min=8, w_max=4), "need w_min <= w_max"),
                                        (dict(gamma=0.0), "gamma must be > 0"),
                                        (dict(alpha=1.5), r"alpha must be in \[0, 1\]")])
def test_wetap_options_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        POLICIES["wetap"](**bad)


def test_wetap_options_take_the_ends_of_their_ranges():
    assert POLICIES["wetap"](alpha=0.0).options.alpha == 0.0 and POLICIES["wetap"](alpha=1.0).options.alpha == 1.0
    assert POLICIES["wetap"](w_min=5, w_max=5).max_tree_depth == 8 == POLICIES["wetap"]().options.length
    assert POLICIES["wetap"](length=3).max_tree_depth == 3


def cumulative(tree, v) -> float:
    """A node's path probability: the product of the recorded token probabilities from the root."""
    return math.prod(tree.probs[u] for u in tree.path(v)[1:])


def test_layer_widths_follow_eq_5_on_cumulative_probabilities():
    """Layer 1 holds w_min children of the root (more than 8 as well); each later width is next_width of the last
    layer's path probabilities, not of its tokens' own."""
    policy = POLICIES["wetap"](budget=1000, w_min=10, w_max=60, length=4, gamma=1.2)
    tree = policy.draft(fake_context(FakeSession(vocab=40, seed=0, sharpness=3.0)))
    assert tree.widths()[1:] == policy.last_widths and policy.last_widths[0] == 10
    for d in range(1, 4):
        layer = [v for v in range(len(tree)) if tree.depths[v] == d]
        want = next_width([cumulative(tree, v) for v in layer], 10, 60, 1.2)
        assert policy.last_widths[d] == min(want, len(layer) * 40)
    own = [next_width([tree.probs[v] for v in range(len(tree)) if tree.depths[v] == d], 10, 60, 1.2) for d in (2, 3)]
    assert own != policy.last_widths[2:]  # the tokens' own probabilities would give other widths


@pytest.mark.parametrize("alpha", [0.2, 0.8])
def test_the_drafted_tree_is_the_constructed_one_pruned_with_its_alpha(alpha):
    options = dict(w_min=3, w_max=8, length=4)
    whole = POLICIES["wetap"](budget=1000, **options).draft(fake_context(FakeSession(vocab=12, seed=5)))
    kept = prune(whole.parents, whole.depths, [cumulative(whole, v) for v in range(len(whole))], 9, alpha)
    want = whole.select(kept)
    got = POLICIES["wetap"](budget=9, alpha=alpha, **options).draft(fake_context(FakeSession(vocab=12, seed=5)))
    assert len(whole) - 1 > 9 and (got.tokens, got.parents) == (want.tokens, want.parents)
