"""The tables both reports show, computed from a results.json alone: one row per method (x budget) for each dataset
and temperature (`tables`), per category where a dataset has several (`category_tables`).

report.py renders them as report.md, figures.py plots them, reproduction.py sets them beside the papers' numbers.
A row's numbers are defined in report.py's glossary and docs/benchmarks.md; the formulas are in metrics.py.
"""
from __future__ import annotations

from collections import defaultdict

from ..core.tree import SOURCES
from ..runspec import split_label
from . import metrics

BASELINES = ("ar", "hf-assisted", "llamacpp-ar")  # each row's speed-up is over these, run in the same benchmark


def fmt(x, digits: int = 2, scale: float = 1.0) -> str:
    """A table cell: `x` (times `scale`) to `digits` decimals, or a dash for a missing value."""
    return "–" if x is None else f"{x * scale:.{digits}f}"


def _label_order(results: dict, labels) -> list[str]:
    methods = (results.get("settings") or {}).get("methods", [])

    def key(label: str):
        stem, budget = split_label(label)
        index = next((i for i, m in enumerate(methods) if m in (label, stem)), len(methods))
        return (index, stem, -1 if budget is None else budget)

    return sorted(set(labels), key=key)


def depth_cell(shares: list[float], depths: int = 3) -> str:
    """Acceptance at depths 1..3 as one compact cell, "0.81/0.62/0.45" (fewer where the trees were shallower)."""
    return "/".join(f"{x:.2f}" for x in shares[:depths]) or "–"


def root_cell(root: tuple[float, float] | None) -> str:
    """Measured root acceptance and its optimum, "0.71 / 0.78"."""
    return "–" if root is None else f"{root[0]:.2f} / {root[1]:.2f}"


def summarize(runs: list[dict], baselines: dict[str, list[dict]]) -> dict:
    """One table row from the runs of one method/budget (all prompts of one dataset and temperature)."""
    ok = [r for r in runs if not r.get("error")]
    committed = [n for r in ok for n in r["committed_per_step"]]
    has_drafts = [r for r in ok if r.get("drafted_per_step")]
    tps = metrics.median_iqr(r["tokens_per_s"] for r in ok if r.get("tokens_per_s") is not None)
    verifiers = sorted({r.get("verifier") or "?" for r in ok})
    return dict(
        runs=len(runs), errors=len(runs) - len(ok), verifier="/".join(verifiers), lossy=any(r.get("lossy") for r in runs),
        mat=metrics.mat(committed),
        accepted=metrics.mean_accepted_drafted([n for r in ok for n in r["accepted_per_step"]]),
        acceptance_rate=metrics.acceptance_rate([n for r in has_drafts for n in r["accepted_per_step"]],
                                                [n for r in has_drafts for n in r["drafted_per_step"]]),
        tree_size=metrics.mean(n for r in has_drafts for n in r["drafted_per_step"]),
        **acceptance_profile(has_drafts),
        tps=tps, speedup={b: metrics.speedup(ok, base) if base else None for b, base in baselines.items()},
        ttft=metrics.mean(r.get("ttft") for r in ok), tpot=metrics.mean(r.get("tpot") for r in ok),
        perplexity=metrics.pooled_perplexity((r.get("perplexity"), r.get("new_tokens")) for r in ok),
        peak_rss=max((r["peak_rss_mb"] for r in runs if r.get("peak_rss_mb") is not None), default=None),
        rss_delta=metrics.mean(r.get("rss_delta_mb") for r in ok),
        new_tokens=metrics.mean(r.get("new_tokens") for r in ok),
        sources=source_profile(ok),
        time=time_profile(ok),
    )


