"""`arborspec serve`'s flags: every bad value fails before anything loads, in one line naming its flag (exit 2);
--help shows each flag's default; the API key comes from a flag or $ARBORSPEC_API_KEY, never empty, and a server
reachable from other machines without one says so. No server runs here: a target that does not exist proves that
the checks come first (loading it would fail with another message)."""
from __future__ import annotations

import argparse
import re
import socket

import pytest

from arborspec import cli
from arborspec.server import add_serve_arguments, main
from tests.server.conftest import server_args

MISSING = "./no-such-dir/target"  # loading it fails at once: an error about anything else came before loading


def unloadable(model_dirs, *extra: str) -> list[str]:
    args = server_args(model_dirs, *extra)
    args[args.index("--target") + 1] = MISSING
    return args


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("arborspec: error:"), err
    return err[0]


@pytest.mark.parametrize("extra, flag, message", [
    (["--max-batch", "0"], "--max-batch", "must be at least 1"),
    (["--max-tokens-limit", "0"], "--max-tokens-limit", "must be at least 1"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout", "must be at least 0"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout", "must be at most 86400"),  # its wait overflowed
    (["--prefix-cache-mb", "-1"], "--prefix-cache-mb", "must be at least 0"),
    (["--prefill-chunk", "-8"], "--prefill-chunk", "must be at least 0"),
    (["--port", "70000"], "--port", "must be at most 65535"),
    (["--port", "-1"], "--port", "must be at least 0"),
    (["--temperature", "-1"], "--temperature", "0 (greedy) or a finite number >= 1e-06"),
    (["--temperature", "nan"], "--temperature", "0 (greedy) or a finite number >= 1e-06"),
    (["--draft-temperature", "-0.5"], "--draft-temperature", "0 (greedy) or a finite number >= 1e-06"),
    (["--temperature", "1e-40"], "--temperature", "0 (greedy) or a finite number >= 1e-06"),
    (["--top-p", "0"], "--top-p", "in (0, 1]"),
    (["--top-p", "1.5"], "--top-p", "in (0, 1]"),
    (["--top-k", "-1"], "--top-k", "integer >= 0"),
    (["--seed", str(2**64)], "--seed", "must be in"),
    (["--llama-threads", "0"], "--llama-threads", "must be in [1, 1024]"),
    (["--llama-ctx", "-5"], "--llama-ctx", "must be at least 2"),
    (["--model-name", ""], "--model-name", "is empty"),
    (["--api-key", ""], "--api-key", "is empty"),
    (["--api-key", " "], "--api-key", "is empty"),
])
def test_a_bad_flag_fails_before_loading_naming_that_flag_only(model_dirs, capsys, extra, flag, message):
    assert main(unloadable(model_dirs, *extra)) == 2
    line = one_error_line(capsys)
    assert message in line and set(re.findall(r"--[a-z][a-z-]*", line)) == {flag}


@pytest.mark.parametrize("extra, message", [
    (["--method", "wetap-lossy"], "lossy"),
    (["--method", "hf-assisted"], "is a baseline"),
    (["--method", "nope"], "unknown method"),
    (["--replicas", "2", "--autoscale", "1,2"], "only make sense with --ray"),
    (["--replica-cpus", "-1"], "--replica-cpus only makes sense with --ray"),  # was taken, and ignored
    # a request without max_tokens got the limit's 100 in silence
    (["--max-tokens-limit", "100", "--default-max-tokens", "200"], "--default-max-tokens 200 is over --max-tokens"),
])
def test_bad_server_settings_fail_before_loading_with_one_line(model_dirs, capsys, extra, message):
    assert main(unloadable(model_dirs, *extra)) == 2
    assert message in one_error_line(capsys)


def test_arborspec_serve_fails_the_same_way(model_dirs, capsys):
    assert cli.main(["serve", *unloadable(model_dirs, "--temperature", "-1")]) == 2
    assert "--temperature must be 0 (greedy) or a finite number >= 1e-06, got -1.0" in one_error_line(capsys)


