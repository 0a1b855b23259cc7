"""Which draft variant to run (`--draft-quant auto`, the CLI default): chosen by measurement on this machine.

A quantized draft is cheaper per call but agrees less often with the target; which wins depends on the CPU, the
thread count and the pair, so arborspec measures instead of guessing. For every variant (a PyTorch draft: bf16 as
loaded, int8, and int4 when torchao is installed; a GGUF draft on the native backend: its file as it is and its lean
IQ4_NL copy (tuning/gguf_requant.py; `AUTO_LEAN_TYPES`), and each of those with its head pruned to the `HEAD_SIZES`
most frequent tokens) it measures

- the draft's cost curve d(w) (one call over w tree nodes, cached per model fingerprint), every variant in the same
  rounds (`costs.profile_together`),
- top-1 agreement a (draft argmax == target argmax) and top-4 coverage, teacher-forced on a fixed reference text
  (tuning/agreement.py: one chain forward of each model through its sessions, no generation),

and scores it by the best chain it would allow. With per-position agreement a (treated as independent), a chain of
depth k commits 1 + a + a^2 + ... + a^k tokens per step and costs k draft calls plus one target forward over k + 1
tokens, so

    score = max over k = 1..16 of (1 - a^(k+1)) / (1 - a) / (k * d(1) + t(k + 1))      [tokens per second]

with t(n) the target's profiled cost. A variant is a quantization and a head size (`label`: "q4_0",
"q4_0+vocab49152"); the one with the highest score is the default; the whole record (curves, agreement, scores, the
choice) is cached beside the cost profiles under the pair's key, and `arborspec profile --pair` prints and plots it.
"""
from __future__ import annotations

import copy
import math
import sys
import time

import torch

from ..backends.native import is_native, read_header
from ..core.disk_cache import keep_record, read_record
from ..core.options import is_whole
from ..core.sampling import is_real
from ..viz.canvas import pyplot, save_figure
from .agreement import agreement_with, fitting, reference_ids, target_choices
from .costs import CostCurve, native_profile_key, profile_key, profile_model, profile_together
from .draft_levers import (
    HEAD_CORPUS,
    QUANT_MODES,
    TORCHAO_HINT,
    lean_native_draft,
    prepare_draft,
    prune_native_draft,
)
from .gguf_requant import lean_types

MAX_CHAIN = 16
# Head sizes a native draft is measured with (each type with the whole head and with each of these). The 0.5B
# draft's 151936-row head is 77 MB of the ~280 MB its 4-bit files read a token. Its ids are ranked by chat and code
# counts (draft_levers.corpus_counts). With that ranking, the IQ4_NL draft's top-1 agreement on the
# reference text / on held-out source files was 0.898 / 0.685 with the whole head, 0.898 / 0.679 at 65536 rows
# (33 MB), 0.896 / 0.673 at 49152 (25 MB), 0.896 / 0.663 at 32768 (17 MB), against the shipped draft's 0.906 / 0.702
# (Zen 4, 2026-11-27, benchmarks/draft_variants.py --held-out). 32768 falls more than 3 points below the shipped draft
# on held-out code, so the two measured are 65536 and 49152.
HEAD_SIZES = (65536, 49152)
# The lean types `auto` measures for a native draft. Q4_0 is left to `--draft-quant q4_0` / `+q4_0`: its greedy top-1
# agreement with the target falls 3.9 points below the shipped draft's on held-out source files (IQ4_NL: 1.7; the
# bound the lean draft was built to stay within is 3), while the 490 positions of the reference text that `auto`
# scores on (a standard error of ~1.4 points) showed it only 2.2 below, so `auto` could prefer it wherever it is the
# cheaper (AVX2: 13% below IQ4_NL's d(1)). Its pruned heads fell 5.1 points below (Zen 4, 2026-11-27,
# benchmarks/draft_variants.py --held-out). Six variants instead of nine also cut the first profile of the pair.
AUTO_LEAN_TYPES = ("iq4_nl",)


def label(quant: str, vocab: int = 0) -> str:
    """A variant's name, in the method grammar's lever spelling: "q4_0", "q4_0+vocab32768", "vocab32768"."""
    if not vocab:
        return quant
    return f"vocab{vocab}" if quant == "none" else f"{quant}+vocab{vocab}"


def head_sizes(vocab: int) -> list[int]:
    """The pruned head sizes worth measuring for a native draft of `vocab` tokens: those under half of it."""
    return [k for k in HEAD_SIZES if 2 * k <= vocab]


def chain_score(a: float, d1: float, t) -> tuple[float, int]:
    """(tokens per second, depth) of the best chain under per-position agreement `a` (see the module docstring)."""
    best = (1.0 / t(1), 0)
    for k in range(1, MAX_CHAIN + 1):
        tokens = sum(a**i for i in range(k + 1))
        best = max(best, (tokens / (k * d1 + t(k + 1)), k))
    return best


