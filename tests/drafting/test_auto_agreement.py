"""auto's start for a new pair: the greedy predictor's c_1 is the pair's measured top-1 agreement
(tuning/agreement.py), not the generic prior, so `uses_draft` judges a pair it has not run yet by the evidence of
one teacher-forced pass over reference text; a pair with a saved calibration keeps it."""
from __future__ import annotations

import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.backends import make_session
from arborspec.core.sampling import SamplingConfig
from arborspec.core.tree import TokenTree
from arborspec.drafting.auto.policy import DEFAULT_CHILD_PROBS, MIN_FIRST_EVIDENCE
from arborspec.tuning.agreement import measure_agreement, measure_overlap, pair_agreement, pair_overlap
from tests.conftest import char_tokenizer, noisy_copy, tiny_model

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/conftest.py: profiles and records in a temp dir


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0)
    return target, noisy_copy(target, 0.6), char_tokenizer()


def fresh_logits(model, ids: list[int], i: int) -> torch.Tensor:
    """(vocab,): `model`'s logits after ids[:i], from a fresh session's one-token forward (no chain)."""
    session = make_session(model)
    if i > 1:
        session.prefill(ids[:i - 1])
    return session.forward(ids[:i], TokenTree.root(ids[i - 1]), [0])[0]


def by_hand(target, draft, ids: list[int]) -> float:
    """Agreement counted one prefix at a time (`fresh_logits`)."""
    hits = 0
    for i in range(1, len(ids)):
        hits += int(fresh_logits(target, ids, i).argmax()) == int(fresh_logits(draft, ids, i).argmax())
    return hits / (len(ids) - 1)


def test_agreement_is_the_share_of_positions_where_the_argmaxes_agree(pair):
    target, draft, tok = pair
    ids = tok("def fib(n):\n    return n", add_special_tokens=False)["input_ids"]
    assert measure_agreement(target, target, [ids]).top1 == 1.0
    measured = measure_agreement(target, draft, [ids]).top1
    assert 0.0 < measured < 1.0  # a noisy draft: some positions disagree
    assert measured == pytest.approx(by_hand(target, draft, ids), abs=1.5 / len(ids))  # one fp32 near-tie at most


def test_a_new_pair_starts_from_its_agreement_and_a_known_pair_from_its_calibration(pair):
    target, draft, tok = pair
    dec = SpeculativeDecoder(target, draft, tokenizer=tok)
    agreement, source = pair_agreement(target, draft, tok)
    assert source == "cache"  # the decoder measured it once; this call read it back
    assert dec.policy.child_probs[True][0] == pytest.approx(agreement)
    assert agreement != DEFAULT_CHILD_PROBS[0]
    assert dec.policy.child_probs[False][0] == DEFAULT_CHILD_PROBS[0]  # the sampled predictor keeps its prior
    assert "pair agreement" in dec.generate("x = ", max_new_tokens=8).stats.policy["summary"]
    # a pair with a saved calibration that holds evidence (drafted nodes seen accepted or not) starts from it
    dec.policy.save()  # no evidence yet: the next decoder still starts from the agreement
    assert "agreement" in SpeculativeDecoder(target, draft, tokenizer=tok).policy.source
    dec.policy.child_probs[True][0] = 0.777
    dec.policy.calibrator.observe([0.5, 0.7], [1.0, 0.0])
    dec.policy.save()
    again = SpeculativeDecoder(target, draft, tokenizer=tok)
    assert again.policy.source["calibration"] == "cache" and "agreement" not in again.policy.source
    assert again.policy.child_probs[True][0] == pytest.approx(0.777)


def overlap_by_hand(target, draft, ids: list[int], sampling: SamplingConfig) -> float:
    """sum_y min(p, q) one prefix at a time (`fresh_logits`), averaged over positions."""
    total = 0.0
    for i in range(1, len(ids)):
        p, q = (sampling.probs(fresh_logits(model, ids, i).float()) for model in (target, draft))
        total += float(torch.minimum(p, q).sum())
    return total / (len(ids) - 1)


def test_overlap_is_the_mean_chance_that_speculative_sampling_accepts_a_drafted_token(pair):
    target, draft, tok = pair
    ids = tok("def fib(n):\n    return n", add_special_tokens=False)["input_ids"]
    warm = SamplingConfig(temperature=1.0)
    assert measure_overlap(target, target, [ids], warm) == pytest.approx(1.0, abs=1e-5)
    measured = measure_overlap(target, draft, [ids], warm)
    assert 0.0 < measured < 0.999
    assert measured == pytest.approx(overlap_by_hand(target, draft, ids, warm), abs=1e-4)
    assert measure_overlap(target, draft, [ids], SamplingConfig(temperature=1.0, top_k=1)) == pytest.approx(
        measure_agreement(target, draft, [ids]).top1, abs=1e-6)  # top-1 sampling: the greedy agreement


def test_a_new_pair_at_t1_starts_its_first_child_rate_from_the_overlap(pair):
    target, draft, tok = pair
    dec = SpeculativeDecoder(target, draft, tokenizer=tok, temperature=1.0)
    overlap, source = pair_overlap(target, draft, tok, SamplingConfig(temperature=1.0), SamplingConfig(temperature=1.0))
    assert source == "cache"  # the decoder measured it once
    hits, steps = dec.policy.first_child.hits[0], dec.policy.first_child.trials[0]
    assert steps == MIN_FIRST_EVIDENCE and hits / steps == pytest.approx(overlap)
    assert "overlap" in dec.generate("x = ", max_new_tokens=8, seed=0).stats.policy["summary"]
    assert SpeculativeDecoder(target, draft, tokenizer=tok).policy.first_child.trials[0] == 0  # greedy
