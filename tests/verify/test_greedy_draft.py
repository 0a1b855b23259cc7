"""Greedy multi-draft (Hu et al., ICLR 2025) and the optimal acceptance rates, checked exactly.

- At one node, averaged over the sampled child, the emitted token is distributed as the target's, and a child is
  accepted with exactly `optimal_acceptance_greedy`; whole trees drawn that way emit the target's distribution.
- The closed forms `optimal_acceptance_greedy` / `optimal_acceptance_iid` equal the linear program "best coupling of
  the draws with the target" (scipy), and mss / mbr stay below the optimum for their drawing rules (the gap the paper
  measures), while the greedy rule reaches it.
- A greedy verifier that skips the residual correction is caught; k = 1 is SpS; temperature 0 is greedy.
"""
import numpy as np
import pytest
import torch
from scipy.optimize import linprog

from arborspec.core.tree import DrawRule
from arborspec.verify.rules import (
    MultiDraftPlan,
    greedy_draft_plan,
    mbr_plan,
    mss_plan,
    optimal_acceptance_greedy,
    optimal_acceptance_iid,
    sps_neighbor,
)
from tests.verify.exact import (
    DRAWS,
    greedy_draws,
    max_error,
    node_output,
    random_dist,
    random_tree_dists,
    target_joint,
    tree_outcomes,
    walk_outcomes,
    with_replacement_draws,
    without_replacement_draws,
)

D = torch.float64
G = DrawRule.GREEDY_TOPK_PLUS_ONE
CASES = [(0, 4, 1), (1, 4, 2), (2, 4, 3), (3, 5, 3), (4, 3, 4), (5, 6, 2), (6, 4, 4), (7, 6, 3)]  # (seed, vocab, k)


def acceptance_rate(plan_fn, draws, p, q, k) -> float:
    return sum(w * plan_fn(p, q, kids).acceptance() for kids, w in draws(q, k))


def lp_optimum(p, draws) -> float:
    """max over couplings of (draws, target token) of P(the target's token is among the draws), by linear program."""
    draws = list(draws)
    vocab = len(p)
    n = len(draws) * vocab
    gain = np.zeros(n)
    for i, (kids, _) in enumerate(draws):
        gain[[i * vocab + y for y in set(kids)]] = 1
    rows, rhs = [], []
    for i, (_, w) in enumerate(draws):  # each draw keeps its probability
        row = np.zeros(n)
        row[i * vocab : (i + 1) * vocab] = 1
        rows.append(row)
        rhs.append(w)
    for y in range(vocab - 1):  # the target keeps its distribution (the last row follows from the others)
        row = np.zeros(n)
        row[y::vocab] = 1
        rows.append(row)
        rhs.append(float(p[y]))
    res = linprog(-gain, A_eq=np.array(rows), b_eq=rhs, bounds=(0, None), method="highs")
    assert res.status == 0
    return -res.fun


# ---- one node ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,vocab,k", CASES)
def test_greedy_draft_is_exact_and_reaches_the_optimum(seed, vocab, k):
    gen = torch.Generator().manual_seed(seed)
    p, q = random_dist(gen, vocab), random_dist(gen, vocab)
    assert torch.allclose(node_output(greedy_draft_plan, greedy_draws, p, q, k), p, atol=1e-12)
    rate = acceptance_rate(greedy_draft_plan, greedy_draws, p, q, k)
    assert rate == pytest.approx(optimal_acceptance_greedy(p, q, k), abs=1e-12)
    assert rate == pytest.approx(lp_optimum(p, greedy_draws(q, k)), abs=1e-9)


@pytest.mark.parametrize("seed,vocab,k", CASES)
def test_iid_optimum_is_the_linear_program_and_bounds_mss_and_mbr(seed, vocab, k):
    gen = torch.Generator().manual_seed(seed)
    p, q = random_dist(gen, vocab, zeros=False), random_dist(gen, vocab, zeros=False)
    best_iid = optimal_acceptance_iid(p, q, k)
    assert best_iid == pytest.approx(lp_optimum(p, with_replacement_draws(q, k)), abs=1e-9)
    assert acceptance_rate(mss_plan, with_replacement_draws, p, q, k) <= best_iid + 1e-12
    best_wo = lp_optimum(p, without_replacement_draws(q, k))
    assert acceptance_rate(mbr_plan, without_replacement_draws, p, q, k) <= best_wo + 1e-9


