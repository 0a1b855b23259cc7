"""DySpec Alg. 2 (threshold, layer by layer)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arborspec.core.tree import MAX_TREE_NODES
from arborspec.drafting import POLICIES
from tests.drafting.equivalence import (
    check_distribution,
    check_greedy_equivalence,
    make_pair,
)
from tests.drafting.fake_session import FakeSession, fake_context
from tests.drafting.properties import check_recorded_draft, check_tree

sessions = st.builds(FakeSession, vocab=st.integers(2, 14), seed=st.integers(0, 10**6),
                     sharpness=st.floats(0.3, 6.0))


@given(sessions, st.integers(1, 40), st.sampled_from([0.0, 0.05, 0.2]), st.sampled_from([0.0, 1.0]),
       st.integers(0, 7))
@settings(max_examples=80, deadline=None)
def test_tree_properties(session, budget, threshold, temperature, max_depth):
    policy = POLICIES["dyspec-threshold"](budget=budget, threshold=threshold)
    ctx = fake_context(session, temperature=temperature, max_depth=max_depth)
    tree = policy.draft(ctx)
    check_tree(tree, budget=budget, max_depth=max_depth, rules=policy.draw_rules(ctx.sampling))
    assert session.forwards <= tree.depth + 1  # one draft call per layer
    assert session.forwards == 0 or len(tree) > 1


@given(sessions, st.sampled_from([0.02, 0.05, 0.1, 0.3]))
@settings(max_examples=50, deadline=None)
def test_uncapped_threshold_tree_is_alg1_with_that_many_tokens(session, threshold):
    """App. A.1: without the cap, Alg. 2 keeps every draw worth more than t; that is Alg. 1's tree of the same size
    (Alg. 1 pops in non-increasing value), up to ties."""
    big = MAX_TREE_NODES  # the most any tree may hold: far past what these thresholds keep
    t_tree = POLICIES["dyspec-threshold"](budget=big, threshold=threshold).draft(fake_context(session, max_depth=8))
    policy = POLICIES["dyspec"](budget=len(t_tree) - 1)
    s2 = FakeSession(session.vocab, session.seed, session.sharpness)
    g_tree = policy.draft(fake_context(s2, max_depth=8))
    paths = lambda tr: sorted(tuple(tr.tokens[i] for i in tr.path(n)) for n in range(len(tr)))
    assert paths(t_tree) == paths(g_tree)
    assert all(v > threshold for v in policy.last_values)


def test_threshold_default_is_one_over_budget():
    assert POLICIES["dyspec-threshold"](budget=32).options.threshold == pytest.approx(1 / 32)
    with pytest.raises(ValueError):
        POLICIES["dyspec-threshold"](threshold=1.5)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request):
    return make_pair(request.param)


@pytest.mark.parametrize("options", [dict(budget=8), dict(budget=24, threshold=0.01)])
def test_greedy_matches_ar(pair, options):
    check_greedy_equivalence(pair, "dyspec-threshold", options)


def test_sampling_preserves_the_target_distribution():
    check_distribution("dyspec-threshold", "mbr", dict(budget=6, threshold=0.05))


def test_a_layer_cut_by_the_cap_goes_to_its_most_valuable_slot():
    """Cap = layer 1's size + 1: layer 2 gets one token, drawn from the best first-child slot of layer 1. Such a slot
    is worth its node's path probability, so at T = 0 that is the root's top child (node 1), and only it goes
    through the draft."""
    session = FakeSession(vocab=8, seed=3, sharpness=1.0)
    layer1 = len(POLICIES["dyspec-threshold"](budget=64, threshold=0.01).draft(fake_context(session, max_depth=1))) - 1
    session = FakeSession(vocab=8, seed=3, sharpness=1.0)
    tree = POLICIES["dyspec-threshold"](budget=layer1 + 1, threshold=0.01).draft(fake_context(session))
    assert layer1 >= 3 and tree.depths[1:] == [1] * layer1 + [2]
    assert tree.probs[1] == max(tree.probs[1 : layer1 + 1])
    assert tree.parents[-1] == 1 and session.rows == 1 + 1


@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (0.6, 3)])
def test_threshold_records_the_warped_draft_distribution_and_each_token_probability(temperature, top_k):
    """As in Alg. 1: children come from the warped draft (mbr needs it); a node's prob is its token's probability
    there at T > 0, under the plain softmax at T = 0."""
    session = FakeSession(vocab=9, seed=4, sharpness=1.0)
    ctx = fake_context(session, temperature=temperature, top_k=top_k, seed=2)
    tree = POLICIES["dyspec-threshold"](budget=12).draft(ctx)
    assert any(len(k) > 1 for k in tree.children_lists())
    assert check_recorded_draft(tree, session, ctx) >= 3
