"""report.md's "accepted by source" table and accepted_by_source.png, from a results.json made by hand."""
from arborspec.bench.figures import accepted_by_source_plot
from arborspec.bench.report import render
from arborspec.bench.tables import tables


def run(label: str, dataset: str, sources: dict | None, accepted: list[int]) -> dict:
    steps = len(accepted)
    return dict(label=label, dataset=dataset, temperature=0.0, prompt_key=f"{dataset}/0", category=None, error=None,
                committed_per_step=[a + 1 for a in accepted], accepted_per_step=accepted,
                drafted_per_step=[4] * steps if sources is not None else None, depth_per_step=[2] * steps,
                new_tokens=sum(accepted) + steps, wall=1.0, tokens_per_s=float(sum(accepted) + steps), verifier="greedy",
                lossy=False, sources=sources)


def results() -> dict:
    mixed = {"suffix": {"proposed": 4, "accepted": 1, "also_accepted": 2},
             "draft": {"proposed": 8, "accepted": 3, "also_accepted": 0}}
    alone = {"suffix": {"proposed": 8, "accepted": 6, "also_accepted": 0}}
    runs = [run("ar", "code-edit", {}, [0, 0]), run("llamacpp-ar", "code-edit", None, [0, 0]),
            run("auto+suffix8", "code-edit", mixed, [2, 2]), run("suffix", "code-edit", alone, [3, 3]),
            run("suffix", "multi-turn", alone, [4, 2])]
    return dict(runs=runs, settings={"methods": ["ar", "llamacpp-ar", "auto+suffix8", "suffix"]}, prompts=[])


def test_the_table_credits_each_source_per_step():
    text = render(results(), [])
    section = text.split("## Accepted by source")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| dataset")]
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
    # ar and the baseline drafted nothing; draft before suffix (tree.SOURCES order), whatever order the run recorded
    assert [c[2:4] for c in cells] == [["auto+suffix8", "draft"], ["auto+suffix8", "suffix"], ["suffix", "suffix"],
                                       ["suffix", "suffix"]]
    assert cells[0][4:] == ["4.00", "1.50", "0.38", "0.75", "0.00"]  # proposed, accepted /step, rate, share, also
    assert cells[1][4:] == ["2.00", "0.50", "0.25", "0.25", "1.00"]
    assert cells[2][4:8] == ["4.00", "3.00", "0.75", "1.00"] and cells[3][:2] == ["multi-turn", "0"]
    assert tables(results())[("code-edit", 0.0)]["llamacpp-ar"]["sources"] is None


def test_the_plot_is_drawn_only_when_a_method_drafted(tmp_path):
    assert accepted_by_source_plot(results(), tmp_path / "a.png") is not None
    assert (tmp_path / "a.png").stat().st_size > 1000
    plain = dict(results(), runs=[r for r in results()["runs"] if r["label"] in ("ar", "llamacpp-ar")])
    assert accepted_by_source_plot(plain, tmp_path / "b.png") is None and not (tmp_path / "b.png").exists()


def test_the_time_table_splits_a_step_into_draft_verify_and_the_rest():
    """Two runs of one method: prefill per run, per-step draft / verify / rest pooled over both, and their shares of
    the time after the prefill; runs without step timings (llama.cpp's own loop) get no row."""
    timed = [dict(run("auto", "humaneval", {}, [1, 1]), t_prefill=0.2, t_draft=0.3, t_verify=0.4, wall=1.0, steps=2),
             dict(run("auto", "humaneval", {}, [1, 1]), t_prefill=0.4, t_draft=0.1, t_verify=0.6, wall=1.5, steps=2)]
    plain = dict(run("llamacpp-ar", "humaneval", None, [0, 0]), t_prefill=None, t_draft=None, t_verify=None, steps=2)
    res = dict(runs=[*timed, plain], settings={"methods": ["llamacpp-ar", "auto"]}, prompts=[])
    section = render(res, []).split("## Where the time goes")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines() if line.startswith("| humaneval")]
    # prefill 0.6 s over 2 runs; 4 steps: draft 0.4 s, verify 1.0 s, rest 2.5 - 0.6 - 0.4 - 1.0 = 0.5 s (of 1.9 s)
    assert rows == [["humaneval", "0", "auto", "300.0", "100.00", "250.00", "125.00", "21", "53", "26"]]


def test_check_equal_fails_when_nothing_was_compared():
    """An ar-only record printed "0 identical, 0 failing" and exited 0; the docs promise exit 1 when the check
    cannot be made."""
    from arborspec.bench.report import check_equal
    only_ar = dict(runs=[dict(run("ar", "humaneval", {}, [0, 0]), token_ids=[1, 2])])
    ok, lines = check_equal(only_ar)
    assert not ok and "nothing to compare" in lines[-1]
    both = dict(runs=only_ar["runs"] + [dict(run("chain", "humaneval", {}, [1]), token_ids=[1, 2])])
    assert check_equal(both)[0]


