"""Sequoia's dynamic program, the static tree it drafts, calibration files, equivalence."""
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arborspec.drafting import POLICIES
from arborspec.drafting.sequoia import expected_accepted, sequoia_shape, sequoia_values
from tests.drafting.equivalence import check_distribution, check_greedy_equivalence, make_pair
from tests.drafting.fake_session import FakeSession, fake_context
from tests.drafting.properties import check_tree


def all_shapes(n):
    """Every rooted ordered tree with n nodes whose children lists are rank prefixes (children lists, BFS-free)."""
    if n == 1:
        yield [[]]
        return
    # compositions of n - 1 into child subtree sizes
    for k in range(1, n):
        for sizes in compositions(n - 1, k):
            for subs in itertools.product(*[list(all_shapes(s)) for s in sizes]):
                shape = [[]]
                for sub in subs:
                    offset = len(shape)
                    shape[0].append(offset)
                    shape += [[c + offset for c in ch] for ch in sub]
                yield shape


def compositions(n, k):
    if k == 1:
        yield (n,)
        return
    for first in range(1, n - k + 2):
        for rest in compositions(n - first, k - 1):
            yield (first,) + rest


vectors = st.lists(st.floats(0.0, 0.5), min_size=1, max_size=4).filter(lambda v: sum(v) <= 1)


@given(vectors, st.integers(1, 7))
@settings(max_examples=60, deadline=None)
def test_dp_is_the_brute_force_optimum(acc, budget):
    shape = sequoia_shape(acc, budget)
    assert len(shape) == budget + 1
    best = max(expected_accepted(s, acc) for s in all_shapes(budget + 1))
    g, _, _ = sequoia_values(acc, budget)
    assert expected_accepted(shape, acc) == pytest.approx(best, abs=1e-12)
    assert g[budget + 1] - 1 == pytest.approx(best, abs=1e-12)


def test_shapes_follow_the_vector():
    chain = sequoia_shape([0.9], 6)  # one candidate per node: a chain
    assert all(len(k) <= 1 for k in chain)
    flat = sequoia_shape([0.2, 0.2, 0.2, 0.2], 4)  # low acceptance: wide
    assert len(flat[0]) == 4


sessions = st.builds(FakeSession, vocab=st.integers(2, 14), seed=st.integers(0, 10**6),
                     sharpness=st.floats(0.3, 6.0))


@given(sessions, st.integers(1, 40), st.sampled_from([0.0, 1.0]), st.integers(0, 9), st.sampled_from([0, 3]))
@settings(max_examples=60, deadline=None)
def test_tree_properties(session, budget, temperature, max_depth, top_k):
    policy = POLICIES["sequoia"](budget=budget)
    ctx = fake_context(session, temperature=temperature, max_depth=max_depth, top_k=top_k)
    tree = policy.draft(ctx)
    check_tree(tree, budget=budget, max_depth=max_depth, rules=policy.draw_rules(ctx.sampling))
    if temperature == 0 and max_depth >= policy.shape_depth and session.vocab >= 8:
        assert len(tree) - 1 == budget  # the shape is followed exactly (at most 8 children per node)
        assert sorted(len(k) for k in tree.children_lists()) == sorted(len(k) for k in policy.shape)


def test_acceptance_file(tmp_path):
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"acceptance": [0.7, 0.1, 0.05]}))
    pol = POLICIES["sequoia"](budget=10, acceptance_file=str(path))
    assert pol.options.vector == (0.7, 0.1, 0.05)
    assert pol.shape == sequoia_shape([0.7, 0.1, 0.05], 10)
    for bad in ("[0.9, 0.5]", "{}", "nope"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            POLICIES["sequoia"](acceptance_file=str(path))
    with pytest.raises(ValueError):
        POLICIES["sequoia"](acceptance="0.5,x")
    with pytest.raises(ValueError, match="every acceptance rate is 0"):  # it drafted a budget-deep chain a step
        POLICIES["sequoia"](acceptance="0,0,0")
    # entries that are no numbers named neither the file nor what was wrong ("could not convert string ...")
    for bad, says in (('[0.5, "x"]', "got 'x'"), ("[0.5, null]", "got None"),
                      ("[true, false]", "got True"), ("[[0.5]]", r"got \[0.5\]")):
        path.write_text(bad)
        with pytest.raises(ValueError, match=f"acceptance file .*acc.json.*: acceptance rates must be numbers, {says}"):
            POLICIES["sequoia"](acceptance_file=str(path))
    path.write_bytes(b"\xff\xfe[0.5]")
    with pytest.raises(ValueError, match="acc.json.* is not JSON"):  # a UnicodeDecodeError naming no file
        POLICIES["sequoia"](acceptance_file=str(path))
    with pytest.raises(ValueError, match="comma-separated list of numbers"):  # 0.5,,0.2 ran [0.5, 0.2]
        POLICIES["sequoia"](acceptance="0.5,,0.2")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request):
    return make_pair(request.param)


@pytest.mark.parametrize("options", [dict(budget=6), dict(budget=20, acceptance="0.5,0.2,0.1")])
def test_greedy_matches_ar(pair, options):
    check_greedy_equivalence(pair, "sequoia", options)


def test_sampling_preserves_the_target_distribution():
    check_distribution("sequoia", "mbr", dict(budget=6, acceptance="0.4,0.2,0.1"))