def test_token_wise_rules_leave_a_gap_the_greedy_rule_does_not():
    gaps = {"mss": [], "mbr": [], "greedy": []}
    for seed in range(10):
        gen = torch.Generator().manual_seed(100 + seed)
        p, q = random_dist(gen, 5, zeros=False), random_dist(gen, 5, zeros=False)
        gaps["mss"].append(optimal_acceptance_iid(p, q, 3) - acceptance_rate(mss_plan, with_replacement_draws, p, q, 3))
        gaps["mbr"].append(lp_optimum(p, without_replacement_draws(q, 3))
                           - acceptance_rate(mbr_plan, without_replacement_draws, p, q, 3))
        gaps["greedy"].append(optimal_acceptance_greedy(p, q, 3) - acceptance_rate(greedy_draft_plan, greedy_draws, p, q, 3))
    print("\nmean distance to the optimum, 3 children over 5 tokens: "
          + ", ".join(f"{k} {np.mean(v):.4f}" for k, v in gaps.items()))
    assert max(gaps["mss"]) > 1e-3 and max(gaps["mbr"]) > 1e-3
    assert max(abs(g) for g in gaps["greedy"]) < 1e-12


def residual_free_plan(p, q, children):
    """Greedy verification that, having rejected the sampled child, draws from p instead of norm(max(p - q', 0))."""
    *fixed, z = children
    rest = q.clone()
    rest[fixed] = 0
    a = min(1.0, float(p[z]) / float(rest[z] / rest.sum()))
    out = (1 - a) * p.clone()
    out[z] += a
    accept, left = [], 1.0
    for y in children:
        accept.append(min(1.0, float(out[y]) / left) if left > 1e-15 else 0.0)
        left -= float(out[y])
    fallback = out.clone()
    fallback[children] = 0
    return MultiDraftPlan(accept, fallback / fallback.sum() if fallback.sum() > 0 else p)


def test_a_greedy_rule_without_the_residual_is_caught():
    gen = torch.Generator().manual_seed(1)
    p, q = random_dist(gen, 5, zeros=False), random_dist(gen, 5, zeros=False)
    wrong = node_output(residual_free_plan, greedy_draws, p, q, 3)
    assert 0.5 * float((wrong - p).abs().sum()) > 0.02


def test_one_child_is_sps_and_exhausted_support_is_target_sampling():
    gen = torch.Generator().manual_seed(3)
    for _ in range(30):
        p, q = random_dist(gen, 5), random_dist(gen, 5)
        y = int(torch.multinomial(q, 1, generator=gen))
        one = greedy_draft_plan(p, q, [y]).output_distribution([y])
        assert torch.allclose(one, sps_neighbor([y], q[None], p[None])[0], atol=1e-12)
    p, q = torch.tensor([0.2, 0.3, 0.5], dtype=D), torch.tensor([0.6, 0.4, 0.0], dtype=D)
    plan = greedy_draft_plan(p, q, [0, 1])  # q has no mass off the children: both are deterministic
    assert torch.allclose(plan.output_distribution([0, 1]), p) and plan.acceptance() == pytest.approx(0.5)
    assert optimal_acceptance_greedy(p, q, 3) == pytest.approx(0.5)


def test_temperature_zero_emits_the_target_argmax():
    eye = torch.eye(4, dtype=D)
    for target in range(4):
        for kids in ([0, 2], [2, 0], [1, 3], [3]):
            out = greedy_draft_plan(eye[target], eye[0], kids).output_distribution(kids)
            assert torch.equal(out, eye[target])


# ---- whole trees ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,vocab,branches", [(0, 3, [2, 2]), (1, 4, [3, 1]), (2, 3, [2, 2, 1]), (3, 4, [1, 3])])
def test_greedy_draft_trees_emit_the_target_distribution(seed, vocab, branches):
    p, q = random_tree_dists(seed, vocab, len(branches))
    got, _ = tree_outcomes(walk_outcomes(greedy_draft_plan), p, q, vocab, branches, G)
    assert max_error(got, target_joint(p, vocab, len(branches))) < 1e-12


def test_greedy_draws_helper_is_a_distribution():
    gen = torch.Generator().manual_seed(9)
    for k in (1, 2, 4, 7):
        q = random_dist(gen, 6)
        draws = list(DRAWS[G](q, k))
        assert sum(w for _, w in draws) == pytest.approx(1.0)
        assert all(len(set(kids)) == len(kids) for kids, _ in draws)
        assert len({tuple(kids[:-1]) for kids, _ in draws}) == 1  # the deterministic children never change
    assert list(DRAWS[G](torch.tensor([0.0, 1.0], dtype=D), 3)) == [([1], 1.0)]  # support exhausted: no sample
