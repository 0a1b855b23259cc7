"""`arborspec bench` end to end on tiny local models: results.json, report.md, plots, and --check-equal."""
import json
import re

import pytest

from arborspec.bench import records
from arborspec.cli import main
from tests.conftest import char_tokenizer, noisy_copy, save_models, tiny_model


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = tiny_model("llama", seed=0)
    save_models(root, {"target": target, "draft": noisy_copy(target, 0.2)})
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"id": "fib", "prompt": "def fib(n):", "category": "code"}\n'
                       '{"id": "sum", "prompt": "x = [1, 2, 3]\\ny = ", "category": "math"}\n')
    out = root / "out"
    code = main(["bench", "--target", str(root / "target"), "--draft", str(root / "draft"), "--dtype", "fp32",
                 "--prompt-file", str(prompts), "--methods", "ar,hf-assisted,chain,static,asps,sps",
                 "--temperatures", "0,1", "--budgets", "2,4", "--max-new-tokens", "16", "--ignore-eos",
                 "--out", str(out), "--no-progress", "--threads", "1", "--draft-quant", "none"])
    assert code == 0
    return out


def test_results_json_records_every_run(bench_run):
    results = records.read(bench_run)  # plain or gzipped
    assert results["env"]["cpu"] and results["env"]["threads"] == 1 and results["env"]["dtype"] == "fp32"
    assert results["env"]["backend"] == results["env"]["draft_backend"] == "torch"  # what ran, "auto" resolved
    assert results["command"].startswith("arborspec bench")
    labels = {r["label"] for r in results["runs"]}
    assert {"ar", "hf-assisted", "chain@2", "chain@4", "static@2", "static@4", "asps@4", "sps@2"} <= labels
    # 2 prompts x 2 temperatures x (ar + hf + 4 x 2 budgets) configurations
    assert len(results["runs"]) == 2 * 2 * 10
    for r in results["runs"]:
        assert r["error"] is None, r["error"]
        assert r["new_tokens"] == len(r["token_ids"]) == 16
        # decoding steps: transformers' assisted generation reads the prompt in its first verification; every
        # other method's first token comes from the prompt's own forward, which is no step
        first = 0 if r["method"] in ("hf-assisted", "hf-lookup") else 1
        assert sum(r["committed_per_step"]) == 16 - first and r["steps"] == len(r["committed_per_step"])
        assert r["wall"] > 0 and r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0
        assert r["perplexity"] is not None and r["perplexity"] >= 1
        assert r["ttft"] is not None and 0 < r["ttft"] <= r["wall"]
        assert r["others_cpu"] is None or 0 <= r["others_cpu"] <= 1  # None: a run too short to tell
    # interleaving: the first configuration of prompt 1 is the second of prompt 0
    first = [r for r in results["runs"] if r["prompt_id"] == "fib"]
    second = [r for r in results["runs"] if r["prompt_id"] == "sum"]
    assert second[0]["label"] == first[1]["label"] and second[0]["temperature"] == first[1]["temperature"]
    chain = next(r for r in results["runs"] if r["label"] == "chain@4")
    assert chain["node_outcomes"] and all(0 <= p <= 1 and a in (0, 1) for p, a in chain["node_outcomes"])
    for r in results["runs"]:  # which source supplied the accepted tokens: here the draft model, or nothing (ar)
        if r["label"] == "hf-assisted":
            assert r["sources"] is None
        else:
            assert set(r["sources"]) <= {"draft"}
            assert sum(c["accepted"] for c in r["sources"].values()) == sum(r["accepted_per_step"])
            assert sum(c["proposed"] for c in r["sources"].values()) == sum(r["drafted_per_step"])


