"""`--backend auto` for a GGUF: the backend on which this pair decodes fastest on this machine, measured once, cached.

Two backends run a GGUF's quantized weights directly: llama.cpp (`llamacpp.py`) and arborspec's own kernels
(`native.py`). Which one is faster depends on the CPU (AVX-512 VNNI or not), the file's block types and the thread
count, and on what the run does: plain decoding costs one t(1) a token, speculation one draft layer d(w) per level
and one t(1 + N) to verify N drafted tokens. The backends differ most in the second: on the 2-core Zen 4 host the 1.5B
target decodes at t(1) 24 ms on native against 29 ms on llama.cpp, but verifies 4 tokens in 47 ms against 77 ms, and
on a host where llama.cpp's t(1) is the faster one native may still verify trees far cheaper (docs/kernels.md).

The rule. Each candidate loads the target (and the GGUF draft, which follows the target's backend) and profiles
them (`costs.profile_model`: the cost curves t(n) and d(w) the auto policy itself sizes its trees by, cached, so
the winner's are not measured again when generation starts). Its figure is the rate the auto policy's own model
predicts from those curves (`drafting.auto.policy.predicted_rates`): the best chain at the pair's saved acceptance
where it beats plain decoding by the guard's margin, else plain decoding's 1 / t(1). The highest rate wins; within
`TIE` of it, the candidate with the cheapest t(4). Without a draft (`ar`, a draft on a backend of its own) the rate is
plain decoding's, t(1) alone.

The result is cached (a record per file pair, machine, thread count and library builds), so the measurement, which
loads the losing backend once, happens the first time only; a later start loads nothing here. The cached figures are
checked against live forwards (`costs.profile_model`: a cached curve more than 2x slower than a few live forwards
was taken while something else ran, and is measured again, once, with a note): when the choice is made, every
candidate again after all were profiled one after another (a first start on a busy machine once timed the draft on
native at 1064 ms against llama.cpp's 65 ms and kept that choice for good), and at each later start the winner's
(`recheck`, ~0.5 s for the default pair). A comparison during which live forwards found the machine busy (a
cached figure kept, while another candidate's was measured live under the same load: native timed at 100 ms against
llama.cpp's cached 32 ms chose llama.cpp, where native decodes faster), or one of whose profiles was measured while
other processes kept the CPUs busy (core/cpu_load.py), is used for that run and not cached. A
candidate that cannot run the file (the native kernels cannot build, a block type they do not cover,
llama-cpp-python not installed) drops out before anything is timed.
"""
from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from ..core.disk_cache import keep_record, read_record
from ..core.downloads import say
from ..core.host import machine_id
from ..drafting.auto.policy import predicted_rates
from ..tuning import costs
from ..tuning.costs import CostCurve, confirm_profile, profile_model

TIE = 0.05  # predicted rates within 5% of the best count as equally fast: the cheaper t(4) wins


class NoBackend(ValueError):
    """No candidate can run the file (the caller falls back to transformers); any other error is the caller's."""


@dataclass
class Choice:
    """The backend chosen, the models the measurement left loaded on it (target, draft or None; None when the choice
    was cached), the figures behind it (a start-up line) and the record cached."""

    backend: str
    loaded: tuple | None = None
    why: str = ""
    record: dict | None = None
    key: dict | None = None


