"""`arborspec bench --concurrency 1,2,4`: total throughput and per-request latency against requests decoded at once.

For each method (at each temperature) and each concurrency C, the benchmark's prompts run through
`SpeculativeDecoder.generate_batch(..., concurrency=C)` (arborspec/engine/many_prompts.py): C requests at once, the next prompt
joining when one finishes, a round = one step of each, and ONE target forward per round where the target batches
(the native backend; elsewhere the steps of a round run one after another). This is what the server's scheduler
runs, without HTTP in between (benchmarks/serve_load.py measures the live server).

Recorded per (method, temperature, C): the level's wall time, total throughput (new tokens of all requests over
that wall time), requests/s, per-request latency (from joining to the last token), TTFT and TPOT (median and p90),
tokens per step, and per request its tokens, which must equal its tokens at the lowest concurrency (batching is
exact per request; `same_tokens`). Written to OUT/concurrency.json, plotted to OUT/concurrency.png, printed as a
table with the speed-up over the lowest concurrency and over `ar` at the same concurrency.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..backends.batching import can_batch
from ..core.disk_cache import write_json
from ..core.options import parse_int_list
from ..runspec import build_decoder
from ..viz.canvas import grid, save_figure
from . import records
from .datasets import prompt_ids
from .runner import (
    SCHEMA,
    UNRECORDED,
    WARMUP_TOKENS,
    Bench,
    BenchSettings,
    Config,
    _configs,
    _prompts,
    check_settings,
    environment,
    load_models,
    run_from_args,
    settings_from_args,
    warm_up,
)


def run_concurrency(settings: BenchSettings, levels: list[int], models=None) -> Path:
    """Run the sweep; returns the path of concurrency.json. `models`: an already loaded (target, draft) pair."""
    check_settings(settings)  # a typo, a missing --prompt-file or an --out that cannot be made: before the loading
    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        with records.writing(settings.out):
            return _run(settings, sorted(set(levels)), models)
    finally:
        torch.set_num_threads(threads)


def _run(settings: BenchSettings, levels: list[int], models) -> Path:
    path = Path(settings.out) / "concurrency.json"
    if path.exists():  # under the lock; a second sweep into the same --out replaced the first, exit 0
        raise ValueError(f"--out {settings.out} holds a concurrency sweep already ({path.name}); choose another --out "
                         "or remove it")
    warnings: list[str] = []
    configs = []
    for cfg in _configs(settings, warnings):
        if cfg.spec.policy is None:  # transformers' / llama.cpp's own loops decode one request at a time
            warnings.append(f"{cfg.method} is a baseline with its own loop: not run at several concurrencies")
        else:
            configs.append(cfg)
    if not configs:
        raise ValueError("none of the methods can run batched: " + "; ".join(warnings))
    pair = models if models is not None else load_models(settings, configs)
    target, draft = pair
    bench = Bench(settings, target, draft)
    prompts = _prompts(settings, bench.tokenizer, warnings)
    ids = [prompt_ids(bench.tokenizer, p) for p in prompts]
    out_dir = Path(settings.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(settings, getattr(pair, "backends", ()))
    results = dict(schema=SCHEMA, command=settings.command, argv=list(sys.argv), env=env,
                   settings={k: v for k, v in asdict(settings).items() if k not in UNRECORDED}, levels=levels,
                   batched=can_batch(target.model), warnings=warnings,
                   prompts=[f"{p.dataset}/{p.id}" for p in prompts], levels_run=[])
    if settings.warmup:  # one that fails is left out, as the comparison does (it ended the sweep, nothing measured)
        warm = min(WARMUP_TOKENS, settings.max_new_tokens)
        for cfg, err in warm_up(configs, lambda cfg: decoder(bench, cfg).generate_batch(ids[:2], warm, concurrency=2)):
            warnings.append(f"skipping {cfg.label} at T={cfg.temperature}: {type(err).__name__}: {err}")
        if not configs:
            raise ValueError("every method failed its warm-up: " + "; ".join(warnings))
    seeds = [settings.seed + i for i in range(len(ids))]  # prompt i's seed, as in the bench's other runs
    for c in levels:
        for cfg in configs:
            level = run_level(bench, cfg, ids, seeds, c)
            results["levels_run"].append(level)
            print(describe(level), file=sys.stderr, flush=True)
            write_json(path, results)
    mark_same_tokens(results["levels_run"])
    write_json(path, results)
    plot(results, out_dir / "concurrency.png")
    print(format_table(results))
    return path


def decoder(bench: Bench, cfg: Config):
    s = bench.s
    return build_decoder(cfg.spec, bench.target, bench.draft_for(cfg.spec), temperature=cfg.temperature,
                         top_k=s.top_k, top_p=s.top_p, draft_temperature=s.draft_temperature, budget=cfg.budget)


def run_level(bench: Bench, cfg: Config, ids: list[list[int]], seeds: list[int], c: int) -> dict:
    """Every prompt through one configuration at concurrency `c`: the level's record."""
    rec = dict(label=cfg.label, method=cfg.method, temperature=cfg.temperature, concurrency=c, error=None)
    try:
        start = time.perf_counter()
        out = decoder(bench, cfg).generate_batch(ids, bench.s.max_new_tokens, seeds=seeds,
                                                 ignore_eos=bench.s.ignore_eos, concurrency=c)
        wall = time.perf_counter() - start
    except Exception as err:  # one failing configuration must not end the sweep
        rec["error"] = f"{type(err).__name__}: {err}"
        return rec
    requests = [dict(new_tokens=r.stats.new_tokens, latency_s=r.stats.t_total, ttft_s=r.stats.t_first_token,
                     tpot_s=r.stats.tpot, tokens_per_step=r.stats.tokens_per_step,
                     finish_reason=r.stats.finish_reason, token_ids=list(r.token_ids)) for r in out]
    tokens = sum(r["new_tokens"] for r in requests)
    rec.update(requests=len(requests), tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
               requests_per_s=len(requests) / wall,
               tokens_per_step=statistics.mean(r["tokens_per_step"] for r in requests), per_request=requests)
    for key in ("latency", "ttft", "tpot"):
        values = sorted(r[f"{key}_s"] for r in requests)
        rec[f"{key}_p50_s"], rec[f"{key}_p90_s"] = percentile(values, 0.5), percentile(values, 0.9)
    return rec


