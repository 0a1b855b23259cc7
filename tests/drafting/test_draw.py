"""The `draw` option of the static and sequoia policies: how a node's children are drawn when the draft samples.

- Trees record the drawing rule `draw` names and have its shape (greedy: the top tokens first, one draw last), so the
  engine picks the verifier made for it (mbr, mss, greedy-draft) and refuses the others.
- At temperature 0 every scheme is the top-k tree: token-identical to plain decoding.
- Sampled with their exact verifiers, the library's trees keep the target's distribution (chi-square, tests/verify/
  harness.py); the larger suites in tests/verify/test_equivalence.py also run them.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arborspec import SpeculativeDecoder
from arborspec.core.sampling import SamplingConfig
from arborspec.core.tree import DrawRule
from arborspec.drafting import POLICIES
from arborspec.drafting.layers import DRAW_RULES, greedy_children
from arborspec.runspec import build_decoder, parse
from tests.drafting.equivalence import check_distribution, check_greedy_equivalence, make_pair
from tests.drafting.fake_session import FakeSession, fake_context
from tests.drafting.properties import check_recorded_draft, check_tree

sessions = st.builds(FakeSession, vocab=st.integers(2, 14), seed=st.integers(0, 10**6), sharpness=st.floats(0.3, 6.0))
DRAWS = sorted(DRAW_RULES)


@given(st.builds(FakeSession, vocab=st.integers(4, 14), seed=st.integers(0, 10**6), sharpness=st.floats(0.3, 6.0)),
       st.sampled_from(DRAWS), st.integers(1, 4), st.integers(1, 3), st.sampled_from([0.0, 1.0]),
       st.sampled_from([0, 3]))
@settings(max_examples=80, deadline=None)
def test_static_trees_follow_the_drawing_rule(session, draw, depth, branch, temperature, top_k):
    policy = POLICIES["static"](depth=depth, branch=branch, draw=draw)
    ctx = fake_context(session, temperature=temperature, max_depth=depth, top_k=top_k)
    tree = policy.draft(ctx)
    check_tree(tree, max_depth=depth, rules=policy.draw_rules(ctx.sampling))  # greedy: top tokens, then one draw
    want = DrawRule.DETERMINISTIC if temperature == 0 else DRAW_RULES[draw]
    assert set(tree.child_rule.values()) == {want}
    assert len(tree.children_lists()[0]) == branch  # the support (>= 3 tokens) never runs out here


@given(sessions, st.sampled_from(DRAWS), st.integers(1, 30), st.sampled_from([0.0, 1.0]), st.integers(0, 6))
@settings(max_examples=60, deadline=None)
def test_sequoia_trees_follow_the_drawing_rule(session, draw, budget, temperature, max_depth):
    policy = POLICIES["sequoia"](budget=budget, draw=draw)
    ctx = fake_context(session, temperature=temperature, max_depth=max_depth)
    tree = policy.draft(ctx)
    check_tree(tree, budget=budget, max_depth=max_depth, rules=policy.draw_rules(ctx.sampling))


def test_greedy_children_are_the_top_tokens_then_one_draw_off_them():
    q = torch.tensor([0.1, 0.4, 0.0, 0.3, 0.2])
    gen = torch.Generator().manual_seed(0)
    draws = [greedy_children(q, 3, gen) for _ in range(2000)]
    assert all(d[:2] == [1, 3] for d in draws)
    last = torch.bincount(torch.tensor([d[2] for d in draws]), minlength=5) / len(draws)
    assert last[[1, 2, 3]].sum() == 0 and abs(float(last[0]) - 1 / 3) < 0.04  # q off {1, 3}: 0.1 / 0.3 and 0.2 / 0.3
    assert greedy_children(q, 6, gen) == [1, 3, 4, 0]  # the support (4 tokens) is used up: no draw is left
    assert greedy_children(q, 1, gen)[0] in (0, 1, 3, 4)  # k = 1: one plain draw


@pytest.mark.parametrize("method,options,verifier", [
    ("static", dict(depth=2, branch=2), "mbr"),
    ("static", dict(depth=2, branch=2, draw="sample"), "mbr"),
    ("static", dict(depth=2, branch=2, draw="iid"), "mss"),
    ("static", dict(depth=2, branch=2, draw="greedy"), "greedy-draft"),
    ("sequoia", dict(budget=6, draw="greedy"), "greedy-draft"),
    ("sequoia", dict(budget=6, draw="iid"), "mss"),
])
def test_the_default_verifier_follows_the_drawing_rule(method, options, verifier):
    target, draft = make_pair("llama")
    dec = SpeculativeDecoder(target, draft, method=method, temperature=0.8, **options)
    assert dec.verifier.name == verifier
    assert SpeculativeDecoder(target, draft, method=method, **options).verifier.name == "greedy"


def test_the_method_grammar_takes_draw():
    spec = parse("static(depth=3,branch=2,draw=greedy)")
    assert dict(spec.options) == dict(depth=3, branch=2, draw="greedy")
    target, draft = make_pair("llama")
    dec = build_decoder(spec, target, draft, temperature=1.0)
    assert dec.verifier.name == "greedy-draft"
    assert len(dec.generate([4, 9, 12], max_new_tokens=8, ignore_eos=True, seed=0).token_ids) == 8
    assert build_decoder(parse("sequoia(draw=iid,verifier=traversal)@8"), target, draft, temperature=1.0)


def test_bad_draw_options_are_refused():
    with pytest.raises(ValueError, match="draw must be one of sample, iid, greedy, got 'top'"):
        POLICIES["static"](draw="top")
    with pytest.raises(ValueError, match="draw applies to k-ary trees"):
        POLICIES["static"](widths="3,2", draw="greedy")
    with pytest.raises(ValueError, match="draw must be one of"):
        POLICIES["sequoia"](draw="")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request):
    return make_pair(request.param)


@pytest.mark.parametrize("method,options", [
    ("static", dict(depth=3, branch=2, draw="greedy")),
    ("static", dict(depth=2, branch=3, draw="iid")),
    ("sequoia", dict(budget=10, draw="greedy")),
])
def test_greedy_matches_ar(pair, method, options):
    check_greedy_equivalence(pair, method, options)


@pytest.mark.parametrize("method,verifier,options", [
    ("static", "greedy-draft", dict(depth=2, branch=3, draw="greedy")),
    ("sequoia", "greedy-draft", dict(budget=6, acceptance="0.4,0.2,0.1", draw="greedy")),
    ("static", "mss", dict(depth=2, branch=2, draw="iid")),
])
def test_sampling_preserves_the_target_distribution(method, verifier, options):
    check_distribution(method, verifier, options)


@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drawn_children_record_the_warped_draft_and_their_probabilities(draw, temperature):
    """At T = 0 the children are the draft's top tokens in order (of the softmax: the warped distribution is one-hot
    there); every scheme records the warped distribution and each child's probability (check_recorded_draft)."""
    session = FakeSession(vocab=9, seed=7, sharpness=1.0)
    ctx = fake_context(session, temperature=temperature, top_k=5, seed=1)
    tree = POLICIES["static"](depth=2, branch=3, draw=draw).draft(ctx)
    assert check_recorded_draft(tree, session, ctx) == 4
    if temperature == 0:
        for node, kids in enumerate(tree.children_lists()):
            if kids:
                path = tuple(tree.tokens[i] for i in tree.path(node)[1:])
                d = session.logits_for(tuple(ctx.context) + path).softmax(-1)
                assert [tree.tokens[c] for c in kids] == torch.argsort(d, descending=True)[:3].tolist()