def test_report_and_plots(bench_run):
    report = (bench_run / "report.md").read_text()
    assert "Machine:" in report and "Command: `arborspec bench" in report
    for png in ["throughput.png", "mat_vs_tree_size.png", "acceptance_vs_draft_prob.png", "sps_vs_asps.png",
                "accepted_by_source.png"]:
        assert (bench_run / png).stat().st_size > 1000
    section = report.split("## prompts, T=0")[1].split("##")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    names = [row.split("|")[1].strip() for row in rows]
    assert names[:3] == ["ar", "hf-assisted", "chain@2"] and len(names) == 10
    ar = rows[0].split("|")
    assert ar[12].strip() == "1.00"  # speed-up of ar over itself
    assert ar[4].strip() == "1.00"  # plain decoding commits one token per step
    assert "per category" in report
    assert "## Accepted by source" in report and "| prompts | 0 | chain@2 | draft |" in report
    # regenerating from results.json alone gives the same report
    before = report
    assert main(["report", str(bench_run)]) == 0
    assert re.sub(r"\s+", " ", (bench_run / "report.md").read_text()) == re.sub(r"\s+", " ", before)


def test_check_equal(bench_run, tmp_path, capsys):
    assert main(["report", "--check-equal", str(bench_run)]) == 0
    out = capsys.readouterr().out
    assert "0 failing" in out
    results = records.read(bench_run)  # plain or gzipped
    doctored = next(r for r in results["runs"] if r["label"] == "static@4" and r["temperature"] == 0)
    doctored["token_ids"][5] = (doctored["token_ids"][5] + 1) % 50
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert main(["report", "--check-equal", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "static@4" in out and "first divergence at token 5" in out


def test_acceptance_profile_columns(bench_run):
    results = records.read(bench_run)  # plain or gzipped
    for r in results["runs"]:
        if r["label"] in ("ar", "hf-assisted"):
            continue
        assert len(r["depth_per_step"]) == len(r["root_optimum_per_step"]) == r["steps"]
        assert r["accepted_at_depth"] and r["zero_accept_share"] is not None
        if r["temperature"] == 0:
            assert r["root_optimum"] is None and set(r["root_optimum_per_step"]) == {None}
        elif r["label"].startswith(("chain", "sps", "asps")):  # sampled roots (static@B: widths, deterministic)
            assert 0 < r["root_optimum"] <= 1 and 0 <= r["root_acceptance"] <= 1
    report = (bench_run / "report.md").read_text()
    section = report.split("## prompts, T=1")[1].split("##")[0]
    header = next(line for line in section.splitlines() if line.startswith("| method"))
    assert "| acc@1/2/3 | zero % | root acc / opt |" in header
    chain = next(line for line in section.splitlines() if line.startswith("| chain@4 ")).split("|")
    assert re.fullmatch(r" \d\.\d\d/\d\.\d\d/\d\.\d\d ", chain[7]) and re.fullmatch(r" \d+\.\d ", chain[8])
    assert re.fullmatch(r" \d\.\d\d / \d\.\d\d ", chain[9])
    ar = next(line for line in section.splitlines() if line.startswith("| ar ")).split("|")
    assert [c.strip() for c in ar[7:10]] == ["–", "–", "–"]  # plain decoding drafts nothing


def test_prompts_past_the_context_window_are_left_out_and_the_warm_up_uses_the_shortest(tmp_path):
    """A long first prompt failed every method's warm-up (all skipped) while transformers' assisted generation ran
    past the window and reported it "ok"."""
    target = tiny_model("llama", seed=0, context=64)
    tok = char_tokenizer()
    for name, model in [("target", target), ("draft", noisy_copy(target, 0.2))]:
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "long", "prompt": "x = 1\n" * 9}) + "\n"  # 54 tokens + 16 > 64
                       + json.dumps({"id": "short", "prompt": "def f(x):"}) + "\n")
    out = tmp_path / "out"
    code = main(["bench", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--dtype", "fp32",
                 "--prompt-file", str(prompts), "--methods", "ar,chain,hf-assisted", "--temperatures", "0",
                 "--max-new-tokens", "16", "--ignore-eos", "--out", str(out), "--no-progress", "--draft-quant", "none",
                 "--no-perplexity"])
    assert code == 0
    results = records.read(out)
    assert not results["skipped"] and {r["prompt_id"] for r in results["runs"]} == {"short"}
    assert {r["method"] for r in results["runs"]} == {"ar", "chain", "hf-assisted"}
    assert any("1 prompt(s) skipped" in w and "context window of 64" in w for w in results["warnings"])
