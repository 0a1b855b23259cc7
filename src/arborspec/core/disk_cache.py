"""The disk cache every part of arborspec shares, and the fingerprints that key it.

Ground floor: this module imports nothing from arborspec (but `__version__`), so models, drafting policies, the bench
and the CLI can all use it without import cycles.

A cached record (a cost profile, a calibration, a draft-variant choice, a prepared draft) is keyed by what it was
measured on: the model's fingerprint, its dtype, the torch thread count and the machine. It also carries the library
versions it was made with; a record whose key or versions differ from the current ones is ignored and made again.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

PROFILE_FORMAT = 1  # bump when the layout of cached profile records changes


def cache_dir() -> Path:
    """$ARBORSPEC_CACHE, or ~/.cache/arborspec: converted models, profiles, prepared drafts, datasets."""
    env = os.environ.get("ARBORSPEC_CACHE")
    return Path(env).expanduser().absolute() if env else Path.home() / ".cache" / "arborspec"  # as printed: whole


def atomic_write(path: Path | str, data: str | bytes) -> Path:
    """Write `data` to `path` through a temporary file and a rename, so a reader never sees half a file (and two
    processes writing the same path leave one whole version). Creates the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # threads of one process too
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        tmp.replace(path)
    except BaseException:  # a full disk, `path` a directory, Ctrl-C: no temporary file left beside it
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path | str, data) -> Path:
    """`data` as indented JSON, written atomically."""
    return atomic_write(path, json.dumps(data, indent=1) + "\n")


def sha256_key(obj, length: int = 20) -> str:
    """A short stable hash of a JSON-serialisable object (dict keys sorted): names cache files after their keys."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:length]


def library_versions() -> dict:
    """What a cached record was made with; any change invalidates it."""
    import torch
    import transformers

    from .. import __version__

    return {"format": PROFILE_FORMAT, "arborspec": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def model_fingerprint(model) -> str:
    """A short hash that changes when the model does: class, config, module types (quantized layers are other
    classes), parameter count, dtypes, and 64 values spread over every weight (the first 64 of the first and last
    two: a checkpoint saved again over the same directory with other middle layers kept its old int8 draft).

    A model that is not a torch module (e.g. a llama.cpp model) may define `fingerprint()` itself."""
    if hasattr(model, "fingerprint"):
        return model.fingerprint()
    h = hashlib.sha256(type(model).__name__.encode())
    try:
        h.update(model.config.to_json_string(use_diff=False).encode())
    except Exception:  # an exotic config: its repr still names the architecture
        h.update(repr(model.config).encode())
    h.update(",".join(sorted({type(m).__name__ for m in model.modules()})).encode())
    params = list(model.named_parameters())
    h.update(str(sum(p.numel() for _, p in params)).encode())
    for name, p in params:
        h.update(f"{name}:{type(p).__name__}:{p.dtype}:{tuple(p.shape)}".encode())
        try:
            flat = p.detach().reshape(-1)
            h.update(np.asarray(flat[::max(1, flat.numel() // 64)][:64].float().cpu()).tobytes())
        except Exception:  # a packed / quantized tensor without a plain view
            pass
    return h.hexdigest()[:20]


def record_path(kind: str, key: dict) -> Path:
    """Where the cached record of `kind` for `key` lives."""
    return cache_dir() / "profiles" / f"{kind}-{sha256_key(key)}.json"


def read_record(kind: str, key: dict) -> dict | None:
    """The cached JSON record for `key`, or None if missing, unreadable, or made with another format or library
    version or for another key."""
    try:
        data = json.loads(record_path(kind, key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("versions") != library_versions() or data.get("key") != key:
        return None
    return data


def write_record(kind: str, key: dict, record: dict) -> Path:
    """Write `record` (plus key and versions) atomically; returns the path."""
    data = dict(record, key=key, versions=library_versions(), written=time.strftime("%Y-%m-%d %H:%M:%S"))
    return write_json(record_path(kind, key), data)


_unwritable: set[str] = set()  # cache directories already reported as unwritable


def keep_record(kind: str, key: dict, record: dict) -> Path | None:
    """`write_record` for a measurement the run goes on without: where the cache cannot be written (read-only, full)
    the run says so once and carries on with what it measured (a read-only cache failed the default `generate`
    after its measurements, on the cost profile's or the backend choice's record). None when not written."""
    try:
        return write_record(kind, key, record)
    except OSError as err:
        note_unwritable(err)
        return None


def note_unwritable(err: Exception) -> None:
    """One note per cache directory that cannot be written (read-only, full): the run goes on without keeping."""
    where = str(cache_dir())
    if where not in _unwritable:
        _unwritable.add(where)
        print(f"[arborspec] note: cannot write to the cache {where} ({getattr(err, 'strerror', None) or err}); "
              "what is measured now is not kept", file=sys.stderr, flush=True)
