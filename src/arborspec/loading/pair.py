"""THE loader of a target/draft pair, for `arborspec generate`, `bench`, `serve` and the Python API, with the
defaults every front end shares: the default Qwen pair, bf16, the backend and draft variant measured fastest here."""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import torch

from ..backends.llamacpp import RANGES
from ..backends.native import is_native
from ..core.downloads import ModelLoadError
from ..tuning import draft_levers
from ..tuning.costs import WindowTooSmall
from ..tuning.draft_choice import best_variant, cached_native_choice, choose_draft_quant, label, variant
from ..tuning.gguf_requant import LEAN_TYPES, requantized
from .model import DEFAULT_DTYPE_NAME, _spec_gguf, check_loaded_pair, resolve_dtype
from .plan import load_planned, plan_backends

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEFAULT_DTYPE = DEFAULT_DTYPE_NAME  # "bf16", defined once in loading/model.py (2-3x faster than fp32 on this CPU)
DEFAULT_DRAFT_QUANT = "auto"
DEFAULT_BACKEND = "auto"  # GGUF: native or llama.cpp, measured (loading/backend_choice.py); else torch
# the draft variants: PyTorch drafts quantized by torch (int8, int4), native GGUF drafts requantized to a lean 4-bit
# file (q4_0, iq4_nl: tuning/gguf_requant.py); "auto" measures which is fastest for the pair here (cached; of the
# lean types it measures IQ4_NL alone: tuning/draft_choice.AUTO_LEAN_TYPES)
DRAFT_QUANTS = ("auto", *draft_levers.QUANT_MODES, *LEAN_TYPES)


def is_torch_model(loaded) -> bool:
    """A model with dense PyTorch weights: the draft levers (int8 / int4, a pruned head) and the draft-variant
    measurement apply to it. A GGUF run as it is (llama.cpp, or native: a torch module over GGUF blocks) is not one."""
    return isinstance(loaded.model, torch.nn.Module) and not is_native(loaded.model)


def backend_of(model) -> str:
    """The backend a loaded (bare) model runs on (loading/model.py's BACKENDS): what ran, where the plan may have
    named another (a GGUF the native kernels do not cover loads on llama.cpp, with a note)."""
    if is_native(model):
        return "native"
    return "torch" if isinstance(model, torch.nn.Module) else "llamacpp"


TORCH_QUANTS = tuple(q for q in draft_levers.QUANT_MODES if q != "none")  # int8, int4: tuning/draft_levers.py


def torch_quant_refused(quant: str, backend: str) -> ValueError:
    """The error for int8 / int4 asked of a draft that runs on `backend` ("native" or "llamacpp") as GGUF blocks."""
    return ValueError(f"draft quantization {quant!r} applies to PyTorch drafts, and the draft runs on {backend} as "
                      "GGUF blocks; use --draft-backend torch for an int8 / int4 draft, or a lean GGUF variant on "
                      f"native ({', '.join('+' + t for t in LEAN_TYPES)})")


# why a GGUF draft is on llama.cpp: asked for, or (with --backend native) a weight type native has no kernel for,
# which the loading note names; "use --backend native" read as nonsense to a user who had
ON_LLAMACPP = ("llama.cpp (--backend llamacpp, or weight types native has no kernel for: the loading note names "
               "them)")


def resolve_draft(target, draft, quant: str, vocab: int = 0, progress: bool = True) -> tuple[str, int]:
    """(quantization, head size) of the draft a run uses: `quant` and `vocab` as given, or for quant "auto" the
    variant measured fastest for this pair on this machine (tuning/draft_choice.py; measured once, then cached). For
    a native draft that includes its head size unless `vocab` names one. int8 / int4 apply to PyTorch drafts, q4_0 /
    iq4_nl to GGUF drafts on the native backend; a GGUF draft on llama.cpp runs its file as it is ("none")."""
    if is_native(draft.model):
        if quant in TORCH_QUANTS:
            raise torch_quant_refused(quant, "native")
    elif quant in LEAN_TYPES:
        raise ValueError(f"draft variant {quant!r} is a requantized GGUF for the native backend; this draft runs on "
                         + (ON_LLAMACPP if not is_torch_model(draft) else "PyTorch (use int8 / int4 there)"))
    elif not is_torch_model(draft) or not is_torch_model(target):
        if quant in ("auto", "none"):
            return "none", vocab
        if not is_torch_model(draft):
            raise torch_quant_refused(quant, "llamacpp")
    if quant != "auto":
        return quant, vocab
    try:
        choice, record, source = choose_draft_quant(target, draft, progress=progress)
    except WindowTooSmall:  # a toy model: nothing to time the variants by (it failed with an IndexError)
        if progress:
            print("[arborspec] draft: as loaded (the context window is too small to time its variants)",
                  file=sys.stderr)
        return "none", vocab
    return _chosen(record, choice, vocab, source, progress)


