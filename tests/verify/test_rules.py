"""The acceptance rules, checked exactly (by enumeration, not sampling) on small distributions.

- ASpS and SpS reproduce the paper's 3-token toy example (Hu & Huang 2024, Tables 1-3) entry by entry.
- Over every possible drafted chain, both emit exactly the target's distribution, and ASpS accepts at least as many
  tokens in expectation (Theorem 5.6) and fully accepts each chain at least as often (Theorem 5.5).
- The log-space ASpS equals a plain transcription of the paper's Alg. 1 and survives long, peaked chains.
- Multi-draft rejection: mss is exact for children drawn with replacement, mbr for children drawn without, and each is
  *wrong* for the other drawing rule (so the enumeration would notice a mix-up).
"""
import itertools

import pytest
import torch

from arborspec.verify.rules import (
    accept_prob,
    asps_log_neighbor,
    asps_neighbor,
    expected_tokens,
    log_sub,
    mbr_plan,
    mss_plan,
    reject_below,
    residual,
    sps_neighbor,
    weight_step,
)
from tests.verify.exact import (
    chain_outcomes,
    node_output,
    random_chain,
    random_dist,
    random_tree_dists,
    target_joint,
    with_replacement_draws,
    without_replacement_draws,
)

D = torch.float64
A, B, C = 0, 1, 2


# ---- the toy example -------------------------------------------------------------------------------------------------
# Reference (draft) and target of Table 1; the second token after 'a' from Table 2's header (P_ref(aa) = 0.2 etc.)
Q0, P0 = torch.tensor([0.5, 0.3, 0.2], dtype=D), torch.tensor([0.3, 0.4, 0.3], dtype=D)
QA, PA = torch.tensor([0.4, 0.4, 0.2], dtype=D), torch.tensor([1 / 3, 1 / 3, 1 / 3], dtype=D)
REFS = [[A, A], [A, B], [A, C], [B], [C]]  # the table's columns; after 'b' or 'c' nothing more matters
OUTS = [(A, A), (A, B), (A, C), (B,), (C,)]  # the table's rows (a-tau has probability 0 and is left out)
# Tables 2 and 3 as printed: rows = outcome, columns = reference draft
TABLE_2 = [
    [0.10, 0.00, 0.00, 0.0, 0.0],
    [0.00, 0.10, 0.00, 0.0, 0.0],
    [0.02, 0.02, 0.06, 0.0, 0.0],
    [0.04, 0.04, 0.02, 0.3, 0.0],
    [0.04, 0.04, 0.02, 0.0, 0.2],
]
TABLE_3 = [
    [0.10, 0.00, 0.00, 0.0, 0.0],
    [0.00, 0.10, 0.00, 0.0, 0.0],
    [0.00, 0.00, 0.10, 0.0, 0.0],
    [0.05, 0.05, 0.00, 0.3, 0.0],
    [0.05, 0.05, 0.00, 0.0, 0.2],
]


def toy_coupling(neighbor_fn) -> torch.Tensor:
    """C[outcome, reference]: P(draft = reference, step emits outcome), bonus after full acceptance left out."""
    table = torch.zeros(len(OUTS), len(REFS), dtype=D)
    for j, ref in enumerate(REFS):
        q, p = torch.stack([Q0, QA][: len(ref)]), torch.stack([P0, PA][: len(ref)])
        p_ref = float(torch.prod(torch.tensor([float(q[i, y]) for i, y in enumerate(ref)])))
        n = neighbor_fn(ref, q, p)
        for row, tok in itertools.product(range(len(ref)), range(3)):
            if n[row, tok] > 0:
                table[OUTS.index(tuple(ref[:row]) + (tok,)), j] += p_ref * n[row, tok]
    return table


def matched(out, ref) -> int:
    """Drafted tokens accepted: the common prefix of outcome and reference (the paper's colour code)."""
    return next((i for i, (o, r) in enumerate(zip(out, ref)) if o != r), min(len(out), len(ref)))


