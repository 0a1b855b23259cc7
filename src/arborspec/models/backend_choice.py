"""`--backend auto` for a GGUF: the backend that runs this file fastest on this machine, measured once and cached.

Two backends run a GGUF's quantized weights directly: llama.cpp (`llamacpp.py`) and arborspec's own kernels
(`native.py`). Which one is faster depends on the CPU (AVX-512 VNNI or not), the file's block types and the thread
count, so it is measured rather than assumed. On the 2-core Zen 3 (AVX2) this project was last measured on, the two
decode the 1.5B target at the same speed within a few percent (native 1.03-1.05x in end-to-end runs), while
verifying 4 and 8 tree tokens costs 1.7x and 2.9x a token on native against 2.4x and 5.7x on llama.cpp
(docs/kernels.md).

The rule. Each candidate is loaded and timed through the same sessions generation uses: t(1), one token after a
64-token prefix, and t(4), a 4-token tree (median of 3 after a warm-up). The fastest t(1) wins, because plain
decoding on the chosen backend is what the `auto` method falls back to when speculation does not pay (its guard):
it must be the fastest plain decoding available. Within `TIE` of that t(1), the candidate with the cheapest t(4)
wins instead: the same plain speed within timing noise, and cheaper verification, which is what speculation buys.

The result is cached (a record per file, machine, thread count and library versions: `cache.read_record`), so the
measurement, which loads the losing backend once (~5-20 s for the default target), happens the first time only.
A candidate that cannot run the file (the native kernels cannot build, a block type they do not cover,
llama-cpp-python not installed) drops out before anything is timed.
"""
from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from ..cache import machine_id, read_record, write_record
from ..profile import measure_forward_cost

TIE = 0.05  # t(1) within 5% of the fastest counts as equally fast plain decoding
PREFIX = 64  # tokens in the cache before the timed forwards
REPEATS = 3  # timed forwards per size (after one warm-up)


def choice_key(path: Path, candidates: list[str], threads: int) -> dict:
    """What a cached choice is valid for: this exact file (path, size, modification time), the candidates, this
    machine, the thread count, and the builds that run it (the kernels' cache key covers their source and CPU)."""
    stat = path.stat()
    key = {"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
           "candidates": sorted(candidates), "threads": threads, "machine": machine_id()}
    if "native" in candidates:
        from ..kernels.build import cache_key
        key["kernels"] = cache_key()
    if "llamacpp" in candidates:
        key["llama_cpp"] = _version("llama-cpp-python")
    return key


def time_forwards(model, sizes=(1, 4)) -> dict[int, float]:
    """Median seconds of one forward over an n-token tree after a `PREFIX`-token cache, for each n in `sizes`: the
    profile's own measurement (profile.measure_forward_cost, through the sessions generation uses), shortened."""
    return dict(zip(sizes, measure_forward_cost(model, sizes, prefix=PREFIX, repeats=REPEATS)))


def pick(costs: dict[str, dict[int, float]], tie: float = TIE) -> str:
    """The backend with the fastest t(1); among those within `tie` of it, the one with the cheapest t(4)."""
    fastest = min(c[1] for c in costs.values())
    close = [name for name, c in costs.items() if c[1] <= fastest * (1 + tie)]
    return min(close, key=lambda name: (costs[name][4], costs[name][1]))


def choose(path: Path, loaders: dict[str, Callable[[], object]], threads: int | None = None,
           progress: bool = True, refresh: bool = False) -> tuple[str, object | None]:
    """(backend name, its loaded model or None) for the GGUF at `path`. `loaders`: candidate name -> a function that
    loads the file on it (returning None when that backend cannot run it). A cached choice is returned without
    loading anything (None: the caller loads it); otherwise every candidate is loaded and timed and the winner is
    returned loaded, the others released."""
    threads = threads or torch.get_num_threads()
    key = choice_key(path, list(loaders), threads)
    saved = None if refresh else read_record("backend-choice", key)
    if saved and saved.get("backend") in loaders:
        return saved["backend"], None
    loaded, costs = {}, {}
    for name, load in loaders.items():
        model = load()
        if model is None:
            continue
        loaded[name] = model
        if len(loaded) > 1:  # something to compare: time whoever is not timed yet, keep only the best so far
            for other, m in loaded.items():
                if other not in costs:
                    _say(f"timing {path.name} on {other} (once per machine, to pick the faster backend)", progress)
                    costs[other] = time_forwards(getattr(m, "model", m))
            best = pick(costs)
            for other in [n for n in loaded if n != best]:
                del loaded[other]
            gc.collect()
    if not loaded:
        raise ValueError(f"no backend can run {path}")
    name = next(iter(loaded))
    if len(loaders) > 1:  # also when only one could run the file: the others need not be tried again
        write_record("backend-choice", key, {"backend": name, "costs_ms": {
            n: {str(s): round(t * 1e3, 3) for s, t in c.items()} for n, c in costs.items()}})
    if len(costs) > 1:
        _say(f"{name} runs {path.name} fastest here: "
             + ", ".join(f"{n} t(1) {c[1] * 1e3:.1f} ms, t(4) {c[4] * 1e3:.1f} ms" for n, c in costs.items()),
             progress)
    return name, loaded[name]


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _say(text: str, progress: bool) -> None:
    if progress:
        print(f"[arborspec] {text}", file=sys.stderr, flush=True)