@pytest.mark.parametrize("method,verifier", [("dynatree", "naive"), ("beam", "naive"), ("wetap", "naive"),
                                             ("dyspec", "mbr"), ("dyspec-threshold", "mbr"), ("sequoia", "mbr")])
def test_policies_default_to_the_verifier_made_for_their_drawing_rule(method, verifier):
    """Deterministic children (top candidates) at T > 0 are verified by target sampling, drawn ones by their own."""
    policy = POLICIES[method]()
    assert policy.default_verifier(SamplingConfig(0.8)) == verifier
    assert policy.default_verifier(SamplingConfig(0.0)) == "greedy"


def test_iid_children_may_repeat_a_token():
    """draw=iid draws with replacement (SpecInfer's rule, verified by mss): with top_k = 1 the warped draft holds one
    token, and all `branch` children are that token, not fewer (a distinct draw) nor an error."""
    session = FakeSession(vocab=9, seed=3, sharpness=1.0)
    ctx = fake_context(session, temperature=1.0, top_k=1, seed=0)
    tree = POLICIES["static"](depth=1, branch=3, draw="iid").draft(ctx)
    top = int(session.logits_for(tuple(ctx.context)).argmax())
    assert [tree.tokens[c] for c in tree.children_lists()[0]] == [top] * 3
    assert tree.child_rule[0] is DrawRule.WITH_REPLACEMENT


