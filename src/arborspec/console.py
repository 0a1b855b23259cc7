"""What the `arborspec` command needs before it needs a model: the command list, the top-level parser, how a
command's errors are reported, and `arborspec models`. None of it imports torch.

Importing the full CLI (cli.py) imports torch, transformers' modeling code and every policy: 4-5 s on a 2-core Zen 4
host before anything is printed. `arborspec`, `arborspec --help`, `--version`, a mistyped command and `arborspec
models` need none of it, so the console script (__main__.py) answers them from here in 0.03-0.2 s and hands every
other command to cli.main. `arborspec generate --help` needs the full parser (its method options come from the policy
registry), as does `arborspec methods`: the first one takes those seconds, and its text is kept in the cache, so
later ones take 0.1 s (`print_kept`). The command list and its one-line helps live only here; cli.build_parser adds
each command's arguments to this same parser.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import shutil
import sys
import warnings
from pathlib import Path

# name -> the line `arborspec --help` shows for it, in that order
COMMAND_HELP = {
    "generate": "generate text with speculative decoding",
    "chat": "a conversation with the target in the terminal, answers decoded speculatively (each turn prefills only "
            "what is new)",
    "models": "built-in model aliases: list, fetch, path",
    "methods": "list tree policies, their options, and verifiers",
    "kernels": "arborspec's own GGUF kernels (the native backend): build, or say what runs",
    "trees": "draw the trees a method drafts in the first steps (PNG)",
    "calibrate": "measure the draft's positional acceptance rates (for sequoia)",
    "profile": "measure a model's tree-forward cost t(N) and fit STree's runtime model; --pair: the target's t(n) and "
               "the draft's per-layer cost that auto uses",
    "bench": "benchmark methods on prompt sets: results.json, report.md, plots",
    "report": "report.md and plots from a bench results.json; --check-equal",
    "serve": "OpenAI-compatible HTTP server, streaming (docs/serve.md)",
}
LIGHT = ("models",)  # commands answered here, without importing torch

# torch's own int8 modules create quantized tensors and TypedStorage, both deprecated in torch, whenever an int8 draft
# is made or loaded: warnings the user can do nothing about. Hidden here only; library users and tests see them.
TORCH_NOISE = (r"TypedStorage is deprecated",
               r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other quantized tensor creation")


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def top_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `arborspec` parser with every command named and none of their arguments yet: (parser, command parsers)."""
    from . import __version__
    parser = argparse.ArgumentParser(prog="arborspec", description="Tree-based speculative decoding of causal LMs.")
    parser.add_argument("--version", action="version", version=f"arborspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    return parser, {name: sub.add_parser(name, help=text) for name, text in COMMAND_HELP.items()}


def add_models_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "fetch", "path"])
    p.add_argument("alias", nargs="?")


def cmd_models(args) -> int:
    from .loading import aliases
    if args.action == "list":
        if args.alias:
            raise CliError(f"`arborspec models list` takes no alias (got {args.alias!r})")
        for name, alias in aliases.ALIASES.items():
            state = "fetched" if aliases.is_fetched(name) else "not fetched"
            print(f"{name:24s} {state:12s} {getattr(alias, 'description', '')}")
        return 0
    if not args.alias:
        raise CliError(f"`arborspec models {args.action}` needs an alias: {', '.join(aliases.ALIASES)}")
    if args.alias not in aliases.ALIASES:
        raise CliError(f"unknown alias {args.alias!r}; known: {', '.join(aliases.ALIASES)}")
    if args.action == "fetch":
        aliases.alias_gguf(args.alias)  # the kept GGUF checked too (a damaged one is downloaded again)
        print(aliases.fetch_alias(args.alias))
    else:
        print(aliases.alias_path(args.alias))
    return 0


def is_kept(argv: list[str]) -> bool:
    """Whether the output of `arborspec ARGV` depends on arborspec's sources alone: a command's --help, `methods`."""
    return argv[1:] in (["-h"], ["--help"]) or argv == ["methods"]


