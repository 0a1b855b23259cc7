"""results.json stored plain or gzipped (bench/records.py): the writer picks the form by size, every reader takes
both, and the reports come out the same from either."""
import gzip
import json
import os

import pytest

from arborspec.bench import records, reproduction
from arborspec.bench.report import load_results, render

from .test_reproduction import grid


def big(n_runs: int) -> dict:
    """A grid record padded with copies of its runs until its JSON is over COMPRESS_ABOVE bytes."""
    data = grid(dyspec_mat=8, dyspec_tps=12.0)
    data["runs"] = (data["runs"] * n_runs)[:n_runs]
    return data


def test_small_records_stay_plain_and_large_ones_are_gzipped(tmp_path):
    small, large = big(4), big(400)
    assert len(json.dumps(small, indent=1)) < records.COMPRESS_ABOVE < len(json.dumps(large, indent=1))
    assert records.write(tmp_path / "results.json", small) == tmp_path / "results.json"
    assert records.read(tmp_path) == small

    packed = records.write(tmp_path / "results.json", large)
    assert packed == tmp_path / "results.json.gz" and not (tmp_path / "results.json").exists()  # one form only
    assert json.loads(gzip.decompress(packed.read_bytes())) == large
    for name in (tmp_path, tmp_path / "results.json", packed):  # a directory, the plain name, the .gz name
        assert records.find(name) == packed and records.read(name) == large
    first = packed.read_bytes()
    records.write(packed, large)
    assert packed.read_bytes() == first  # no timestamp inside: the same record gives the same bytes

    records.write(tmp_path / "results.json", small)  # shrinking back: the plain form replaces the gzipped one
    assert records.find(tmp_path) == tmp_path / "results.json" and not packed.exists()


def test_readers_take_the_gzipped_form_and_report_the_same(tmp_path):
    data = big(400)
    plain, packed = tmp_path / "plain" / "policies-grid", tmp_path / "packed" / "policies-grid"
    plain.mkdir(parents=True)
    (plain / "results.json").write_text(json.dumps(data, indent=1))
    records.write(packed / "results.json", data)
    assert (packed / "results.json.gz").exists()
    assert load_results(packed) == (data, packed) and load_results(packed / "results.json")[0] == data
    assert render(load_results(packed)[0], []) == render(load_results(plain)[0], [])
    assert reproduction.render(tmp_path / "packed") == reproduction.render(tmp_path / "plain")
    assert "| T=0 | 64 | 8.00 |" in reproduction.render(tmp_path / "packed")  # the gzipped grid was read


