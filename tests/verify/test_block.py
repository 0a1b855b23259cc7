"""Block verification (Sun et al., ICLR 2025), checked exactly by enumeration, and compared with SpS and ASpS.

- Over every chain the draft can draw, block verification emits exactly the target's distribution; a version that
  forgets the weight in its residual does not (the enumeration has teeth).
- Chain by chain, its outcome distribution *equals* ASpS's (Hu & Huang 2024, Alg. 1): the two papers' rules accept
  exactly the same. Both accept at least as many tokens as SpS in expectation over the draft's draws, for every toy
  distribution, though not for every single drafted chain.
- One drafted token: it is SpS. Temperature 0: it is greedy. Long peaked chains: no NaN, total mass 1.
"""
import itertools

import numpy as np
import pytest
import torch

from arborspec.verify.rules import (
    BlockPlan,
    accept_prob,
    asps_neighbor,
    block_expected_tokens_by_prefix,
    block_neighbor,
    block_plan,
    expected_tokens,
    sps_neighbor,
)
from tests.verify.exact import chain_outcomes, max_error, random_chain, random_dist, random_tree_dists, target_joint

D = torch.float64
CHAINS = [(0, 3, 2), (1, 3, 3), (2, 4, 2), (3, 2, 4), (4, 3, 3), (5, 4, 3)]  # (seed, vocab, drafted tokens)


def weightless_block_neighbor(tokens, q, p):
    """Block verification whose residual forgets the weight: norm(max(p - q, 0)) instead of norm(max(w p - q, 0))."""
    n = len(tokens)
    wrong = np.maximum(p[:n].numpy() - q[:n].numpy(), 0)
    wrong /= np.maximum(wrong.sum(axis=1, keepdims=True), 1e-300)
    return BlockPlan(block_plan(tokens, q, p).stop, wrong).neighbor(tokens)


def residual_free_block_neighbor(tokens, q, p):
    """Block verification that skips the residual correction: after a partial acceptance the bonus comes from p."""
    return BlockPlan(block_plan(tokens, q, p).stop, p[: len(tokens)].numpy().copy()).neighbor(tokens)


@pytest.mark.parametrize("seed,vocab,n", CHAINS)
def test_block_emits_the_target_distribution(seed, vocab, n):
    p, q = random_tree_dists(seed, vocab, n)
    got, _, _ = chain_outcomes(block_neighbor, p, q, vocab, n)
    assert max_error(got, target_joint(p, vocab, n)) < 1e-12


@pytest.mark.parametrize("broken,seed,vocab,n", [(weightless_block_neighbor, 0, 4, 2), (residual_free_block_neighbor, 3, 3, 3)])
def test_broken_block_rules_are_caught(broken, seed, vocab, n):
    p, q = random_tree_dists(seed, vocab, n, zeros=False)
    got, _, _ = chain_outcomes(broken, p, q, vocab, n)
    want = target_joint(p, vocab, n)
    assert 0.5 * sum(abs(got[s] - want[s]) for s in want) > 0.02


def test_block_equals_asps_chain_by_chain():
    """Not only in expectation: for every drafted chain the two outcome distributions coincide."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        n, vocab = int(torch.randint(2, 6, (1,), generator=gen)), int(torch.randint(2, 7, (1,), generator=gen))
        q, p, ref = random_chain(gen, n, vocab)
        assert torch.allclose(block_neighbor(ref, q, p), asps_neighbor(ref, q, p), atol=1e-12)


@pytest.mark.parametrize("seed,vocab,n", CHAINS)
def test_block_accepts_at_least_as_much_as_sps_in_expectation(seed, vocab, n):
    p, q = random_tree_dists(seed, vocab, n)
    e_sps = chain_outcomes(sps_neighbor, p, q, vocab, n)[1]
    e_block = chain_outcomes(block_neighbor, p, q, vocab, n)[1]
    e_asps = chain_outcomes(asps_neighbor, p, q, vocab, n)[1]
    assert e_block >= e_sps - 1e-12
    assert e_block == pytest.approx(e_asps, abs=1e-12)


def test_block_gains_over_sps_but_not_on_every_chain():
    gains, worse_chains = [], 0
    for seed in range(12):
        p, q = random_tree_dists(100 + seed, 3, 3, zeros=False)
        gains.append(chain_outcomes(block_neighbor, p, q, 3, 3)[1] - chain_outcomes(sps_neighbor, p, q, 3, 3)[1])
        for chain in itertools.product(range(3), repeat=3):
            qs = torch.stack([q[chain[:i]] for i in range(3)])
            ps = torch.stack([p[chain[:i]] for i in range(4)])
            c = list(chain)
            worse_chains += expected_tokens(block_neighbor(c, qs, ps), c) < expected_tokens(sps_neighbor(c, qs, ps), c) - 1e-9
    assert min(gains) >= -1e-12 and max(gains) > 1e-3
    assert worse_chains > 0  # the guarantee is over the draft's draws, not per chain


def test_one_token_is_sps_and_the_plan_is_consistent():
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        q, p = random_dist(gen, 6), random_dist(gen, 6)
        y = int(torch.multinomial(q, 1, generator=gen))
        assert torch.allclose(block_neighbor([y], q[None], p[None]), sps_neighbor([y], q[None], p[None]), atol=1e-12)
        plan = block_plan([y], q[None], p[None])
        assert plan.stop == [1.0, pytest.approx(accept_prob(float(p[y]), float(q[y])))]


def test_temperature_zero_is_greedy():
    onehot = torch.eye(4, dtype=D)
    agree = block_neighbor([2, 1, 3], onehot[[2, 1, 3]], onehot[[2, 1, 0]])  # the target disagrees at the third token
    assert agree[2, 0] == pytest.approx(1.0)
    first = block_neighbor([2, 1], onehot[[2, 1]], onehot[[3, 1]])
    assert first[0, 3] == pytest.approx(1.0)
    same = block_neighbor([2, 1], onehot[[2, 1]], onehot[[2, 1]])  # p == q: 0/0 guards, everything accepted
    assert same[1, 1] == pytest.approx(1.0) and float(same.sum()) == pytest.approx(1.0)


def test_long_peaked_chain_is_finite_and_normalised():
    gen = torch.Generator().manual_seed(0)
    n, vocab = 40, 5000
    q, p, ref = random_chain(gen, n, vocab, peaked=True)
    neigh = block_neighbor(ref, q, p)
    assert not torch.isnan(neigh).any() and float(neigh.sum()) == pytest.approx(1.0, abs=1e-9)


def test_expectations_by_prefix_match_the_neighbor_distributions():
    gen = torch.Generator().manual_seed(2)
    n, vocab = 7, 9
    q, p, ref = random_chain(gen, n, vocab)
    want = [expected_tokens(block_neighbor(ref[:m], q[:m], p[: m + 1]), ref[:m]) for m in range(1, n + 1)]
    assert block_expected_tokens_by_prefix(ref, q, p) == pytest.approx(want, abs=1e-12)
