"""The interleaved loop: a failing method is recorded and skipped, not fatal; names and budgets become configurations;
each method runs on its own draft variant. (The method-name grammar itself: tests/test_spec.py.)"""
import pytest
import torch

from arborspec import runspec
from arborspec.bench import records, runner
from arborspec.bench.runner import BenchSettings, run_bench
from arborspec.loading import pair
from tests.conftest import char_tokenizer


def test_failures_are_recorded_and_the_run_goes_on(loaded_pair, tmp_path, monkeypatch):
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
                             progress=False, ignore_eos=True, threads=1, draft_quant="none")
    results = records.read(run_bench(settings, models=loaded_pair))
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


def test_a_benchmark_whose_every_run_failed_exits_non_zero(loaded_pair, tmp_path, monkeypatch, capsys):
    """Each run failed with a warning (an out-of-range seed, with --no-warmup) and the command exited 0."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')

    def broken(self, cfg, ids, max_new_tokens, seed):
        raise RuntimeError("broke")

    settings = BenchSettings(target="t", draft="d", dtype="fp32", datasets=[], prompt_file=str(prompts),
                             methods=["ar", "chain"], max_new_tokens=4, out=str(tmp_path / "out"), progress=False,
                             threads=1, draft_quant="none", warmup=False)
    monkeypatch.setattr(runner, "settings_from_args", lambda args: settings)
    monkeypatch.setattr(runner, "run_bench", lambda s: run_bench(s, models=loaded_pair))
    assert runner.run_from_args(None) == 0  # runs that work
    monkeypatch.setattr(runner.Bench, "generate", broken)
    settings.out = str(tmp_path / "out2")
    assert runner.run_from_args(None) == 1
    assert "every run failed (the first: RuntimeError: broke)" in capsys.readouterr().err


@pytest.mark.parametrize("bad, message", [("future", "not registered"), ("chian", "unknown method"),
                                          ("chain+fp8", "unknown lever"), ("wetap-lossy@64", "--allow-lossy")])
def test_a_bad_method_name_is_an_error_before_anything_runs(monkeypatch, tmp_path, bad, message):
    """Skipped with a warning in report.md alone, a misspelled method vanished from a run that exited 0."""
    monkeypatch.setitem(runspec.METHODS, "future", runspec.RunSpec("future", "not-yet-written"))
    settings = BenchSettings(target="t", draft="d", methods=["ar", bad], out=str(tmp_path / "out"))
    with pytest.raises(ValueError, match=message):
        runner.run_bench(settings)
    assert not (tmp_path / "out").exists()  # nothing left behind
    settings.allow_lossy = True
    if bad == "wetap-lossy@64":
        assert [c.label for c in runner._configs(settings, [])] == ["ar", "wetap-lossy@64"]


def test_a_pinned_budget_ignores_budgets_and_labels_stay_unique():
    warnings = []
    settings = BenchSettings(target="t", draft="d", methods=["chain@5", "dyspec", "dyspec(batch=false)"],
                             budgets=[8, 16])
    labels = [c.label for c in runner._configs(settings, warnings)]
    assert labels == ["chain@5", "dyspec@8", "dyspec@16", "dyspec(batch=false)@8", "dyspec(batch=false)@16"]
    assert not warnings


def test_levers_run_on_their_own_draft_copy_and_stay_exact(loaded_pair, tmp_path, monkeypatch):
    from arborspec.tuning import draft_levers

    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))  # the int8 draft is cached on disk
    monkeypatch.setattr(draft_levers, "corpus_counts",  # no ShareGPT download: count a line of code instead
                        lambda tok, vocab, **kw: draft_levers.token_counts(tok, ["def f(x): return x + 1"], vocab))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    settings = BenchSettings(target="t", draft="d", dtype="fp32", datasets=[], prompt_file=str(prompts),
                             methods=["ar", "chain@3+int8", "dyspec@8+vocab40+ngram2", "hf-assisted+int8"],
                             max_new_tokens=12, out=str(tmp_path / "out"), progress=False, ignore_eos=True,
                             threads=1, warmup=False, draft_quant="none")
    results = records.read(run_bench(settings, models=loaded_pair))
    runs = {r["label"]: r for r in results["runs"]}
    assert all(r["error"] is None for r in runs.values()), [r["error"] for r in runs.values()]
    assert runs["chain@3+int8"]["draft_quant"] == "int8" and runs["dyspec@8+vocab40+ngram2"]["ngram"] == 2
    for label in ("chain@3+int8", "dyspec@8+vocab40+ngram2", "hf-assisted+int8"):
        assert runs[label]["token_ids"] == runs["ar"]["token_ids"], label  # greedy: levers keep the output
    assert not hasattr(loaded_pair[1].model.get_output_embeddings(), "keep")  # the shared draft was not pruned
    assert type(loaded_pair[1].model.model.layers[0].mlp.up_proj) is torch.nn.Linear  # nor quantized


def test_resume_carries_an_interrupted_run_on_and_refuses_a_different_one(loaded_pair, tmp_path, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "def f{i}(x):"}}\n' for i in range(3)))
    settings = dict(target="t", draft="d", dtype="fp32", datasets=[], prompt_file=str(prompts),
                    methods=["ar", "chain"], max_new_tokens=6, progress=False, ignore_eos=True, threads=1,
                    draft_quant="none")
    whole = records.read(run_bench(BenchSettings(out=str(tmp_path / "whole"), **settings),
                                   models=loaded_pair))

    real = runner.Bench.run

    def dies_on_the_third_prompt(self, cfg, prompt, ids, index, position, env):
        if index == 2:
            raise KeyboardInterrupt
        return real(self, cfg, prompt, ids, index, position, env)

    out = str(tmp_path / "cut")
    monkeypatch.setattr(runner.Bench, "run", dies_on_the_third_prompt)
    with pytest.raises(KeyboardInterrupt):
        run_bench(BenchSettings(out=out, **settings), models=loaded_pair)
    monkeypatch.setattr(runner.Bench, "run", real)
    cut = records.read(tmp_path / "cut")
    assert cut["finished"] is None and {r["prompt_key"] for r in cut["runs"]} == {"p/0", "p/1"}

    with pytest.raises(ValueError, match="other settings .*max_new_tokens"):
        run_bench(BenchSettings(out=out, resume=True, **{**settings, "max_new_tokens": 7}), models=loaded_pair)
    with pytest.raises(ValueError, match="holds a benchmark already .*--resume"):  # a plain rerun replaced it
        run_bench(BenchSettings(out=out, **settings), models=loaded_pair)
    # the same folder written otherwise ("cut/" for "cut") was "other settings (out)"
    done = records.read(run_bench(BenchSettings(out=out + "/", resume=True, **settings), models=loaded_pair))
    assert done["finished"] and done["resumed"][0]["prompts_done"] == 2
    from arborspec.bench.report import render

    assert f"Resumed {done['resumed'][0]['at']} after 2 prompts" in render(done, [])
    key = lambda r: (r["prompt_key"], r["label"], r["temperature"])  # noqa: E731
    assert sorted(map(key, done["runs"])) == sorted(map(key, whole["runs"]))  # each run once, none lost
    # greedy with the same seeds: the resumed run's outputs are the uninterrupted run's
    assert {key(r): r["token_ids"] for r in done["runs"]} == {key(r): r["token_ids"] for r in whole["runs"]}
    with pytest.raises(ValueError, match="finished run"):
        run_bench(BenchSettings(out=out, resume=True, **settings), models=loaded_pair)
    # a finished run grows with a larger --prompts: the old prompts come first and keep their seeds
    small = str(tmp_path / "small")
    run_bench(BenchSettings(out=small, **{**settings, "prompts": 2}), models=loaded_pair)
    grown = records.read(run_bench(BenchSettings(out=small, resume=True, **{**settings, "prompts": 3}),
                                   models=loaded_pair))
    assert grown["settings"]["prompts"] == 3 and len(grown["prompts"]) == 3 and grown["finished"]
    assert {key(r): r["token_ids"] for r in grown["runs"]} == {key(r): r["token_ids"] for r in whole["runs"]}
    with pytest.raises(ValueError, match="other prompts"):
        run_bench(BenchSettings(out=small, resume=True, **{**settings, "prompts": 1}), models=loaded_pair)


def test_methods_take_the_runs_draft_quant_measured_once(loaded_pair, tmp_path, monkeypatch):
    """`--draft-quant auto` (the default, as for `generate`): methods without a quantization lever run the variant
    measured fastest, resolved once per benchmark and recorded per run; `+noquant` pins the draft as loaded."""
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    calls = []

    def measured(target, draft, progress=True):
        calls.append(draft)
        return "int8", {"variants": {"int8": {"quant": "int8", "vocab": 0, "agreement": 0.9, "draft_times": [0.01]}}}, \
            "measured"

    monkeypatch.setattr(pair, "choose_draft_quant", measured)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    settings = BenchSettings(target="t", draft="d", dtype="fp32", datasets=[], prompt_file=str(prompts),
                             methods=["ar", "chain@3", "chain@3+noquant", "hf-assisted"], max_new_tokens=10,
                             out=str(tmp_path / "out"), progress=False, ignore_eos=True, threads=1,
                             draft_temperature=0.5)
    assert settings.draft_quant == "auto"
    results = records.read(run_bench(settings, models=loaded_pair))
    runs = {r["label"]: r for r in results["runs"]}
    assert len(calls) == 1 and calls[0] is loaded_pair[1]
    assert {label: r["draft_quant"] for label, r in runs.items()} == \
        {"ar": "none", "chain@3": "int8", "chain@3+noquant": "none", "hf-assisted": "int8"}
    assert results["settings"]["draft_quant"] == "auto" and results["settings"]["draft_temperature"] == 0.5
    for label in ("chain@3", "chain@3+noquant", "hf-assisted"):
        assert runs[label]["error"] is None and runs[label]["token_ids"] == runs["ar"]["token_ids"], label


def test_the_bench_passes_the_draft_temperature(loaded_pair, monkeypatch):
    seen = []
    real = runner.build_decoder

    def spy(*args, **kwargs):
        seen.append(kwargs["draft_temperature"])
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "build_decoder", spy)
    bench = runner.Bench(BenchSettings(target="t", draft="d", draft_temperature=0.3, draft_quant="none"), *loaded_pair)
    cfg = runner._configs(BenchSettings(target="t", draft="d", methods=["chain"], temperatures=[1.0],
                                        draft_quant="none"), [])[0]
    assert bench.decoder(cfg).draft_sampling.temperature == 0.3 and seen == [0.3]


def test_resume_after_a_method_failed_its_warm_up_keeps_the_finished_prompts(loaded_pair, tmp_path, monkeypatch):
    """The skipped method stayed among the configurations every finished prompt needed, so nothing counted as
    finished and the first prompt ran again; and each resume listed the skip once more."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "def f{i}(x):"}}\n' for i in range(3)))
    real = runner.Bench.generate

    def no_dyspec(self, cfg, ids, max_new_tokens, seed):
        if cfg.method == "dyspec":
            raise RuntimeError("dyspec cannot warm up")
        return real(self, cfg, ids, max_new_tokens, seed)

    monkeypatch.setattr(runner.Bench, "generate", no_dyspec)
    settings = dict(target="t", draft="d", dtype="fp32", datasets=[], prompt_file=str(prompts), threads=1,
                    methods=["ar", "chain", "dyspec"], max_new_tokens=5, progress=False, ignore_eos=True,
                    draft_quant="none", out=str(tmp_path / "out"))
    first = records.read(run_bench(BenchSettings(prompts=1, **settings), models=loaded_pair))
    grown = records.read(run_bench(BenchSettings(prompts=2, resume=True, **settings), models=loaded_pair))
    assert grown["resumed"][0]["prompts_done"] == 1 and [s["label"] for s in grown["skipped"]] == ["dyspec"]
    kept = [r for r in grown["runs"] if r["prompt_key"] == "p/0"]
    assert [(r["label"], r["wall"]) for r in kept] == [(r["label"], r["wall"]) for r in first["runs"]]  # not rerun

    def no_chain_either(self, cfg, *args):  # a method that ran before fails its warm-up in the resuming shell
        if cfg.method == "chain":
            raise RuntimeError("chain's package is gone")
        return no_dyspec(self, cfg, *args)
    monkeypatch.setattr(runner.Bench, "generate", no_chain_either)
    third = records.read(run_bench(BenchSettings(prompts=3, resume=True, **settings), models=loaded_pair))
    assert [s["label"] for s in third["skipped"]] == ["chain", "dyspec"]  # chain fails its warm-up this time
    assert [r["prompt_key"] for r in third["runs"] if r["label"] == "chain"] == ["p/0", "p/1"]  # its runs stay