def percentile(sorted_values: list[float], q: float) -> float:
    """The value at quantile q of an ascending list, by nearest rank: the smallest value with at least q of the list
    at or below it (int(q * n) read one rank high: the p50 of [1, 2] was 2, the p90 of ten values their maximum)."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def mark_same_tokens(levels: list[dict]) -> None:
    """Per level: whether every request's tokens equal that request's tokens at the configuration's lowest
    concurrency (None for the lowest itself, or when either failed)."""
    lowest: dict[tuple, dict] = {}
    for level in sorted(levels, key=lambda lv: lv["concurrency"]):
        key = (level["label"], level["temperature"])
        base = lowest.setdefault(key, level)
        if base is level or level["error"] or base["error"]:
            level["same_tokens"] = None
            continue
        level["same_tokens"] = all(a["token_ids"] == b["token_ids"]
                                   for a, b in zip(level["per_request"], base["per_request"]))


def describe(level: dict) -> str:
    head = f"{level['label']} T={level['temperature']:g} c={level['concurrency']}"
    if level["error"]:
        return f"{head}: failed: {level['error']}"
    return (f"{head}: {level['tokens_per_s']:.1f} tok/s over {level['requests']} requests, latency p50 "
            f"{level['latency_p50_s']:.2f} s, TTFT p50 {level['ttft_p50_s']:.3f} s, TPOT p50 "
            f"{level['tpot_p50_s'] * 1000:.1f} ms, {level['tokens_per_step']:.2f} tokens/step")


def format_table(results: dict) -> str:
    """A markdown table: one row per (method, temperature, concurrency)."""
    ok = [lv for lv in results["levels_run"] if not lv["error"]]
    first = {}
    for lv in sorted(ok, key=lambda lv: lv["concurrency"]):
        first.setdefault((lv["label"], lv["temperature"]), lv)
    ar = {(lv["temperature"], lv["concurrency"]): lv for lv in ok if lv["method"] == "ar"}
    lines = ["| method | T | concurrency | tokens/s | x lowest c | x ar | latency p50 s | TTFT p50 s | TPOT p50 ms "
             "| tokens/step | same tokens |", "|" + "---|" * 11]
    for lv in sorted(ok, key=lambda lv: (lv["label"], lv["temperature"], lv["concurrency"])):
        base = first[(lv["label"], lv["temperature"])]
        plain = ar.get((lv["temperature"], lv["concurrency"]))
        vs_ar = f"{lv['tokens_per_s'] / plain['tokens_per_s']:.2f}" if plain else "-"
        same = {None: "-", True: "yes", False: "NO"}[lv.get("same_tokens")]
        lines.append(f"| {lv['label']} | {lv['temperature']:g} | {lv['concurrency']} | {lv['tokens_per_s']:.1f} | "
                     f"{lv['tokens_per_s'] / base['tokens_per_s']:.2f} | {vs_ar} | {lv['latency_p50_s']:.2f} | "
                     f"{lv['ttft_p50_s']:.3f} | {lv['tpot_p50_s'] * 1000:.1f} | {lv['tokens_per_step']:.2f} | {same} |")
    failed = [f"{lv['label']} T={lv['temperature']:g} c={lv['concurrency']}: {lv['error']}"
              for lv in results["levels_run"] if lv["error"]]
    return "\n".join(lines + [f"failed: {f}" for f in failed])


def plot(results: dict, path: Path) -> str | None:
    """Total tokens/s and per-request latency (p50) against concurrency, a line per method and temperature."""
    series: dict[str, list[dict]] = {}
    for lv in results["levels_run"]:
        if not lv["error"]:
            series.setdefault(f"{lv['label']} T={lv['temperature']:g}", []).append(lv)
    if not series:
        return None
    fig, (ax1, ax2) = grid(2, cols=2, width=5.5)
    for name, levels in series.items():
        levels.sort(key=lambda lv: lv["concurrency"])
        cs = [lv["concurrency"] for lv in levels]
        ax1.plot(cs, [lv["tokens_per_s"] for lv in levels], marker="o", label=name)
        ax2.plot(cs, [lv["latency_p50_s"] for lv in levels], marker="o", label=name)
    for ax, ylabel in ((ax1, "tokens/s, all requests"), (ax2, "request latency p50 (s)")):
        ax.set_xlabel("requests decoded at once")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(results["levels"], [str(c) for c in results["levels"]])
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    batched = "one target forward per round" if results["batched"] else "no batching: steps one after another"
    ax1.set_title(f"throughput; {batched}", fontsize=9)
    ax2.set_title(f"latency ({results['settings']['max_new_tokens']} new tokens max)", fontsize=9)
    return save_figure(fig, path)


def bench_from_args(args) -> int:
    """`arborspec bench`: the concurrency sweep with --concurrency, else the comparison of methods (runner.py)."""
    if args.concurrency is None:
        return run_from_args(args)
    if args.resume:
        raise ValueError("--resume carries on a comparison of methods; a --concurrency sweep runs whole")
    levels = list(parse_int_list(args.concurrency, "--concurrency"))
    path = run_concurrency(settings_from_args(args), levels)
    print(f"results: {path}")
    return 0
