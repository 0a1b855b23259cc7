"""DySpec Alg. 1: tree properties, App. D optimality, batched == unbatched, greedy and distribution equivalence."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from arborspec.core.tree import DrawRule
from arborspec.drafting import POLICIES
from tests.drafting.equivalence import check_distribution, check_greedy_equivalence, make_pair
from tests.drafting.fake_session import FakeSession, fake_context
from tests.drafting.properties import check_recorded_draft, check_tree

sessions = st.builds(FakeSession, vocab=st.integers(2, 14), seed=st.integers(0, 10**6),
                     sharpness=st.floats(0.3, 6.0))


@given(sessions, st.integers(1, 40), st.sampled_from([0.0, 0.6, 1.0]), st.sampled_from([0, 3]), st.integers(0, 7),
       st.booleans())
@settings(max_examples=80, deadline=None)
def test_tree_properties(session, budget, temperature, top_k, max_depth, batch):
    policy = POLICIES["dyspec"](budget=budget, batch=batch)
    ctx = fake_context(session, temperature=temperature, top_k=top_k, max_depth=max_depth)
    tree = policy.draft(ctx)
    check_tree(tree, budget=budget, max_depth=max_depth, rules=policy.draw_rules(ctx.sampling))
    if temperature == 0 and max_depth >= budget:
        assert len(tree) - 1 == budget  # softmax has full support: the budget is always filled
    if max_depth == 0:
        assert len(tree) == 1 and session.forwards == 0
    # values: the root's first draw is worth 1; values of the pops never increase (Alg. 1 is monotone)
    values = policy.last_values[1:]
    assert all(a >= b - 1e-12 for a, b in zip(values, values[1:]))
    if temperature > 0:
        assert all(r is DrawRule.WITHOUT_REPLACEMENT for r in tree.child_rule.values())


@given(sessions, st.integers(1, 40), st.sampled_from([0.0, 0.8]), st.integers(1, 8), st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_batched_builds_the_same_tree_as_alg1_with_fewer_calls(session, budget, temperature, max_depth, seed):
    trees, calls = [], []
    for batch in (False, True):
        s = FakeSession(session.vocab, session.seed, session.sharpness)
        policy = POLICIES["dyspec"](budget=budget, batch=batch)
        tree = policy.draft(fake_context(s, temperature=temperature, max_depth=max_depth, seed=seed))
        trees.append(tree)
        calls.append(s.forwards)
        assert policy.last_calls == s.forwards
    a, b = trees
    assert a.tokens == b.tokens and a.parents == b.parents
    assert calls[1] <= calls[0]


def test_batching_saves_calls_on_average():
    saved = []
    for seed in range(20):
        calls = []
        for batch in (False, True):
            s = FakeSession(vocab=20, seed=seed, sharpness=2.5)
            POLICIES["dyspec"](budget=32, batch=batch).draft(fake_context(s))
            calls.append(s.forwards)
        saved.append(calls[0] / calls[1])
        assert calls[1] < calls[0]
    assert sum(saved) / len(saved) > 3  # 32 calls unbatched; a handful of layers batched


# ---- App. D: the greedy tree is the most valuable connected tree of its size -----------------------------------
def slot_successors(session, context, slot):
    """Slots of the (left-child, right-sibling) tree at temperature 0: (value, path, k) = the k-th ranked child of
    the node reached by `path`, worth `value`. Its successors: that child's first child and the (k+1)-th sibling."""
    value, path, k = slot
    d = session.logits_for(tuple(context) + path).softmax(-1).double()
    order = torch.argsort(d, descending=True, stable=True).tolist()
    y = order[k]
    tried = float(d[order[:k]].sum())
    r = float(d[y]) / (1 - tried)  # R[y] of the residual after k draws
    # a sibling worth nothing (the draws so far took all the mass, 1.0 in float32) is no slot: Alg. 1 never pushes it
    sibling = value * (1 - r) if k + 1 < len(order) else 0.0
    return [(value * r, path + (y,), 0), (sibling, path, k + 1)] if sibling > 0 else [(value * r, path + (y,), 0)]


def brute_force_best(session, context, size, max_depth):
    """Max total value over connected slot trees of exactly `size` slots (every token tree whose sibling sets are
    rank prefixes, i.e. every tree drawing without replacement can produce), by exhaustive enumeration."""
    best = -1.0

    def go(cands, chosen, total):
        nonlocal best
        if chosen == size:
            best = max(best, total)
            return
        if not cands:
            return
        (c, rest) = cands[0], cands[1:]
        go(rest, chosen, total)  # leave c out for good
        succ = [s for s in slot_successors(session, context, c) if len(s[1]) < max_depth or s[1] == c[1]]
        go(rest + succ, chosen + 1, total + c[0])

    go([(1.0, (), 0)], 0, 0.0)
    return best


