"""The overlap at any sampling settings from a pair's LogitTable (tuning/logit_table.py): exact where the table keeps
the whole vocabulary, close where it keeps each model's likely tokens, and read from the cache for a new setting
without running either model."""
from __future__ import annotations

import pytest
import torch

from arborspec.core.sampling import SamplingConfig
from arborspec.tuning import agreement
from arborspec.tuning.agreement import measure_agreement, measure_overlap, measure_pair, pair_overlap
from arborspec.tuning.logit_table import LogitTable
from tests.conftest import char_tokenizer, noisy_copy, tiny_model

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/conftest.py: records in a temp dir

SETTINGS = [SamplingConfig(1.0), SamplingConfig(0.6), SamplingConfig(1.3, top_k=3), SamplingConfig(0.9, top_p=0.7)]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0)
    return target, noisy_copy(target, 0.6), char_tokenizer()


def texts(tok) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in ("def fib(n):\n    return n", "x = [1, 2, 3]")]


def test_a_table_of_the_whole_vocabulary_gives_the_exact_overlap_and_the_agreement(pair):
    target, draft, tok = pair
    found, table = measure_pair(target, draft, texts(tok))  # TABLE_K >= the tiny vocabulary: every token kept
    assert found == measure_agreement(target, draft, texts(tok))
    for sampling in SETTINGS:
        assert table.overlap(sampling) == pytest.approx(measure_overlap(target, draft, texts(tok), sampling), abs=1e-5)
    same = measure_pair(target, target, texts(tok))[1]
    assert same.overlap(SamplingConfig(1.0)) == pytest.approx(1.0, abs=1e-6)  # each id once: repeats are masked


def test_a_table_of_the_likely_tokens_is_close_and_counts_each_token_once():
    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(50, 400, generator=gen) * 3, torch.randn(50, 400, generator=gen) * 3  # (positions, vocab)
    q[:, :200] = p[:, :200] + 0.3 * torch.randn(50, 200, generator=gen)  # the models agree where they are likely
    p[:, :200] += 6
    q[:, :200] += 6

    def exact(sampling):
        return float(torch.minimum(sampling.probs(p), sampling.probs(q)).sum(-1).mean())

    table = LogitTable.of(p, q, k=100)
    assert table.target.shape == (50, 200)
    assert torch.isinf(table.target).sum(-1).tolist() == torch.isinf(table.draft).sum(-1).tolist()
    kept = (~torch.isinf(table.target)).sum(-1)
    assert bool((kept >= 100).all()) and bool((kept < 200).any())  # the union, each id once
    for sampling in SETTINGS:
        assert table.overlap(sampling) == pytest.approx(exact(sampling), abs=0.003)  # repeats unmasked: 0.03 off
    round_trip = LogitTable.from_record(table.to_record())
    assert torch.equal(round_trip.target, table.target) and torch.equal(round_trip.draft, table.draft)


def test_a_new_setting_reads_the_pairs_table_without_running_the_models(pair, monkeypatch):
    target, draft, tok = pair
    first, source = pair_overlap(target, draft, tok, SamplingConfig(1.0), SamplingConfig(1.0))
    assert source == "measured"

    def no_forward(*_):
        raise AssertionError("a model ran")

    monkeypatch.setattr(agreement, "next_token_logits", no_forward)
    again, source = pair_overlap(target, draft, tok, SamplingConfig(0.5), SamplingConfig(0.5))
    assert source == "cache" and again != first
    assert agreement.pair_agreement(target, draft, tok)[1] == "cache"  # the same pass measured the agreement
    monkeypatch.undo()
    want = measure_overlap(target, draft, agreement.reference_ids(tok), SamplingConfig(0.5))
    assert again == pytest.approx(want, abs=1e-5)


def test_an_agreement_cached_without_its_table_is_measured_again_with_it(monkeypatch, tmp_path):
    """A cache from before the table: the greedy agreement's first read measures both (a server's warm-up at T = 0
    then leaves the table for its requests at T > 0)."""
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=3)
    draft, tok = noisy_copy(target, 0.4), char_tokenizer()
    agreement.pair_agreement(target, draft, tok)
    table = agreement.record_path("logit-table", agreement._table_key(target, draft))
    assert table.exists() and agreement.pair_agreement(target, draft, tok)[1] == "cache"
    table.unlink()
    assert agreement.pair_agreement(target, draft, tok)[1] == "measured" and table.exists()


def test_an_agreement_record_out_of_range_is_measured_again(monkeypatch, tmp_path):
    """Any float was taken: a NaN was a ZeroDivisionError in auto, 7.5 or -3 a "probability" auto kept in its
    calibration record."""
    import json
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=3)
    draft, tok = noisy_copy(target, 0.4), char_tokenizer()
    measured, _ = agreement.pair_agreement(target, draft, tok)
    (record,) = tmp_path.rglob("agreement-*.json")
    whole = json.loads(record.read_text())
    for bad in (float("nan"), 7.5):
        record.write_text(json.dumps({**whole, "agreement": bad}))
        again, source = agreement.pair_agreement(target, draft, tok)
        assert source == "measured" and again == pytest.approx(measured), bad