def test_calibrate_measures_ranks():
    from arborspec.bench.calibrate import calibrate

    target, _ = make_pair("llama")
    same = calibrate(target, target, [[5, 6, 7], [9, 3]], max_new_tokens=10, ranks=4)
    assert same["acceptance"][0] == pytest.approx(1.0) and same["positions"] == 20  # a perfect draft: always rank 1
    target, draft = make_pair("llama", noise=0.6)
    res = calibrate(target, draft, [[5, 6, 7], [9, 3]], max_new_tokens=10, ranks=4)
    assert 0 < sum(res["acceptance"]) <= 1 and res["acceptance"][0] < 1
    # the largest seed: the second prompt's seed + 1 was out of torch's range (an error for a seed never given)
    assert calibrate(target, draft, [[5, 6, 7], [9, 3]], max_new_tokens=4, ranks=2, seed=2**64 - 1,
                     temperature=1.0)["positions"] == 8


def test_calibrate_stops_reading_at_an_id_the_drafts_table_lacks():
    """A target whose table is wider than the draft's (padding rows, as 152064 against 151936) may emit an id the
    draft cannot read: an IndexError inside the draft's embedding."""
    from arborspec import SpeculativeDecoder
    from arborspec.bench.calibrate import calibrate
    from tests.conftest import tiny_model

    target, narrow = tiny_model("llama", seed=1), tiny_model("llama", seed=2, vocab=40)
    prompt = [3, 4]
    out = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=30).token_ids
    wide = next(j for j, t in enumerate(out) if t >= 40)  # the target does write an id the draft lacks, not first
    assert wide > 0
    res = calibrate(target, narrow, [prompt], max_new_tokens=30, ranks=2)
    assert res["positions"] == wide
    short = tiny_model("llama", seed=2, context=12)  # and a draft with a shorter window reads up to its end
    assert calibrate(target, short, [[5, 6, 7]], max_new_tokens=20, ranks=2)["positions"] == 12 - 3
    with pytest.raises(ValueError, match="fill the draft's 12-token window"):
        calibrate(target, short, [list(range(3, 15))], max_new_tokens=20, ranks=2)


def test_sequoia_follows_a_budget_changed_between_steps():
    """The budget tuner (drafting/budget_tuner.py) sets `options.budget` between steps: each budget has its shape."""
    policy = POLICIES["sequoia"](budget=6)
    assert len(policy.draft(fake_context(FakeSession(vocab=12)))) - 1 == 6
    policy.options.budget = 12
    assert len(policy.draft(fake_context(FakeSession(vocab=12)))) - 1 == 12
    assert policy.shape == sequoia_shape(policy.options.vector, 12)


def test_sequoia_shape_is_numbered_breadth_first():
    shape = sequoia_shape([0.5, 0.2, 0.1], 20)
    depth = [0] * len(shape)
    for node, kids in enumerate(shape):
        for c in kids:
            depth[c] = depth[node] + 1
    assert max(depth) >= 3 and depth == sorted(depth)
    assert [c for kids in shape for c in kids] == list(range(1, len(shape)))


# ---- pins found by mutating sequoia.py ------------------------------------------------------------------------------
def test_acceptance_vectors_at_the_edges_of_the_rules_are_taken():
    """Rates may be 0 or 1 and may sum to exactly 1: a perfect draft ("1") drafts a chain, a zero rank is allowed
    as long as some rank is not."""
    from arborspec.drafting.sequoia import parse_acceptance

    assert parse_acceptance("1") == (1.0,)
    assert all(len(k) <= 1 for k in POLICIES["sequoia"](budget=5, acceptance="1").shape)
    assert parse_acceptance("0.5,0.5") == (0.5, 0.5)
    assert parse_acceptance("0.5,0") == (0.5, 0.0)
    assert parse_acceptance("0.7,0.3000004") == (0.7, 0.3000004)  # float noise in a calibrated vector's sum


@pytest.mark.parametrize("options, match", [
    (dict(acceptance="0.6,0.41"), "sum to at most 1, got 1.0100"),
    (dict(acceptance="0.6,0.405"), "sum to at most 1"),
    (dict(budget=2000), "budget must be at most 1024"),
    (dict(draw="often"), "draw must be one of"),
])
def test_sequoia_options_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        POLICIES["sequoia"](**options)


def test_an_empty_acceptance_file_is_refused_as_empty(tmp_path):
    path = tmp_path / "acc.json"
    path.write_text("[]")
    with pytest.raises(ValueError, match="non-empty list"):
        POLICIES["sequoia"](acceptance_file=str(path))


@pytest.mark.parametrize("acceptance", ["0.65,0.12,0.05,0.03", "0.3,0.25,0.2,0.1"])
def test_at_t0_the_draft_follows_the_shape_rank_by_rank(acceptance):
    """The draft's i-th token gets the shape's rank-i child and its subtree (the largest ones go to the likeliest
    tokens): the drafted children lists are the shape's, node for node, and the depth limit is the shape's depth."""
    policy = POLICIES["sequoia"](budget=20, acceptance=acceptance)
    session = FakeSession(vocab=12, seed=4, sharpness=2.0)
    tree = policy.draft(fake_context(session))
    assert tree.children_lists() == policy.shape
    for kids in tree.children_lists():
        probs = [tree.probs[c] for c in kids]
        assert probs == sorted(probs, reverse=True)
    assert policy.max_tree_depth == tree.depth == max(tree.depths)


@pytest.mark.parametrize("draw", ["sample", "iid", "greedy"])
def test_the_sampled_rule_follows_the_draw_option(draw):
    from arborspec.drafting.layers import DRAW_RULES

    policy = POLICIES["sequoia"](budget=8, draw=draw)
    assert policy.sampled_rule == DRAW_RULES[draw]
    tree = policy.draft(fake_context(FakeSession(vocab=12, seed=1), temperature=1.0))
    assert set(tree.child_rule.values()) == {DRAW_RULES[draw]}