@given(st.integers(2, 4), st.integers(0, 10**6), st.floats(0.3, 4.0), st.integers(1, 7), st.integers(1, 4))
@example(vocab=2, seed=8087, sharpness=4.0, budget=2, max_depth=2)  # the root's top token has float32 probability 1
@settings(max_examples=40, deadline=None)
def test_greedy_is_optimal_app_d(vocab, seed, sharpness, budget, max_depth):
    session = FakeSession(vocab, seed, sharpness)
    ctx = fake_context(session, max_depth=max_depth)
    policy = POLICIES["dyspec"](budget=budget)
    tree = policy.draft(ctx)
    greedy_total = sum(policy.last_values[1:])
    best = brute_force_best(FakeSession(vocab, seed, sharpness), ctx.context, len(tree) - 1, max_depth)
    assert greedy_total == pytest.approx(best, rel=1e-6)
    # and the children of each node are its top tokens, in order
    for node, kids in enumerate(tree.children_lists()):
        if kids:
            path = tuple(tree.tokens[i] for i in tree.path(node)[1:])
            d = session.logits_for(tuple(ctx.context) + path).softmax(-1)
            ranked = torch.argsort(d, descending=True, stable=True)
            assert [tree.tokens[c] for c in kids] == ranked[: len(kids)].tolist()


# ---- end to end ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request):
    return make_pair(request.param)


@pytest.mark.parametrize("options", [dict(budget=4), dict(budget=16), dict(budget=12, batch=False)])
def test_greedy_matches_ar(pair, options):
    check_greedy_equivalence(pair, "dyspec", options)


def test_draft_calls_are_reported():
    from arborspec import SpeculativeDecoder

    target, draft = make_pair("llama")
    res = {b: SpeculativeDecoder(target, draft, method="dyspec", budget=16, batch=b).generate(
        [5, 6, 7], max_new_tokens=20, ignore_eos=True) for b in (False, True)}
    assert res[False].token_ids == res[True].token_ids
    calls = {b: sum(s.draft_calls for s in r.stats.steps) for b, r in res.items()}
    assert calls[True] < calls[False]


def test_sampling_preserves_the_target_distribution():
    check_distribution("dyspec", "mbr", dict(budget=6))


# ---- what the tree records, and what the draft is asked ----------------------------------------------------------
@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (0.6, 3)])
def test_dyspec_records_the_warped_draft_distribution_and_each_token_probability(temperature, top_k):
    """Children come from the draft's warped distribution (mbr needs it); a node's prob is its token's probability
    there at T > 0, and under the plain softmax at T = 0 (where the warped distribution is one-hot)."""
    session = FakeSession(vocab=9, seed=4, sharpness=1.0)
    ctx = fake_context(session, temperature=temperature, top_k=top_k, seed=2)
    tree = POLICIES["dyspec"](budget=12).draft(ctx)
    assert any(len(k) > 1 for k in tree.children_lists())  # siblings: not only first children are checked
    assert check_recorded_draft(tree, session, ctx) >= 3


def test_unbatched_dyspec_calls_the_draft_once_per_node_but_not_for_the_last():
    """Alg. 1 forwards every node it adds while pops are left: the root and the first budget - 1 drafted nodes."""
    session = FakeSession(vocab=6, seed=1, sharpness=1.0)
    policy = POLICIES["dyspec"](budget=10, batch=False)
    tree = policy.draft(fake_context(session))
    assert len(tree) - 1 == 10
    assert session.forwards == session.rows == 10 == policy.last_calls


@pytest.mark.parametrize("seed", range(6))
def test_batched_dyspec_forwards_no_more_nodes_than_pops_left(seed):
    """A slot below the (r-1)-th best left in the heap is never popped: its node is not forwarded (flat drafts fill
    the heap with many unforwarded first-child slots, so the bound binds)."""
    session = FakeSession(vocab=3, seed=seed, sharpness=0.5)
    policy = POLICIES["dyspec"](budget=8)
    tree = policy.draft(fake_context(session))
    calls = [(len(nodes), 8 - (size - 1)) for nodes, size in session.calls]  # (nodes forwarded, pops left then)
    assert calls[0] == (1, 8)  # the root alone
    assert all(n <= left for n, left in calls[1:]), calls
    assert policy.last_wasted == session.rows - len(set(tree.parents[1:]))


@pytest.mark.parametrize("batch", [False, True])
def test_dyspec_wasted_rows_are_the_forwarded_nodes_never_expanded(batch):
    session = FakeSession(vocab=10, seed=3, sharpness=2.0)
    policy = POLICIES["dyspec"](budget=20, batch=batch)
    tree = policy.draft(fake_context(session, temperature=0.8, seed=5))
    expanded = set(tree.parents[1:])  # every expanded node went through the draft, once
    assert policy.last_wasted == session.rows - len(expanded) > 0


def test_dyspec_drafts_no_token_worth_nothing():
    """The root's top token has float32 probability 1 and the other one 2e-11 (not 0): the second child slot is worth
    value * (1 - 1) = 0 and never pushed, so at depth 1 the tree stops at one token rather than fill the budget
    with a token it values at 0."""
    session = FakeSession(vocab=2, seed=0, sharpness=20.0)
    assert sorted(session.logits_for((3, 1, 4)).softmax(-1).tolist())[0] > 0
    assert float(session.logits_for((3, 1, 4)).softmax(-1).max()) == 1.0
    policy = POLICIES["dyspec"](budget=2)
    tree = policy.draft(fake_context(session, max_depth=1))
    assert len(tree) == 2 and all(v > 0 for v in policy.last_values)
