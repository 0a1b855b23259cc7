"""Beam-search trees (STree Table 1): N layers x M tokens, every beam's tokens kept."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arborspec.core.tree import DrawRule
from arborspec.drafting import POLICIES
from tests.drafting.equivalence import check_distribution, check_greedy_equivalence, make_pair
from tests.drafting.fake_session import FakeSession, fake_context
from tests.drafting.properties import check_recorded_draft, check_tree

sessions = st.builds(FakeSession, vocab=st.integers(2, 14), seed=st.integers(0, 10**6),
                     sharpness=st.floats(0.3, 6.0))


@given(sessions, st.integers(1, 6), st.integers(1, 5), st.sampled_from([0.0, 1.0]), st.integers(0, 7))
@settings(max_examples=80, deadline=None)
def test_tree_properties(session, steps, beams, temperature, max_depth):
    policy = POLICIES["beam"](steps=steps, beams=beams)
    ctx = fake_context(session, temperature=temperature, max_depth=max_depth)
    tree = policy.draft(ctx)
    layers = min(steps, max_depth)
    check_tree(tree, budget=steps * beams, max_depth=layers, rules={DrawRule.DETERMINISTIC})
    assert session.forwards == layers
    assert tree.widths()[1:] == [min(beams, session.vocab ** d) for d in range(1, layers + 1)]


def brute_beams(session, context, steps, beams):
    """Plain beam search over token sequences: the set of beams after each step."""
    beams_now = [((), 1.0)]
    out = []
    for _ in range(steps):
        cands = []
        for seq, p in beams_now:
            d = session.logits_for(tuple(context) + seq).softmax(-1)
            cands += [(seq + (t,), p * float(d[t])) for t in range(session.vocab)]
        beams_now = sorted(cands, key=lambda c: -c[1])[:beams]
        out.append(sorted(s for s, _ in beams_now))
    return out


@given(sessions, st.integers(1, 4), st.integers(1, 4))
@settings(max_examples=50, deadline=None)
def test_layers_are_the_beams_of_beam_search(session, steps, beams):
    ctx = fake_context(session)
    tree = POLICIES["beam"](steps=steps, beams=beams).draft(ctx)
    want = brute_beams(FakeSession(session.vocab, session.seed, session.sharpness), ctx.context, steps, beams)
    for d, layer in enumerate(want, start=1):
        got = sorted(tuple(tree.tokens[i] for i in tree.path(n)[1:]) for n in range(len(tree)) if tree.depths[n] == d)
        assert got == layer


@given(sessions, st.integers(1, 4), st.integers(1, 4))
@settings(max_examples=30, deadline=None)
def test_same_tree_as_static_widths(session, steps, beams):
    a = POLICIES["beam"](steps=steps, beams=beams).draft(fake_context(session))
    s2 = FakeSession(session.vocab, session.seed, session.sharpness)
    b = POLICIES["static"](widths=",".join([str(beams)] * steps)).draft(fake_context(s2))
    assert a.tokens == b.tokens and a.parents == b.parents


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request):
    return make_pair(request.param)


@pytest.mark.parametrize("options", [dict(steps=3, beams=2), dict(steps=5, beams=4)])
def test_greedy_matches_ar(pair, options):
    check_greedy_equivalence(pair, "beam", options)


def test_sampling_preserves_the_target_distribution():
    check_distribution("beam", "naive", dict(steps=3, beams=2))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_beam_records_the_warped_draft_distribution_and_each_token_probability(temperature):
    """Beams are picked from the plain softmax at any temperature: that is each token's recorded probability."""
    session = FakeSession(vocab=7, seed=3, sharpness=1.0)
    ctx = fake_context(session, temperature=temperature)
    tree = POLICIES["beam"](steps=3, beams=3).draft(ctx)
    assert check_recorded_draft(tree, session, ctx) >= 3


# ---- pins found by mutating beam.py ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [(dict(beams=0), "beams must be an integer >= 1"),
                                        (dict(beams=2.0), "beams must be an integer"),
                                        (dict(steps=0), "steps must be an integer >= 1"),
                                        (dict(steps=5, beams=205), "steps x beams = 1025")])
def test_beam_options_are_checked(bad, match):
    from arborspec.drafting.beam import BeamOptions

    with pytest.raises(ValueError, match=match):
        BeamOptions(**bad)


def test_a_beam_tree_of_exactly_the_node_limit_is_allowed_and_as_deep_as_its_steps():
    from arborspec.core.tree import MAX_TREE_NODES

    policy = POLICIES["beam"](steps=4, beams=MAX_TREE_NODES // 4)
    assert policy.options.beams * policy.options.steps == MAX_TREE_NODES
    assert POLICIES["beam"](steps=5, beams=2).max_tree_depth == 5