def test_distinct_children_stop_where_the_support_runs_out():
    """draw=sample asks for no more distinct tokens than the warped draft can draw: with top_k = 2 and branch 4 the
    node gets the two tokens of the support (torch 2.13's multinomial would return a zero-mass token for the third, and
    core/sampling.py's redraw loop refuses it)."""
    session = FakeSession(vocab=9, seed=3, sharpness=1.0)
    ctx = fake_context(session, temperature=1.0, top_k=2, seed=0)
    tree = POLICIES["static"](depth=2, branch=4, draw="sample").draft(ctx)
    top2 = set(torch.topk(session.logits_for(tuple(ctx.context)), 2).indices.tolist())
    assert {tree.tokens[c] for c in tree.children_lists()[0]} == top2
    assert tree.widths() == [1, 2, 4]  # the root, then two children for each of the two nodes
    check_tree(tree, max_depth=2, rules={DrawRule.WITHOUT_REPLACEMENT})


@pytest.mark.parametrize("options,layers", [(dict(depth=4, branch=2), 4), (dict(widths="3,2,2,2,2"), 5)])
def test_static_trees_stop_at_the_steps_max_depth(options, layers):
    """ctx.max_depth (the tokens left to generate, or the context window) caps the tree's depth below the policy's
    own: a deeper tree would draft past the end. max_tree_depth (the engine's context-window check) is the number of
    layers: the widths' count, not the unused depth option (4)."""
    policy = POLICIES["static"](**options)
    assert policy.max_tree_depth == layers
    assert policy.draft(fake_context(FakeSession(vocab=9, seed=1), max_depth=2)).depth == 2
    assert policy.draft(fake_context(FakeSession(vocab=9, seed=1), max_depth=100)).depth == layers


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_widths_trees_record_the_warped_draft_and_plain_probabilities(temperature):
    """A widths tree picks its children deterministically (by the plain softmax's path probability) but records the
    warped draft at each expanded node: sps reads it on widths=1,1,... chains (check_recorded_draft)."""
    session = FakeSession(vocab=9, seed=5, sharpness=1.0)
    ctx = fake_context(session, temperature=temperature, top_k=5, seed=1)
    tree = POLICIES["static"](widths="3,2,2").draft(ctx)
    assert tree.widths() == [1, 3, 2, 2] and set(tree.child_rule.values()) == {DrawRule.DETERMINISTIC}
    assert check_recorded_draft(tree, session, ctx) >= 3  # the root and at least one parent per deeper layer


def test_widths_trees_are_never_chains():
    """draws_chains lets chain-only verifiers (sps, asps, block) take the trees: a widths tree with branch=1 set
    alongside (branch applies to k-ary trees only) is still a tree."""
    assert POLICIES["static"](depth=3, branch=1).draws_chains
    assert not POLICIES["static"](widths="3,2", branch=1).draws_chains