def file_id(path: Path) -> dict:
    stat = path.stat()
    return {"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def choice_key(path: Path, candidates: list[str], threads: int, draft: Path | None = None) -> dict:
    """What a cached choice is valid for: this exact target file (path, size, modification time) and draft file (or
    none), the candidates, this machine, the thread count, and the builds that run it (the kernels' cache key covers
    their source and CPU)."""
    key = {**file_id(path), "draft": file_id(draft) if draft is not None else None, "candidates": sorted(candidates),
           "threads": threads, "machine": machine_id()}
    if "native" in candidates:
        from ..kernels.build import cache_key
        key["kernels"] = cache_key()
    if "llamacpp" in candidates:
        key["llama_cpp"] = _version("llama-cpp-python")
    return key


def measure(target, draft=None) -> dict:
    """The figures of one candidate: its cost curves (cached profiles, measured if need be) and the rates the auto
    policy predicts from them (tokens per second), for `pick` and the cached record."""
    t_curve, _ = profile_model(_model(target), progress=True)
    d_curve = profile_model(_model(draft), progress=True)[0] if draft is not None else None
    return figures_of(t_curve, d_curve, _model(target), _model(draft) if draft is not None else None,
                      getattr(target, "tokenizer", None))


def figures_of(t_curve: CostCurve, d_curve: CostCurve | None, target=None, draft=None, tokenizer=None) -> dict:
    rates = predicted_rates(t_curve, d_curve, target, draft, tokenizer=tokenizer)
    out = {k: (None if v is None else round(v, 3)) for k, v in rates.items() if k != "acceptance"}
    out["acceptance"] = rates["acceptance"]
    out["target"] = t_curve.to_dict()
    out["draft"] = d_curve.to_dict() if d_curve is not None else None
    return out


def remeasured(models: tuple, progress: bool = True) -> bool:
    """Whether a candidate's profiles (target, draft) had to be measured again after all candidates were profiled:
    each checked against a few live forwards now (costs.confirm_profile). Profiles are taken one after another;
    this catches one that ran while something else did."""
    return any(confirm_profile(_model(m), progress)[1] == "measured" for m in models if m is not None)


def pick(figures: dict[str, dict], tie: float = TIE) -> str:
    """The candidate with the highest predicted rate; among those within `tie` of it, the one with the cheapest
    t(4) (the same speed within timing noise, and cheaper verification)."""
    best = max(f["rate"] for f in figures.values())
    close = [name for name, f in figures.items() if f["rate"] >= best * (1 - tie)]
    return min(close, key=lambda name: (_t(figures[name], 4), -figures[name]["rate"]))


def choose(path: Path, loaders: dict[str, Callable[[], tuple | None]], draft: Path | None = None,
           threads: int | None = None, progress: bool = True, refresh: bool = False) -> Choice:
    """The backend for the GGUF at `path` (and the GGUF `draft` that follows it, if any). `loaders`: candidate name
    -> a function that loads (target, draft or None) on it (None when that backend cannot run them). A cached choice
    is returned without loading anything (the caller loads the models); otherwise every candidate is loaded and
    measured, and the winner is returned loaded, the others released."""
    threads = threads or torch.get_num_threads()
    key = choice_key(path, list(loaders), threads, draft)
    saved = None if refresh else read_record("backend-choice", key)
    if saved is not None:
        try:  # a damaged record (a figure without its rate, null, a list for a name): measured again
            if saved["backend"] in loaders and isinstance(saved["figures"], dict):
                return Choice(saved["backend"], None, describe(saved), saved, key)
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
    loaded, figures, busy_before = {}, {}, costs.busy
    for name, load in loaders.items():
        models = load()
        if models is None:
            continue
        loaded[name] = models
        if len(loaded) > 1:  # something to compare: measure whoever is not measured yet, keep only the best so far
            for other, m in loaded.items():
                if other not in figures:
                    say(f"measuring {path.name}{' with its draft' if draft else ''} on {other} (once per machine, "
                         "to pick the faster backend)", progress)
                    figures[other] = measure(*m)
            for other, m in loaded.items():  # each against live forwards again: a stall during one profile shows
                if remeasured(m, progress):
                    figures[other] = measure(*m)
            best = pick(figures)
            for other in [n for n in loaded if n != best]:
                del loaded[other]
            gc.collect()
    if not loaded:
        raise NoBackend(f"no backend can run {path}")
    name = next(iter(loaded))
    record = {"backend": name, "figures": figures}
    if costs.busy > busy_before:
        say("the machine was busy while the backends were compared (other processes took CPU time, or ran a live "
            "forward slower than a cached figure): this choice is not cached, and the next start compares them again",
            progress)
    elif len(loaders) > 1:  # also when only one could run the file: the others need not be tried again
        keep_record("backend-choice", key, record)
    why = describe(record)
    if len(figures) > 1:
        say(f"{name} runs {path.name} fastest here: {why}", progress)
    return Choice(name, loaded[name], why, record, key)


def recheck(choice: Choice, target, draft=None, progress: bool = True) -> None:
    """After a cached choice's models loaded: their cost curves as the auto policy will read them (cached, checked
    against a few live forwards: costs.profile_model). A curve measured again (its cached figure more than 2x
    slower than the live forwards) replaces the winner's figures in the record, so the start-up line and the next
    comparison read true ones. The choice itself stands: the winner only got faster. (The choice's own measurement
    checks every candidate against live forwards before it compares them: `choose`.)"""
    record = choice.record or {}
    if choice.backend not in (record.get("figures") or {}):
        return
    t_curve, t_src = profile_model(_model(target), progress=progress)
    d_curve, d_src = profile_model(_model(draft), progress=progress) if draft is not None else (None, "cache")
    if "measured" not in (t_src, d_src) or choice.key is None:
        return
    figures = dict(record["figures"], **{choice.backend: figures_of(
        t_curve, d_curve, _model(target), _model(draft) if draft is not None else None,
        getattr(target, "tokenizer", None))})
    keep_record("backend-choice", choice.key, {"backend": choice.backend, "figures": figures})
    choice.why = describe({"figures": figures})


def describe(record: dict) -> str:
    """One line: each candidate's predicted rate and what it rests on."""
    parts = []
    for name, f in (record.get("figures") or {}).items():
        spec = f.get("speculative")
        parts.append(f"{name} {f['rate']:.1f} tok/s (t(1) {_t(f, 1) * 1e3:.1f} ms, t(4) {_t(f, 4) * 1e3:.1f} ms"
                     + (f", best chain {spec:.1f} tok/s at the {f.get('acceptance')} acceptance" if spec else "")
                     + ")")
    return ", ".join(parts)


def _t(figures: dict, n: int) -> float:
    curve = figures["target"]
    return float(CostCurve.from_measurements(curve["sizes"], curve["times"])(n))


def _model(loaded):
    return getattr(loaded, "model", loaded)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"
