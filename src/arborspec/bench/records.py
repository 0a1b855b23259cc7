"""A benchmark's raw record, results.json, stored plain or gzip-compressed (results.json.gz), and read in either form.

A bench run keeps every step of every run (accepted lengths, drafted sizes, timings): 0.2-5 MB of indented JSON
for the experiments under results/, which every clone carries. Compressed they are 10-24x smaller (the 20 records
under results/ on 2026-11-25: 25 MB plain, 1.8 MB gzipped), and the summaries the docs are made from (report.md,
docs/reproduction.md) are recomputed from them unchanged. A record under COMPRESS_ABOVE bytes (a smoke run, a test's
run) stays plain, to be read and diffed as it is.

Paths name the plain file (`DIR/results.json`, as the bench's commands and docs say); `find` resolves a directory
or such a path to whichever form exists, and the writer removes the other form, so there is one record per
directory. gzip is written with a zero timestamp: the same data gives the same bytes, so git sees no change.

A record of schema 1 (before session 29) counted the prompt's forward, which makes the first token and drafts
nothing, as a decoding step of arborspec's runs (since session 24; before, the first step drafted a tree) and of
llama.cpp's and transformers' plain loops; `read` drops such a first step (one token committed, nothing drafted) from
the per-step lists, as the runner records them now (engine/stats.py), so reports recomputed from results/ count MAT
and tree sizes the same way as new runs.

`python -m arborspec.bench.records DIR...` rewrites every results.json under DIR in the form the writer picks (how
results/ was compressed), upgrading schema-1 records as `read` does.
"""
from __future__ import annotations

import fcntl
import gzip
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..core.disk_cache import atomic_write

NAME = "results.json"
LOCK = ".bench.lock"  # held by the run writing the folder (git ignores it)
GZ = ".gz"
COMPRESS_ABOVE = 128 * 1024  # bytes of JSON; a 20-prompt x 10-method record is ~1-5 MB, a test's a few KB


@contextmanager
def writing(directory: str | Path) -> Iterator[None]:
    """Hold `directory` for one bench run. Two runs with the same --out each rewrite results.json as they go (and the
    writer removes the other form), so the later one silently replaced the earlier's record with its first prompts:
    a whole 20 + 20 run was lost so on 2026-11-26. The second run now stops at once and names the first one's pid."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--out {directory} is a file; bench writes a folder (results.json, report.md, plots)")
    try:  # the system's words alone ("Permission denied: '/x'") did not say which flag to change
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / LOCK, "a+")
    except OSError as err:
        raise ValueError(f"--out {directory} cannot be written: {err.strerror}") from None
    with lock as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise ValueError(f"another `arborspec bench` (pid {f.read().strip() or '?'}) is writing {directory}; wait "
                             "for it to end or give another --out") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def find(path: str | Path) -> Path | None:
    """The file a directory (its results.json) or a JSON path names, plain or with `.gz` added; None if neither
    exists."""
    path = Path(path)
    plain = path / NAME if path.is_dir() else path
    if plain.name.endswith(GZ):
        plain = plain.with_name(plain.name[:-len(GZ)])
    packed = plain.with_name(plain.name + GZ)
    return next((p for p in (plain, packed) if p.is_file()), None)


def read(path: str | Path):
    """The JSON of the record at `path` (see `find`). FileNotFoundError if there is none; ValueError (one line,
    naming the file) if it is not whole, valid JSON."""
    file = find(path)
    if file is None:
        raise FileNotFoundError(f"no {NAME} at {str(path)!r}")
    try:
        raw = gzip.decompress(file.read_bytes()) if file.name.endswith(GZ) else file.read_bytes()
        data = json.loads(raw)
    except (OSError, EOFError, ValueError) as err:  # a cut gzip stream, bad UTF-8, bad JSON
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    return upgraded(data)


PER_STEP = ("committed_per_step", "accepted_per_step", "drafted_per_step", "depth_per_step", "root_optimum_per_step")
PLAIN_FIRST = ("hf-ar", "llamacpp-ar", "llamacpp-lookup")  # baselines whose first recorded step read the prompt


def upgraded(data):
    """A schema-1 bench record with the prompt's forward left out of its runs' per-step lists (see above)."""
    if not isinstance(data, dict) or data.get("schema") != 1 or not isinstance(data.get("runs"), list):
        return data
    for run in data["runs"]:
        steps, drafted = run.get("committed_per_step"), run.get("drafted_per_step")
        if not steps or len(steps) < 2 or not (run.get("policy") or run.get("method") in PLAIN_FIRST):
            continue
        if steps[0] != 1 or (drafted and drafted[0] != 0):  # a first step that drafted: no prompt-only forward
            continue
        for key in PER_STEP:
            if isinstance(run.get(key), list) and len(run[key]) == len(steps):
                run[key] = run[key][1:]
        run["steps"] = len(run["committed_per_step"])
        run["mat"] = sum(run["committed_per_step"]) / run["steps"]
    data["schema"] = 2
    return data


def write(path: str | Path, data) -> Path:
    """Write `data` as the record `path` names (`DIR/results.json`): indented JSON, gzipped when it is over
    COMPRESS_ABOVE bytes; the other form, if any, is removed. Atomic (see disk_cache.atomic_write). Returns the file."""
    path = Path(path)
    if path.name.endswith(GZ):
        path = path.with_name(path.name[:-len(GZ)])
    text = (json.dumps(data, indent=1) + "\n").encode()
    packed = path.with_name(path.name + GZ)
    target, other = (packed, path) if len(text) > COMPRESS_ABOVE else (path, packed)
    atomic_write(target, gzip.compress(text, compresslevel=9, mtime=0) if target is packed else text)
    other.unlink(missing_ok=True)
    return target


def recompress(root: str | Path) -> list[Path]:
    """Rewrite every record under `root` in the form `write` picks; the files written. A schema-1 record is upgraded
    on the way (`upgraded`: the prompt's forward leaves the per-step lists), so its JSON changes."""
    return [write(p, read(p)) for p in sorted({find(f.parent) for f in Path(root).rglob(f"{NAME}*")} - {None})]


def main(roots: list[str]) -> int:
    """`python -m arborspec.bench.records [DIR ...]` (default: results/): a DIR that is missing or holds no record
    is an error (it exited 0 in silence, so a typo read as done)."""
    for root in roots or ["results"]:
        files = recompress(root) if Path(root).is_dir() else []
        if not files:
            print(f"{root}: no benchmark record ({NAME} or {NAME}{GZ}) in or under it", file=sys.stderr)
            return 2
        print("\n".join(map(str, files)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