def time_profile(runs: list[dict]) -> dict | None:
    """Where the decoding time went, pooled over the runs that timed their steps (the engine's; not the peers'):
    prefill per run, then per step the draft's calls, the target's verification and the rest (sampling, tree
    building, bookkeeping: the wall time less the other three), each also as a share of the time after the prefill.
    None where no run timed its steps."""
    have = [r for r in runs if r.get("t_draft") is not None and r.get("t_verify") is not None and r.get("steps")]
    if not have:
        return None
    total = lambda key: sum(r.get(key) or 0.0 for r in have)  # noqa: E731
    prefill, draft, verify, wall = total("t_prefill"), total("t_draft"), total("t_verify"), total("wall")
    steps = sum(r["steps"] for r in have)
    rest = max(wall - prefill - draft - verify, 0.0)
    decode = draft + verify + rest
    share = lambda x: x / decode if decode > 0 else None  # noqa: E731
    return dict(prefill_ms=1000 * prefill / len(have), draft_ms=1000 * draft / steps, verify_ms=1000 * verify / steps,
                rest_ms=1000 * rest / steps, draft_share=share(draft), verify_share=share(verify),
                rest_share=share(rest))


def source_profile(runs: list[dict]) -> dict[str, dict] | None:
    """metrics.by_source over the runs that recorded their sources; None where none did (baselines, older runs)."""
    have = [r for r in runs if r.get("sources") is not None]
    if not have:
        return None
    return metrics.by_source([r["sources"] for r in have], sum(len(r["committed_per_step"]) for r in have))


def acceptance_profile(runs: list[dict]) -> dict:
    """How the drafted steps of `runs` were accepted, pooled over their steps: acceptance at each depth, the
    zero-accept share, and (measured, optimum) root acceptance; None / [] where the runs did not record them (runs
    made before these fields existed, baselines)."""
    steps = [r for r in runs if r.get("depth_per_step") is not None]
    accepted = [a for r in steps for a in r["accepted_per_step"]]
    optimum = [o for r in steps for o in r.get("root_optimum_per_step") or [None] * len(r["accepted_per_step"])]
    return dict(
        acc_at_depth=metrics.accepted_at_depth(accepted, [d for r in steps for d in r["depth_per_step"]]),
        zero_accept=metrics.zero_accept_share(accepted, [n for r in steps for n in r["drafted_per_step"]]),
        root=metrics.root_acceptance(accepted, optimum),
    )


def tables(results: dict) -> dict[tuple[str, float], dict[str, dict]]:
    """{(dataset, temperature): {label: row}}, labels in the order the methods were asked for."""
    groups: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in results["runs"]:
        groups[(r["dataset"], r["temperature"])][r["label"]].append(r)
    out = {}
    for key in sorted(groups):
        by_label = groups[key]
        baselines = {b: by_label.get(b, []) for b in BASELINES}
        out[key] = {label: summarize(by_label[label], baselines) for label in _label_order(results, by_label)}
    return out


def category_tables(results: dict) -> dict[tuple[str, float], dict[tuple[str, str], dict]]:
    """{(dataset, temperature): {(category, label): row}} for datasets whose prompts have several categories."""
    cats = defaultdict(set)
    for r in results["runs"]:
        cats[r["dataset"]].add(r.get("category"))
    groups: dict[tuple, dict[tuple, list]] = defaultdict(lambda: defaultdict(list))
    for r in results["runs"]:
        if len(cats[r["dataset"]] - {None}) > 1:
            groups[(r["dataset"], r["temperature"])][(r.get("category") or "–", r["label"])].append(r)
    out = {}
    for key in sorted(groups):
        g = groups[key]
        order = _label_order(results, {label for _, label in g})
        rows = {}
        for cat in sorted({c for c, _ in g}):
            base = {b: g.get((cat, b), []) for b in BASELINES}
            for label in order:
                if (cat, label) in g:
                    rows[(cat, label)] = summarize(g[(cat, label)], base)
        out[key] = rows
    return out


def ordered_sources(by_source: dict[str, dict]) -> list[tuple[str, dict]]:
    """A row's sources (summarize's `sources`) in tree.SOURCES order, any other source after them by name."""
    rank = {name: i for i, name in enumerate(SOURCES)}
    return sorted(by_source.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0]))


def resumed_lines(results: dict) -> list[str]:
    """One line per `--resume`: when, how many prompts were kept, and on which machine (a changed CPU shows here)."""
    out = [f"Resumed {r.get('at')} after {r.get('prompts_done')} prompts, on {r.get('env', {}).get('cpu', '?')} "
           f"({(r.get('env') or {}).get('threads', '?')} torch threads)." for r in results.get("resumed") or []]
    return out + [""] if out else []
