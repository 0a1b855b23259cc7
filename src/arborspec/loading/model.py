"""One model loaded on the backend asked for: transformers (`torch`), llama.cpp, or arborspec's native kernels.

`loading/plan.py` decides the backend (and `--backend auto`); this module loads on the one given: an alias (fetched by
loading/aliases.py), a local .gguf file, a local directory or a hub id, with its tokenizer.

bf16 is the default dtype because on this CPU bf16 decodes 2-3x faster than fp32 (the weights are read at the
memory bandwidth, and bf16 reads half the bytes).
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..backends import check_session_support, llamacpp, native
from ..backends.model_info import check_pair, pair_names
from ..core.disk_cache import cache_dir, note_unwritable, sha256_key
from ..core.downloads import ModelLoadError, first_line, say
from .aliases import ALIASES, _dense_gguf, alias_gguf, alias_path, fetch_alias, is_fetched

DEFAULT_DTYPE_NAME = "bf16"  # the dtype flags' default; DEFAULT_DTYPE below is the same as a torch.dtype
# Which code runs a model: "torch" (transformers, weights dequantized to dense tensors), "llamacpp" (llama.cpp's
# quantized CPU kernels on the GGUF file itself), "native" (transformers' layers with the GGUF's weights kept as
# blocks, on arborspec's own kernels: backends/native.py, docs/kernels.md), or "auto": for a GGUF (an alias or a .gguf
# file) whichever of native and llama.cpp is measured to run it fastest on this machine (backend_choice.py; both
# decode the default pair's Q4_K_M files 4-5x faster than transformers' bf16), and transformers for everything else.
BACKENDS = ("auto", "torch", "llamacpp", "native")
_GGUF_BACKENDS = {"llamacpp": "the llama.cpp backend", "native": "the native backend"}


@dataclass
class LoadedModel:
    model: PreTrainedModel  # eval mode, requires_grad off
    tokenizer: PreTrainedTokenizerBase
    name: str  # the spec the user gave (alias, path, or hub id)
    source: str  # where the weights were read from (a path, or the hub id)


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
    if check and path.is_dir():
        raise ModelLoadError(f"{spec!r} is a directory; a GGUF model is one .gguf file")
    if check and not path.is_file():
        raise ModelLoadError(f"model path {spec!r} not found")
    return path


def is_gguf(spec: str | None) -> bool:
    """An alias or a .gguf file: what the GGUF backends (native, llama.cpp) run."""
    return spec is not None and (spec in ALIASES or spec.endswith(".gguf"))


def load_llamacpp_model(spec: str, progress: bool = True, tokenizer_like=None, **options):
    """An alias's kept GGUF or a .gguf file, on llama.cpp (backends/llamacpp.py; `options` go to load_llamacpp).
    `tokenizer_like`: see gguf_tokenizer."""
    path = _spec_gguf(spec, progress, check=False)  # llama.cpp's own message for a missing file
    say(f"loading {spec} on llama.cpp", progress)
    try:
        return llamacpp.load_llamacpp_pair(path, name=spec, **options,
                                           tokenizer=lambda file: gguf_tokenizer(spec, file, tokenizer_like))
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


def gguf_tokenizer(spec: str, path: Path, like: PreTrainedTokenizerBase | None = None) -> PreTrainedTokenizerBase:
    """A GGUF's tokenizer, built once per file. transformers builds one from the file's vocabulary and merges, ~10 s
    for Qwen2.5's 150k tokens (Zen 4), and every load of a GGUF on llama.cpp or native paid that. A fetched alias
    keeps its tokenizer beside its checkpoint; any other GGUF's is saved under the cache the first time, keyed by
    the file (path, size, mtime) and the transformers version. Either loads in ~0.9 s, the same tokenizer.

    `like`: a tokenizer already loaded (a pair's target's, for its draft), returned itself when its vocabulary files
    are the same bytes as this one's (`same_vocabulary`). That skips the second ~0.9 s load, and the pair check,
    which compares two tokenizers' vocabularies (~0.2 s a time), sees one object. Its chat template is `like`'s:
    a pair formats prompts with its target's."""
    if spec in ALIASES and is_fetched(spec):
        kept = alias_path(spec)
        return like if same_vocabulary(like, kept) else AutoTokenizer.from_pretrained(kept)
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    saved = cache_dir() / "tokenizers" / sha256_key(
        {"gguf": str(path), "size": stat.st_size, "mtime": stat.st_mtime_ns, "transformers": transformers.__version__})
    if (saved / _SAVED).is_file():
        if same_vocabulary(like, saved):
            return like
        try:
            return AutoTokenizer.from_pretrained(saved)
        except Exception:  # unreadable (half deleted, another build): built again below
            pass
    tokenizer = llamacpp.gguf_tokenizer(path)
    tmp = saved.with_name(f"{saved.name}.{os.getpid()}.tmp")
    try:
        tokenizer.save_pretrained(tmp)
        (tmp / _SAVED).write_text(str(path) + "\n")  # written last: a directory without it is not used
    except Exception as err:  # a read-only or full cache (the tokenizers library raises a bare Exception): a note
        shutil.rmtree(tmp, ignore_errors=True)
        note_unwritable(err)
        return tokenizer
    shutil.rmtree(saved, ignore_errors=True)
    try:
        tmp.rename(saved)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


_SAVED = "arborspec-tokenizer"  # the marker file of a saved GGUF tokenizer (gguf_tokenizer)
# The files that say which text a token id stands for (the chat template is not among them): what a draft must
# share with its target, byte for byte, to share its tokenizer object too.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model")


