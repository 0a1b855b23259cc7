"""`--draft-quant auto`: agreement, the chain score that ranks draft variants, and the cached choice."""
import json

import pytest

from arborspec.loading.model import LoadedModel
from arborspec.tuning import draft_choice
from arborspec.tuning.agreement import measure_agreement
from arborspec.tuning.costs import CostCurve
from tests.conftest import char_tokenizer, noisy_copy, tiny_model


def test_chain_score_finds_the_known_best_depth():
    flat = CostCurve.from_measurements([1, 64], [0.1, 0.1])  # verifying costs the same at any size
    # a = 1: every drafted token is accepted; rate(k) = (k + 1) / (k * 0.01 + 0.1) rises with k -> the deepest chain
    assert draft_choice.chain_score(1.0, 0.01, flat) == pytest.approx(((17) / (0.16 + 0.1), 16))
    # a = 0: drafting never pays -> plain decoding (depth 0)
    assert draft_choice.chain_score(0.0, 0.01, flat) == pytest.approx((10.0, 0))
    # a = 0.5, a draft call as dear as the target: k = 1 gives 1.5 / 0.2 = 7.5 < 10 -> plain decoding again
    assert draft_choice.chain_score(0.5, 0.1, flat)[1] == 0
    # a cheaper draft with the same agreement is never ranked lower
    assert draft_choice.chain_score(0.8, 0.01, flat)[0] > draft_choice.chain_score(0.8, 0.03, flat)[0]


def test_agreement_against_the_target():
    target = tiny_model("llama", seed=0)
    texts = [[3, 9, 14, 2, 7, 30, 11, 5], [4, 4, 8]]
    same = measure_agreement(target, target, texts)
    assert (same.top1, same.cover, same.positions) == (1.0, 1.0, 9)
    noisy = measure_agreement(target, noisy_copy(target, 3.0), texts)
    assert noisy.top1 <= noisy.cover <= 1.0 and noisy.top1 < 1.0
    with pytest.raises(ValueError, match="no text"):
        measure_agreement(target, target, [[1]])


def test_the_choice_is_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(draft_choice, "available_variants", lambda native=False: ["none", "int8"])
    tok = char_tokenizer()
    target = tiny_model("llama", seed=0)
    pair = LoadedModel(target, tok, "t", "memory"), LoadedModel(noisy_copy(target, 0.1), tok, "d", "memory")
    kw = dict(sizes=(1, 2, 4), prefix=8, repeats=1, progress=False)
    quant, record, source = draft_choice.choose_draft_quant(*pair, **kw)
    assert source == "measured" and quant in ("none", "int8")
    scores = {q: v["score"] for q, v in record["variants"].items() if "score" in v}
    assert set(scores) == {"none", "int8"} and scores[quant] == max(scores.values())
    assert "torchao" in record["variants"]["int4"]["unavailable"]
    assert all(0 <= v["agreement"] <= v["coverage4"] <= 1 for v in record["variants"].values() if "score" in v)
    assert type(pair[1].model.model.layers[0].mlp.up_proj).__name__ == "Linear"  # the draft itself is untouched
    again = draft_choice.choose_draft_quant(*pair, **kw)
    assert again[0] == quant and again[2] == "cache"
    assert draft_choice.choose_draft_quant(*pair, refresh=True, **kw)[2] == "measured"
    # a damaged record is measured again: its fields were read unchecked (a traceback, a format error in the
    # profile's table, an unknown quantization blamed on a flag never given, a corpus fetched for a negative head)
    (file,) = tmp_path.rglob("draft-quant-*.json")
    whole = json.loads(file.read_text())
    other = next(q for q in ("none", "int8") if q != quant)
    for damage in (lambda r: r.update(choice=[quant]), lambda r: r.pop("target_sizes"),
                   lambda r: r["variants"][quant].update(agreement="x"), lambda r: r["variants"][quant].pop("quant"),
                   lambda r: r["variants"][quant].update(quant="bogus"), lambda r: r["variants"][quant].update(vocab=-7),
                   lambda r: r["variants"][other]["draft_times"].__setitem__(0, float("nan")),
                   lambda r: r.update(choice="int4")):  # a variant that did not run
        damaged = json.loads(json.dumps(whole))
        damage(damaged)
        file.write_text(json.dumps(damaged))
        assert draft_choice.choose_draft_quant(*pair, **kw)[2] == "measured", damaged
    rows = draft_choice.describe(record)
    assert len(rows) == 4 and sum("<- default" in r for r in rows) == 1 and "unavailable" in rows[-1]
    chosen = record["variants"][quant]
    d = dict(zip(chosen["draft_sizes"], chosen["draft_times"]))
    t1 = record["target_times"][record["target_sizes"].index(1)]
    cells = next(r for r in rows if "<- default" in r).split()
    assert cells[2:4] == [f"{d[1] / t1:.2f}", f"{d[4] / d[1]:.2f}"] and cells[4] == "-"  # no d(32): sizes 1, 2, 4