def test_recompress_rewrites_every_record_in_the_form_write_picks(tmp_path, capsys):
    for name, data in (("a", big(4)), ("b", big(400))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    assert records.recompress(tmp_path) == [tmp_path / "a" / "results.json", tmp_path / "b" / "results.json.gz"]
    assert records.read(tmp_path / "b") == big(400) and not (tmp_path / "b" / "results.json").exists()
    # the command: a folder that is missing or holds no record is an error (a typo exited 0 in silence)
    assert records.main([str(tmp_path)]) == 0 and "b/results.json.gz" in capsys.readouterr().out
    for root in (tmp_path / "missing", tmp_path / "a" / "results.json", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        assert records.main([str(root)]) == 2 and "no benchmark record" in capsys.readouterr().err


def test_missing_or_broken_records_give_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results.json"):
        records.read(tmp_path)
    (tmp_path / "results.json.gz").write_bytes(gzip.compress(b'{"runs": [1, 2')[:-6])  # cut short
    with pytest.raises(ValueError, match=r"results.json.gz is not valid JSON"):
        records.read(tmp_path)
    (tmp_path / "results.json.gz").write_bytes(gzip.compress(b'{"runs": [1, 2'))  # whole gzip, broken JSON
    with pytest.raises(ValueError, match=r"results.json.gz is not valid JSON"):
        load_results(tmp_path)


def test_the_bench_writes_and_resumes_a_gzipped_record(loaded_pair, tmp_path, monkeypatch):
    from arborspec.bench.runner import BenchSettings, run_bench

    monkeypatch.setattr(records, "COMPRESS_ABOVE", 0)  # every record counts as large
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "y = x + "}\n')
    settings = dict(target="t", draft="d", dtype="fp32", datasets=[], prompt_file=str(prompts), methods=["ar"],
                    max_new_tokens=4, progress=False, ignore_eos=True, threads=1, out=str(tmp_path / "out"))
    first = run_bench(BenchSettings(prompts=1, **settings), models=loaded_pair)
    assert first == tmp_path / "out" / "results.json.gz" and len(records.read(first)["runs"]) == 1
    grown = run_bench(BenchSettings(prompts=2, resume=True, **settings), models=loaded_pair)
    data = records.read(grown)
    assert grown == first and data["finished"] and data["resumed"][0]["prompts_done"] == 1
    assert [r["prompt_key"] for r in data["runs"]] == ["p/0", "p/1"]


def test_a_second_run_into_the_same_folder_stops_before_it_writes(tmp_path, capsys):
    from arborspec.cli import main

    (tmp_path / records.NAME).write_text('{"first": "run"}')
    with records.writing(tmp_path):
        with pytest.raises(ValueError, match=rf"another `arborspec bench` \(pid {os.getpid()}\) is writing"):
            with records.writing(tmp_path):
                pass
        # the command line: the error comes before any model loads (this target does not exist)
        assert main(["bench", "--out", str(tmp_path), "--target", "/nonexistent/model"]) == 2
        assert "another `arborspec bench`" in capsys.readouterr().err
    assert (tmp_path / records.NAME).read_text() == '{"first": "run"}'  # the first run's record untouched
    with records.writing(tmp_path):  # free again once the first run ends
        pass
    # and then a plain rerun is refused, before any model loads: it replaced the record (and left its plots)
    assert main(["bench", "--out", str(tmp_path), "--target", "/nonexistent/model"]) == 2
    assert "holds a benchmark already (results.json); add --resume" in capsys.readouterr().err


def test_bad_outputs_and_records_are_one_line_errors(tmp_path, capsys):
    from arborspec.cli import main

    (tmp_path / "afile").write_text("")
    assert main(["bench", "--out", str(tmp_path / "afile"), "--target", "/nonexistent/model"]) == 2
    assert "is a file; bench writes a folder" in capsys.readouterr().err
    for sweep in ([], ["--concurrency", "1,2"]):  # a folder under a file: the system's words alone named no flag
        assert main(["bench", "--out", str(tmp_path / "afile" / "sub"), "--target", "/nonexistent/model", *sweep]) == 2
        err = capsys.readouterr().err
        assert f"--out {tmp_path / 'afile' / 'sub'} cannot be written: Not a directory" in err, err
    for name, text, message in [("object", "{}", "no list of runs"), ("list", "[]", "no list of runs"),
                                ("runs", '{"runs": 5}', "no list of runs"),
                                ("field", '{"runs": [{"label": "ar"}]}', "the record lacks a field"),
                                ("null", '{"env": null, "runs": [{"label": "ar"}]}', "the record lacks a field")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / records.NAME).write_text(text)
        assert main(["report", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (name, err)


def test_a_schema_1_record_leaves_the_prompts_forward_out_of_its_steps(tmp_path):
    """Since session 29 the prompt's forward (one token, nothing drafted) is no decoding step; records written before
    are read the same way, and a first step that drafted a tree (before session 24) stays."""
    runs = [dict(method="chain", policy="chain", committed_per_step=[1, 3, 3], drafted_per_step=[0, 5, 5],
                 accepted_per_step=[0, 2, 2], depth_per_step=[0, 5, 5], steps=3, mat=7 / 3),
            dict(method="chain", policy="chain", committed_per_step=[4, 3], drafted_per_step=[5, 5],
                 accepted_per_step=[3, 2], depth_per_step=[5, 5], steps=2, mat=3.5),
            dict(method="llamacpp-ar", policy=None, committed_per_step=[1, 1, 1], drafted_per_step=[0, 0, 0],
                 steps=3, mat=1.0),
            dict(method="hf-assisted", policy=None, committed_per_step=[1, 4], drafted_per_step=[0, 4], steps=2,
                 mat=2.5)]
    records.write(tmp_path / "results.json", dict(schema=1, runs=runs))
    got = records.read(tmp_path)["runs"]
    assert got[0]["committed_per_step"] == [3, 3] and got[0]["drafted_per_step"] == [5, 5] and got[0]["mat"] == 3.0
    assert got[0]["accepted_per_step"] == [2, 2] and got[0]["steps"] == 2
    assert got[1]["committed_per_step"] == [4, 3] and got[1]["mat"] == 3.5  # its first step drafted
    assert got[2]["committed_per_step"] == [1, 1] and got[2]["steps"] == 2
    assert got[3]["committed_per_step"] == [1, 4]  # assisted generation has no prompt-only forward


def test_impossible_values_are_one_line_errors_naming_the_file_and_stale_plots_go(tmp_path, capsys):
    """A perplexity of 0 ended in "math domain error", a temperature stored as text in "Unknown format code 'g'",
    neither naming the file; a rerun's report left the earlier record's plots (here: accepted by source) beside it."""
    from arborspec.cli import main

    good = dict(label="ar", method="ar", dataset="d", prompt_key="d/0", prompt_id="0", category=None, error=None,
                temperature=0.0, token_ids=[1, 2], new_tokens=2, wall=1.0, tokens_per_s=2.0, steps=1,
                committed_per_step=[1], accepted_per_step=[0], drafted_per_step=[0], lossy=False, perplexity=3.0,
                sources={})
    drafted = dict(good, label="chain", method="chain", committed_per_step=[2], accepted_per_step=[1],
                   drafted_per_step=[2], sources={"draft": {"proposed": 2, "accepted": 1, "also_accepted": 0}})
    records.write(tmp_path / "results.json", dict(runs=[good, drafted], settings={"methods": ["ar", "chain"]}))
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "accepted_by_source.png").is_file() and (tmp_path / "throughput.png").is_file()
    records.write(tmp_path / "results.json", dict(runs=[good], settings={"methods": ["ar"]}))
    assert main(["report", str(tmp_path)]) == 0
    assert not (tmp_path / "accepted_by_source.png").exists() and (tmp_path / "throughput.png").is_file()
    capsys.readouterr()
    for field, value, words in [("perplexity", 0.0, "a run's perplexity is 0; a perplexity is at least 1"),
                                ("temperature", "0", "Unknown format code")]:
        records.write(tmp_path / "results.json", dict(runs=[dict(good, **{field: value})]))
        assert main(["report", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path}: the record lacks a field or holds a wrong value" in err and words in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
