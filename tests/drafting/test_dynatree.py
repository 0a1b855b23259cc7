"""DynaTree: branching/depth rules, pruning, node budget, history adaptation, equivalence."""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arborspec.core.tree import DrawRule
from arborspec.drafting import POLICIES
from tests.drafting.equivalence import check_distribution, check_greedy_equivalence, make_pair
from tests.drafting.fake_session import FakeSession, fake_context
from tests.drafting.properties import check_tree

sessions = st.builds(FakeSession, vocab=st.integers(2, 14), seed=st.integers(0, 10**6),
                     sharpness=st.floats(0.3, 6.0))


@given(sessions, st.integers(1, 40), st.sampled_from([0.0, 1.0]), st.integers(0, 9),
       st.sampled_from([dict(), dict(tau_h=0.6, tau_l=0.2, d0=2, d_max=4), dict(rho_stop=0.0, rho_deep=0.0, tau=0.0),
                        dict(b_min=2, b_mid=3, b_max=5, tau=0.05)]))
@settings(max_examples=80, deadline=None)
def test_tree_properties_and_rules(session, budget, temperature, max_depth, extra):
    policy = POLICIES["dynatree"](budget=budget, **extra)
    o = policy.options
    ctx = fake_context(session, temperature=temperature, max_depth=max_depth)
    tree = policy.draft(ctx)
    check_tree(tree, budget=budget, max_depth=min(max_depth, o.d_max), rules={DrawRule.DETERMINISTIC})
    assert session.forwards <= tree.depth + 1  # one draft call per layer
    kids = tree.children_lists()
    full = len(tree) - 1 == budget
    for node, children in enumerate(kids):
        path = tuple(tree.tokens[i] for i in tree.path(node)[1:])
        p = tree.path_prob(node)
        if children:
            assert policy.expandable(tree.depths[node], p, max_depth)
            d = session.logits_for(tuple(ctx.context) + path).softmax(-1)
            b = policy.branching(float(d.max()))
            top = torch.argsort(d, descending=True, stable=True).tolist()
            assert [tree.tokens[c] for c in children] == top[: len(children)]  # the top tokens, in order
            assert len(children) <= b
            if not full:  # fewer than B children only where pruning stopped the rest
                dropped = top[len(children) : b]
                assert all(p * float(d[t]) < o.tau for t in dropped)
        if node and node != kids[0][0]:  # pruning spares only the root's most likely child
            assert p >= o.tau


def step(accepted, depth):
    return SimpleNamespace(accepted=accepted, depth=depth)


def test_history_adaptation_moves_parameters_the_right_way():
    pol = POLICIES["dynatree"](window=4)
    d0, tau_h = pol.d0, pol.tau_h
    for _ in range(3):
        pol.update(step(5, 5))
    assert (pol.d0, pol.tau_h) == (d0, tau_h)  # the window is not full yet
    pol.update(step(4, 5))  # mean of (1, 1, 1, 0.8) >= 0.7: more aggressive
    assert pol.d0 == d0 + 1 and pol.tau_h == pytest.approx(tau_h - 0.05)
    assert len(pol.history) == 0  # a fresh window after each adjustment
    for _ in range(4):
        pol.update(step(0, 6))  # nothing accepted: more conservative
    assert pol.d0 == d0 and pol.tau_h == pytest.approx(tau_h)
    for _ in range(4):
        pol.update(step(0, 6))
    assert pol.d0 == d0 - 1 and pol.tau_h == pytest.approx(tau_h + 0.05)
    for _ in range(4):
        pol.update(step(2, 4))  # 0.5: in between, no change
    assert pol.d0 == d0 - 1 and len(pol.history) == 4


def test_history_adaptation_stays_in_bounds():
    pol = POLICIES["dynatree"](window=2, d0=2, d_max=4, tau_h=0.5, tau_l=0.45)
    for _ in range(40):
        pol.update(step(3, 3))
    assert pol.d0 == 3 and pol.tau_h == pytest.approx(0.5)  # d0 < d_max; tau_h never moves below tau_l + step
    for _ in range(100):
        pol.update(step(0, 3))
    assert pol.d0 == 1 and pol.tau_h == pytest.approx(0.99)
    pol.update(step(0, 0))  # an empty tree says nothing
    assert len(pol.history) == 0
    for _ in range(600):  # the record of adjustments keeps the last 256 (it grew a step at a time, without end)
        pol.update(step(0, 3))
    assert len(pol.adjustments) == 256 and pol.adjustments[-1] == (pol.d0, pol.tau_h)
    off = POLICIES["dynatree"](window=1, adapt=False)
    off.update(step(5, 5))
    assert off.d0 == 5