def greedy_run(label: str, prompt: int, ids: list[int]) -> dict:
    return dict(run(label, "humaneval", {}, [0] * len(ids)), prompt_key=f"humaneval/{prompt}", token_ids=ids)


def test_check_equal_holds_each_method_against_plain_decoding_on_its_own_kernels():
    """On a native bench llama.cpp's plain decoding (other kernels) may break a near-tie the other way than native
    `ar`: it was held against `ar` and the check never passed. Now arborspec's methods are checked against `ar`, the
    llama.cpp peers against `llamacpp-ar`, and the peer's agreement with `ar` is shown, not checked."""
    from arborspec.bench.report import check_equal
    runs = [greedy_run("ar", 0, [1, 2, 3]), greedy_run("auto", 0, [1, 2, 3]),
            greedy_run("llamacpp-ar", 0, [1, 2, 4]), greedy_run("llamacpp-lookup", 0, [1, 2, 4]),
            greedy_run("ar", 1, [5, 6]), greedy_run("auto", 1, [5, 6]),
            greedy_run("llamacpp-ar", 1, [5, 6]), greedy_run("llamacpp-lookup", 1, [5, 6])]
    native = dict(runs=runs, env={"backend": "native", "dtype": "the GGUF's own (native)"})
    ok, lines = check_equal(native)
    assert ok, lines
    assert lines[-2].startswith("not checked: llamacpp-ar equals `ar` on 1 of 2 prompts")
    assert not any(line.startswith("MISMATCH") for line in lines)
    assert lines[-1].startswith("4 identical, 0 failing")
    # a record from before the resolved backend was kept: --backend native, and the unused torch dtype flag
    old = dict(runs=runs, env={"dtype": "bf16"}, settings={"backend": "native"})
    assert check_equal(old)[0]
    # llama.cpp's own speculation leaving its plain decoding is listed, not failed; an arborspec method's mismatch
    # fails, and bf16 (the unused torch flag) is not blamed for it on native
    peer_apart = dict(old, runs=[*runs[:3], greedy_run("llamacpp-lookup", 0, [1, 2, 5]), *runs[4:]])
    ok, lines = check_equal(peer_apart)
    assert ok and any(line.startswith("peer      llamacpp-lookup on humaneval/0") and "(llamacpp-ar: 4, "
                      in line for line in lines)
    assert lines[-1].startswith("3 identical, 0 failing, 0 lossy differences, 1 peer differences")
    ours_apart = dict(old, runs=[*runs[:1], greedy_run("auto", 0, [1, 2, 4]), *runs[2:]])
    ok, lines = check_equal(ours_apart)
    assert not ok and any(line.startswith("MISMATCH  auto on humaneval/0") for line in lines)
    assert "bf16:" not in lines[-1]
    # a llama.cpp bench without `ar` (or one whose backend was not recorded) checks everything against llamacpp-ar
    for env in ({"backend": "llamacpp"}, {}):
        ok, lines = check_equal(dict(runs=[r for r in runs if r["label"] != "ar"], env=env))
        assert not ok and [line[:34] for line in lines if line.startswith("MISMATCH")] == [
            "MISMATCH  auto on humaneval/0: fir"]
    # an exact method with no `ar` on its kernels is a failure that says what to add, not a mismatch against llama.cpp
    ok, lines = check_equal(dict(native, runs=[r for r in runs if r["label"] != "ar"]))
    assert not ok and any(line.startswith("NO AR RUN arborspec methods: no `ar` run") for line in lines)
    assert not any(line.startswith("MISMATCH") for line in lines)


def test_runs_that_shared_the_machine_are_named_in_a_warning(busy_rule):
    """Other processes' share of the CPUs during a run (`others_cpu`) at 0.1 or more makes its timings slow: the
    report says how many runs, and how busy the machine was at most."""
    res = results()
    for r, share in zip(res["runs"], (0.02, None, 0.31, 0.12, "?")):
        r["others_cpu"] = share
    warnings = [line for line in render(res, []).splitlines() if line.startswith("> warning: other processes")]
    assert warnings == ["> warning: other processes kept 10% or more of the CPUs busy during 2 of 5 runs (up to "
                        "31%): their timings are slow; rerun on a quiet machine for figures to compare"]
    for r in res["runs"]:
        r["others_cpu"] = 0.05
    assert "other processes" not in render(res, [])