def same_vocabulary(tokenizer: PreTrainedTokenizerBase | None, directory: Path) -> bool:
    """Whether `tokenizer` was loaded from a directory whose VOCABULARY_FILES are `directory`'s, byte for byte (the
    default pair's two kept tokenizers differ only in a character of their chat templates)."""
    source = Path(getattr(tokenizer, "name_or_path", "") or "") if tokenizer is not None else None
    if source is None or not source.is_dir() or not (directory / "tokenizer.json").is_file():
        return False
    for name in VOCABULARY_FILES:
        mine, theirs = directory / name, source / name
        if mine.is_file() != theirs.is_file():
            return False
        if mine.is_file() and (mine.stat().st_size != theirs.stat().st_size
                               or mine.read_bytes() != theirs.read_bytes()):
            return False
    return True


def load_native_model(spec: str, progress: bool = True, quiet: bool = False, tokenizer_like=None,
                      file: Path | None = None) -> LoadedModel | None:
    """An alias's kept GGUF or a .gguf file on the native backend (backends/native.py), with the GGUF's tokenizer
    (`tokenizer_like`: see gguf_tokenizer); None, after a one-line note on stderr, for a GGUF the native backend does
    not cover (its weight types, its architecture), which the caller loads elsewhere. ModelLoadError for a missing
    or unreadable file. `file`: the weights to load in place of the spec's own (its lean copy), with its tokenizer."""
    path = _spec_gguf(spec, progress)
    say(f"loading {spec} on arborspec's kernels (native)" + (f" from {file}" if file else ""), progress)
    start = time.perf_counter()
    try:
        model = native.load_native(file or path)
        tokenizer = gguf_tokenizer(spec, path, tokenizer_like)
    except native.NotNative as exc:
        if quiet:  # `--backend auto` tries native among others: not a surprise worth a note, only progress
            say(f"native cannot run {spec}: {exc}", progress)
            return None
        other = {"llamacpp": "llama.cpp", "torch": "transformers (torch)"}[gguf_fallback()]
        print(f"[arborspec] note: {spec} is not run natively: {exc}; loading it on {other} instead", file=sys.stderr,
              flush=True)
        return None
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    say(f"loaded {spec} in {time.perf_counter() - start:.1f} s", progress)
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec, source=str(file or path))


HUB_TIMEOUT = 3.0  # seconds a TCP connection to the hub may take before it counts as unreachable


def hub_reachable(timeout: float = HUB_TIMEOUT) -> bool:
    """Whether the HuggingFace hub (HF_ENDPOINT, else huggingface.co) accepts a connection within `timeout` s.
    Why ask first: transformers retries an unreachable hub five times with back-off, so a mistyped model name took
    28 s to fail on a machine without a route to it; the hub's own cache is then read alone, at once."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_torch_model(spec: str, dtype=None, attn_implementation: str = "sdpa", progress: bool = True) -> LoadedModel:
    """`spec` on transformers: dense weights in `dtype` (a GGUF dequantized), eval mode, no grads."""
    torch_dtype = resolve_dtype(dtype)
    source, gguf_file, from_hub = _resolve(spec, progress)
    offline = from_hub and not hub_reachable()
    cache_only = {"local_files_only": True} if offline else {}  # for the model and its tokenizer alike
    say(f"loading {spec}" + (" from the HuggingFace hub's local cache (the hub is unreachable)" if offline else ""),
        progress)
    start = time.perf_counter()
    try:
        kwargs = dict(dtype=torch_dtype, **(_dense_gguf(gguf_file) if gguf_file else {}), **cache_only)
        try:
            model = AutoModelForCausalLM.from_pretrained(source, attn_implementation=attn_implementation, **kwargs)
        except ValueError as exc:  # models without attention (Mamba2) refuse "sdpa": let transformers pick
            if "does not support an attention implementation" not in str(exc):
                raise
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, **({"gguf_file": gguf_file} if gguf_file else {}),
                                                  **cache_only)
    except Exception as exc:
        reason = first_line(exc)
        if offline:
            raise ModelLoadError(
                f"could not load {spec!r}: the HuggingFace hub is unreachable from this machine and the model is not "
                f"in its local cache; give a local directory, a .gguf file, or an alias "
                f"({', '.join(sorted(ALIASES))})") from exc
        if from_hub:
            raise ModelLoadError(
                f"could not load {spec!r} from the HuggingFace hub (hub unreachable or unknown id: {reason}); "
                f"give a local directory, a .gguf file, or an alias ({', '.join(sorted(ALIASES))})") from exc
        raise ModelLoadError(f"could not load {spec!r} from {source}: {reason}") from exc
    model.eval()
    model.requires_grad_(False)
    say(f"loaded {spec} in {time.perf_counter() - start:.1f} s", progress)
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec, source=source)


# ------------------------------------------------------------------------------------------------------ tokenizers


def check_tokenizers_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise ValueError unless draft and target tokenize identically (same vocabulary, same ids, same EOS): the
    tokenizer half of `model_info.check_pair`, for loaded models (the engine checks the models' output rows too)."""
    check_pair(None, None, target.tokenizer, draft.tokenizer, pair_names(target, draft))


def check_loaded_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """What the engine would refuse the pair for, checked before the draft is prepared: with draft_quant "auto" the
    draft variants were measured first, and a pair the engine refuses (a draft's table short of the tokenizer, a
    model without a KV cache, ALiBi) failed there with a traceback (an IndexError in the draft's embedding)."""
    check_tokenizers_compatible(target, draft)
    check_pair(target.model, draft.model, target.tokenizer, draft.tokenizer, pair_names(target, draft))
    for loaded in (target, draft):
        check_session_support(loaded.model)