def kept_path(argv: list[str]) -> Path:
    """Where `arborspec ARGV`'s text is kept: named after what it depends on (the package's source files, the Python
    version and the terminal's width, which argparse wraps to), so an edit or an upgrade writes a new one."""
    from . import __version__
    from .core.disk_cache import cache_dir
    package = Path(__file__).parent
    sources = sorted((str(f.relative_to(package)), f.stat().st_mtime_ns, f.stat().st_size)
                     for f in package.rglob("*.py"))
    key = [__version__, sys.version, shutil.get_terminal_size().columns, argv, sources]
    return cache_dir() / "help" / f"{argv[0]}-{hashlib.sha256(repr(key).encode()).hexdigest()[:20]}.txt"


def print_kept(argv: list[str], full_main) -> int:
    """`arborspec ARGV` (`is_kept`): the kept text, else the full CLI's (`full_main`, imported by the caller), kept."""
    path = kept_path(argv)
    try:
        text, code = path.read_text(encoding="utf-8"), 0
    except (OSError, UnicodeDecodeError):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                code = full_main(argv) or 0
            except SystemExit as done:
                code = done.code or 0
        text = out.getvalue()
        if code == 0 and text:
            from .core.disk_cache import atomic_write
            with contextlib.suppress(OSError):  # a read-only cache: the text is printed all the same
                atomic_write(path, text)
                prune_kept(path.parent)

    def show(_) -> int:
        sys.stdout.write(text)
        sys.stdout.flush()
        return code
    return run_command(show, None)  # `| head`: exit status 141, as the full CLI's


KEPT_FILES = 64  # a version's 13 commands' help and `methods` at ~4 widths or source versions


def prune_kept(folder: Path, keep: int = KEPT_FILES) -> None:
    """Remove all but the `keep` newest kept texts: each source edit or upgrade writes a new set, and the old ones
    were never read again."""
    files = sorted(folder.glob("*.txt"), key=lambda f: f.stat().st_mtime_ns, reverse=True)
    for old in files[keep:]:
        old.unlink(missing_ok=True)


def typed_text(text: str, what: str) -> str:
    """Text from the command line or a terminal line as the UTF-8 it was typed in. Python decodes it with the
    locale's codec and keeps the bytes it cannot decode as surrogates: under a C locale (PYTHONUTF8=0) "héllo" was
    refused as "bytes that are not UTF-8?", and text that is not UTF-8 was refused only after the models loaded."""
    if not any("\udc80" <= c <= "\udcff" for c in text):
        return text
    try:
        return os.fsencode(text).decode("utf-8")
    except (UnicodeError, ValueError) as err:
        raise CliError(f"{what} is not UTF-8 text ({getattr(err, 'reason', err)})") from None


def printable_streams() -> None:
    """Standard output and error that cannot encode a character show it escaped (\\u3053), as Python's stderr does:
    an answer in Japanese under an ASCII locale failed after the whole generation with "'ascii' codec can't encode",
    and chat lost the answer and advised /reset."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if encoding not in ("utf8", "") and hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")


def run_command(command, args) -> int:
    """Run one parsed command: a user-facing error is one line on stderr and exit status 2 (ARBORSPEC_DEBUG=1 shows
    the traceback), Ctrl-C is exit status 130."""
    from .core.downloads import ModelLoadError
    printable_streams()
    try:
        with warnings.catch_warnings():
            for message in TORCH_NOISE:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
            return command(args)
    except BrokenPipeError:  # `arborspec generate ... | head`: the reader has all it wanted; as the shell's tools do
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141  # 128 + SIGPIPE
    # OSError: an --out under a file, a directory given for a file, a disk full ...: what the system said, one line
    except (CliError, ValueError, ModelLoadError, OSError, FloatingPointError, ImportError) as err:
        if os.environ.get("ARBORSPEC_DEBUG"):
            raise
        print(f"arborspec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("arborspec: interrupted", file=sys.stderr)
        return 130