def available_variants(native: bool = False) -> list[str]:
    """The variants `auto` measures on this installation. A native GGUF draft: as it is, and each of
    `AUTO_LEAN_TYPES` the kernels cover. A PyTorch draft: int4 needs the optional torchao (imported only here and in
    `draft_levers.quantize`: it is slow to import and may be absent)."""
    if native:
        return ["none", *(kind for kind in lean_types() if kind in AUTO_LEAN_TYPES)]
    try:
        import torchao  # noqa: F401
    except ImportError:
        return [q for q in QUANT_MODES if q != "int4"]
    return list(QUANT_MODES)


def measure_variants(target, draft, progress: bool = True, **profile_kw) -> dict:
    """Measure every available variant of `draft` (LoadedModel, left unchanged) against `target`; the record.
    All variants' cost curves are measured in the same rounds (`costs.profile_together`), so the choice compares
    figures taken in one machine state. `profile_kw` (sizes, prefix, repeats) goes to `costs.profile_model` /
    `profile_together`. The target's curve is read as cached (measured if absent), also for a refresh:
    `arborspec profile --pair --refresh` has just measured it, and measuring it twice printed one curve and kept
    another."""
    native = is_native(draft.model)
    t_curve, _ = profile_model(target.model, progress=progress, **profile_kw)
    texts = fitting(reference_ids(target.tokenizer), target.model, draft.model)
    with torch.inference_mode():
        choices = target_choices(target.model, texts)
    variants, prepared = {}, {}

    def prepare(quant: str, vocab: int, make) -> None:  # the variant's model and agreement (its entry waits for costs)
        if progress:
            print(f"[arborspec] measuring the {label(quant, vocab)} draft ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        loaded = make()
        with torch.inference_mode():
            measured = agreement_with(choices, loaded.model, texts)
        prepared[label(quant, vocab)] = loaded
        variants[label(quant, vocab)] = dict(quant=quant, vocab=vocab, agreement=measured.top1,
                                             coverage4=measured.cover, prepare_seconds=time.perf_counter() - start)

    def cost_together(names: list[str]) -> None:  # their curves from the same rounds, and the scores they give
        curves = profile_together([prepared[n].model for n in names], progress=progress, **profile_kw)
        for name, d_curve in zip(names, curves):
            score, depth = chain_score(variants[name]["agreement"], d_curve(1), t_curve)
            variants[name].update(draft_sizes=list(d_curve.sizes), draft_times=list(d_curve.times), score=score,
                                  best_chain=depth)

    for quant in available_variants(native):
        try:
            prepare(quant, 0, lambda: variant(draft, quant, progress=progress))
        except Exception as err:  # e.g. a model whose own forward cannot run a quantized head: not a candidate
            if quant == "none":
                raise
            variants[quant] = dict(quant=quant, vocab=0, unavailable=f"{type(err).__name__}: {err}")
    if native:  # each quantization's file with its head pruned too (sharing every other weight with the file)
        for quant in list(prepared):
            for vocab in head_sizes(draft.model.config.vocab_size):
                prepare(quant, vocab, lambda: prune_native_draft(prepared[quant], vocab, progress=progress))
    cost_together(list(prepared))
    if not native and "int4" not in variants:
        variants["int4"] = dict(quant="int4", vocab=0, unavailable=TORCHAO_HINT)
    return dict(choice=best_variant(variants), variants=variants, target_sizes=list(t_curve.sizes),
                target_times=list(t_curve.times), positions=sum(len(t) - 1 for t in texts))


def best_variant(variants: dict, full_head: bool = False) -> str:
    """The label of the measured variant with the best score (`full_head`: among those with the whole head)."""
    scored = [name for name, v in variants.items() if "score" in v and not (full_head and v["vocab"])]
    return max(scored, key=lambda name: variants[name]["score"])


def variant(draft, quant: str, vocab: int = 0, progress: bool = True):
    """`draft` (LoadedModel) as variant (`quant`, `vocab`), `draft` itself untouched: a quantized copy of a PyTorch
    draft, or the lean requantized file of a native one (sharing nothing with it), its head then pruned to the
    `vocab` most frequent tokens."""
    if is_native(draft.model):
        lean = draft if quant == "none" else lean_native_draft(draft, quant, progress=progress)
        return prune_native_draft(lean, vocab, progress=progress) if vocab else lean
    if quant == "none" and not vocab:
        return draft
    return prepare_draft(copy.deepcopy(draft), quant, vocab, progress=progress)


def choose_draft_quant(target, draft, progress: bool = True, refresh: bool = False,
                       **profile_kw) -> tuple[str, dict, str]:
    """(label, record, source): the measured best variant for this pair on this machine (its quantization and head
    size: `record["variants"][label]["quant"]` / `["vocab"]`), from the cache when the pair, dtype, thread count,
    machine and library versions are unchanged ('cache'), else measured ('measured')."""
    native = is_native(draft.model)
    key = choice_key(profile_key(target.model), profile_key(draft.model), native, draft.model.config.vocab_size)
    record = None if refresh else read_record("draft-quant", key)
    if usable(record, key):
        return record["choice"], record, "cache"
    record = measure_variants(target, draft, progress=progress, **profile_kw)
    keep_record("draft-quant", key, record)
    return record["choice"], record, "measured"


def choice_key(target_key: dict, draft_key: dict, native: bool, vocab: int) -> dict:
    """What a cached choice is filed under: both models' profile keys and the variants measured."""
    return {"target": target_key, "draft": draft_key, "variants": available_variants(native),
            "heads": head_sizes(vocab) if native else [], "head_corpus": HEAD_CORPUS}


def cached_native_choice(target_file, draft_file) -> tuple[str, dict] | None:
    """(label, record) of the choice cached for a GGUF pair on the native backend, as choose_draft_quant reads it,
    found from the files' headers before either model is loaded (None if none is cached): a start that will run the
    lean file loads it alone, not the shipped file first."""
    (t_info, _), (d_info, d_config) = read_header(target_file), read_header(draft_file)
    key = choice_key(native_profile_key(t_info), native_profile_key(d_info), True, d_config.vocab_size)
    record = read_record("draft-quant", key)
    return (record["choice"], record) if usable(record, key) else None


def usable(record, key: dict) -> bool:
    """Whether a cached record is whole: a chosen variant it measured, each variant one of those `key` names with a
    head size it names, and finite figures. A damaged one (edited, truncated by hand) is measured again: its fields
    were read unchecked (tracebacks, "unknown draft quantization" blaming a flag never given, a corpus fetched for a
    negative head size)."""
    try:
        variants = record["variants"]
        if not (isinstance(record["choice"], str) and "unavailable" not in variants[record["choice"]]
                and _curve(record["target_sizes"], record["target_times"])):
            return False
        measured = [v for v in variants.values() if "unavailable" not in v]  # int4 without torchao: a note
        return all(v["quant"] in key["variants"] and (v["vocab"] == 0 or v["vocab"] in key["heads"])
                   and _curve(v["draft_sizes"], v["draft_times"]) and is_whole(v["best_chain"])
                   and all(is_real(v[f]) and math.isfinite(v[f]) for f in ("agreement", "coverage4", "score"))
                   for v in measured)
    except (KeyError, TypeError, AttributeError):
        return False


def _curve(sizes, times) -> bool:
    """Sizes and their times, as a cost curve takes them."""
    try:
        CostCurve.from_measurements(sizes, times)
    except (TypeError, ValueError):
        return False
    return True


def describe(record: dict) -> list[str]:
    """Table rows: one line per variant, side by side; d(1) / t(1) (a drafted token's price in target tokens) and
    d(4) / d(1) (what a tree's extra rows cost) are the figures the lean drafts were built to bring down."""
    t1 = dict(zip(record["target_sizes"], record["target_times"])).get(1)
    rows = [f"{'variant':>17} {'d(1) ms':>8} {'d(1)/t(1)':>9} {'d(4)/d(1)':>9} {'d(32) ms':>9} {'top-1 agree':>11} "
            f"{'top-4 cover':>11} {'best chain':>10} {'est. tok/s':>10}"]
    for quant, v in record["variants"].items():
        if "unavailable" in v:
            rows.append(f"{quant:>17}  unavailable: {v['unavailable']}")
            continue
        d = dict(zip(v["draft_sizes"], v["draft_times"]))
        ms = lambda n: f"{d[n] * 1e3:.1f}" if n in d else "-"  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}" if a is not None and b else "-"  # noqa: E731
        mark = "  <- default" if quant == record["choice"] else ""
        rows.append(f"{quant:>17} {ms(1):>8} {ratio(d.get(1), t1):>9} {ratio(d.get(4), d.get(1)):>9} {ms(32):>9} "
                    f"{v['agreement']:11.3f} {v['coverage4']:11.3f} {v['best_chain']:10d} {v['score']:10.2f}{mark}")
    return rows


def plot_variants(record: dict, out: str, title: str = "") -> str:
    """Draft cost curves of every variant beside the target's, and agreement vs. cost per drafted token."""
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(10, 4))
    ax1.plot(record["target_sizes"], [t * 1e3 for t in record["target_times"]], "k-o", label="target t(n)")
    for quant, v in record["variants"].items():
        if "unavailable" in v:
            continue
        ax1.plot(v["draft_sizes"], [t * 1e3 for t in v["draft_times"]], "-o", label=f"draft {quant} d(n)")
        ax2.scatter(v["draft_times"][0] * 1e3, v["agreement"], s=40)
        ax2.annotate(f"{quant} (top-4 {v['coverage4']:.2f})", (v["draft_times"][0] * 1e3, v["agreement"]),
                     fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("tokens per call n")
    ax1.set_ylabel("ms per call")
    ax1.legend(fontsize=8)
    ax1.set_title(title or "draft variants: cost per call")
    ax2.set_xlabel("draft ms per token, d(1)")
    ax2.set_ylabel("top-1 agreement with the target")
    ax2.set_title(f"default: {record['choice']}")
    return save_figure(fig, out, dpi=120)
