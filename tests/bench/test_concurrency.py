"""`arborspec bench --concurrency` (bench/concurrency.py) on tiny models: every level's fields, the same tokens at
every concurrency, the table and the plot; bad flags are one-line errors before anything loads."""
import json
from dataclasses import replace

import pytest

from arborspec.bench.concurrency import format_table, mark_same_tokens, run_concurrency
from arborspec.bench.runner import BenchSettings
from arborspec.cli import main

LEVEL_FIELDS = {"label", "method", "temperature", "concurrency", "requests", "tokens", "wall_s", "tokens_per_s",
                "requests_per_s", "tokens_per_step", "latency_p50_s", "latency_p90_s", "ttft_p50_s", "ttft_p90_s",
                "tpot_p50_s", "tpot_p90_s", "per_request", "same_tokens", "error"}


def test_a_sweep_records_throughput_and_latency_per_level(loaded_pair, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "y = x + "}\n{"prompt": "for i in range(10):"}\n')
    settings = BenchSettings(target="t", draft="d", dtype="fp32", datasets=[], prompt_file=str(prompts),
                             methods=["ar", "static", "llamacpp-ar"], temperatures=[0.0, 1.0], max_new_tokens=6,
                             out=str(tmp_path / "out"), progress=False, ignore_eos=True, threads=1, draft_quant="none")
    path = run_concurrency(settings, [2, 1], models=loaded_pair)
    results = json.loads(path.read_text())
    assert results["levels"] == [1, 2] and results["batched"] is False  # a torch target runs its steps in turn
    assert any("llamacpp-ar" in w for w in results["warnings"])  # a baseline's own loop is not run batched
    levels = results["levels_run"]
    assert sorted((lv["label"], lv["temperature"], lv["concurrency"]) for lv in levels) == [
        (m, t, c) for m in ("ar", "static") for t in (0.0, 1.0) for c in (1, 2)]
    for lv in levels:
        assert LEVEL_FIELDS <= set(lv) and lv["error"] is None
        assert lv["requests"] == 3 and lv["tokens"] == 18 and lv["tokens_per_s"] > 0
        assert all(r["new_tokens"] == 6 and r["ttft_s"] <= r["latency_s"] for r in lv["per_request"])
        # seeded and exact per request: the same tokens at every concurrency, sampled runs included
        assert lv["same_tokens"] is (None if lv["concurrency"] == 1 else True)
    assert (tmp_path / "out" / "concurrency.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert table.count("| static |") == 4 and "| ar | 0 | 2 |" in table
    # a configuration that fails its warm-up is left out with a warning; the sweep goes on
    from arborspec.bench import concurrency
    real = concurrency.decoder

    def failing(bench, cfg):
        if cfg.method == "static":
            raise RuntimeError("static broke")
        return real(bench, cfg)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(concurrency, "decoder", failing)
        other = json.loads(run_concurrency(replace(settings, out=str(tmp_path / "out2"), temperatures=[0.0]), [1],
                                           models=loaded_pair).read_text())
    assert [lv["label"] for lv in other["levels_run"]] == ["ar"]
    assert any("skipping static at T=0.0: RuntimeError: static broke" in w for w in other["warnings"])
    # a second sweep into the same --out replaced the first, exit 0: refused before it loads or runs anything
    with pytest.raises(ValueError, match="holds a concurrency sweep already"):
        run_concurrency(settings, [1], models=None)
    assert json.loads(path.read_text()) == results


def test_different_tokens_at_another_concurrency_are_flagged():
    def level(c, tokens):
        return dict(label="ar", temperature=0.0, concurrency=c, error=None, tokens_per_s=1.0, latency_p50_s=1.0,
                    ttft_p50_s=0.1, tpot_p50_s=0.01, tokens_per_step=1.0, method="ar",
                    per_request=[dict(token_ids=tokens)])

    levels = [level(2, [1, 2]), level(1, [1, 3])]
    mark_same_tokens(levels)
    assert [lv["same_tokens"] for lv in levels] == [False, None]
    assert "| NO |" in format_table({"levels_run": levels})


@pytest.mark.parametrize("flags,message", [(["--concurrency", "1,0"], "--concurrency must list positive integers"),
                                           (["--concurrency", "2", "--resume"], "a --concurrency sweep runs whole")])
def test_bad_concurrency_flags_are_one_line_errors(flags, message, capsys):
    assert main(["bench", "--target", "nowhere", *flags]) == 2
    assert message in capsys.readouterr().err


def test_percentiles_are_nearest_rank():
    """int(q * n) read one rank high: the p50 of [1, 2] was 2, the p90 of 1..10 its maximum."""
    from arborspec.bench.concurrency import percentile
    assert percentile([1, 2], 0.5) == 1 and percentile([1, 2, 3, 4], 0.5) == 2
    assert percentile(list(range(1, 11)), 0.9) == 9 and percentile([7.0], 0.9) == 7.0
    assert percentile(list(range(1, 11)), 0.95) == 10
