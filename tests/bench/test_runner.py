"""The interleaved loop: a failing method is recorded and skipped, not fatal; budgets map to method options."""
import json

import pytest

from arborspec.bench import methods, runner
from arborspec.bench.runner import BenchSettings, run_bench
from arborspec.models.loading import LoadedModel
from tests.conftest import char_tokenizer, noisy_copy, tiny_model


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=0)
    tok = char_tokenizer()
    return (LoadedModel(target, tok, "target", "memory"), LoadedModel(noisy_copy(target, 0.2), tok, "draft", "memory"))


def test_failures_are_recorded_and_the_run_goes_on(models, tmp_path, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "y = x + "}\n')
    real = runner.Bench.generate

    def flaky(self, cfg, ids, max_new_tokens, seed):
        if cfg.method == "static" and max_new_tokens != runner.WARMUP_TOKENS:
            raise RuntimeError("static broke")
        if cfg.method == "dyspec":
            raise RuntimeError("dyspec cannot even warm up")
        return real(self, cfg, ids, max_new_tokens, seed)

    monkeypatch.setattr(runner.Bench, "generate", flaky)
    settings = BenchSettings(target="t", draft="d", dtype="fp32", datasets=[], prompt_file=str(prompts),
                             methods=["ar", "static", "dyspec", "chain"], max_new_tokens=10, out=str(tmp_path / "out"),
                             progress=False, ignore_eos=True, threads=1)
    results = json.loads(run_bench(settings, models=models).read_text())
    assert [s["label"] for s in results["skipped"]] == ["dyspec"]
    assert "cannot even warm up" in results["skipped"][0]["reason"]
    by = {}
    for r in results["runs"]:
        by.setdefault(r["label"], []).append(r)
    assert set(by) == {"ar", "static", "chain"}
    assert all(r["error"] == "RuntimeError: static broke" for r in by["static"])
    assert all(r["error"] is None and r["new_tokens"] == 10 for r in by["ar"] + by["chain"])
    from arborspec.bench.report import check_equal, render

    ok, lines = check_equal(results)
    assert not ok and any(line.startswith("ERROR") and "static" in line for line in lines)
    assert "static broke" in render(results, [])


def test_budgets_map_to_each_methods_size_option():
    assert methods.options_for(methods.METHODS["chain"], 8) == ({"k": 8}, None)
    assert methods.options_for(methods.METHODS["dyspec"], 32) == ({"budget": 32}, None)
    assert methods.options_for(methods.METHODS["ar"], 32) == ({}, None)
    assert methods.options_for(methods.METHODS["static"], None) == ({}, None)
    for b in (1, 2, 5, 16, 32, 64):
        widths = [int(w) for w in methods.static_widths(b)["widths"].split(",")]
        assert sum(widths) == b and widths == sorted(widths, reverse=True)
    assert methods.static_widths(16) == {"widths": "4,4,4,4"}
    spec, why = methods.resolve("no-such-method")
    assert spec is None and "skipped" in why
    spec, _ = methods.resolve("wetap")
    assert spec.verifier == "wetap" and spec.allow_lossy


def test_unregistered_policy_is_skipped_with_a_warning(monkeypatch):
    monkeypatch.setitem(methods.METHODS, "future", methods.MethodSpec("future", "not-yet-written"))
    warnings = []
    configs = runner._configs(BenchSettings(target="t", draft="d", methods=["ar", "future"]), warnings)
    assert [c.label for c in configs] == ["ar"] and "not registered" in warnings[0]