def _chosen(record: dict, choice: str, vocab: int, source: str, progress: bool) -> tuple[str, int]:
    """(quantization, head size) of a draft-variant record's choice, named on stderr; with `vocab` given, the best
    quantization measured with the whole head, and that head size."""
    if vocab:  # the head size was asked for: the best quantization measured with the whole head
        choice = best_variant(record["variants"], full_head=True)
    best = record["variants"][choice]
    if progress:
        print(f"[arborspec] draft: {label(best['quant'], vocab or best['vocab'])} ({source}: top-1 agreement "
              f"{best['agreement']:.2f}, {best['draft_times'][0] * 1e3:.1f} ms per draft token; --draft-quant and "
              "--draft-vocab to override)", file=sys.stderr)
    return best["quant"], vocab or best["vocab"]


def cached_lean_draft(target: str, draft: str | None, plan, quant: str, vocab: int,
                      progress: bool = True) -> tuple[str, int] | None:
    """(quantization, head size) of a native pair's cached `auto` draft variant when it is a lean file, found from
    the files' headers before either model loads (and named on stderr); else None. The pair then loads that file
    alone in place of the shipped one, which it would have loaded only to key the choice by: ~0.7 s of the default
    pair's start (the shipped draft's load and its live cost check, Zen 4)."""
    if draft is None or quant != "auto" or (plan.target, plan.draft) != ("native", "native") or plan.loaded[1]:
        return None
    try:
        found = cached_native_choice(_spec_gguf(target, progress), _spec_gguf(draft, progress))
    except (ValueError, OSError, ModelLoadError):  # loading says what is wrong with the file
        return None
    if found is None or _chosen(found[1], found[0], vocab, "cache", False)[0] not in LEAN_TYPES:
        return None
    return _chosen(found[1], found[0], vocab, "cache", progress)


def prepare_draft(target, draft, quant: str = DEFAULT_DRAFT_QUANT, vocab: int = 0, copy_first: bool = False,
                  progress: bool = True):
    """(the draft a run uses, its quantization, its head size), "auto" resolved: `draft` (LoadedModel) quantized and
    its head cut as asked or chosen. `copy_first` leaves `draft` itself untouched (the bench prepares several variants
    of one draft)."""
    quant, vocab = resolve_draft(target, draft, quant, vocab, progress)
    rows = getattr(getattr(draft.model, "config", None), "vocab_size", None)
    if vocab and rows and vocab >= rows:  # pruned nothing, said nothing, and still counted the corpus for it
        raise ValueError(f"a draft head of the {vocab} most frequent tokens (+vocab, --draft-vocab) keeps the whole "
                         f"head: this draft has {rows} tokens; give fewer, or leave the lever out")
    if quant == "none" and not vocab:
        return draft, quant, vocab
    if is_native(draft.model):  # a native GGUF draft: its lean file, then its head pruned (other weights shared)
        if progress and vocab:
            print(f"[arborspec] preparing the draft (head over the {vocab} most frequent tokens) ...",
                  file=sys.stderr)
        return variant(draft, quant, vocab, progress=progress), quant, vocab
    if not is_torch_model(draft):
        raise ValueError("a pruned draft vocabulary (+vocabK, --draft-vocab) applies to PyTorch and native drafts; "
                         "this draft runs on " + ON_LLAMACPP)
    if progress:
        print(f"[arborspec] preparing the draft (quantization {quant}, vocabulary {vocab or 'full'}) ...",
              file=sys.stderr)
    prepared = copy.deepcopy(draft) if copy_first else draft
    return draft_levers.prepare_draft(prepared, quant, vocab, progress=progress), quant, vocab


@dataclass
class LoadedPair:
    """What `load_pair` returns: the models and what was decided for them. It unpacks as `target, draft = ...`."""

    target: object  # LoadedModel (or llama.cpp's LlamaCppLoaded)
    draft: object | None  # prepared (quantization, head) as asked; None when the run drafts nothing
    quant: str = "none"  # the draft's quantization, "auto" resolved ("none" without a draft)
    backends: tuple = ()  # (target's backend, draft's backend or None): what each model runs on
    choice: str = ""  # why `--backend auto` chose the target's backend (empty when the backend was given)
    vocab: int = 0  # the draft's head size, "auto" resolved (0: the whole vocabulary)

    def __iter__(self):
        return iter((self.target, self.draft))


