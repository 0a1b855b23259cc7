"""auto: the objective against brute-force optima on synthetic costs, calibration, the guard, cost adaptation, stats,
and exactness (greedy equivalence with `ar`, the target's distribution at T > 0 with mbr)."""
import itertools
import json
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arborspec import SpeculativeDecoder
from arborspec.core.isotonic import pool_adjacent_violators
from arborspec.core.sampling import SamplingConfig, make_generator
from arborspec.core.tree import DrawRule
from arborspec.drafting import POLICIES, DraftContext
from arborspec.drafting.auto.acceptance import Calibrator
from arborspec.drafting.auto.guard import Guard
from arborspec.drafting.auto.objective import CostModel, best_prefix, tree_rate
from arborspec.drafting.grafts.suffix import graft_suffix_branches
from arborspec.drafting.grafts.suffix_index import SuffixIndex
from arborspec.engine import StepStats
from arborspec.engine.verifier_choice import with_free_branches
from arborspec.tuning import costs as forward_costs
from arborspec.tuning.costs import CostCurve
from arborspec.verify.naive import NaiveVerifier
from tests.drafting.equivalence import check_greedy_equivalence, make_pair
from tests.drafting.fake_session import FakeSession, fake_context
from tests.drafting.properties import check_tree

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# the shape measured on this project's CPU (bf16, 1.5B target / 0.5B draft, 200-token cache): verification flat to
# 8 tokens, a draft layer ~1/3 of a target token
T_CPU = CostCurve.from_measurements(SIZES, [0.178 * r for r in (1, 0.81, 0.86, 0.99, 1.16, 1.59, 2.22, 3.5)])
D_CPU = CostCurve.from_measurements(SIZES, [0.057 * r for r in (1, 1.01, 0.97, 1.08, 1.24, 1.62, 2.35, 3.8)])


def flat(seconds: float) -> CostCurve:
    return CostCurve.from_measurements((1, 128), (seconds, seconds))


class ConstSession:
    """A draft whose next-token distribution is `probs` after every path (a stationary acceptance model)."""

    def __init__(self, probs):
        self.logits = torch.log(torch.tensor(np.array(probs, dtype=np.float32)))
        self.forwards = 0
        self.widths: list[int] = []

    def forward(self, context, tree, nodes):
        self.forwards += 1
        self.widths.append(len(nodes))
        return self.logits.expand(len(nodes), -1).clone()


def auto(costs: CostModel, p=None, greedy: bool = True, **options):
    """An auto policy with a fixed cost model; `p`: the exact child probabilities (a perfect predictor)."""
    policy = POLICIES["auto"](**options).use_costs(costs)
    if p is not None:
        policy.child_probs[greedy][: len(p)] = p
        policy.child_probs[greedy][len(p):] = 0.0
    return policy


def ctx_for(session, temperature=0.0, max_depth=100, seed=0, context=(3, 1, 4)):
    return DraftContext(session, list(context), SamplingConfig(temperature), make_generator(seed), max_depth)


def step_for(tree, path, t_draft=0.05, t_verify=0.2, t_other=0.0, committed=None):
    return StepStats(tree_size=len(tree) - 1, depth=tree.depth, widths=tree.widths(), accepted=len(path),
                     committed=len(path) + 1 if committed is None else committed, draft_calls=0, t_draft=t_draft,
                     t_verify=t_verify, t_other=t_other, path=list(path))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def cheap_profile(monkeypatch):
    """Skip measuring tiny models: a target that verifies up to 128 tokens for the price of one, cheap draft layers."""
    curves = {}

    def fake(model, refresh=False, **kw):
        curves.setdefault("calls", []).append(model)
        return (flat(0.01) if len(curves["calls"]) % 2 else flat(0.001)), "measured"

    monkeypatch.setattr(forward_costs, "profile_model", fake)
    return curves


# ---- the objective's pieces --------------------------------------------------------------------------------------
def test_best_prefix_is_the_enumerated_argmax():
    rng = np.random.default_rng(0)
    for _ in range(200):
        times = np.sort(rng.uniform(0.5, 3.0, 4))
        costs = CostModel(CostCurve.from_measurements((1, 4, 16, 64), times), flat(0.1),
                          overhead=float(rng.uniform(0, 0.2)))
        gains = np.sort(rng.uniform(0, 1, rng.integers(0, 12)))[::-1]
        expected, draft_time, nodes = float(rng.uniform(1, 3)), float(rng.uniform(0, 1)), int(rng.integers(0, 20))
        rates = [(expected + gains[:m].sum()) / (draft_time + costs.verify(1 + nodes + m) + costs.overhead)
                 for m in range(len(gains) + 1)]
        m, r = best_prefix(expected, draft_time, nodes, gains, costs)
        assert m == int(np.argmax(rates)) and r == pytest.approx(max(rates))


def test_best_prefix_ties_go_to_the_smaller_prefix():
    """Free verification and worthless candidates: every prefix has the same rate, and a node must strictly pay."""
    m, r = best_prefix(1.0, 0.0, 0, [0.0, 0.0, 0.0], CostModel(flat(1.0), flat(0.1)))
    assert (m, r) == (0, 1.0)


def test_cost_model_scales_its_profiles_shares_rows_and_adds_the_overhead():
    """t(n) = n and d(w) = 0.1 w (linear profiles); a round of 4 requests forwards 4x the rows."""
    costs = CostModel(CostCurve.from_measurements((1, 128), (1.0, 128.0)),
                      CostCurve.from_measurements((1, 128), (0.1, 12.8)),
                      overhead=0.5, draft_scale=2.0, verify_scale=3.0, sharing=4)
    assert costs.layer(2) == pytest.approx(2.0 * 0.1 * 8)  # draft_scale * d(4 * 2)
    assert costs.verify(3) == pytest.approx(3.0 * 12)  # verify_scale * t(4 * 3)
    assert costs.plain_step() == pytest.approx(3.0 * 4 + 0.5)  # verify_scale * t(4) + overhead
    assert costs.raw_draft(2) == pytest.approx(0.8) and costs.raw_verify(3) == pytest.approx(12.0)


def test_ceiling_rate_is_the_best_fully_accepted_chain():
    """Flat t = 1, d = 0.1, c = 0.1: a chain of k nodes commits k + 1 tokens in 1.1 + 0.1 k seconds, a rate that
    rises with k, so the best chain is the longest allowed."""
    from arborspec.drafting.auto.objective import ceiling_rate

    costs = CostModel(flat(1.0), flat(0.1), overhead=0.1)
    assert ceiling_rate(costs) == pytest.approx(17 / 2.7)  # k = 16
    assert ceiling_rate(costs, max_depth=4) == pytest.approx(5 / 1.5)


def test_expected_ceiling_accepts_chain_node_i_at_the_first_childs_rate_to_the_power_i():
    """Flat t = 1, d = 0.1, c = 0.1, acceptance 0.5 per token: k nodes commit 1 + 0.5 + ... + 0.5^k = 2 - 0.5^k
    tokens in 1.1 + 0.1 k seconds: 1.5/1.2, 1.75/1.3, 1.875/1.4, ... (best k = 2). The measured first-child rate
    replaces a(c_1^i) entirely; without it, a(x) = x with c_1 = 0.5 gives the same chain."""
    from arborspec.drafting.auto.objective import expected_ceiling

    costs = CostModel(flat(1.0), flat(0.1), overhead=0.1)
    assert expected_ceiling(costs, lambda x: 1.0, 0.9, first_accept=0.5) == pytest.approx(1.75 / 1.3)
    assert expected_ceiling(costs, lambda x: x, 0.5) == pytest.approx(1.75 / 1.3)


def test_cost_curve_interpolates_extrapolates_and_smooths_noise():
    c = CostCurve.from_measurements((1, 2, 4, 8), (1.0, 0.8, 0.9, 0.85))  # t(1) > t(2) is real; t(8) < t(4) noise
    assert c(1) == 1.0 and c(2) == 0.8
    assert c(4) == pytest.approx(0.875) and c(8) == pytest.approx(0.875)  # pooled: non-decreasing from n = 2
    assert c(3) == pytest.approx((0.8 + 0.875) / 2)
    assert c(16) == pytest.approx(0.875)  # flat last segment: flat extrapolation
    up = CostCurve.from_measurements((1, 2, 4), (1.0, 1.0, 2.0))
    assert up(8) == pytest.approx(4.0) and list(up(np.array([1, 3]))) == [1.0, 1.5]
    with pytest.raises(ValueError):
        CostCurve.from_measurements((1, 1), (1.0, 2.0))


