"""The console script: what needs no model answers without importing torch, and says the same as the full CLI."""
import json
import os
import subprocess
import sys

import pytest

from arborspec import __main__ as console_script
from arborspec import cli
from arborspec.console import COMMAND_HELP, top_parser
from arborspec.loading import aliases

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/conftest.py

# runs the console script's main in a fresh interpreter, then prints which heavy modules it imported
PROBE = """
import json, sys
from arborspec.__main__ import main
try:
    code = main(sys.argv[1:])
except SystemExit as done:
    code = done.code
heavy = sorted(m for m in ("torch", "transformers", "arborspec.engine", "arborspec.cli") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def probe(*args: str) -> tuple[dict, str, str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    *err, last = proc.stderr.strip().splitlines()
    return json.loads(last), proc.stdout, "\n".join(err)


@pytest.mark.parametrize("args", [["--help"], ["--version"], [], ["bogus"], ["models", "list"],
                                  ["models", "path", "qwen2.5-coder-0.5b"], ["models", "path", "nope"]])
def test_what_needs_no_model_imports_no_torch(args):
    result, out, err = probe(*args)
    assert result["heavy"] == []
    if args in (["--help"], ["--version"]):
        assert result["code"] in (0, None) and out
    if args == ["--help"]:
        assert all(name in out for name in COMMAND_HELP)
    if args in ([], ["bogus"]):
        assert result["code"] == 2 and "usage: arborspec" in err
    if args == ["models", "list"]:
        assert result["code"] == 0 and [line.split()[0] for line in out.splitlines()] == list(aliases.ALIASES)
    if args == ["models", "path", "nope"]:
        assert result["code"] == 2 and "unknown alias 'nope'" in err and "Traceback" not in err


def test_a_model_command_is_handed_to_the_full_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    result, out, _ = probe("generate", "--help")
    assert result["code"] in (0, None) and "arborspec.cli" in result["heavy"]
    assert "--max-new-tokens" in out and "--draft-vocab" in out
    # the second time the kept text answers, without the 4-5 s import, and says the same
    again, out_again, _ = probe("generate", "--help")
    assert again == {"code": 0, "heavy": []} and out_again == out
    listed, methods, _ = probe("methods")  # `methods` prints what the sources hold: kept the same way
    listed_again, methods_again, _ = probe("methods")
    assert "arborspec.cli" in listed["heavy"] and listed_again["heavy"] == [] and methods_again == methods
    assert "auto:" in methods and "verifiers:" in methods
    # any other argument goes to the full CLI as before: `-h` beside a bad flag is still the full parser's answer
    other, _, err = probe("generate", "--max-new-tokens", "0")
    assert other["code"] == 2 and "arborspec.cli" in other["heavy"] and "--max-new-tokens must be at least 1" in err


def test_kept_help_is_named_after_the_sources_and_the_width(monkeypatch):
    from arborspec import console
    first = console.kept_path(["generate", "--help"])
    assert console.kept_path(["generate", "--help"]) == first and console.kept_path(["bench", "--help"]) != first
    assert console.kept_path(["generate", "-h"]) != first and console.is_kept(["methods"])
    assert not console.is_kept(["methods", "x"]) and not console.is_kept(["generate", "--prompt", "--help"])
    monkeypatch.setenv("COLUMNS", "57")  # argparse wraps to the terminal: another width, another text
    assert console.kept_path(["generate", "--help"]) != first
    monkeypatch.delenv("COLUMNS")
    real_stat = console.Path.stat
    monkeypatch.setattr(console.Path, "stat", lambda self, **kw: real_stat(self, **kw) if self.name != "cli.py"
                        else type("S", (), {"st_mtime_ns": 1, "st_size": real_stat(self).st_size})())
    assert console.kept_path(["generate", "--help"]) != first  # an edited source file: the kept text is made again


def test_only_the_newest_kept_texts_stay(tmp_path):
    """Each source edit or upgrade writes a new set of kept texts; the old ones were never read again."""
    import os

    from arborspec import console
    for i in range(console.KEPT_FILES + 3):
        (tmp_path / f"generate-{i}.txt").write_text("x")
        os.utime(tmp_path / f"generate-{i}.txt", ns=(i * 10**9, i * 10**9))
    (tmp_path / "other.json").write_text("{}")
    console.prune_kept(tmp_path)
    left = {f.name for f in tmp_path.glob("*.txt")}
    assert left == {f"generate-{i}.txt" for i in range(3, console.KEPT_FILES + 3)}
    assert (tmp_path / "other.json").exists()


def test_the_full_parser_lists_the_same_commands():
    assert cli.build_parser().format_help() == top_parser()[0].format_help()
    assert set(cli.COMMANDS) == set(COMMAND_HELP)


def test_models_through_either_entry(capsys):
    assert console_script.main(["models", "path", "qwen2.5-coder-1.5b"]) == 0
    light = capsys.readouterr().out
    assert cli.main(["models", "path", "qwen2.5-coder-1.5b"]) == 0
    assert capsys.readouterr().out == light == f"{aliases.alias_path('qwen2.5-coder-1.5b')}\n"
    assert console_script.main(["models", "fetch"]) == 2
    assert "needs an alias" in capsys.readouterr().err


def test_the_package_exports_load_on_first_use():
    code = ("import sys, arborspec; before = 'torch' in sys.modules; "
            "from arborspec import SpeculativeDecoder, load_pair; "
            "print(before, 'torch' in sys.modules, SpeculativeDecoder.__module__, load_pair.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "True", "arborspec.engine.decoder", "arborspec.loading.pair"]
    import arborspec
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        arborspec.nope  # noqa: B018


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """`arborspec generate ... | head -c5` ended in "arborspec: error: [Errno 32] Broken pipe", exit status 2."""
    code = ("import sys\nfrom arborspec.console import run_command\n"
            "def chatty(args):\n    for _ in range(100000):\n        print('x' * 100)\n    return 0\n"
            "sys.exit(run_command(chatty, None))")
    done = subprocess.run(f"{sys.executable} -c \"{code}\" | head -c 5", shell=True, capture_output=True, text=True,
                          timeout=120, executable="/bin/bash")
    assert done.stdout == "xxxxx" and "error" not in done.stderr and "Traceback" not in done.stderr


def test_ctrl_c_while_the_full_cli_imports_is_one_line(monkeypatch, capsys):
    """Ctrl-C during the seconds `arborspec generate` spends importing torch printed a 60-line traceback."""
    class Interrupting:
        def find_spec(self, name, path=None, target=None):
            if name == "arborspec.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "arborspec.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    assert console_script.main(["generate", "--prompt", "x"]) == 130
    assert capsys.readouterr().err == "arborspec: interrupted\n"


def test_an_answer_an_ascii_stdout_cannot_encode_is_shown_escaped():
    """Under an ASCII locale (PYTHONUTF8=0) an answer in Japanese failed after the whole generation: "'ascii' codec
    can't encode", exit status 2, the text lost."""
    code = ("import sys\nfrom arborspec.console import run_command\n"
            "sys.exit(run_command(lambda args: print('hi \\u3053\\u3093') or 0, None))")
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "PYTHONUTF8": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout == b"hi \\u3053\\u3093\n", done.stderr


@pytest.mark.parametrize("typed,want", [
    ("h\udcc3\udca9llo", "héllo"),  # UTF-8 bytes an ASCII locale kept as surrogates: what was typed
    ("héllo", "héllo"),  # decoded already (a UTF-8 locale, or a Latin-1 one): left as it is
    ("caf\udce9", None),  # bytes that are not UTF-8: refused before any model loads
])
def test_typed_text_is_read_as_the_utf8_it_was_typed_in(typed, want):
    from arborspec.console import CliError, typed_text
    if want is None:
        with pytest.raises(CliError, match="the prompt argument is not UTF-8 text"):
            typed_text(typed, "the prompt argument")
    else:
        assert typed_text(typed, "the prompt argument") == want
