"""Distance to the optimum: the best first-token acceptance any exact verifier can reach at a tree's root.

- The closed forms on a 3-token example worked out by hand, and `acceptance_bound_without_replacement` against the
  linear program over every draw (exact for 1 and 2 children, an upper bound from 3 on).
- `root_optimum` picks the form by the root's drawing rule and number of children, and says None where the root's
  children were not sampled.
- In the engine (measure_optimum): the verifiers that reach the optimum for their trees (sps on chains, greedy-draft
  on greedy multi-draft trees) accept a first token as often as the recorded optimum says, mbr stays below its
  bound, and the time spent measuring is kept out of the timings.
"""
import math
import time

import numpy as np
import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.core.sampling import SamplingConfig
from arborspec.core.tree import DrawRule, TokenTree
from arborspec.engine import decoder
from arborspec.verify.base import root_optimum
from arborspec.verify.rules import (
    acceptance_bound_without_replacement,
    optimal_acceptance_greedy,
    optimal_acceptance_iid,
    optimal_acceptance_one,
)
from tests.conftest import noisy_copy, tiny_model
from tests.verify.exact import random_dist, without_replacement_draws
from tests.verify.test_greedy_draft import lp_optimum

D = torch.float64
P = torch.tensor([0.5, 0.3, 0.2], dtype=D)
Q = torch.tensor([0.2, 0.3, 0.5], dtype=D)


def test_the_closed_forms_on_a_hand_example():
    assert optimal_acceptance_one(P, Q) == pytest.approx(0.2 + 0.3 + 0.2)  # sum min(p, q)
    # i.i.d. pairs: A = {2, 1} (lowest p/q first) has q(A)^2 - p(A) = 0.64 - 0.5, the largest gap
    assert optimal_acceptance_iid(P, Q, 2) == pytest.approx(1 - 0.14)
    # greedy: D = {2} (the draft's top token) with p = 0.2; q' = norm(0.2, 0.3) off D overlaps p in 0.4 + 0.3
    assert optimal_acceptance_greedy(P, Q, 2) == pytest.approx(0.2 + 0.4 + 0.3)
    # without replacement: S = {1, 2} with probability 0.3 * 5/7 + 0.5 * 3/5; the cut A = {1, 2} gives
    # 1 - P(S = {1, 2}) + p(1) + p(2), and no other set does better (the linear program agrees)
    best = 1 - (0.3 * 5 / 7 + 0.5 * 0.6) + 0.5
    assert acceptance_bound_without_replacement(P, Q, 2) == pytest.approx(best)
    assert lp_optimum(P, without_replacement_draws(Q, 2)) == pytest.approx(best)
    assert acceptance_bound_without_replacement(P, Q, 3) == pytest.approx(1.0)  # every token is drawn
    assert acceptance_bound_without_replacement(P, Q, 1) == optimal_acceptance_one(P, Q)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_the_without_replacement_bound_against_the_linear_program(k):
    gaps = []
    for seed in range(15):
        gen = torch.Generator().manual_seed(500 + seed)
        vocab = 5 + seed % 2
        p, q = random_dist(gen, vocab, zeros=False), random_dist(gen, vocab, zeros=False)
        exact = lp_optimum(p, without_replacement_draws(q, k))
        bound = acceptance_bound_without_replacement(p, q, k)
        assert bound >= exact - 1e-9  # a true upper bound
        assert bound >= optimal_acceptance_iid(p, q, k) - 1e-9  # distinct draws never cover less than i.i.d. ones
        gaps.append(bound - exact)
    print(f"\nk={k}: bound - optimum mean {sum(gaps) / len(gaps):.4f}, max {max(gaps):.4f}")
    if k <= 2:
        assert max(gaps) < 1e-9
    else:
        assert max(gaps) < 0.1


@pytest.mark.parametrize("k", [2, 3])
def test_the_without_replacement_bound_for_a_draft_sure_of_one_token(k):
    """A draft with all but 1e-17 of its mass on one token (1 - q rounds to 0): a finite bound, continuous in that
    mass (the residual decides the later draws), never below one draw's optimum."""
    p = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64)

    def bound(eps):
        q = torch.tensor([1.0, eps, eps, 2 * eps], dtype=torch.float64)
        return acceptance_bound_without_replacement(p, q / q.sum(), k)

    with np.errstate(all="raise"):
        sure = bound(1e-17)
    assert math.isfinite(sure) and optimal_acceptance_one(p, torch.tensor([1.0, 0, 0, 0])) - 1e-12 <= sure <= 1.0
    assert sure == pytest.approx(bound(1e-9), abs=1e-6)


def root_tree(children: list[int], q: torch.Tensor, rule: DrawRule) -> TokenTree:
    tree = TokenTree.root(0)
    tree.set_children_dist(0, q, rule)
    for t in children:
        tree.add(0, t, float(q[t]))
    return tree