def test_resume_refuses_a_prompt_whose_text_changed(loaded_pair, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "def f(x):"}\n{"id": "b", "prompt": "def g(x):"}\n')
    settings = dict(target="t", draft="d", dtype="fp32", datasets=[], prompt_file=str(prompts), threads=1,
                    methods=["ar"], max_new_tokens=4, progress=False, draft_quant="none", out=str(tmp_path / "o"))
    run_bench(BenchSettings(prompts=1, **settings), models=loaded_pair)
    prompts.write_text('{"id": "a", "prompt": "class A:"}\n{"id": "b", "prompt": "def g(x):"}\n')
    with pytest.raises(ValueError, match="other prompts"):  # its runs on the old text were kept under the new one
        run_bench(BenchSettings(prompts=2, resume=True, **settings), models=loaded_pair)


def test_resume_takes_a_path_typed_otherwise_for_the_same_file(loaded_pair, tmp_path, monkeypatch):
    """`--prompt-file p.jsonl` resumed as `--prompt-file /abs/p.jsonl` was refused as "other settings"."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f(x):"}\n{"prompt": "def g(x):"}\n')
    monkeypatch.chdir(tmp_path)
    settings = dict(target="t", draft="d", dtype="fp32", datasets=[], threads=1, methods=["ar"], max_new_tokens=4,
                    progress=False, draft_quant="none", out=str(tmp_path / "o"))
    run_bench(BenchSettings(prompts=1, prompt_file="p.jsonl", **settings), models=loaded_pair)
    done = records.read(run_bench(BenchSettings(prompts=2, prompt_file=str(tmp_path / "p.jsonl"), resume=True,
                                                **settings), models=loaded_pair))
    assert done["finished"] and done["resumed"][0]["prompts_done"] == 1 and len(done["runs"]) == 2
    (tmp_path / "q.jsonl").write_text((tmp_path / "p.jsonl").read_text())
    with pytest.raises(ValueError, match=r"other settings \(prompt_file\)"):  # another file, the same text
        run_bench(BenchSettings(prompts=3, prompt_file="q.jsonl", resume=True, **settings), models=loaded_pair)


def test_a_prompt_file_takes_its_turn_with_the_datasets_so_a_larger_run_extends_a_smaller(monkeypatch):
    from arborspec.bench.datasets import Prompt
    monkeypatch.setattr(runner, "load_prompts", lambda name, n, *a, **k: [Prompt(name, str(i), "x") for i in range(n)])
    monkeypatch.setattr(runner, "load_prompt_file", lambda path, tok, n, m, skipped: [Prompt("file", str(i), "y")
                                                                                       for i in range(n)])

    def keys(n, warnings):
        settings = BenchSettings(target="t", draft="d", datasets=["humaneval"], prompt_file="p.jsonl", prompts=n)
        return [f"{p.dataset}/{p.id}" for p in runner._prompts(settings, None, warnings)]
    assert keys(2, []) == ["humaneval/0", "file/0", "humaneval/1", "file/1"]
    assert keys(2, []) == keys(3, [])[:4]
    warnings = []
    monkeypatch.setattr(runner, "load_prompts", lambda *a, **k: [])  # e.g. --text-tokens past every text
    assert keys(2, warnings) == ["file/0", "file/1"] and "humaneval gave 0 of the 2 prompts" in warnings[0]


def test_prompts_a_prompt_file_loses_are_counted_in_a_warning(tmp_path, capsys):
    """An empty prompt and one over --max-prompt-tokens were dropped without a word: 2 of 3 prompts ran."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": ""}\n{"prompt": "' + "z " * 80 + '"}\n')
    tok, warnings = char_tokenizer(), []
    settings = dict(target="t", draft="d", datasets=[], prompt_file=str(path), prompts=5)
    assert [p.id for p in runner._prompts(BenchSettings(**settings, max_prompt_tokens=50), tok, warnings)] == ["0"]
    assert warnings == [f"{path}: 2 prompt(s) skipped (1 empty, 1 longer than --max-prompt-tokens 50)"]
    assert warnings[0] in capsys.readouterr().err
    warnings = []
    assert len(runner._prompts(BenchSettings(**settings, max_prompt_tokens=1000), tok, warnings)) == 2
    assert warnings == [f"{path}: 1 prompt(s) skipped (1 empty)"]


def test_transformers_baselines_on_a_gguf_target_are_skipped_saying_why(tmp_path, monkeypatch):
    """Skipped with "'LlamaCppModel' object has no attribute 'generate'": the default --methods include hf-assisted,
    and --backend auto puts the default pair on llama.cpp or native."""
    from arborspec.loading import load_model
    from tests.backends.tiny_gguf import write_tiny_gguf
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))  # the GGUF's tokenizer: not in ~/.cache
    loaded = load_model(str(write_tiny_gguf(tmp_path / "t.gguf")), backend="llamacpp", progress=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ab"}\n')
    settings = BenchSettings(target="t", draft="d", datasets=[], prompt_file=str(prompts), methods=["ar", "hf-ar"],
                             max_new_tokens=3, progress=False, out=str(tmp_path / "out"), draft_quant="none")
    results = records.read(run_bench(settings, models=(loaded, None)))
    assert [s["label"] for s in results["skipped"]] == ["hf-ar"]
    reason = results["skipped"][0]["reason"]
    assert "needs a transformers model (--backend torch or native); the target runs on llamacpp" in reason
    assert all(r["perplexity"] is not None for r in results["runs"])  # read through the session