def test_adaptation_changes_the_trees():
    """A higher D0 and a lower tau_h give deeper trees on the same draft."""
    s = FakeSession(vocab=10, seed=3, sharpness=3.0)
    base = POLICIES["dynatree"](budget=200, rho_stop=0.0, rho_deep=0.9, tau=0.0, d0=1, window=1)
    shallow = base.draft(fake_context(s, max_depth=20))
    for _ in range(5):
        base.update(step(2, 2))
    s2 = FakeSession(vocab=10, seed=3, sharpness=3.0)
    deep = base.draft(fake_context(s2, max_depth=20))
    assert base.d0 == 6 and deep.depth > shallow.depth


def test_bad_options_are_refused():
    for bad in (dict(b_min=3, b_max=2), dict(tau_h=0.3, tau_l=0.4), dict(d0=8, d_max=8), dict(budget=0),
                dict(rho_stop=0.5, rho_deep=0.1)):
        with pytest.raises(ValueError):
            POLICIES["dynatree"](**bad)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request):
    return make_pair(request.param)


@pytest.mark.parametrize("options", [dict(), dict(budget=10, d0=2, window=2), dict(tau_h=0.5, tau_l=0.2, tau=0.0)])
def test_greedy_matches_ar(pair, options):
    check_greedy_equivalence(pair, "dynatree", options)


def test_sampling_preserves_the_target_distribution():
    check_distribution("dynatree", "naive", dict(budget=6, tau_h=0.6, tau_l=0.3, rho_stop=0.0, tau=0.0))


def test_dynatree_spends_a_layer_cut_by_the_budget_on_its_most_probable_nodes():
    """Three children a node, no pruning, budget 5: the root's 3 children fill layer 1; 2 tokens are left, so only
    the 2 most probable layer-1 nodes are forwarded, and the first (the root's top child, node 1) takes both."""
    session = FakeSession(vocab=6, seed=5, sharpness=1.0)
    policy = POLICIES["dynatree"](budget=5, b_min=3, b_mid=3, b_max=3, rho_stop=0.0, rho_deep=0.0, tau=0.0)
    ctx = fake_context(session, temperature=0.7)
    tree = policy.draft(ctx)
    assert tree.parents == [-1, 0, 0, 0, 1, 1]
    assert session.rows == 1 + 2
    for node in (0, 1):  # the recorded distribution is the draft's warped one
        path = tuple(tree.tokens[i] for i in tree.path(node)[1:])
        assert torch.allclose(tree.child_dist[node], ctx.sampling.probs(session.logits_for(tuple(ctx.context) + path)))


def test_dynatree_keeps_the_root_s_most_likely_child_whatever_tau():
    session = FakeSession(vocab=10, seed=1, sharpness=0.5)
    d = session.logits_for((3, 1, 4)).softmax(-1)
    assert float(d.max()) < 0.9  # so every child is below tau
    tree = POLICIES["dynatree"](tau=0.9).draft(fake_context(session))
    assert tree.parents == [-1, 0] and tree.tokens[1] == int(d.argmax())


def test_dynatree_branching_thresholds():
    """B = b_min at c >= tau_h, b_max at c < tau_l, b_mid in between (both thresholds: the confident side)."""
    policy = POLICIES["dynatree"](b_min=1, b_mid=2, b_max=3, tau_h=0.9, tau_l=0.4)
    assert [policy.branching(c) for c in (1.0, 0.9, 0.89, 0.4, 0.39, 0.0)] == [1, 1, 2, 2, 3, 3]


def test_dynatree_expandable_gates():
    """d < min(D_max, limit), p >= rho_stop, and beyond D0 p >= rho_deep (each bound checked on both sides)."""
    policy = POLICIES["dynatree"](d0=5, d_max=8, rho_stop=0.02, rho_deep=0.3)
    assert policy.expandable(4, 0.02, 100) and not policy.expandable(4, 0.0199, 100)
    assert policy.expandable(5, 0.3, 100) and not policy.expandable(5, 0.2999, 100)
    assert policy.expandable(7, 1.0, 100) and not policy.expandable(8, 1.0, 100)
    assert policy.expandable(2, 1.0, 3) and not policy.expandable(3, 1.0, 3)


def test_history_adaptation_thresholds_are_inclusive():
    high = POLICIES["dynatree"](window=1, d0=5)
    high.update(step(7, 10))  # a_bar = 0.7 = adapt_high
    assert high.d0 == 6
    low = POLICIES["dynatree"](window=1, d0=5)
    low.update(step(3, 10))  # a_bar = 0.3 = adapt_low
    assert low.d0 == 4


def test_history_adaptation_averages_the_last_window_only():
    pol = POLICIES["dynatree"](window=2, d0=5)
    pol.update(step(1, 2))
    pol.update(step(1, 2))  # mean 0.5: no change, the window stays full
    pol.update(step(2, 2))  # the last two: (0.5, 1) -> 0.75 >= 0.7 (all three would be 0.67)
    assert pol.d0 == 6