def test_root_optimum_follows_the_rule_and_the_number_of_children():
    logits, t1 = P.log(), SamplingConfig(1.0)
    assert root_optimum(root_tree([1, 2], Q, DrawRule.WITHOUT_REPLACEMENT), logits, t1) == pytest.approx(
        acceptance_bound_without_replacement(P, Q, 2))
    assert root_optimum(root_tree([2, 2], Q, DrawRule.WITH_REPLACEMENT), logits, t1) == pytest.approx(0.86)
    assert root_optimum(root_tree([2, 0], Q, DrawRule.GREEDY_TOPK_PLUS_ONE), logits, t1) == pytest.approx(0.9)
    for rule in (DrawRule.WITH_REPLACEMENT, DrawRule.WITHOUT_REPLACEMENT, DrawRule.GREEDY_TOPK_PLUS_ONE):
        assert root_optimum(root_tree([1], Q, rule), logits, t1) == pytest.approx(0.7)  # one child: one draw
    # the target's warp counts: at T = 0.5 the target puts p^2 / sum p^2 on each token
    p_half = P**2 / (P**2).sum()
    assert root_optimum(root_tree([1], Q, DrawRule.WITHOUT_REPLACEMENT), logits, SamplingConfig(0.5)) == \
        pytest.approx(optimal_acceptance_one(p_half, Q))
    assert root_optimum(root_tree([2, 1], Q, DrawRule.DETERMINISTIC), logits, t1) is None  # top-k, widths, grafts
    assert root_optimum(TokenTree.root(0), logits, t1) is None
    assert root_optimum(root_tree([], Q, DrawRule.WITH_REPLACEMENT), logits, t1) is None  # recorded, none drawn


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=0)
    return target, noisy_copy(target, 0.5)


def first_token_rates(models, method, verifier=None, runs=30, **options):
    """(share of steps that accepted a first token, mean root optimum, steps) over `runs` generations at T=1."""
    target, draft = models
    dec = SpeculativeDecoder(target, draft, method=method, temperature=1.0, verifier=verifier, measure_optimum=True,
                             **options)
    steps = [s for seed in range(runs)
             for s in dec.generate([4, 9, 12], max_new_tokens=40, ignore_eos=True, seed=seed).stats.steps]
    steps = [s for s in steps if s.root_optimum is not None]
    accepted = sum(s.accepted >= 1 for s in steps) / len(steps)
    return accepted, sum(s.root_optimum for s in steps) / len(steps), len(steps)


@pytest.mark.parametrize("method,verifier,options", [
    ("chain", "sps", dict(k=3)),  # one child: speculative sampling accepts sum min(p, q), the optimum
    ("static", "greedy-draft", dict(depth=2, branch=3, draw="greedy")),  # greedy-draft reaches its optimum
])
def test_verifiers_that_reach_the_optimum_accept_as_often_as_it_says(models, method, verifier, options):
    accepted, optimum, n = first_token_rates(models, method, verifier, **options)
    sd = (optimum * (1 - optimum) / n) ** 0.5 + 1e-3
    print(f"\n{method}/{verifier}: first token accepted {accepted:.3f}, optimum {optimum:.3f} over {n} steps")
    assert abs(accepted - optimum) < 4 * sd


def test_mbr_stays_below_its_bound(models):
    accepted, bound, n = first_token_rates(models, "static", "mbr", depth=2, branch=3)
    print(f"\nstatic/mbr: first token accepted {accepted:.3f}, bound {bound:.3f} over {n} steps")
    assert accepted <= bound + 4 * (bound * (1 - bound) / n) ** 0.5


def test_the_stats_say_none_where_nothing_was_measured_and_keep_the_time_out(models, monkeypatch):
    target, draft = models
    greedy = SpeculativeDecoder(target, draft, method="static", measure_optimum=True)
    st = greedy.generate([4, 9, 12], max_new_tokens=10, ignore_eos=True).stats
    assert st.root_optimum is None and st.root_acceptance is None and st.t_measure == 0  # T = 0
    off = SpeculativeDecoder(target, draft, method="static", temperature=1.0)
    st = off.generate([4, 9, 12], max_new_tokens=10, ignore_eos=True, seed=0).stats
    assert st.root_optimum is None and st.to_dict()["root_optimum"] is None  # not asked for
    on = SpeculativeDecoder(target, draft, method="static", temperature=1.0, measure_optimum=True)
    res = on.generate([4, 9, 12], max_new_tokens=10, ignore_eos=True, seed=0)
    st = res.stats
    assert res.token_ids == off.generate([4, 9, 12], max_new_tokens=10, ignore_eos=True, seed=0).token_ids
    assert 0 < st.root_optimum <= 1 and 0 <= st.root_acceptance <= 1 and st.t_measure > 0
    # the first token comes from the prompt's forward (no tree, nothing to measure); a last step without room
    # for a tree has none either
    measured = [s for s in st.steps if s.root_optimum is not None]
    assert st.steps[0].root_optimum is None and len(measured) >= len(st.steps) - 2
    assert st.root_acceptance == sum(s.accepted >= 1 for s in measured) / len(measured)

    def slow(*args):  # measuring takes 20 ms a step: none of it may show in the timings
        time.sleep(0.02)
        return root_optimum(*args)

    monkeypatch.setattr(decoder, "root_optimum", slow)
    start = time.perf_counter()
    st = on.generate([4, 9, 12], max_new_tokens=10, ignore_eos=True, seed=0).stats
    wall = time.perf_counter() - start
    assert st.t_measure >= 0.02 * sum(s.root_optimum is not None for s in st.steps)
    assert st.t_total <= wall - st.t_measure + 1e-3 and st.t_first_token < st.t_total
