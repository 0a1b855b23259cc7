"""Which backend each model of a pair runs on, decided before anything loads, and `load_model`, the public loader
of one model that asks the same question for `backend="auto"`.

Given backends are kept; `auto` on a GGUF measures (once, cached) which GGUF backend predicts the fastest decoding
(loading/backend_choice.py), and a GGUF draft follows its target's backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import llamacpp
from . import backend_choice
from .model import (
    LoadedModel,
    _spec_gguf,
    gguf_fallback,
    is_gguf,
    load_llamacpp_model,
    load_native_model,
    load_torch_model,
    resolve_backend,
    resolve_dtype,
)


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
                 progress: bool = True, draft_file=None) -> tuple:
    """(target, draft or None) loaded on the backends `plan` names, each once. A cached `auto` choice is checked
    here: the loaded models' cost curves against a few live forwards (backend_choice.recheck, ~0.5 s for the
    default pair); a cached figure that proved to be a busy machine's is measured again. `draft_file`: a GGUF the
    native draft is loaded from in place of its own (its lean copy: pair.cached_lean_draft)."""
    llama = llama or {}
    target_model = plan.loaded[0] or load_model(target, dtype=dtype, progress=progress, backend=plan.target,
                                                llama=llama)
    like = getattr(target_model, "tokenizer", None)
    if draft is None or plan.loaded[1] is not None:
        draft_model = plan.loaded[1]
    elif draft_file is not None:
        draft_model = load_native_model(draft, progress, tokenizer_like=like, file=draft_file)
    else:
        draft_model = load_model(draft, dtype=dtype, progress=progress, backend=plan.draft, llama=llama,
                                 tokenizer_like=like)
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
            t = load(target, None)
            if t is None or draft is None:
                return t and (t, None)
            d = load(draft, t.tokenizer)
            return (t, d) if d is not None else None
        return both

    loaders = {"native": on(lambda spec, like: load_native_model(spec, progress, quiet=True, tokenizer_like=like))}
    if llamacpp.available():
        loaders["llamacpp"] = on(lambda spec, like: load_llamacpp_model(spec, progress, like, **llama))
    try:
        return backend_choice.choose(path, loaders, draft_path, threads=llama.get("n_threads"), progress=progress)
    except backend_choice.NoBackend:  # no GGUF backend can run it (any other ValueError is the run's error)
        return backend_choice.Choice("torch")


def load_model(
    spec: str,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str = "sdpa",
    progress: bool = True,
    backend: str = "torch",
    llama: dict | None = None,
    tokenizer_like=None,
) -> LoadedModel:
    """Load model and tokenizer from an alias, a .gguf file, a checkpoint directory or a hub id; eval, no grads.

    `backend` "llamacpp" loads it on llama.cpp instead: a `LlamaCppLoaded` with the same fields, which every policy
    and verifier runs on unchanged; `llama`: its options (n_threads, n_ctx, n_batch, ... of
    backends.llamacpp.load_llamacpp). "auto" on a GGUF: native or llama.cpp, whichever this machine's measured costs
    predict decodes faster (plan_backends; cached). "native" keeps a GGUF's weights as blocks on
    arborspec's kernels (a LoadedModel; `dtype` does not apply: activations are float32); a GGUF it does not cover
    goes to llama.cpp (or transformers without llama-cpp-python) with a note on stderr. `tokenizer_like`: a
    tokenizer loaded already (a pair's target's) that a GGUF whose vocabulary files are the same bytes shares
    instead of loading its own (model.gguf_tokenizer)."""
    resolve_dtype(dtype)  # an unknown name is refused whichever backend runs (the GGUF ones ignore a valid one)
    chosen = resolve_backend(spec, backend)
    if backend == "auto" and chosen != "torch":  # a GGUF: the backend measured fastest for it here
        plan = plan_backends(spec, None, "auto", None, llama, progress)
        if plan.loaded[0] is not None:
            return plan.loaded[0]
        chosen = plan.target
    if chosen == "native":
        loaded = load_native_model(spec, progress, tokenizer_like=tokenizer_like)
        if loaded is not None:
            return loaded
        chosen = gguf_fallback()
    if chosen == "llamacpp":
        return load_llamacpp_model(spec, progress, tokenizer_like, **(llama or {}))
    return load_torch_model(spec, dtype, attn_implementation, progress)
