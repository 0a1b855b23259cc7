"""A benchmark's raw record, results.json, stored plain or gzip-compressed (results.json.gz), and read in either form.

A bench run keeps every step of every run (accepted lengths, drafted sizes, timings): 0.2-5 MB of indented JSON
for the experiments under results/, which every clone carries. Compressed they are 10-24x smaller (the 20 records
under results/ on 2026-11-25: 25 MB plain, 1.8 MB gzipped), and the summaries the docs are made from (report.md,
docs/reproduction.md) are recomputed from them unchanged. A record under COMPRESS_ABOVE bytes (a smoke run, a test's
run) stays plain, to be read and diffed as it is.

Paths name the plain file (`DIR/results.json`, as the bench's commands and docs say); `find` resolves a directory
or such a path to whichever form exists, and the writer removes the other form, so there is one record per
directory. gzip is written with a zero timestamp: the same data gives the same bytes, so git sees no change.

`python -m arborspec.bench.records DIR...` rewrites every results.json under DIR in the form the writer picks (how
results/ was compressed).
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from ..core.disk_cache import atomic_write

NAME = "results.json"
GZ = ".gz"
COMPRESS_ABOVE = 128 * 1024  # bytes of JSON; a 20-prompt x 10-method record is ~1-5 MB, a test's a few KB


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
        return json.loads(raw)
    except (OSError, EOFError, ValueError) as err:  # a cut gzip stream, bad UTF-8, bad JSON
        raise ValueError(f"{file} is not valid JSON: {err}") from None


def write(path: str | Path, data) -> Path:
    """Write `data` as the record `path` names (`DIR/results.json`): indented JSON, gzipped when it is over
    COMPRESS_ABOVE bytes; the other form, if any, is removed. Atomic (see cache.atomic_write). Returns the file."""
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
    """Rewrite every record under `root` in the form `write` picks (the JSON itself unchanged); the files written."""
    return [write(p, read(p)) for p in sorted({find(f.parent) for f in Path(root).rglob(f"{NAME}*")} - {None})]


if __name__ == "__main__":
    for root in sys.argv[1:] or ["results"]:
        for file in recompress(root):
            print(file)