def expected_matched(table) -> float:
    return sum(float(table[i][j]) * matched(OUTS[i], REFS[j]) for i in range(len(OUTS)) for j in range(len(REFS)))


@pytest.mark.parametrize("fn,printed,accepted", [(sps_neighbor, TABLE_2, 1.06), (asps_neighbor, TABLE_3, 1.10)])
def test_toy_example_tables(fn, printed, accepted):
    table = toy_coupling(fn)
    assert torch.allclose(table, torch.tensor(printed, dtype=D), atol=1e-12)
    assert table.sum(dim=1).tolist() == pytest.approx([0.1, 0.1, 0.1, 0.4, 0.3])  # target marginal P(aa), ..., P(c)
    assert table.sum(dim=0).tolist() == pytest.approx([0.2, 0.2, 0.1, 0.3, 0.2])  # reference marginal
    assert expected_matched(printed) == pytest.approx(accepted)  # the printed tables' own numbers
    assert expected_matched(table) == pytest.approx(accepted)


def test_toy_single_token_is_table_1():
    n = sps_neighbor([A], Q0[None], P0[None])
    assert n.tolist() == [[pytest.approx(0.6), pytest.approx(0.2), pytest.approx(0.2)]]
    assert torch.allclose(asps_neighbor([A], Q0[None], P0[None]), n)


# ---- random tree distributions, enumerated exactly ---------------------------------------------------------------------
@pytest.mark.parametrize("seed,vocab,n", [(0, 3, 2), (1, 3, 3), (2, 4, 2), (3, 2, 4), (4, 3, 3)])
def test_sps_and_asps_emit_the_target_distribution(seed, vocab, n):
    p, q = random_tree_dists(seed, vocab, n)
    want = target_joint(p, vocab, n)
    sps, e_sps, full_sps = chain_outcomes(sps_neighbor, p, q, vocab, n)
    asps, e_asps, full_asps = chain_outcomes(asps_neighbor, p, q, vocab, n)
    for s in want:
        assert sps[s] == pytest.approx(want[s], abs=1e-12)
        assert asps[s] == pytest.approx(want[s], abs=1e-12)
    assert e_asps >= e_sps - 1e-12  # Theorem 5.6
    assert all(full_asps[c] >= full_sps[c] - 1e-12 for c in full_sps)  # Theorem 5.5


def test_asps_gains_over_sps_on_average():
    gains = []
    for seed in range(20):
        p, q = random_tree_dists(100 + seed, 3, 3, zeros=False)
        e_sps = chain_outcomes(sps_neighbor, p, q, 3, 3)[1]
        e_asps = chain_outcomes(asps_neighbor, p, q, 3, 3)[1]
        assert e_asps >= e_sps - 1e-12
        gains.append(e_asps - e_sps)
    assert max(gains) > 1e-3  # strictly better somewhere, not just equal


def test_single_drafted_token_asps_is_sps():
    gen = torch.Generator().manual_seed(7)
    for _ in range(50):
        q, p = random_dist(gen, 6), random_dist(gen, 6)
        y = int(torch.multinomial(q, 1, generator=gen))
        assert torch.allclose(asps_neighbor([y], q[None], p[None]), sps_neighbor([y], q[None], p[None]), atol=1e-12)


# ---- log space ------------------------------------------------------------------------------------------------------
def alg1_reference(ref, p_ref, p):
    """The paper's Alg. 1, transcribed literally in probability space (0-indexed)."""
    n = len(ref)
    pn = torch.zeros_like(p_ref)
    pn_s = 1.0
    for i in range(n):
        if i:
            pn[i - 1, ref[i - 1]] = 0
        c1 = (p_ref[i] - pn_s * p[i]).clamp_min(0)
        c2 = float(c1[ref[i]] / c1.sum()) if c1.sum() > 0 else 0.0
        pn = c2 / p_ref[i, ref[i]] * pn
        pn[i] = c2 / p_ref[i, ref[i]] * (pn_s * p[i] - p_ref[i]).clamp_min(0)
        pn[i, ref[i]] = min(1.0, pn_s * float(p[i, ref[i]]) / float(p_ref[i, ref[i]]))
        pn_s = float(pn[i, ref[i]])
        assert float(pn.sum()) == pytest.approx(1.0)
    return pn


