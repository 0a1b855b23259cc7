"""A lean copy of a GGUF draft: its matrices requantized to a 4-bit 32-value block type, built once and cached.

Why: on a 2-core CPU a draft token costs what its weights take to read. The default pair's 0.5B draft reads ~397 MB a
step (layers Q5_0 / Q8_0 / Q6_K, a Q8_0 output head of 144.6 MB) against the 1.5B target's ~986 MB, so even a chain
whose every token is accepted paid little (docs/kernels.md, "A lean draft"). Requantized to Q4_0 or IQ4_NL (4.5 bits a
weight, 32-value blocks that fit its 896-wide rows), head included, it reads ~277 MB; greedy top-1 agreement with the
target fell only from 0.906 to 0.891 (Q4_0) on the reference texts (measured with llama.cpp's own quantizer).

The quantizer is llama.cpp's (`llama_cpp.llama_model_quantize`, the package the llama.cpp backend already uses): it
writes every tensor of the new type, keeps the file's metadata and vocabulary, and copies what it cannot quantize.
Every matrix gets the type (llama.cpp's `pure`), but the token embedding stays Q8_0 (rows are looked up, never read
whole, so its size costs nothing a step).
The result is written under `cache_dir()/drafts/`, keyed by the source file (path, size, mtime), the type and
llama.cpp's version; a second run loads it at once.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from gguf import GGMLQuantizationType as QT

from ..backends.gguf_file import read_gguf
from ..backends.llamacpp import bindings, llama_error
from ..core.disk_cache import cache_dir, sha256_key
from ..core.downloads import file_lock, say
from ..kernels.matrix import SUPPORTED_TYPES

# variant name -> (llama.cpp file type LLAMA_FTYPE_MOSTLY_*, ggml tensor type GGML_TYPE_*), as llama.h numbers them
LEAN_TYPES = {"q4_0": (2, 2), "iq4_nl": (25, 20)}
EMBEDDING_TYPE = 8  # GGML_TYPE_Q8_0


def lean_types() -> tuple[str, ...]:
    """The lean variants the native kernels here can run (kernels/matrix.py: SUPPORTED_TYPES)."""
    return tuple(name for name in LEAN_TYPES if QT[name.upper()] in SUPPORTED_TYPES)


def requantized_path(source: Path, kind: str, llama_version: str) -> Path:
    """Where the `kind` copy of `source`, made by llama.cpp `llama_version`, is cached (it may not exist yet)."""
    stat = source.stat()
    # mtime in nanoseconds: a file replaced within the same second (a requantized download of the same size) kept
    # the old file's copy
    key = dict(path=str(source.resolve()), size=stat.st_size, mtime_ns=stat.st_mtime_ns, kind=kind, pure=True,
               llama_cpp=llama_version)
    return cache_dir() / "drafts" / f"{variant_prefix(source, kind)}{sha256_key(key)}.gguf"


def variant_prefix(source: Path, kind: str) -> str:
    """What the names of every `kind` copy of the file at `source`'s path start with: its name and a hash of its
    path, so that two files of one name (every `ggml-model-Q4_K_M.gguf`) keep a copy each, where each one's copy
    deleted the other's as stale."""
    return f"{source.stem}-{sha256_key(str(source.resolve()), 8)}-{kind}-"


def requantized(source: str | Path, kind: str, progress: bool = True) -> Path:
    """The GGUF `source` with its matrices in `kind` ("q4_0" or "iq4_nl"), built once (~10-20 s for the 0.5B draft
    on 2 cores) and cached. ValueError for an unknown kind or a file llama.cpp cannot quantize."""
    if kind not in LEAN_TYPES:
        raise ValueError(f"unknown lean draft type {kind!r}; choose one of: {', '.join(LEAN_TYPES)}")
    llama_cpp = bindings()  # ValueError naming the package where it is missing; llama.cpp's log kept quiet
    source = Path(source)
    out = requantized_path(source, kind, llama_cpp.__version__)
    if _whole(out):
        return out
    with file_lock(cache_dir() / "locks" / f"{out.name}.lock"):
        if _whole(out):
            return out
        out.unlink(missing_ok=True)  # cut short (a full disk, a copy): every later load failed, and no --refresh helped
        for stale in out.parent.glob(f"{out.name}.*.tmp"):  # a killed build's (up to ~430 MB): the lock is ours
            stale.unlink(missing_ok=True)
        say(f"requantizing the draft {source.name} to {kind} (once; cached in {out.parent})", progress)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.output_tensor_type = LEAN_TYPES[kind]
        params.token_embedding_type = EMBEDDING_TYPE
        params.allow_requantize = True  # the source is already quantized (Q5_0 / Q8_0 / Q6_K)
        params.pure = True  # every matrix in `kind`: left to itself llama.cpp gives IQ4_NL files Q5_1 / Q5_K tensors
        params.nthread = os.cpu_count() or 1
        rc = llama_cpp.llama_model_quantize(os.fsencode(source), os.fsencode(tmp), ctypes.byref(params))
        if rc != 0 or not tmp.exists():
            tmp.unlink(missing_ok=True)
            raise ValueError(f"llama.cpp could not requantize {source} to {kind}: {llama_error(f'status {rc}')}")
        tmp.replace(out)
        drop_stale(out, [variant_prefix(source, kind), f"{source.stem}-{kind}-"], progress)  # and pre-path names
    return out


def _whole(path: Path) -> bool:
    """Whether a GGUF is at `path` with every tensor inside the file (its header read, no data)."""
    if not path.is_file():
        return False
    try:
        read_gguf(path)
    except Exception:
        return False
    return True


def drop_stale(kept: Path, prefixes: list[str], progress: bool = True) -> None:
    """Delete the earlier copies of one variant (a name of `prefixes` and a key's hash, beside `kept`): made from an
    older file at the same path or by another llama.cpp, they would never be read again, and each holds ~430 MB for
    the 0.5B draft (its Q8_0 embedding table stays whole). A process that has one open keeps reading it (the file
    lives until closed)."""
    tail = len(kept.name) - len(prefixes[0])  # the key's hash and ".gguf"
    freed = 0
    for old in kept.parent.glob("*.gguf"):
        if old != kept and any(old.name.startswith(p) and len(old.name) == len(p) + tail for p in prefixes):
            freed += old.stat().st_size
            old.unlink(missing_ok=True)
    if freed:
        say(f"removed earlier copies of {prefixes[0].rstrip('-')} ({freed / 1e6:.0f} MB)", progress)