def load_pair(target: str = DEFAULT_TARGET, draft: str | None = DEFAULT_DRAFT, draft_quant: str = DEFAULT_DRAFT_QUANT,
              dtype: str = DEFAULT_DTYPE, draft_vocab: int = 0, progress: bool = True, backend: str = DEFAULT_BACKEND,
              draft_backend: str | None = None, llama: dict | None = None) -> LoadedPair:
    """THE loader of a target/draft pair, for `arborspec generate`, `bench`, `serve` and the Python API: (target,
    draft) loaded (alias, local directory, .gguf file or hub id) and checked to share a tokenizer, the draft prepared.

    The backends are decided before anything loads (loading/plan.py, plan_backends: `--backend auto` picks the
    GGUF backend whose measured costs predict the fastest decoding, speculation included, cached; the draft follows
    it), so each model loads once, on the backend it runs on. For a PyTorch draft `draft_quant="auto"` measures
    which draft variant is fastest for this pair on this machine the first time (seconds to a minute; cached, see
    `arborspec profile --pair`). `draft=None` loads the target alone (for `ar`). `llama`: llama.cpp options
    (n_threads, n_ctx, n_batch) for models on that backend."""
    if draft_quant not in DRAFT_QUANTS:
        raise ValueError(f"unknown draft quantization {draft_quant!r}; choose one of: {', '.join(DRAFT_QUANTS)}")
    resolve_dtype(dtype)  # before anything loads, whichever backend runs (the GGUF ones ignore a valid name)
    llama = llama or {}
    plan = plan_backends(target, draft, backend, draft_backend, llama, progress)
    if draft is not None and draft_quant in TORCH_QUANTS and plan.draft in ("native", "llamacpp"):
        raise torch_quant_refused(draft_quant, plan.draft)  # before loading: the models took minutes for nothing
    lean = cached_lean_draft(target, draft, plan, draft_quant, draft_vocab, progress)
    draft_file = requantized(_spec_gguf(draft, False), lean[0], progress) if lean else None
    target_model, draft_model = load_planned(target, draft, plan, dtype, llama, progress, draft_file)
    if draft is None:
        return LoadedPair(target_model, None, "none", (backend_of(target_model.model), None), plan.why)
    check_loaded_pair(target_model, draft_model)
    if lean:  # the chosen lean file is loaded: its head is what is left to prepare
        quant, vocab = lean
        draft_model = prepare_draft(target_model, draft_model, "none", vocab, progress=progress)[0]
    else:
        draft_model, quant, vocab = prepare_draft(target_model, draft_model, draft_quant, draft_vocab, progress)
    backends = (backend_of(target_model.model), backend_of(draft_model.model))
    return LoadedPair(target_model, draft_model, quant, backends, plan.why, vocab)


def load_pair_for(args, spec, progress: bool = True) -> LoadedPair:
    """`load_pair` with a command's flags (--target, --draft, --dtype, --backend, --draft-backend, --llama-*) for
    `spec` (its quantization and head; the draft only when it drafts): what `generate` and `serve` both load."""
    return load_pair(args.target, args.draft if spec.needs_draft else None, spec.quant, args.dtype, spec.vocab,
                     progress=progress, backend=args.backend, draft_backend=args.draft_backend,
                     llama=llama_options(args))


def llama_options(args) -> dict:
    """The llama.cpp options of the command line (--llama-threads/-ctx/-batch/-seq), for load_model / load_pair."""
    flags = {"n_threads": "threads", "n_ctx": "ctx", "n_batch": "batch", "n_seq_max": "seq"}
    given = {name: getattr(args, f"llama_{flag}", None) for name, flag in flags.items()}
    for name, value in given.items():  # checked whichever backend runs (the native one ignored --llama-threads 0),
        low, high = RANGES[name]  # by the flag's name, before any loading (they named n_threads, after it)
        if value is not None and not low <= value <= (high or value):
            raise ValueError(f"--llama-{flags[name]} must be " + (f"in [{low}, {high}]" if high else f"at least {low}")
                             + f", got {value}")
    return {k: v for k, v in given.items() if v is not None}