@pytest.mark.parametrize("seed", range(5))
def test_log_space_matches_alg1(seed):
    gen = torch.Generator().manual_seed(seed)
    n, vocab = 8, 12
    q, p, ref = random_chain(gen, n, vocab)
    assert torch.allclose(asps_neighbor(ref, q, p), alg1_reference(ref, q, p), atol=1e-12)


def test_log_space_long_peaked_chain():
    """60 drafted tokens over a 5000-token vocabulary with sharp logits: no NaN, total mass 1."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 60, 5000
    q, p, ref = random_chain(gen, n, vocab, peaked=True)
    log_n = asps_log_neighbor(ref, q, p)
    assert not torch.isnan(log_n).any()
    assert float(torch.logsumexp(log_n.flatten(), 0)) == pytest.approx(0.0, abs=1e-9)
    assert expected_tokens(log_n.exp(), ref) >= expected_tokens(sps_neighbor(ref, q, p), ref) - 0.5  # sane, not exact


def test_guards_equal_and_one_hot_distributions():
    # p == q everywhere: sum(C1) = 0 at every position; everything is accepted
    q = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.3, 0.1]], dtype=D)
    neigh = asps_neighbor([1, 0], q, q)
    assert neigh[1, 0] == pytest.approx(1.0) and neigh.sum() == pytest.approx(1.0)
    # temperature 0: one-hot draft and target -> greedy
    onehot = torch.eye(4, dtype=D)
    for fn in (sps_neighbor, asps_neighbor):
        agree = fn([2, 1, 3], onehot[[2, 1, 3]], onehot[[2, 1, 0]])  # the target disagrees at the third token
        assert agree[2, 0] == pytest.approx(1.0)
        first = fn([2, 1], onehot[[2, 1]], onehot[[3, 1]])  # disagrees at once
        assert first[0, 3] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="draft probability 0"):
        asps_log_neighbor([1], onehot[[0]], onehot[[1]])


def test_log_sub():
    a = torch.log(torch.tensor([0.5, 0.2, 0.0, 0.3], dtype=D))
    b = torch.log(torch.tensor([0.2, 0.5, 0.0, 0.0], dtype=D))
    assert torch.allclose(log_sub(a, b).exp(), torch.tensor([0.3, 0.0, 0.0, 0.3], dtype=D))


def test_accept_prob_and_residual_guards():
    assert accept_prob(0.2, 0.4) == 0.5 and accept_prob(0.4, 0.2) == 1.0
    assert accept_prob(0.3, 0.0) == 1.0 and accept_prob(0.0, 0.0) == 0.0
    p = torch.tensor([0.5, 0.5], dtype=D)
    assert torch.equal(residual(p, p), p)  # nothing to reject: fall back to p itself
    # a draft with rounding-level mass where the target has none: the fallback is p, never a token p cannot emit
    p, q = torch.tensor([0.5, 0.5, 0.0], dtype=D), torch.tensor([0.5, 0.5, 1e-17], dtype=D)
    assert torch.equal(residual(p, q), p)


def test_weight_step_and_reject_below_guards():
    """q(y) = 0 gives weight 1 only under a parent of positive weight; when nothing is left to reject at weight 1
    (p <= q, i.e. p = q up to rounding) the node is accepted for sure with the target's own distribution."""
    assert weight_step(0.5, 0.2, 0.4) == 0.25 and weight_step(0.5, 0.3, 0.0) == 1.0
    assert weight_step(0.0, 0.3, 0.0) == 0.0 and weight_step(0.5, 0.0, 0.0) == 0.0
    p, q = torch.tensor([0.5, 0.5, 0.0], dtype=D), torch.tensor([0.5, 0.5, 1e-17], dtype=D)
    alpha, target = reject_below(1.0, p, q)
    assert alpha == 1.0 and torch.equal(target, p)