# ---- synthetic optima ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q,delta", [(0.9, 0.1), (0.8, 0.25), (0.6, 0.2), (0.5, 0.45), (0.3, 0.5), (0.97, 0.02)])
def test_chain_depth_is_the_closed_form_optimum(q, delta):
    """One child per node, acceptance = draft probability q per token, flat verification, draft layers of delta:
    R(D) = (1 + q + ... + q^D) / (1 + D delta); the policy's depth is the argmax (0 = plain decoding)."""
    policy = auto(CostModel(flat(1.0), flat(delta)), [q], max_children=1, calibration=False)
    session = ConstSession([q] + [(1 - q) / 4] * 4)
    tree = policy.draft(ctx_for(session))
    rates = [sum(q**i for i in range(d + 1)) / (1 + d * delta) for d in range(17)]
    best = int(np.argmax(rates))
    assert tree.depth == best and len(tree) - 1 == best
    assert session.forwards == best  # a perfect predictor never wastes a draft call
    assert policy._built.record["expected"] == pytest.approx(sum(q**i for i in range(best + 1)), rel=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_root_width_is_the_enumerated_optimum(seed):
    """One layer (max_layers=1): the number of root children is argmax_m (1 + p_1 + ... + p_m) / (d(1) + t(1 + m))."""
    rng = np.random.default_rng(seed)
    p = np.sort(rng.dirichlet(np.full(12, 0.4)))[::-1]
    t = CostCurve.from_measurements(SIZES, np.sort(rng.uniform(0.8, 3.0, len(SIZES))))
    d = flat(float(rng.uniform(0.02, 0.3)))
    policy = auto(CostModel(t, d), p[:8], max_layers=1, calibration=False)
    tree = policy.draft(ctx_for(ConstSession(p)))
    rates = [(1 + p[:m].sum()) / (d(1) + t(1 + m)) if m else 1 / t(1) for m in range(9)]
    assert len(tree) - 1 == int(np.argmax(rates))
    assert [tree.tokens[c] for c in tree.children(0)] == list(range(len(tree) - 1))  # the top tokens, in order


def rank_trees(k: int, max_nodes: int, max_depth: int):
    """Every tree of rank paths (child j of a node = its j-th most likely token) closed under parents and under
    earlier siblings, with at most max_nodes drafted nodes."""
    full = sorted((t for d in range(1, max_depth + 1) for t in itertools.product(range(k), repeat=d)),
                  key=lambda t: (len(t), t))
    out = []

    def grow(i, chosen):
        if i == len(full):
            out.append(list(chosen))
            return
        grow(i + 1, chosen)
        t = full[i]
        parent_in = len(t) == 1 or t[:-1] in chosen
        elder_in = t[-1] == 0 or t[:-1] + (t[-1] - 1,) in chosen
        if len(chosen) < max_nodes and parent_in and elder_in:
            chosen.add(t)
            grow(i + 1, chosen)
            chosen.remove(t)

    grow(0, set())
    return out


def rank_tree_rate(nodes, p, costs):
    values = [math.prod(p[j] for j in t) for t in nodes]
    depth = max((len(t) for t in nodes), default=0)
    widths = [len({t[:-1] for t in nodes if len(t) == d + 1}) for d in range(depth)]  # nodes each call forwards
    return tree_rate(values, widths, costs)


def test_trees_are_near_the_brute_force_optimum():
    """Stationary acceptance = draft probability, random CPU-like costs: the greedy layer-by-layer tree reaches
    >= 97% of the best rate over every tree of <= 7 nodes (and exactly the best in most cases)."""
    rng = random.Random(0)
    ratios = []
    trees = rank_trees(3, 7, 4)
    for _ in range(30):
        p = sorted((rng.random() ** rng.choice([0.3, 1, 3]) for _ in range(3)), reverse=True)
        scale = sum(p) * rng.uniform(1.0, 1.6)
        p = [x / scale for x in p]
        t = CostCurve.from_measurements((1, 2, 4, 8), [1.0] + sorted(rng.uniform(0.8, 1.4) for _ in range(3)))
        delta = rng.uniform(0.05, 0.6)
        costs = CostModel(t, CostCurve.from_measurements((1, 2, 4, 8), [delta * r for r in (1, 1.02, 1.05, 1.2)]))
        tail = max(5, math.ceil((1 - sum(p)) / p[-1]) + 1)  # tail tokens, each less likely than the top 3
        session = ConstSession(p + [(1 - sum(p)) / tail] * tail)
        tree = auto(costs, p, max_nodes=7, max_layers=4, max_children=3, calibration=False).draft(ctx_for(session))
        got = tree_rate([tree.path_prob(i) for i in range(1, len(tree))], session.widths, costs)
        best = max(rank_tree_rate(nodes, p, costs) for nodes in trees)
        assert got <= best * (1 + 1e-5)  # (float32 draft probabilities)
        ratios.append(got / best)
    assert min(ratios) >= 0.97 and np.mean(ratios) >= 0.995
    assert sum(r > 1 - 1e-5 for r in ratios) >= 0.8 * len(ratios)


def test_no_draft_call_when_drafting_cannot_pay():
    session = ConstSession([0.5] + [0.1] * 5)
    policy = auto(CostModel(flat(1.0), flat(2.0)), [0.5])
    tree = policy.draft(ctx_for(session))
    assert len(tree) == 1 and session.forwards == 0
    assert policy._built.record["mode"] == "ar (objective)"


def test_cpu_costs_give_wide_shallow_trees_for_an_unsure_draft_and_deep_ones_for_a_sure_one():
    unsure = ConstSession([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05])
    tree = auto(CostModel(T_CPU, D_CPU), [0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05]).draft(ctx_for(unsure))
    assert tree.depth == 1 and len(tree) - 1 >= 4  # verification is free up to ~8 tokens; depth costs draft calls
    sure = ConstSession([0.95, 0.02, 0.01, 0.01, 0.01])
    tree = auto(CostModel(T_CPU, D_CPU), [0.95, 0.02, 0.01, 0.01, 0.01]).draft(ctx_for(sure))
    assert tree.depth >= 4 and len(tree) - 1 <= tree.depth + 2


def test_in_a_batching_round_a_tree_must_pay_for_every_request_it_delays():
    """Rows at 2/5 of a one-token forward: a sure draft's tree pays for one request alone. In a round of four requests
    verified by one forward, each row delays all four, whose plain round commits 4 tokens in t(4): no tree pays."""
    linear = CostCurve.from_measurements(SIZES, [0.05 + 0.02 * (n - 1) for n in SIZES])
    p = [0.6, 0.2, 0.1, 0.1]
    assert len(auto(CostModel(linear, flat(0.005)), p).draft(ctx_for(ConstSession(p)))) > 1
    shared = auto(CostModel(linear, flat(0.005)), p)
    ctx = ctx_for(ConstSession(p))
    ctx.sharing = 4
    assert len(shared.draft(ctx)) == 1 and shared._built.record["mode"] == "ar (objective)"
    assert shared.costs.sharing == 4 and shared.costs.verify(2) == linear(8)  # four requests' two rows each


@given(st.integers(2, 14), st.integers(0, 10**6), st.floats(0.3, 6.0), st.sampled_from([0.0, 0.7, 1.0]),
       st.integers(0, 6), st.integers(1, 20), st.floats(0.001, 0.5))
@settings(max_examples=60, deadline=None)
def test_tree_properties(vocab, seed, sharpness, temperature, max_depth, max_nodes, delta):
    session = FakeSession(vocab, seed, sharpness)
    policy = auto(CostModel(T_CPU, flat(delta)), max_nodes=max_nodes, max_children=4)
    ctx = fake_context(session, temperature=temperature, max_depth=max_depth, seed=seed)
    tree = policy.draft(ctx)
    check_tree(tree, budget=max_nodes, max_depth=max_depth, rules=policy.draw_rules(ctx.sampling))
    assert all(len(k) <= 4 for k in tree.children_lists())
    assert session.forwards == len(policy._built.record["forwarded"]) <= tree.depth + 1
    assert len(policy._built.scores) == len(tree) - 1
    if temperature > 0:
        assert all(r is DrawRule.WITHOUT_REPLACEMENT for r in tree.child_rule.values())


class RootSureSession(FakeSession):
    """A draft sure of its next token at the root (top probability ~0.98) and unsure below it (~0.3)."""

    def forward(self, context, tree, nodes):
        logits = super().forward(context, tree, nodes)
        for i, node in enumerate(nodes):
            if node == 0:
                logits[i, int(logits[i].argmax())] += 8.0
        return logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_child_predictor_learns_from_the_roots_rows_only(temperature):
    """c_j predicts the root's children (whether to draft at all): rows of deeper nodes, where the draft is often
    unsure and the tree stops, must not pull it down (tree_builder.PREDICTOR_RATE)."""
    greedy = temperature == 0
    policy = auto(CostModel(T_CPU, flat(0.001)), max_children=4)
    policy.child_probs[greedy][0] = 0.5
    for seed in range(30):
        ctx = fake_context(RootSureSession(12, seed, 1.0), context=(3, 1, seed), temperature=temperature, seed=seed)
        tree = policy.draft(ctx)
        assert tree.depth >= 2  # rows below the root were forwarded too
    root_top = 0.97 if greedy else 0.94  # E[q(y)] = sum q^2 at the root for the first draw
    assert policy.child_probs[greedy][0] > root_top - 0.03


def build_tree(ctx, costs: CostModel, acceptance=None, force=False, **options):
    """One TreeBuilder step with the default predictor (tree_builder.py without the policy around it)."""
    from arborspec.drafting.auto.options import AutoOptions
    from arborspec.drafting.auto.policy import DEFAULT_CHILD_PROBS
    from arborspec.drafting.auto.tree_builder import TreeBuilder

    builder = TreeBuilder(ctx, costs, acceptance or Calibrator(enabled=False), np.array(DEFAULT_CHILD_PROBS),
                          AutoOptions(**options), force=force)
    return builder.run(), builder


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_probe_step_drafts_one_child_even_when_none_pays(temperature):
    """A guard probe (force) must put a drafted token on the tree to measure speculation. t(n) = n seconds, draft
    layers of 2: once the call is made, a first child of gain 0.3 turns 1 token in 3 s into 1.3 in 4 s, which does
    not pay."""
    linear = CostCurve.from_measurements((1, 128), (1.0, 128.0))
    p = [0.3, 0.25, 0.2, 0.15, 0.1]
    for force in (True, False):
        session = ConstSession(p)
        tree, builder = build_tree(ctx_for(session, temperature=temperature), CostModel(linear, flat(2.0)), force=force)
        assert len(tree) == (2 if force else 1) and session.forwards == force and builder.wasted == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_node_records_its_own_path_probability_and_its_rows_draft_distribution(temperature):
    """A node's x_u (which scores its children and orders the frontier) is the product of its path's draft
    probabilities, and the distribution recorded for its children (what traversal/mbr verify against) is the
    warped draft row of that node, also when one call forwards several nodes."""
    checked_wide = False
    for seed in range(4):
        session = FakeSession(10, seed, 1.0)
        ctx = fake_context(session, temperature=temperature, seed=seed)
        tree, builder = build_tree(ctx, CostModel(flat(1.0), flat(0.001)), max_children=4, max_nodes=24)
        assert tree.depth >= 2
        for i in range(1, len(tree)):
            assert builder.path_probs[i] == pytest.approx(tree.path_prob(i), rel=1e-5)
        for node, dist in tree.child_dist.items():
            row = session.logits_for(tuple(ctx.context) + tuple(tree.tokens[i] for i in tree.path(node)[1:]))
            assert torch.allclose(dist, ctx.sampling.probs(row[None])[0])
        checked_wide |= any(len(c) > 1 and sum(n in tree.child_dist for n in c[1:]) for c, _ in session.calls)
    assert checked_wide


def test_sampled_frontier_forwards_its_likeliest_nodes():
    """At T > 0 a layer's children come out in order of their expected scores; the next call must forward the
    frontier nodes with the largest drawn path probabilities."""
    narrowed = 0
    for seed in range(8):
        session = FakeSession(10, seed, 1.0)
        tree, _ = build_tree(fake_context(session, temperature=1.0, seed=seed), CostModel(T_CPU, flat(0.02)))
        calls = [nodes for nodes, _ in session.calls]
        for before, call in zip(calls, calls[1:]):
            layer = [n for n in range(1, len(tree)) if tree.parents[n] in before]
            rest = [tree.path_prob(n) for n in layer if n not in call]
            assert min(tree.path_prob(n) for n in call) >= max(rest, default=0.0)
            narrowed += bool(rest)
    assert narrowed > 0  # some call forwarded part of its frontier


def test_children_of_equal_gain_are_added_likeliest_first():
    """A flat calibration (every score accepted half the time): which children pay depends only on how many, and the
    ones added are the draft's top tokens."""
    p = [0.4, 0.25, 0.15, 0.1, 0.05, 0.05]
    tree, builder = build_tree(ctx_for(ConstSession(p)), CostModel(T_CPU, D_CPU),
                               acceptance=lambda s: np.full(np.shape(s), 0.5), max_layers=1)
    assert len(tree) > 2
    assert [tree.tokens[c] for c in tree.children(0)] == list(range(len(tree) - 1))


def test_growth_stops_at_max_nodes_and_says_so():
    tree, builder = build_tree(ctx_for(ConstSession([0.95, 0.02, 0.01, 0.01, 0.01])), CostModel(T_CPU, D_CPU),
                               max_nodes=2)
    assert len(tree) - 1 == 2 and builder.stop == "max nodes"


def test_a_free_draft_call_predicted_to_add_nothing_is_not_made():
    """The draft call must be predicted to raise the rate strictly: with a free draft and a predictor that expects
    worthless children, forwarding leaves the predicted rate exactly equal, so no call (though the draft is sure)."""
    from arborspec.drafting.auto.options import AutoOptions
    from arborspec.drafting.auto.tree_builder import TreeBuilder

    session = ConstSession([0.95, 0.02, 0.01, 0.01, 0.01])
    free = CostModel(flat(1.0), flat(0.001), draft_scale=0.0)
    builder = TreeBuilder(ctx_for(session), free, Calibrator(enabled=False), np.zeros(8), AutoOptions())
    assert len(builder.run()) == 1 and session.forwards == 0


# ---- calibration --------------------------------------------------------------------------------------------------
def test_calibrator_starts_at_the_identity_and_learns_a_monotone_curve():
    cal = Calibrator(max_evidence=1e9)
    assert cal(cal.centers) == pytest.approx(cal.centers)  # the prior: draft probability = acceptance
    rng = np.random.default_rng(0)
    scores = rng.uniform(0, 1, 60000)
    truth = lambda s: 0.8 * s**2  # noqa: E731  the draft is overconfident
    cal.observe(scores, rng.uniform(0, 1, len(scores)) < truth(scores))
    curve = cal.curve()
    assert np.all(np.diff(curve) >= 0)
    busy = cal.trials > 1000
    assert np.abs(curve[busy] - truth(cal.centers[busy])).max() < 0.03
    assert cal(0.0) == 0.0 and 0.0 <= cal(1.0) <= 1.0


def test_calibration_is_monotone_even_when_the_data_is_not():
    cal = Calibrator()
    cal.observe([0.35] * 200 + [0.45] * 200, [1] * 180 + [0] * 20 + [1] * 20 + [0] * 180)
    assert np.all(np.diff(cal.curve()) >= 0)
    assert pool_adjacent_violators([3, 1, 2], [1, 1, 1]).tolist() == [2, 2, 2]
    off = Calibrator(enabled=False)
    off.observe([0.5], [0])
    assert off(0.37) == pytest.approx(0.37) and off.trials.sum() == 0


def test_calibrator_save_load_caps_old_evidence():
    cal = Calibrator(max_evidence=10**9)
    cal.observe([0.55] * 1000, [1] * 300 + [0] * 700)
    again = Calibrator()
    assert again.load(cal.to_dict(), cap=100)
    b = int(np.searchsorted(again.edges, 0.55, side="right") - 1)
    assert again.trials[b] == pytest.approx(100) and again.hits[b] == pytest.approx(30)
    assert not Calibrator(edges=(0, 0.5, 1)).load(cal.to_dict())  # other bins: ignored


def test_calibrator_bins_are_closed_below_and_forget_old_evidence_proportionally():
    cal = Calibrator(edges=(0.0, 0.5, 1.0), max_evidence=10)
    cal.observe([0.5], [1])  # bins are [e_b, e_{b+1}): 0.5 opens the second
    assert cal.trials.tolist() == [0, 1]
    cal.observe([0.7] * 19, [0] * 19)  # 20 observations over a cap of 10: both counts scaled by 10 / 20
    assert cal.trials.tolist() == [0, 10] and cal.hits[1] == pytest.approx(0.5)


def test_calibrated_acceptance_is_flat_past_the_last_bin_centre():
    """a(.) interpolates between bin centres and keeps the last bin's estimate up to 1 (it does not jump to 1)."""
    cal = Calibrator()
    last = cal.centers[-1]  # 0.975, the centre of [0.95, 1]
    assert cal(1.0) == pytest.approx(cal.curve()[-1]) == pytest.approx(last)


def test_update_learns_from_the_accepted_path():
    policy = auto(CostModel(T_CPU, D_CPU), [0.6, 0.2, 0.1])
    session = ConstSession([0.6, 0.2, 0.1, 0.05, 0.05])
    tree = policy.draft(ctx_for(session))
    assert len(tree) > 2
    path = [tree.children(0)[0]]
    policy.update(step_for(tree, path))
    assert policy.calibrator.trials.sum() == len(tree) - 1 and policy.calibrator.hits.sum() == 1
    rec = policy.explain()["steps"][-1]
    assert rec["accepted"] == 1 and rec["widths"] == tree.widths()


def test_update_ignores_grafted_nodes():
    policy = auto(CostModel(T_CPU, D_CPU), [0.6, 0.2, 0.1])
    tree = policy.draft(ctx_for(ConstSession([0.6, 0.2, 0.1, 0.05, 0.05])))
    own = len(tree) - 1
    extra = tree.add(0, 4)  # e.g. an n-gram branch the engine grafted after drafting
    policy.update(step_for(tree, [extra]))
    assert policy.calibrator.trials.sum() == own and policy.calibrator.hits.sum() == 0


# ---- the guard ----------------------------------------------------------------------------------------------------
def run_guard(guard, steps, model_plain=0.1):
    """Feed (seconds, tokens) as drafted steps whenever the guard plans speculation; returns the plans."""
    plans = []
    for seconds, tokens in steps:
        plan = guard.plan()
        plans.append(plan)
        if plan == "ar":
            guard.observe(0.1, 1, "ar", False, model_plain)
        else:
            guard.observe(seconds, tokens, plan, True, model_plain)
    return plans


def test_guard_falls_back_probes_backs_off_and_resumes():
    guard = Guard(margin=0.1, window=4, cooldown=3)
    slow = [(0.5, 2)] * 4  # 4 tokens/s against plain decoding's 10
    plans = run_guard(guard, slow + [(0, 0)] * 3 + slow + [(0, 0)] * 6)
    assert plans[:4] == ["spec"] * 4 and plans[4:7] == ["ar"] * 3  # fallback for `cooldown` plain steps
    assert plans[7:11] == ["spec"] * 4 and plans[11:17] == ["ar"] * 6  # the probe failed: twice as long
    actions = [d["action"] for d in guard.decisions]
    assert actions == ["fallback", "probe", "fallback", "probe"]
    assert guard.decisions[0]["measured_tokens_per_s"] == pytest.approx(4.0)
    assert guard.decisions[0]["plain_tokens_per_s"] == pytest.approx(10.0)
    fast = [(0.1, 3)] * 4  # 30 tokens/s
    run_guard(guard, fast)
    assert guard.decisions[-1]["action"] == "resume" and guard.backoff == 1
    run_guard(guard, fast * 3)
    assert guard.decisions[-1]["action"] == "resume"  # no news while speculation keeps paying


def test_one_stalled_step_does_not_trigger_a_fallback():
    guard = Guard(margin=0.1, window=4, cooldown=3)
    run_guard(guard, [(5.0, 3)] + [(0.1, 3)] * 3)  # 12 tokens in 5.3 s, but one step was a stall
    assert guard.decisions == [] and guard.rate() == pytest.approx(30.0)
    run_guard(guard, [(5.0, 3)] * 2)  # two stalls in the window are a trend
    assert [d["action"] for d in guard.decisions] == ["fallback"]


def test_guard_uses_measured_plain_steps_over_the_profile():
    guard = Guard(margin=0.1, window=2, cooldown=2)
    for _ in range(3):
        guard.observe(0.5, 1, "spec", False, model_plain=0.1)  # measured plain decoding: 2 tokens/s, not 10
    assert guard.plain_time(0.1) == (0.5, "measured")
    run_guard(guard, [(0.5, 2)] * 4)  # 4 tokens/s beats the measured 2 tokens/s
    assert guard.decisions == []
    assert Guard(enabled=False).plan() == "spec"


def test_guard_tolerates_speculation_within_its_margin():
    """Plain decoding profiles at 10 tokens/s (0.1 s a token); margin 0.1 lets speculation run down to 9."""
    within, below = Guard(margin=0.1, window=2, cooldown=2), Guard(margin=0.1, window=2, cooldown=2)
    run_guard(within, [(10.0, 95)] * 2)  # 9.5 tokens/s: slower than plain, but within the margin
    run_guard(below, [(10.0, 85)] * 2)  # 8.5 tokens/s
    assert within.decisions == [] and [d["action"] for d in below.decisions] == ["fallback"]


def test_guard_backoff_doubles_up_to_its_cap():
    guard = Guard(margin=0.1, window=1, cooldown=1, max_backoff=4)
    run_guard(guard, [(1.0, 1)] * 30)  # 1 token/s against 10: every probe fails
    assert [d["plain_steps"] for d in guard.decisions if d["action"] == "fallback"][:5] == [1, 2, 4, 4, 4]


def test_guard_trusts_measured_plain_steps_from_the_second_on():
    """One plain step (often a first call with new shapes) does not outvote the profile; two do (their median)."""
    guard = Guard()
    guard.observe(0.5, 1, "spec", False, model_plain=0.1)
    assert guard.plain_time(0.1) == (0.1, "profile")
    guard.observe(0.3, 1, "spec", False, model_plain=0.1)
    assert guard.plain_time(0.1) == (pytest.approx(0.4), "measured")


def test_guard_forces_a_probe_after_a_long_plain_stretch():
    guard = Guard(cooldown=3)
    for _ in range(3):
        assert guard.plan() == "spec"
        guard.observe(0.1, 1, "spec", False, 0.1)  # the objective chose plain decoding
    assert guard.plan() == "probe"
    guard.observe(0.1, 2, "probe", True, 0.1)
    assert guard.plan() == "spec"
    for _ in range(3):  # steps with grafted free branches only: the draft model still unused
        guard.observe(0.1, 3, "spec", True, 0.1, draft_used=False)
    assert guard.plan() == "probe"
    guard.observe(0.1, 2, "probe", True, 0.1, draft_used=True)
    assert guard.plan() == "spec"


def test_policy_obeys_the_guard_and_explains_it():
    policy = auto(CostModel(T_CPU, D_CPU), [0.9], guard_window=3, guard_cooldown=4, adapt_costs=False)
    session = ConstSession([0.9, 0.05, 0.05])
    modes, context = [], [3, 1, 4]
    for _ in range(10):
        calls = session.forwards
        tree = policy.draft(ctx_for(session, context=context))
        context.append(0)  # one committed token per step (the account resets when the context does not grow)
        modes.append(policy._built.record["mode"])
        if modes[-1] == "ar (guard)":
            assert len(tree) == 1 and session.forwards == calls  # plain steps make no draft call
        path = tree.path(len(tree) - 1)[1:] if len(tree) > 1 else []
        policy.update(step_for(tree, path, t_draft=10.0 * (len(tree) > 1), t_verify=float(T_CPU(len(tree)))))
        # (drafting measured far slower than profiled: speculation loses)
    assert modes[:3] == ["spec"] * 3 and modes[3:7] == ["ar (guard)"] * 4 and modes[7] == "spec"
    info = policy.explain()
    assert [d["action"] for d in info["guard"]][:2] == ["fallback", "probe"]
    assert "fallback" in info["summary"]
    json.dumps(info)


def test_a_policy_that_never_drafts_still_probes_and_no_room_steps_leave_the_guard_alone():
    policy = auto(CostModel(flat(1.0), flat(2.0)), [0.5], guard_cooldown=3)
    session = ConstSession([0.5] + [0.1] * 5)
    modes, context = [], [3, 1, 4]
    for _ in range(5):
        tree = policy.draft(ctx_for(session, context=context))
        context.append(0)
        modes.append(policy._built.record["mode"])
        policy.update(step_for(tree, [], t_draft=0.0, t_verify=1.0))
    assert modes == ["ar (objective)"] * 3 + ["probe", "ar (objective)"]
    assert session.forwards == 1 and policy.guard.decisions == []
    tree = policy.draft(ctx_for(session, context=context, max_depth=0))  # the last token: no room for a tree
    assert len(tree) == 1 and policy._built.record["mode"] == "ar (no room)"
    policy.update(step_for(tree, [], t_draft=0.0, t_verify=1.0))
    assert policy.guard.decisions == [] and policy.guard.ar_left == 0


def test_cost_scales_follow_measured_times():
    costs = CostModel(T_CPU, D_CPU)
    policy = auto(costs, [0.9])
    session = ConstSession([0.9, 0.05, 0.05])
    for _ in range(40):
        tree = policy.draft(ctx_for(session))
        predicted_draft = policy._built.draft_raw
        policy.update(step_for(tree, [], t_draft=2 * predicted_draft, t_verify=3 * T_CPU(len(tree)), t_other=0.01))
    assert costs.draft_scale == pytest.approx(2.0, rel=0.02)
    assert costs.verify_scale == pytest.approx(3.0, rel=0.02)
    assert costs.overhead == pytest.approx(0.01, rel=0.02)
    # after plain steps the draft's first call also catches up on the tokens it missed: predicted, not a slowdown
    lagging = auto(CostModel(T_CPU, D_CPU), [0.9], max_layers=1)
    session.cached = [3]  # the draft's cache holds 1 of the 9 committed tokens before the root
    for _ in range(5):
        tree = lagging.draft(ctx_for(session, context=[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]))
        assert lagging._built.record["catch_up"] == 8
        lagging.update(step_for(tree, [], t_draft=float(D_CPU(1 + 8)), t_verify=float(T_CPU(len(tree)))))
    assert lagging.costs.draft_scale == pytest.approx(1.0) and lagging.costs.verify_scale == pytest.approx(1.0)
    frozen = CostModel(T_CPU, D_CPU)
    policy = auto(frozen, [0.9], adapt_costs=False, guard=False)
    tree = policy.draft(ctx_for(session))
    policy.update(step_for(tree, [], t_draft=5.0, t_verify=5.0, t_other=1.0))
    assert (frozen.draft_scale, frozen.verify_scale, frozen.overhead) == (1.0, 1.0, 0.0)


# ---- end to end: exactness and stats --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_matches_ar(arch, cheap_profile):
    accepted = check_greedy_equivalence(make_pair(arch), "auto", {})
    assert accepted > 0


def test_budget_auto_on_dyspec_is_the_auto_policy(cheap_profile):
    from arborspec.drafting.dyspec import DySpecOptions

    assert DySpecOptions(budget="AUTO").budget == "auto" and DySpecOptions(budget="12").budget == 12
    with pytest.raises(ValueError, match="'auto'"):
        DySpecOptions(budget="many")
    a = POLICIES["dyspec"](budget="auto")
    a.auto.use_costs(CostModel(T_CPU, D_CPU))
    b = auto(CostModel(T_CPU, D_CPU))
    for seed in range(3):
        ta = a.draft(fake_context(FakeSession(20, seed, 3.0), temperature=1.0, seed=seed))
        tb = b.draft(fake_context(FakeSession(20, seed, 3.0), temperature=1.0, seed=seed))
        assert ta.tokens == tb.tokens and ta.parents == tb.parents
    target, draft = make_pair("llama")
    dec = SpeculativeDecoder(target, draft, method="dyspec", budget="auto", temperature=1.0)
    assert dec.verifier.name == "mbr"
    res = dec.generate([5, 6, 7], max_new_tokens=12, seed=0, ignore_eos=True)
    assert res.stats.policy["summary"].startswith("auto:")


def test_auto_verifies_its_sampled_trees_by_traversal(cheap_profile):
    """Traversal at T > 0 (exact for auto's trees: tests/verify/test_adaptive_trees.py), naive for the bare trees
    its default suffix branches go onto; naive for all once n-gram branches are asked for (traversal is not exact
    for deterministic children); greedy at T = 0."""
    target, draft = make_pair("llama")
    dec = SpeculativeDecoder(target, draft, method="auto", temperature=0.8)
    assert (dec.verifier.name, dec.free_verifier.name, dec.verifier_name) == ("traversal", "naive", "traversal+naive")
    assert SpeculativeDecoder(target, draft, method="auto", temperature=0.8, suffix=0).verifier_name == "traversal"
    assert SpeculativeDecoder(target, draft, method="auto", temperature=0.8, ngram=2).verifier_name == "naive"
    assert SpeculativeDecoder(target, draft, method="auto").verifier.name == "greedy"
    dec = SpeculativeDecoder(target, draft, method="auto", temperature=0.8, verifier="mbr")  # still the user's call
    assert dec.verifier_name == "mbr+naive"
    assert SpeculativeDecoder(target, draft, method="auto", temperature=0.8, verifier="naive").verifier_name == "naive"
    greedy_draft = SpeculativeDecoder(target, draft, method="auto", temperature=0.8, draft_temperature=0.0)
    assert greedy_draft.verifier_name == "naive" and not greedy_draft.bare_grafts  # naive anyway: every tree


def test_stats_explain_the_choices(cheap_profile):
    target, draft = make_pair("llama")
    dec = SpeculativeDecoder(target, draft, method="auto", suffix=0)  # the drafted trees alone (grafts: "grafts")
    assert dec.verifier.name == "greedy" and dec.policy.source["costs"] == "target measured, draft measured"
    res = dec.generate([5, 6, 7, 8], max_new_tokens=30, ignore_eos=True)
    info = res.stats.policy
    drafted = res.stats.steps[1:]  # the first token comes from the prompt's forward, before the policy drafts
    assert len(info["steps"]) == len(drafted) == res.stats.n_steps
    assert [s["widths"] for s in info["steps"]] == [s.widths for s in drafted]
    assert sum(s.tree_size for s in res.stats.steps) > 0
    assert len(info["calibration"]) == len(Calibrator().centers) and info["costs"]["target_ms"]
    assert sum(b["observed"] for b in info["calibration"]) > 0
    data = res.stats.to_dict(per_step=True)
    assert data["policy"]["summary"] == info["summary"] and "path" in data["per_step"][0]
    json.dumps(data)
    again = dec.generate([9, 9, 2], max_new_tokens=5, ignore_eos=True)  # a new generation: a new account
    # (the costs measured so far may leave no tree that pays: then it is a plain generation, with no steps to explain)
    assert len(again.stats.policy["steps"]) == (0 if again.stats.policy["plain"] else again.stats.n_steps)
    with pytest.raises(RuntimeError, match="cost profile"):
        POLICIES["auto"]().draft(fake_context(FakeSession()))


class LearningTableDecoder:
    """The harness's TableDecoder loop plus what the engine adds for learning policies: `policy.update(StepStats)`
    with the accepted path and random step times, so calibration, cost scales and the guard all move between (and
    within) samples; the tree of a step still never sees that step's verdict."""

    def __init__(self, table_decoder, seed: int = 0, suffix: int = 0):
        self.d = table_decoder
        self.vocab = table_decoder.vocab
        self.rng = random.Random(seed)
        self.shapes: set[tuple[int, int]] = set()  # (depth, widest layer) of the trees drafted
        # with `suffix`: auto's default suffix branches at T > 0, as the engine grafts them (onto bare trees only,
        # verified by naive: engine.verifier_choice.with_free_branches); the index persists across samples: trees vary
        self.index = SuffixIndex(8, 4) if suffix else None
        self.suffix = suffix
        self.grafted_accepted = 0  # accepted suffix nodes

    def generate(self, prompt, max_new_tokens, seed=None, ignore_eos=True, generator=None):
        from tests.verify.harness import TableResult

        d = self.d
        gen = generator if generator is not None else make_generator(seed)
        horizon = max(d.horizon or 0, max_new_tokens)
        target, draft = d.target.session(), d.draft.session()
        context, out = list(prompt), TableResult([])
        while len(out.token_ids) < max_new_tokens:
            room = horizon - len(out.token_ids) - 1
            tree = d.policy.draft(DraftContext(draft, context, d.draft_sampling, gen, max(room, 0)))
            self.shapes.add((tree.depth, max(tree.widths())))
            verifier = d.verifier
            if self.index is not None:
                tree, verifier = with_free_branches(
                    tree, lambda t: graft_suffix_branches(t, self.index, context, self.suffix, max(room, 0)), True,
                    d.verifier, NaiveVerifier())
            logits = target.forward(context, tree, list(range(len(tree))))
            verdict = verifier.verify(tree, logits, d.sampling, gen)
            self.grafted_accepted += sum(tree.sources[n] == "suffix" for n in verdict.path)
            kept = ([tree.tokens[i] for i in verdict.path] + [verdict.bonus])[: max_new_tokens - len(out.token_ids)]
            target.commit([0] + verdict.path)
            draft.commit([0] + verdict.path)
            context += kept
            out.token_ids += kept
            slow = self.rng.random() < 0.3
            d.policy.update(step_for(tree, verdict.path, t_draft=(3.0 if slow else 0.01) * (len(tree) > 1),
                                     t_verify=0.1, committed=len(kept)))
        return out


@pytest.mark.parametrize("verifier", ["mbr", "traversal"])
def test_sampled_output_follows_the_target_distribution(verifier):
    from tests.drafting.equivalence import assert_samples_target, table_pair
    from tests.verify.harness import TableDecoder

    t_table, d_table, prompt, probs = table_pair()
    policy = auto(CostModel(flat(1.0), flat(0.05)), guard_window=3, guard_cooldown=2, remember=False)
    dec = LearningTableDecoder(TableDecoder(t_table, d_table, method=policy, verifier=verifier, temperature=1.0,
                                            horizon=4))
    assert_samples_target(dec, prompt, probs)
    actions = {g["action"] for g in policy.run["guard"]} | {a["action"] for a in policy.guard.decisions}
    assert "fallback" in actions  # the guard did switch during sampling
    assert (0, 1) in dec.shapes and any(depth >= 2 and width >= 2 for depth, width in dec.shapes)
    assert policy.calibrator.trials.sum() > 100


@pytest.mark.slow
def test_default_suffix_branches_on_bare_trees_keep_the_target_distribution():
    """auto's default at T = 1: suffix branches only on the trees auto leaves bare (guard fallbacks, steps where no
    child pays), those verified by naive, the drafted ones by traversal without them: the first tokens keep the
    target's distribution, with both kinds of step and accepted suffix nodes among the samples."""
    from tests.drafting.equivalence import assert_samples_target, table_pair
    from tests.verify.harness import TableDecoder

    t_table, d_table, prompt, probs = table_pair(prompt=[1, 3, 1, 3, 1])  # it repeats: suffix branches are drafted
    policy = auto(CostModel(flat(1.0), flat(0.05)), guard_window=3, guard_cooldown=2, remember=False)
    dec = LearningTableDecoder(TableDecoder(t_table, d_table, method=policy, verifier="traversal", temperature=1.0,
                                            horizon=4), suffix=4)
    assert_samples_target(dec, prompt, probs)
    assert (0, 1) in dec.shapes and any(depth >= 1 for depth, _ in dec.shapes)  # bare and drafted steps
    assert dec.grafted_accepted > 100


def test_bench_knows_auto():
    from arborspec.runspec import options_for, parse

    spec = parse("auto")
    assert spec.policy == "auto" and spec.needs_draft
    assert options_for(spec, 16) == ({}, None)  # auto sizes its trees itself: a bench budget does not apply


def test_new_generation_resets_the_account_not_the_calibration():
    policy = auto(CostModel(T_CPU, D_CPU), [0.6])
    session = ConstSession([0.6, 0.2, 0.1, 0.1])
    tree = policy.draft(DraftContext(session, [1, 2, 3], SamplingConfig(0.0), None, 10))
    policy.update(step_for(tree, []))
    seen = policy.calibrator.trials.sum()
    tree = policy.draft(DraftContext(session, [1, 2, 3, 7], SamplingConfig(0.0), None, 10))
    policy.update(step_for(tree, []))
    assert len(policy.explain()["steps"]) == 2
    policy.draft(DraftContext(session, [1, 2], SamplingConfig(0.0), None, 10))  # shorter: another generation
    assert policy.explain()["steps"] == [] and policy.calibrator.trials.sum() >= seen


def test_auto_leaves_the_draft_alone_when_no_tree_could_pay():
    """Verification as steep as llama.cpp's on an AVX2 CPU (t(n) = n t(1)) and a draft at half a target token: even a
    chain accepted in full commits k + 1 tokens for k/2 + k + 1 target-token times, so the ceiling is below plain
    decoding. Then a generation neither opens nor calls the draft (no catch-up cost) and decodes plainly; with flat
    verification (the bf16 torch shape) speculation can pay and the draft is used."""
    from arborspec.drafting.auto.objective import ceiling_rate

    linear = CostCurve.from_measurements((1, 2, 4, 8, 16, 32), [0.04 * n for n in (1, 2, 4, 8, 16, 32)])
    steep = CostModel(linear, flat(0.02))
    assert ceiling_rate(steep) < 1 / steep.plain_step()
    gentle = CostModel(T_CPU, D_CPU)
    assert ceiling_rate(gentle) > 1 / gentle.plain_step()
    target, draft = make_pair("llama", seed=3, noise=0.0)
    ref = SpeculativeDecoder(target, method="ar").generate([5, 6, 7], max_new_tokens=20, ignore_eos=True)
    dec = SpeculativeDecoder(target, draft, method="auto")
    dec.policy.use_costs(steep)
    res = dec.generate([5, 6, 7], max_new_tokens=20, ignore_eos=True)
    assert res.token_ids == ref.token_ids
    assert sum(s.draft_calls for s in res.stats.steps) == 0 and res.stats.tokens_per_step == 1.0
    assert res.stats.policy["plain"] and res.stats.policy["summary"].startswith("auto: plain decoding")
    dec.policy.use_costs(gentle)
    res = dec.generate([5, 6, 7], max_new_tokens=20, ignore_eos=True)
    assert res.token_ids == ref.token_ids and sum(s.draft_calls for s in res.stats.steps) > 0


def test_at_temperature_auto_grafts_its_default_suffix_branches_only_onto_bare_trees(cheap_profile):
    """At T > 0 a step either keeps the draft's tree (traversal, nothing grafted) or, when auto drafts nothing (here:
    a draft too slow to pay, so it is never called), gets suffix branches verified by naive; on a repetitive text
    those are accepted."""
    target, draft = make_pair("llama", seed=3, noise=0.0)
    prompt = [5, 6, 7, 8, 9] * 4
    for costs, drafts in ((CostModel(T_CPU, flat(10.0)), False), (CostModel(T_CPU, D_CPU), True)):
        dec = SpeculativeDecoder(target, draft, method="auto", temperature=1.0, top_k=2, record_trees=True,
                                 remember=False)  # top-2 sampling: a text that repeats itself, now and then
        dec.policy.use_costs(costs)
        res = dec.generate(prompt, max_new_tokens=40, ignore_eos=True, seed=0)
        assert res.stats.verifier == "traversal+naive"
        trees = [set(s.tree["sources"][1:]) for s in res.stats.steps]
        assert not any({"draft", "suffix"} <= t for t in trees)  # never both in one tree
        if not drafts:
            assert sum(s.draft_calls for s in res.stats.steps) == 0
            assert res.stats.sources["suffix"]["accepted"] > 0
        else:
            assert sum(s.draft_calls for s in res.stats.steps) > 0


def test_auto_drafts_only_when_the_expected_rate_beats_plain_decoding_by_the_guards_margin():
    """The native backend's shape on an AVX2 CPU: t(2) = 1.25 t(1), a draft token at 0.67 t(1). Even with the draft's
    top token accepted 99% of the time a chain would win ~3%, less than the 10% the guard lets speculation lose:
    auto decodes plainly. Without the guard the line is plain decoding itself, which 99% clears and the default
    prior (top-1 probability 0.6, accepted as often) does not."""
    from arborspec.drafting.auto.objective import ceiling_rate, expected_ceiling

    sizes = (1, 2, 4, 8, 16, 32)
    native = CostModel(CostCurve.from_measurements(sizes, [0.049 * (1 + 0.25 * (n - 1)) for n in sizes]), flat(0.033))
    plain = 1 / native.plain_step()
    assert plain < ceiling_rate(native) < 1.1 * plain
    assert expected_ceiling(native, lambda x: x, 0.6) < plain < expected_ceiling(native, lambda x: x, 0.99)
    target, draft = make_pair("llama", seed=3, noise=0.0)
    cases = [(True, 0.99, False), (False, 0.99, True), (False, 0.6, False)]  # (guard, top-1 acceptance, drafts?)
    for guard, top1, drafts in cases:
        # suffix=0: a graft step would adapt the given costs to the tiny model's measured times (policy._adapt)
        dec = SpeculativeDecoder(target, draft, method="auto", guard=guard, calibration=False, remember=False,
                                 suffix=0)
        dec.policy.use_costs(native)
        dec.policy.child_probs[True][0] = top1
        assert dec.policy.uses_draft(3, 10_000) == drafts, (guard, top1)
        if not drafts:
            res = dec.generate([5, 6, 7], max_new_tokens=12, ignore_eos=True)
            assert sum(s.draft_calls for s in res.stats.steps) == 0 and res.stats.policy["plain"]
            assert "margin" in res.stats.policy["summary"]
    # the draft's prefill is paid once per generation: over 12 new tokens, 0.99 does not clear plain decoding either
    assert not dec.policy.uses_draft(3, 12) and not dec.policy.uses_draft(3, 10_000)  # 0.6: never
    dec.policy.child_probs[True][0] = 0.99
    assert dec.policy.uses_draft(3, 10_000) and not dec.policy.uses_draft(200, 12)


def test_auto_judges_sampled_steps_by_the_measured_acceptance_of_the_first_child():
    """At T > 0 a node's score (E[q(y)] = sum q^2) says little about its acceptance, and a(.) of the mean score fell
    far below the measured acceptance (0.41 against 0.86-0.92 on the default pair): once the root's first child has
    been drafted often enough, uses_draft reads its measured acceptance instead, at T = 0 as well."""
    sizes = (1, 2, 4, 8, 16, 32)
    costs = CostModel(CostCurve.from_measurements(sizes, [0.020 * (1 + 0.05 * (n - 1)) for n in sizes]), flat(0.006))
    target, draft = make_pair("llama", seed=3, noise=0.0)
    dec = SpeculativeDecoder(target, draft, method="auto", temperature=1.0, remember=False, suffix=0)
    policy = dec.policy
    policy.use_costs(costs)
    policy.child_probs[False][0] = 0.353
    policy.calibrator.observe([0.353] * 200, [1] * 82 + [0] * 118)  # a(0.353) ~ 0.41
    assert abs(float(policy.calibrator(0.353)) - 0.41) < 0.03
    assert not policy.uses_draft(3, 10_000)  # no first-child evidence yet: a(.) of the mean score decides
    policy.first_child.set_evidence(9, 10)  # too few steps to read
    assert not policy.uses_draft(3, 10_000)
    policy.first_child.set_evidence(88, 100)
    assert policy.uses_draft(3, 10_000)
    policy.first_child.set_evidence(30, 100)
    assert not policy.uses_draft(3, 10_000)
    policy._greedy = True  # greedy steps read the same evidence (the mean top probability under-reads a chain)
    policy.child_probs[True][0] = 0.353
    policy.first_child.set_evidence(100, 100)
    assert policy.uses_draft(3, 10_000)
    policy.first_child.set_evidence(30, 100)
    assert not policy.uses_draft(3, 10_000)
    policy.first_child.set_evidence(9, 10)  # too few steps: a(c_1 ** i) decides
    assert not policy.uses_draft(3, 10_000)


def test_auto_counts_how_often_the_roots_first_child_is_accepted():
    """update() adds each drafted step's verdict on the root's first child (its first draw at T > 0) to the
    evidence, which the calibration record carries to the next run."""
    target, draft = make_pair("llama", seed=3, noise=0.0)
    dec = SpeculativeDecoder(target, draft, method="auto", temperature=1.0, top_k=2, record_trees=True,
                             remember=False, suffix=0)
    dec.policy.use_costs(CostModel(T_CPU, D_CPU))
    res = dec.generate([5, 6, 7, 8, 9] * 4, max_new_tokens=40, ignore_eos=True, seed=0)
    drafted = accepted = 0
    for s in res.stats.steps:
        firsts = [i for i, p in enumerate(s.tree["parents"]) if p == 0]
        if firsts:
            drafted += 1
            accepted += firsts[0] in s.tree["path"]
    assert drafted > 0 and 0 < accepted
    first = dec.policy.first_child
    assert (first.hits.tolist(), first.trials.tolist()) == ([accepted], [drafted])
    assert dec.policy.explain()["first_child"] == {"accepted": accepted, "drafted": drafted}


@pytest.mark.usefixtures("private_cache")
def test_the_first_childs_evidence_is_saved_with_the_calibration_and_capped_when_loaded():
    target, draft = make_pair("llama", seed=3, noise=0.0)
    dec = SpeculativeDecoder(target, draft, method="auto", temperature=1.0, suffix=0)
    dec.policy.use_costs(CostModel(T_CPU, D_CPU))
    dec.generate([5, 6, 7, 8, 9] * 4, max_new_tokens=40, ignore_eos=True, seed=0)
    dec.policy.first_child.set_evidence(300, 400)  # more than a run may start from
    dec.policy.calibrator.observe([0.5], [1])  # evidence (has_evidence), so the next decoder loads the record
    dec.policy.save()
    again = SpeculativeDecoder(target, draft, method="auto", temperature=1.0, suffix=0).policy
    assert again.source["calibration"] == "cache"
    # capped at 100 drafted steps, the same rate
    assert (again.first_child.hits.tolist(), again.first_child.trials.tolist()) == ([75.0], [100.0])


@pytest.mark.usefixtures("private_cache")
def test_a_damaged_calibration_record_is_set_aside():
    """Fields of the record were read unchecked: child_probs "x" was an AttributeError traceback, plain_runs "abc"
    an error naming no file, NaN hits a ZeroDivisionError in uses_draft, NaN probabilities sized trees silently."""
    from arborspec.core.disk_cache import cache_dir
    target, draft = make_pair("llama", seed=3, noise=0.0)
    dec = SpeculativeDecoder(target, draft, method="auto", temperature=1.0, suffix=0)
    dec.policy.calibrator.observe([0.5], [1])
    dec.policy.save()
    (record,) = cache_dir().rglob("calibration-*.json")
    good = json.loads(record.read_text())
    assert SpeculativeDecoder(target, draft, method="auto", temperature=1.0).policy.source["calibration"] == "cache"
    nan_hits = dict(good["calibrator"], hits=[float("nan")] * len(good["calibrator"]["hits"]))
    negative = dict(good["calibrator"], trials=[-2.0] * len(good["calibrator"]["trials"]),
                    hits=[0.0] * len(good["calibrator"]["hits"]))
    for damage in ({"child_probs": "x"}, {"child_probs": {"true": ["a"]}}, {"child_probs": {"true": [float("nan")]}},
                   {"plain_runs": "abc"}, {"plain_runs": -5}, {"calibrator": nan_hits}, {"calibrator": negative}):
        record.write_text(json.dumps({**good, **damage}))
        policy = SpeculativeDecoder(target, draft, method="auto", temperature=1.0).policy
        assert policy.source["calibration"] == "new", damage
        assert np.isfinite(policy.child_probs[True]).all() and policy.plain_runs == 0


@pytest.mark.usefixtures("private_cache")
def test_at_t_above_0_a_calibration_is_kept_per_verifier():
    """auto+ngram at T > 0 verifies every tree with naive, which accepts fewer sampled draft tokens than auto's own
    traversal; its evidence must not become the record plain auto plans its trees with. At T = 0 they share one."""
    target, draft = make_pair("llama", seed=3, noise=0.0)

    def saved(temperature, **options):
        dec = SpeculativeDecoder(target, draft, method="auto", temperature=temperature, **options)
        dec.policy.use_costs(CostModel(T_CPU, D_CPU))
        dec.policy.calibrator.observe([0.5], [0])  # evidence (has_evidence), so a later decoder loads the record
        dec.policy.save()
        return dec.verifier.name

    assert saved(1.0, ngram=4, suffix=0) == "naive"
    plain = SpeculativeDecoder(target, draft, method="auto", temperature=1.0, suffix=0)
    assert plain.verifier.name == "traversal" and plain.policy.source["calibration"] == "new"
    assert SpeculativeDecoder(target, draft, method="auto", temperature=1.0, ngram=4,
                              suffix=0).policy.source["calibration"] == "cache"
    saved(0.0, ngram=4, suffix=0)
    assert SpeculativeDecoder(target, draft, method="auto", suffix=0).policy.source["calibration"] == "cache"


@pytest.mark.usefixtures("private_cache")
def test_a_repeatable_auto_samples_the_same_tokens_whatever_the_clock_and_earlier_runs(monkeypatch):
    """At T > 0 the tokens a seed gives depend on the trees (a tree's shape decides which random draws are made),
    and auto's trees follow the measured step times and the calibration saved by earlier runs. auto(repeatable)
    sizes them from the profile and this run alone, so a seeded run repeats: here under a steady clock, then one on
    which every fourth reading jumps (a step measured slow: the guard falls back to plain decoding), the second run
    with the first's saved calibration."""
    from types import SimpleNamespace

    from arborspec.engine import decoder as decoder_module

    def clock(increments):
        ticks, now = itertools.cycle(increments), [0.0]

        def perf_counter():
            now[0] += next(ticks)
            return now[0]
        return SimpleNamespace(perf_counter=perf_counter)

    target, draft = make_pair("llama", seed=3, noise=0.3)
    runs = {}
    for repeatable in (False, True):
        for jumps in (False, True):
            dec = SpeculativeDecoder(target, draft, method="auto", temperature=1.0, suffix=0, repeatable=repeatable)
            dec.policy.use_costs(CostModel(T_CPU, D_CPU))
            monkeypatch.setattr(decoder_module, "time", clock([0.5, 0.001, 0.001, 0.001] if jumps else [0.001]))
            res = dec.generate([5, 6, 7, 8, 9] * 4, max_new_tokens=40, ignore_eos=True, seed=0)
            runs[repeatable, jumps] = res.token_ids
    assert runs[True, False] == runs[True, True]
    assert runs[False, False] != runs[False, True]  # without it, the same seed gives other tokens


def test_a_repeatable_auto_repeats_after_other_generations_and_in_a_batch(monkeypatch):
    """Two ways a seeded auto(repeatable) run gave other tokens: a decoder reused after an unrelated generation (the
    calibration it had learned moved the trees), and a batch (trees sized for the requests sharing a round)."""
    target, draft = make_pair("llama", seed=3, noise=0.3)
    monkeypatch.setattr(forward_costs, "profile_model",  # every decoder and fork prices its trees alike
                        lambda model, **kw: (T_CPU if model is target else D_CPU, "measured"))
    prompts = [[5, 6, 7, 8, 9] * 4, [9, 3, 2, 7], [11, 4, 4, 2, 8, 1]]

    def decoder():
        return SpeculativeDecoder(target, draft, method="auto", temperature=1.0, suffix=0, repeatable=True)

    alone = [decoder().generate(p, max_new_tokens=30, ignore_eos=True, seed=i).token_ids for i, p in enumerate(prompts)]
    used = decoder()
    used.generate([3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=40, ignore_eos=True, seed=7)  # moves its calibration
    assert used.generate(prompts[0], max_new_tokens=30, ignore_eos=True, seed=0).token_ids == alone[0]
    batched = decoder().generate_batch(prompts, max_new_tokens=30, seeds=[0, 1, 2], ignore_eos=True, concurrency=3)
    assert [b.token_ids for b in batched] == alone
    from arborspec.engine import decoder as decoder_module
    monkeypatch.setattr(decoder_module, "sharing", lambda: 64)  # a round of 64 requests, as a busy server's
    assert decoder().generate(prompts[0], max_new_tokens=30, ignore_eos=True, seed=0).token_ids == alone[0]


def test_a_pair_judged_unable_to_pay_drafts_again_every_so_often_across_runs():
    """A plain generation learns nothing: one bad stretch saved with the calibration kept every later run of the pair
    plain for good, a perfect draft included. Every EXPLORE_EVERY-th plain generation in a row drafts anyway (the
    guard judges it), the count kept with the calibration; a repeatable run never does."""
    from arborspec.drafting.auto.policy import EXPLORE_EVERY

    sizes = (1, 2, 4, 8, 16, 32)
    verify = CostCurve.from_measurements(sizes, [0.049 * (1 + 0.25 * (n - 1)) for n in sizes])
    target, draft = make_pair("llama", seed=3, noise=0.0)

    def decoder(draft_cost=0.010, **options):  # a chain of the draft's tokens, all accepted, would pay
        dec = SpeculativeDecoder(target, draft, method="auto", suffix=0, **options)
        dec.policy.use_costs(CostModel(verify, flat(draft_cost)))
        dec.policy.child_probs[True][0] = 0.3  # no chain clears plain decoding by the guard's margin
        dec.policy.first_child.set_evidence(0, 0)
        return dec

    first = decoder()
    assert [first.policy.uses_draft(3, 10_000) for _ in range(EXPLORE_EVERY - 3)] == [False] * (EXPLORE_EVERY - 3)
    later = decoder()  # a later run of the pair: it reads the count saved with the calibration
    assert [later.policy.uses_draft(3, 10_000) for _ in range(4)] == [False, False, True, False]
    assert not any(decoder(repeatable=True).policy.uses_draft(3, 10_000) for _ in range(2 * EXPLORE_EVERY))
    assert not any(later.policy.uses_draft(3, 0) for _ in range(2 * EXPLORE_EVERY))  # scoring: nothing to learn
    dear = decoder(draft_cost=0.033)  # where not even full acceptance pays, nothing could change the decision
    assert not any(dear.policy.uses_draft(3, 10_000) for _ in range(2 * EXPLORE_EVERY))


def test_saved_evidence_capped_on_load_is_the_cap_itself():
    """Scaled by cap / trials, 49 trials read 15.999999999999998: under MIN_FIRST_EVIDENCE, so the first child's
    measured rate went unread after an exploring run's cut."""
    from arborspec.drafting.auto.acceptance import Calibrator
    for trials in (49, 98, 103):
        cal = Calibrator(edges=(0.0, 1.0))
        assert cal.load({"edges": [0.0, 1.0], "hits": [trials / 2], "trials": [trials]}, cap=16)
        assert cal.trials[0] == 16 and cal.hits[0] == pytest.approx(8)


# ---- pins found by mutating policy.py -------------------------------------------------------------------------------
def test_the_child_predictor_has_one_entry_per_child_slot():
    """c_j is kept (and saved, and explained) for j = 1..max_children: the prior truncated or padded with zeros."""
    from arborspec.drafting.auto.policy import DEFAULT_CHILD_PROBS

    for width in (3, len(DEFAULT_CHILD_PROBS), 11):
        probs = POLICIES["auto"](max_children=width).explain()["child_probs"]
        expected = list(DEFAULT_CHILD_PROBS[:width]) + [0.0] * max(0, width - len(DEFAULT_CHILD_PROBS))
        assert probs["greedy"] == probs["sampled"] == pytest.approx(expected)


def measured_draft_scale(ratios) -> float:
    """The draft scale after steps whose measured draft seconds are `ratios` times the predicted ones."""
    policy = auto(CostModel(T_CPU, D_CPU), [0.9], guard=False)
    session = ConstSession([0.9, 0.05, 0.05])
    for r in ratios:
        tree = policy.draft(ctx_for(session))
        policy.update(step_for(tree, [], t_draft=r * policy._built.draft_raw, t_verify=float(T_CPU(len(tree)))))
    return policy.costs.draft_scale


def test_cost_scales_start_from_two_prior_ratios_and_forget_past_their_window():
    """The median starts from two prior ratios of 1, so a first measured stall does not rescale the draft; the
    scale is the median of the last COST_WINDOW ratios, so a lasting change takes over once it fills that window."""
    from arborspec.drafting.auto.policy import COST_WINDOW

    assert measured_draft_scale([10.0]) == pytest.approx(1.0)  # median of 1, 1, 10
    assert measured_draft_scale([10.0, 10.0]) == pytest.approx(5.5)  # median of 1, 1, 10, 10
    assert measured_draft_scale([2.0] * COST_WINDOW + [4.0] * (COST_WINDOW // 2)) == pytest.approx(2.0)
    assert measured_draft_scale([2.0] * COST_WINDOW + [4.0] * (COST_WINDOW // 2 + 1)) == pytest.approx(4.0)


def test_a_one_off_stall_moves_neither_the_cost_scales_nor_the_overhead():
    """Scales and overhead are medians: one step measured 50x slow among steady ones leaves them where they were."""
    assert measured_draft_scale([2.0] * 10 + [50.0]) == pytest.approx(2.0)
    policy = auto(CostModel(T_CPU, D_CPU), [0.9], guard=False)
    session = ConstSession([0.9, 0.05, 0.05])
    for other in [0.01] * 10 + [0.5]:
        tree = policy.draft(ctx_for(session))
        policy.update(step_for(tree, [], t_draft=policy._built.draft_raw, t_verify=float(T_CPU(len(tree))),
                               t_other=other))
    assert policy.costs.overhead == pytest.approx(0.01)


def test_a_step_with_no_measured_draft_time_leaves_the_draft_scale_alone():
    """A ratio of 0 (no draft call timed) is no measurement: it must not pull the median down."""
    policy = auto(CostModel(T_CPU, D_CPU), [0.9], guard=False)
    session = ConstSession([0.9, 0.05, 0.05])
    for t_draft in (0.0, 0.0, 0.0):
        tree = policy.draft(ctx_for(session))
        assert len(tree) > 1 and policy._built.draft_raw > 0
        policy.update(step_for(tree, [], t_draft=t_draft, t_verify=float(T_CPU(len(tree)))))
    assert policy.costs.draft_scale == 1.0


def test_the_branch_limit_is_the_smaller_of_the_two_models():
    """A forward of either model takes at most branch_limit leaves, so the tighter one bounds the drafted nodes."""
    from types import SimpleNamespace

    from arborspec.backends.model_info import branch_limit

    target, draft = SimpleNamespace(n_seq_max=9), SimpleNamespace(n_seq_max=5)
    for pair in ((target, draft), (draft, target)):
        policy = auto(CostModel(T_CPU, D_CPU))
        policy._fit_branch_limit(*pair)
        assert policy.options.max_nodes == min(branch_limit(target), branch_limit(draft))
    policy = auto(CostModel(T_CPU, D_CPU))
    policy._fit_branch_limit(SimpleNamespace(), draft)  # one model without a limit: the other's
    assert policy.options.max_nodes == branch_limit(draft)


def bind_sampled(policy, monkeypatch, overlap: float):
    """Bind `policy` at T = 1 to stand-in models whose measured agreement and overlap are given, not computed."""
    from types import SimpleNamespace

    from arborspec.drafting.auto import policy as policy_module

    monkeypatch.setattr(policy_module, "pair_agreement", lambda *a: (0.5, "stub"))
    monkeypatch.setattr(policy_module, "pair_overlap", lambda *a: (overlap, "stub"))
    sampling = SamplingConfig(1.0)
    policy.bind(SimpleNamespace(), SimpleNamespace(), sampling, sampling, tokenizer=object())


def test_the_overlap_seeds_the_first_child_only_without_enough_evidence_of_its_own(monkeypatch):
    """At T > 0 the overlap stands in for the first child's acceptance until MIN_FIRST_EVIDENCE steps have measured
    it; evidence that has (a saved calibration's) is kept."""
    from arborspec.drafting.auto.policy import MIN_FIRST_EVIDENCE

    fresh = auto(CostModel(T_CPU, D_CPU), remember=False)
    fresh.first_child.set_evidence(1, MIN_FIRST_EVIDENCE - 1)
    bind_sampled(fresh, monkeypatch, overlap=0.75)
    assert fresh.first_child.trials[0] == MIN_FIRST_EVIDENCE
    assert fresh.first_child.hits[0] == pytest.approx(0.75 * MIN_FIRST_EVIDENCE)
    known = auto(CostModel(T_CPU, D_CPU), remember=False)
    known.first_child.set_evidence(2, MIN_FIRST_EVIDENCE)
    bind_sampled(known, monkeypatch, overlap=0.75)
    assert (known.first_child.hits[0], known.first_child.trials[0]) == (2, MIN_FIRST_EVIDENCE)


def prefill_threshold(policy) -> float:
    """uses_draft's rate with a prefill of L seconds over N new tokens is N / (N / r + L); it clears the bar
    b = (1 + margin) / t(1) iff N > L / (1 / b - 1 / r). Returns 1 / b - 1 / r."""
    bar = (1.0 + policy.options.guard_margin) / policy.costs.plain_step()
    rate = policy._expected_rate()
    assert rate > bar  # speculation pays before any prefill
    return 1 / bar - 1 / rate


def test_uses_draft_prices_the_drafts_prefill_of_the_prompt_but_its_last_token():
    """The draft prefills prompt_tokens - 1 tokens (the last is the root of the first tree): a one-token prompt
    costs it nothing; a longer one one forward of that many tokens, spread over the new tokens."""
    policy = auto(CostModel(T_CPU, D_CPU))
    k = prefill_threshold(policy)
    assert policy.costs.layer(0) > k  # a prefill of even 0 tokens' profiled cost would stop a one-token generation
    assert policy.uses_draft(1, 1) and policy.uses_draft(0, 1)
    steep = CostCurve.from_measurements((1, 2, 4, 8), (0.01, 0.5, 1.0, 2.0))  # chains cheap, prefills dear
    policy = auto(CostModel(T_CPU, steep))
    k = prefill_threshold(policy)
    low, high = policy.costs.layer(2) / k, policy.costs.layer(3) / k  # a 3-token prompt prefills 2
    assert high - low > 2
    n = math.floor(high)
    assert policy.uses_draft(3, n) and not policy.uses_draft(3, math.floor(low))


def plain_pair_policy(**options):
    """A policy for which no chain clears plain decoding by the guard's margin, though a fully accepted one would
    (so plain generations count towards exploring); its probabilities a lever to make it pay."""
    sizes = (1, 2, 4, 8, 16, 32)
    verify = CostCurve.from_measurements(sizes, [0.049 * (1 + 0.25 * (n - 1)) for n in sizes])
    policy = auto(CostModel(verify, flat(0.010)), [0.3], remember=False, **options)
    assert not policy.uses_draft(3, 10_000) and policy.plain_runs == 1
    return policy


def test_a_drafting_generation_restarts_the_count_towards_exploring():
    """EXPLORE_EVERY counts plain generations in a row: one that drafts on its own evidence resets it."""
    from arborspec.drafting.auto.policy import EXPLORE_EVERY

    policy = plain_pair_policy()
    for _ in range(EXPLORE_EVERY - 2):
        assert not policy.uses_draft(3, 10_000)
    assert policy.plain_runs == EXPLORE_EVERY - 1
    policy.child_probs[True][0] = 0.99  # now a chain pays
    assert policy.uses_draft(3, 10_000) and policy.plain_runs == 0
    policy.child_probs[True][0] = 0.3
    assert not any(policy.uses_draft(3, 10_000) for _ in range(EXPLORE_EVERY - 1))


def test_exploring_scales_both_calibrations_down_to_the_first_evidence_cap():
    """An exploring generation decides on its own evidence: the saved calibration and first-child counts are cut to
    MIN_FIRST_EVIDENCE observations a bin, at the same rates."""
    from arborspec.drafting.auto.policy import EXPLORE_EVERY, MIN_FIRST_EVIDENCE

    policy = plain_pair_policy()
    policy.calibrator.observe([0.3] * 200 + [0.9] * 10, [1] * 50 + [0] * 150 + [1] * 10)
    policy.first_child.set_evidence(20, 100)
    before = policy.calibrator.trials.copy()
    rates = policy.calibrator.hits[before > 0] / before[before > 0]
    assert [policy.uses_draft(3, 10_000) for _ in range(EXPLORE_EVERY - 1)][-1]
    trials = policy.calibrator.trials
    assert trials.tolist() == np.minimum(before, MIN_FIRST_EVIDENCE).tolist()
    assert policy.calibrator.hits[before > 0] / trials[before > 0] == pytest.approx(rates)
    assert (policy.first_child.hits[0], policy.first_child.trials[0]) == (pytest.approx(0.2 * MIN_FIRST_EVIDENCE),
                                                                          MIN_FIRST_EVIDENCE)


def test_a_repeatable_policy_restarts_every_generation_from_the_same_evidence():
    """Not only the second generation: the evidence a generation learns must not leak into the saved start state."""
    policy = auto(CostModel(T_CPU, D_CPU), [0.9], repeatable=True)
    start = policy.calibrator.trials.sum()
    for _ in range(3):
        policy.uses_draft(3, 100)
        assert policy.calibrator.trials.sum() == start
        policy.calibrator.observe([0.5] * 10, [1] * 10)
        policy.first_child.observe([0.5], [True])
        policy.child_probs[True][0] = 0.1
    policy.uses_draft(3, 100)
    assert policy.first_child.trials[0] == 0 and policy.child_probs[True][0] == pytest.approx(0.9)


def test_the_first_childs_rate_is_read_from_exactly_min_first_evidence_steps_on():
    from arborspec.drafting.auto.objective import expected_ceiling
    from arborspec.drafting.auto.policy import MIN_FIRST_EVIDENCE

    policy = auto(CostModel(T_CPU, D_CPU), [0.6])
    c1 = float(policy.child_probs[True][0])
    policy.first_child.set_evidence(MIN_FIRST_EVIDENCE, MIN_FIRST_EVIDENCE)  # every first child accepted
    read = expected_ceiling(policy.costs, policy.calibrator, c1, first_accept=float(policy.first_child.curve()[0]))
    unread = expected_ceiling(policy.costs, policy.calibrator, c1)
    assert read != pytest.approx(unread)
    assert policy._expected_rate() == pytest.approx(read)
    policy.first_child.set_evidence(MIN_FIRST_EVIDENCE - 1, MIN_FIRST_EVIDENCE - 1)
    assert policy._expected_rate() == pytest.approx(unread)


def test_predicted_rates_choose_speculation_only_past_the_margin():
    """`rate` is the speculative one only where it beats plain decoding by more than `margin` (as uses_draft)."""
    from arborspec.drafting.auto.policy import predicted_rates

    rates = predicted_rates(T_CPU, D_CPU, margin=0.0)
    gain = rates["speculative"] / rates["plain"] - 1
    assert gain > 0 and rates["rate"] == rates["speculative"]
    assert predicted_rates(T_CPU, D_CPU, margin=gain / 2)["rate"] == rates["speculative"]
    assert predicted_rates(T_CPU, D_CPU, margin=min(0.99, gain * 2))["rate"] == rates["plain"]


def test_update_credits_each_drafted_node_by_its_own_score():
    """The calibration sees, for each drafted node n, the score the builder gave n and whether n is on the accepted
    path: the hit lands in the bin of the accepted node's score. The path may also come from the recorded tree."""
    policy = auto(CostModel(T_CPU, D_CPU), [0.6, 0.2, 0.1])
    tree = policy.draft(ctx_for(ConstSession([0.6, 0.2, 0.1, 0.05, 0.05])))
    scores = list(policy._built.scores)
    first, second = tree.children(0)[:2]
    expected = Calibrator()
    expected.observe(scores, [n == second for n in range(1, len(tree))])
    shifted = Calibrator()  # had the hit gone to another node's score: another bin
    shifted.observe(scores, [n == first for n in range(1, len(tree))])
    assert shifted.hits.tolist() != expected.hits.tolist()
    step = step_for(tree, [second])
    step.path = None
    step.tree = {"path": [second]}
    policy.update(step)
    assert policy.calibrator.hits.tolist() == expected.hits.tolist()
    assert policy.calibrator.trials.tolist() == expected.trials.tolist()
    assert (policy.first_child.hits[0], policy.first_child.trials[0]) == (0, 1)  # the root's first child: missed


def test_without_calibration_the_policy_learns_no_acceptance_curve():
    policy = auto(CostModel(T_CPU, D_CPU), [0.6, 0.2, 0.1], calibration=False)
    tree = policy.draft(ctx_for(ConstSession([0.6, 0.2, 0.1, 0.05, 0.05])))
    policy.update(step_for(tree, [tree.children(0)[0]]))
    assert policy.calibrator.trials.sum() == 0 and policy.calibrator(0.3) == pytest.approx(0.3)


def test_a_depth_of_one_left_is_room_for_a_tree():
    """max_depth counts the layers still allowed: 1 leaves room for one layer of children, 0 for none."""
    policy = auto(CostModel(T_CPU, D_CPU), [0.6, 0.2, 0.1])
    tree = policy.draft(ctx_for(ConstSession([0.6, 0.2, 0.1, 0.05, 0.05]), max_depth=1))
    assert len(tree) > 1 and tree.depth == 1 and policy._built.record["mode"] == "spec"


def test_plain_steps_the_objective_chose_measure_plain_decoding_for_the_guard():
    """A step that drafted nothing (tree_size 0) is a plain step: the guard takes its time as plain decoding's."""
    policy = auto(CostModel(flat(1.0), flat(2.0)), [0.5], guard_cooldown=100)
    session, context = ConstSession([0.5] + [0.1] * 5), [3, 1, 4]
    for _ in range(3):
        tree = policy.draft(ctx_for(session, context=context))
        context.append(0)
        assert len(tree) == 1
        policy.update(step_for(tree, [], t_draft=0.0, t_verify=0.25))
    assert policy.guard.plain_time(1.0) == (0.25, "measured")


def test_the_calibration_is_saved_every_8_steps_and_when_a_generation_ends():
    from arborspec.core.disk_cache import read_record

    def steps(policy, n, context):
        for _ in range(n):
            tree = policy.draft(ctx_for(ConstSession([0.6, 0.2, 0.1, 0.05]), context=context))
            context.append(0)
            policy.update(step_for(tree, []))

    policy = auto(CostModel(T_CPU, D_CPU), [0.6, 0.2, 0.1])
    policy._calib_key = {"test": "every 8"}
    steps(policy, 7, [3, 1, 4])
    assert read_record("calibration", policy._calib_key) is None
    steps(policy, 1, [3, 1, 4] + [0] * 7)
    assert read_record("calibration", policy._calib_key)["calibrator"]["trials"] == policy.calibrator.trials.tolist()
    other = auto(CostModel(T_CPU, D_CPU), [0.6, 0.2, 0.1])
    other._calib_key = {"test": "generations"}
    steps(other, 2, [3, 1, 4])
    assert read_record("calibration", other._calib_key) is None
    other.draft(ctx_for(ConstSession([0.6, 0.2]), context=[3, 1, 4]))  # a new generation: the last one's evidence
    assert read_record("calibration", other._calib_key)["calibrator"]["trials"] == other.calibrator.trials.tolist()


def test_a_new_generation_with_a_prompt_as_long_as_the_last_context_gets_its_own_account():
    """The context grows within a generation; one no longer than the last (the same prompt again) starts anew."""
    policy = auto(CostModel(T_CPU, D_CPU), [0.6])
    session = ConstSession([0.6, 0.2, 0.1, 0.1])
    tree = policy.draft(ctx_for(session, context=[1, 2, 3]))
    policy.update(step_for(tree, []))
    assert len(policy.explain()["steps"]) == 1
    policy.draft(ctx_for(session, context=[1, 2, 3]))
    assert policy.explain()["steps"] == []


def test_at_t0_a_lossy_verifier_keeps_a_calibration_of_its_own():
    """At T = 0 every exact verifier accepts the same path and they share a record; a lossy one does not."""
    from arborspec.drafting.auto.policy import _calibration_key
    from arborspec.verify import VERIFIERS

    target, draft = make_pair("llama")
    greedy = SamplingConfig()
    lossy = [name for name, v in VERIFIERS.items() if not v.exact]
    assert lossy
    keys = {name: _calibration_key(target, draft, greedy, greedy, name) for name in VERIFIERS}
    for name, key in keys.items():
        assert (key.get("verifier") == name) == (name in lossy), name
    assert keys["greedy"] == keys["naive"] == _calibration_key(target, draft, greedy, greedy)


def test_a_saved_predictor_is_read_per_side_and_clipped_to_probabilities():
    """A record may hold one side's predictor (the other keeps its prior); saved values outside [0, 1] are clipped."""
    from arborspec.core.disk_cache import keep_record
    from arborspec.drafting.auto.policy import DEFAULT_CHILD_PROBS, _child_probs

    assert list(_child_probs({"true": [0.5]})) == [True] and list(_child_probs({"false": [0.5]})) == [False]
    policy = auto(CostModel(T_CPU, D_CPU))
    policy._calib_key = {"test": "clip"}
    keep_record("calibration", policy._calib_key, {"calibrator": Calibrator().to_dict(), "plain_runs": 0,
                                                   "child_probs": {"true": [1.5, -0.2]}})
    policy._load_calibration()
    assert policy.source["calibration"] == "cache"
    assert policy.child_probs[True][:3].tolist() == [1.0, 0.0, DEFAULT_CHILD_PROBS[2]]
    assert policy.child_probs[False].tolist() == pytest.approx(DEFAULT_CHILD_PROBS)


# ---- pins found by mutating options.py ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    (dict(max_children=0), "max_children must be an integer >= 1"), (dict(max_children=2000), "at most 1024"),
    (dict(max_layers=0), "max_layers must be an integer >= 1"), (dict(max_layers=2000), "at most 1024"),
    (dict(guard_window=0), "guard_window must be an integer"), (dict(guard_cooldown=2.0), "guard_cooldown must be"),
    (dict(calibration="maybe"), "calibration must be true or false"), (dict(repeatable=2), "repeatable must be"),
    (dict(guard_margin=-0.1), r"guard_margin must be in \[0, 1\)"), (dict(guard_margin=1.0), "guard_margin must be"),
])
def test_auto_options_refuse_values_out_of_range(bad, match):
    from arborspec.drafting.auto.options import AutoOptions

    with pytest.raises(ValueError, match=match):
        AutoOptions(**bad)


def test_auto_options_take_a_zero_margin_and_default_to_the_profiled_range():
    """A margin of 0 is plain decoding itself as the line (guard=false's); max_nodes defaults to the largest tree
    the cost profile measures, so the default trees are priced by measurement, not extrapolation."""
    from arborspec.drafting.auto.options import AutoOptions
    from arborspec.tuning.costs import DEFAULT_SIZES

    assert AutoOptions(guard_margin=0.0).guard_margin == 0.0
    assert AutoOptions(calibration="false").calibration is False  # text from the command line, parsed
    assert AutoOptions(repeatable="false").guard and AutoOptions(repeatable="true").guard is False
    assert AutoOptions().max_nodes == max(DEFAULT_SIZES)
