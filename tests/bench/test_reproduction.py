"""docs/reproduction.md is computed from measurement files: verdicts follow the numbers, missing runs are named."""
import json

import pytest

from arborspec.bench import reproduction
from arborspec.cli import main


def run(label, temperature, committed, tps, prompt="p0", t_draft=0.2, t_verify=0.1, ppl=None, lossy=False):
    """A recorded run as `arborspec bench` writes it (only the fields the report reads)."""
    new = sum(committed)
    return dict(label=label, method=label.split("@")[0], temperature=temperature, dataset="humaneval",
                prompt_key=f"humaneval/{prompt}", category=None, error=None, verifier="greedy", lossy=lossy,
                committed_per_step=committed, accepted_per_step=[c - 1 for c in committed],
                drafted_per_step=[8] * len(committed), tokens_per_s=tps, new_tokens=new, wall=new / tps,
                steps=len(committed), t_draft=t_draft, t_verify=t_verify, ttft=0.1, tpot=0.05, perplexity=ppl,
                peak_rss_mb=100.0, rss_delta_mb=0.0)


def grid(dyspec_mat: int, dyspec_tps: float) -> dict:
    runs = []
    for temp in (0.0, 0.6):
        runs += [run("ar", temp, [1] * 8, 5.0), run("dyspec@64", temp, [dyspec_mat] * 2, dyspec_tps),
                 run("sequoia@64", temp, [3] * 3, 8.0), run("static@64", temp, [2] * 4, 7.0),
                 run("chain@5", temp, [2] * 4, 6.0), run("dynatree@64", temp, [4] * 2, 9.0),
                 run("dynatree(adapt=false)@64", temp, [4] * 2, 8.5)]
    return dict(command="arborspec bench ...", target="t", draft="d", env={"cpu": "test cpu", "dtype": "bf16"},
                settings={"datasets": ["humaneval"], "max_new_tokens": 8, "methods": []}, prompts=[{}],
                finished="now", runs=runs)


def write(root, name, data):
    path = root / reproduction.SOURCES[name][0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start: end if end > 0 else None]


def test_verdicts_follow_the_numbers(tmp_path):
    write(tmp_path, "grid", grid(dyspec_mat=8, dyspec_tps=12.0))
    dyspec = section(reproduction.render(tmp_path), "## DySpec")
    assert dyspec.count("**holds**") >= 4 and "does not hold" not in dyspec.split("### DySpec App. C")[0]
    assert "| T=0 | 64 | 8.00 | 3.00 | 2.00 | 5.25 / 4.99 / 3.32 |" in dyspec  # ours beside the paper's
    assert "| 100 + 50 + 517 |" in dyspec  # ms per step: draft 0.2 s, verify 0.1 s, other 16/12 s less both, 2 steps
    write(tmp_path, "grid", grid(dyspec_mat=8, dyspec_tps=7.5))  # more tokens per step, but slower than sequoia
    dyspec = section(reproduction.render(tmp_path), "## DySpec")
    assert "more tokens per step than Sequoia and static trees: **holds**; faster (tokens/s): **does not hold**" \
        in dyspec
    dynatree = section(reproduction.render(tmp_path), "## DynaTree")
    assert "faster than linear speculation and the fixed tree: **holds**" in dynatree
    assert "History adaptation adds speed (dynatree@64 vs dynatree(adapt=false)@64): **holds**" in dynatree


def test_missing_experiments_name_their_command(tmp_path):
    text = reproduction.render(tmp_path)
    for name, (rel, command) in reproduction.SOURCES.items():
        assert rel in text and command in text
    assert text.count("## ") >= 5


def test_asps_and_block_sparsity_sections(tmp_path):
    rows = [dict(n=1, steps=10, sps_tokens=1.8, asps_tokens=1.8, gain_tokens_pct=0.0, gain_tokens_se=0.01),
            dict(n=10, steps=10, sps_tokens=4.0, asps_tokens=4.3, gain_tokens_pct=7.5, gain_tokens_se=1.0)]
    write(tmp_path, "asps", dict(args={"target": "t", "prompts": 2}, rows=rows))
    tiles = dict(original=40.0, bfs=30.0, dfs=20.0, heavy=19.0)
    write(tmp_path, "blocks", dict(args={"seeds": 1}, rows=[dict(tree="random", nodes=256, depth=9.0, prefix=0,
                                                                 block=32, tiles=tiles)]))
    text = reproduction.render(tmp_path)
    assert "| 10 | 10 | 4.000 | 4.300 | +7.50% ± 1.00 |" in text
    assert "No gain at n = 1 (|gain| < 0.5%): **holds**; a gain at n = 10" in text
    assert "| random | 256 | 32 | 40.0 | 30.0 | 20.0 | 19.0 | 2.00x | 36 -> 22.5 |" in text