def test_expected_tokens_of_an_empty_chain_is_the_bonus():
    assert expected_tokens(torch.zeros(0, 3, dtype=D), []) == 1.0


# ---- multi-draft rejection at one node --------------------------------------------------------------------------------
CASES = [(seed, vocab, k) for seed, vocab, k in [(0, 4, 1), (1, 4, 2), (2, 4, 3), (3, 5, 3), (4, 3, 4), (5, 6, 2), (6, 4, 4)]]


@pytest.mark.parametrize("seed,vocab,k", CASES)
def test_mss_exact_for_children_with_replacement(seed, vocab, k):
    gen = torch.Generator().manual_seed(seed)
    p, q = random_dist(gen, vocab), random_dist(gen, vocab)
    assert torch.allclose(node_output(mss_plan, with_replacement_draws, p, q, k), p, atol=1e-12)


@pytest.mark.parametrize("seed,vocab,k", CASES)
def test_mbr_exact_for_children_without_replacement(seed, vocab, k):
    gen = torch.Generator().manual_seed(seed)
    p, q = random_dist(gen, vocab), random_dist(gen, vocab)
    assert torch.allclose(node_output(mbr_plan, without_replacement_draws, p, q, k), p, atol=1e-12)


def test_rules_are_wrong_for_the_other_drawing_rule():
    gen = torch.Generator().manual_seed(11)
    p, q = random_dist(gen, 4, zeros=False), random_dist(gen, 4, zeros=False)
    tv = lambda x: 0.5 * float((x - p).abs().sum())  # noqa: E731
    assert tv(node_output(mbr_plan, with_replacement_draws, p, q, 3)) > 0.01
    assert tv(node_output(mss_plan, without_replacement_draws, p, q, 3)) > 0.01


def test_one_child_mss_and_mbr_coincide():
    """A chain's single child is one draw: with or without replacement, the two rules agree (and equal SpS)."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(30):
        p, q = random_dist(gen, 5), random_dist(gen, 5)
        y = int(torch.multinomial(q, 1, generator=gen))
        a, b = mss_plan(p, q, [y]), mbr_plan(p, q, [y])
        assert a.accept == pytest.approx(b.accept)
        assert torch.allclose(a.fallback, b.fallback)
        assert torch.allclose(a.output_distribution([y]), sps_neighbor([y], q[None], p[None])[0], atol=1e-12)


def test_mbr_stops_when_the_draft_is_exhausted():
    p = torch.tensor([0.1, 0.2, 0.7], dtype=D)
    q = torch.tensor([0.5, 0.5, 0.0], dtype=D)
    plan = mbr_plan(p, q, [0, 1])
    assert len(plan.accept) == 2 and torch.allclose(plan.fallback, torch.tensor([0.0, 0.0, 1.0], dtype=D))


def test_expectations_by_prefix_match_the_neighbor_distributions():
    from arborspec.verify.rules import asps_expected_tokens_by_prefix, sps_expected_tokens_by_prefix

    gen = torch.Generator().manual_seed(2)
    n, vocab = 7, 9
    q, p, ref = random_chain(gen, n, vocab)
    for fn, by_prefix in [(sps_neighbor, sps_expected_tokens_by_prefix), (asps_neighbor, asps_expected_tokens_by_prefix)]:
        want = [expected_tokens(fn(ref[:m], q[:m], p[: m + 1]), ref[:m]) for m in range(1, n + 1)]
        assert by_prefix(ref, q, p) == pytest.approx(want, abs=1e-12)