def test_an_empty_key_in_the_environment_is_an_error(model_dirs, capsys, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_API_KEY", "")
    assert main(unloadable(model_dirs)) == 2
    assert "$ARBORSPEC_API_KEY is empty" in one_error_line(capsys)


@pytest.mark.parametrize("host, key, warned", [("0.0.0.0", None, True), ("0.0.0.0", "k", False),
                                               ("127.0.0.1", None, False), ("localhost", None, False)])
def test_a_server_other_machines_reach_without_a_key_warns(model_dirs, capsys, monkeypatch, host, key, warned):
    monkeypatch.delenv("ARBORSPEC_API_KEY", raising=False)
    if key is not None:
        monkeypatch.setenv("ARBORSPEC_API_KEY", key)
    assert main(unloadable(model_dirs, "--host", host)) == 2  # the missing model, after the warning
    err = capsys.readouterr().err
    assert (f"warning: listening on {host} without an API key" in err) == warned
    assert "not found" in err.strip().splitlines()[-1]


def test_a_taken_port_is_an_error_not_a_traceback(model_dirs, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = server_args(model_dirs)
        args[args.index("--port") + 1] = str(taken.getsockname()[1])
        assert main(args) == 2
    assert "arborspec: error: cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_the_server_binds_127_0_0_1_unless_told_otherwise(servers):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args([]).host == "127.0.0.1"
    assert parser.parse_args(["--host", "0.0.0.0"]).host == "0.0.0.0"
    servers["main"].url()  # (not `tight`: test_capacity_and_shutdown.py stops it)
    assert "on http://127.0.0.1:" in servers["main"].log.read_text()  # started without --host


def serve_help() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The `arborspec serve` parser and each flag's entry of its --help (wrapped lines joined)."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices["serve"]
    entries = re.split(r"\n  (?=-)", parser.format_help())
    return parser, {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries[1:]}


def test_the_default_max_tokens_follows_a_lower_limit_unless_given():
    from arborspec.server.run import check_flags
    parser = serve_help()[0]
    for argv, want in (([], 128), (["--max-tokens-limit", "64"], 64), (["--default-max-tokens", "7"], 7)):
        args = parser.parse_args(["--target", "t", *argv])
        check_flags(args)
        assert args.default_max_tokens == want


def test_serve_help_explains_every_flag_and_shows_every_default():
    parser, entries = serve_help()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 30
    for action in flags:
        entry = entries[action.option_strings[0]]
        described = entry.split(" ", 1 if action.nargs == 0 else 2)[-1]  # past the flag and its metavar
        assert len(described) > 15, f"{action.option_strings[0]} has no help: {entry!r}"
        if action.default is not None and action.default is not False:
            shown = {str(action.default)} | ({f"{action.default:g}"} if isinstance(action.default, float) else set())
            assert "default" in entry and any(s in entry for s in shown), entry
    assert "(default 8000)" in entries["--port"] and "(default warning)" in entries["--log-level"]


def test_switches_show_no_default_in_help():
    """A store_true flag's default is False: "(default False)" after each of them says nothing."""
    _, entries = serve_help()
    assert not [entry for entry in entries.values() if "(default False)" in entry]


def test_the_defaults_are_the_ones_docs_serve_md_lists():
    from pathlib import Path
    parser = serve_help()[0]
    table = (Path(__file__).parents[2] / "docs" / "serve.md").read_text()
    rows = re.findall(r"^\| `(--[\w-]+)` \| `?([\w.]+)`? \|", table, re.M)
    assert len(rows) >= 10
    defaults = {a.option_strings[0]: a.default for a in parser._actions if a.option_strings}
    for flag, documented in rows:
        if defaults[flag] is not None:
            assert documented in (str(defaults[flag]), f"{defaults[flag]:g}" if isinstance(defaults[flag], float)
                                  else None), flag


def test_ctrl_c_before_the_server_is_up_exits_130_without_a_traceback(monkeypatch, capsys):
    from arborspec.server import run

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(run, "run_serve", interrupted)
    assert main(["--target", "t"]) == 130 and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--max-queue", "-1"], "--max-queue must be at least 0"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be at least 0"),  # `not >=`: a NaN fails the bound
    (["--port", "65536"], "--port must be at most 65535"),
    (["--model-name", "  "], "--model-name is empty"),
    (["--ray", "--autoscale", "0,0"], "MIN,MAX"),  # MAX >= 1
])
def test_values_just_past_a_bound_are_refused(argv, message):
    from arborspec.server.run import check_flags
    with pytest.raises(ValueError, match=re.escape(message)):
        check_flags(serve_help()[0].parse_args(["--target", "t", *argv]))


def test_values_at_a_bound_are_taken_and_a_key_is_stripped(monkeypatch):
    from arborspec.server.run import check_flags
    monkeypatch.delenv("ARBORSPEC_API_KEY", raising=False)
    args = serve_help()[0].parse_args(["--target", "t", "--max-queue", "0", "--port", "65535", "--max-tokens-limit",
                                       "64", "--default-max-tokens", "64", "--api-key", " k ", "--ray",
                                       "--autoscale", "2,2"])
    check_flags(args)
    assert args.default_max_tokens == 64 and args.api_key == "k" and args.autoscale == (2, 2)