def test_cli_writes_the_report_and_refuses_a_file(tmp_path, capsys):
    write(tmp_path, "grid", grid(dyspec_mat=8, dyspec_tps=12.0))
    out = tmp_path / "docs" / "reproduction.md"
    assert main(["report", str(tmp_path), "--reproduction", str(out)]) == 0
    assert out.read_text().startswith("# Reproducing the five papers")
    assert main(["report", str(tmp_path / "policies-grid" / "results.json"), "--reproduction", str(out)]) == 2
    assert "needs a results directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "policies-grid"), "--reproduction", str(out)]) == 2  # one experiment
    assert "one experiment's folder" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "docs"), "--reproduction", str(out)]) == 2  # no experiment in it
    assert "no experiment of the reproduction report" in capsys.readouterr().err
    (tmp_path / "policies-grid" / "results.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        reproduction.load_sources(tmp_path)


def test_wetap_and_stree_hybrid_sections(tmp_path):
    wetap = grid(8, 12.0)
    wetap["runs"] = [run("ar", 1.0, [1] * 8, 5.0, ppl=1.20), run("static@64", 1.0, [2] * 4, 6.0, ppl=1.21),
                     run("wetap@64", 1.0, [4] * 2, 7.0, ppl=1.40, lossy=True)]
    write(tmp_path, "wetap", wetap)
    hybrid = grid(8, 12.0)
    hybrid["runs"] = [run("ar", 0.0, [1] * 8, 5.0), run("sps@4", 0.0, [2] * 4, 4.0),
                      run("static(widths=3,3,3,3)", 0.0, [4] * 2, 3.5)]
    write(tmp_path, "stree_hybrid", hybrid)
    text = reproduction.render(tmp_path)
    wetap_text = section(text, "## WETAP")
    assert "| wetap@64 LOSSY | 4.00 | 7.00 | " in wetap_text
    assert "longer per step than the static (SpecInfer-style) tree: **holds**; faster: **holds**" in wetap_text
    assert "no higher than the static tree's: **does not hold**" in wetap_text  # 1.40 vs 1.21
    assert "differs from plain sampling's by +16.7%" in wetap_text  # 1.40 / 1.20: the lossy drift shows
    stree = section(text, "## STree")
    assert "T = 0: the tree accepts more per step than the chain: **holds**; and is faster: **does not hold**" in stree


def test_beyond_the_papers_checks_the_issue_targets(tmp_path):
    text = section(reproduction.render(tmp_path), "## Beyond the papers")
    assert "results/auto-levers/results.json" in text  # not run yet: named with its command
    beyond = grid(8, 12.0)
    beyond["runs"] = [run("ar", 0.0, [1] * 8, 5.0), run("hf-assisted", 0.0, [2] * 4, 7.5),
                      run("auto", 0.0, [4] * 2, 12.0), run("dynatree", 0.0, [2] * 4, 4.5),
                      run("auto+int8", 0.0, [4] * 2, 16.0), run("auto+int4+ngram", 0.0, [4] * 2, 4.0)]
    write(tmp_path, "beyond", beyond)
    text = section(reproduction.render(tmp_path), "## Beyond the papers")
    assert "- auto: >= 2.2x ar: **holds** (2.40x); >= 1.5x hf-assisted: **holds** (1.60x)." in text
    assert ("- best lever combination (auto+int8): >= 3.0x ar: **holds** (3.20x); >= 2.0x hf-assisted: "
            "**holds** (2.13x).") in text
    assert "- auto against the fastest fixed-budget policy (dynatree, 0.90x ar): faster: **holds** (2.40x)." in text
    # the floor is arborspec's own promise: a slow seed method (dynatree here) does not break it, a slow lever does
    assert "at >= 0.95x ar: **does not hold** (below: auto+int4+ngram)." in text
    # where a step's time goes: draft 0.2 s + verify 0.1 s over 2 steps; other = 8 / 12 s wall less both
    assert "| 100 + 50 + 183 |" in text
    # ar: 0.1 s verify over 8 steps; auto: 8 tokens in 2/3 s, 0.2 s of it drafting -> 8 / (2/3 - 0.2) tok/s over ar's 5
    assert ("where auto's time goes: a step (4.00 tokens) spends 100 ms drafting, 50 ms verifying (a plain decoding "
            "step: 12 ms) and 183 ms in bookkeeping; with free drafting it would run at 3.43x ar.") in text


def test_verifier_sections_compare_the_rules(tmp_path):
    runs = []
    for prompt, extra in (("p0", 0), ("p1", 1)):
        runs += [run("ar", 1.0, [1] * 8, 10.0, prompt), run("sps@4", 1.0, [2] * 4, 6.0, prompt),
                 run("asps@4", 1.0, [2 + extra] * 4, 6.5, prompt)]
    data = grid(8, 12.0) | dict(runs=runs)
    write(tmp_path, "verifiers", data)
    rule = lambda tps, gain: dict(tokens_per_step=tps, gain=gain, gain_se=0.01)  # noqa: E731
    same = {"commands": ["python benchmarks/verifiers_same_trees.py --families chain,sampled"], "families": {
        "chain": {"1": dict(steps=40, prompts=2, rules={"sps": rule(2.0, 0.0), "asps": rule(2.2, 0.1),
                                                        "block": rule(2.2, 0.1)})},
        "sampled": {"1": dict(steps=40, prompts=2, rules={"naive": rule(2.0, 0.0), "mbr": rule(2.5, 0.25),
                                                          "traversal": rule(2.4, 0.2)},
                              per_prompt=[[2.0, 2.0, 2.2], [2.0, 3.0, 2.7]])}}}
    write(tmp_path, "same_trees", same)
    text = section(reproduction.render(tmp_path), "## Beyond the seeds")
    assert "| asps@4 | greedy | 2.50 | – | – | – | 6.50 | 0.65 |" in text  # MAT pooled over prompts; x ar
    assert "| 1 | asps@4 | sps@4 | 2 | +0.500 ± 0.500 | 1.250 |" in text
    assert "| sampled | 1 | 2 | 40 | traversal | 2.400 | +20.00% ± 1.00 |" in text
    assert "block accepts what ASpS accepts on the same chains (|difference| < 0.1%): **holds**" in text
    assert "traversal never below the token-wise rule on the same trees: **does not hold** (vs mbr -4.00%)" in text
    assert "| sampled | 1 | traversal | mbr | 2 | +0.00% ± 10.00 |" in text  # +10% and -10%: paired by prompt
