"""Whole-model verification cost t(n) of one GGUF on two backends, measured interleaved: native vs llama.cpp.

t(n) is one forward over an n-node tree (a complete binary tree after a 200-token prefix, as `arborspec profile`
measures it), the median over rounds that alternate the backends so both see the same machine state. The native
backend is timed three ways in the same rounds: its sessions (the C++ step, kernels/forward.cpp), the Python forward
it replaced (backends/native_forward.py through hf.TreeSession, kept as the reference), and its kernels alone (every
matrix product of one forward, called as the step calls them, on random activations), so the table says where a
forward's time goes: the kernels, and everything else (attention, norms, rotary, the cache, Python).

Usage: python benchmarks/backend_costs.py [--model ALIAS|PATH.gguf] [--sizes 1,2,...] [--rounds 3]
           [--out results/native/costs.json] [--figure docs/figures/native_costs.png]
Prints a markdown table: t(n) in ms, t(n)/t(1) per backend, and native's t(n) over llama.cpp's t(1); then the time
outside the kernels per extra verified row and native's t(1) over its kernels' (issue 33's goals: <= 0.5 ms a row for
the target, <= 1.15x for the draft), stored in the JSON too ("outside_ms", "outside_ms_per_row", "t1_over_kernels").
Those take each timer's fastest round (interference on the shared host only ever adds time: single rounds ran up to
1.4x slow, which the median of a few rounds does not always absorb), and the per-row figure is the least-squares
slope of the outside time over n.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from arborspec.backends.hf import TreeSession
from arborspec.console import run_command
from arborspec.core.host import this_cpu
from arborspec.kernels.build import library
from arborspec.loading import load_model
from arborspec.tuning.costs import measure_forward_cost
from arborspec.viz.canvas import pyplot, save_figure

BACKENDS = ("native", "llamacpp")


def measure(model_name: str, sizes: list[int], rounds: int) -> dict:
    models = {b: load_model(model_name, backend=b, progress=False).model for b in BACKENDS}
    native = models["native"]
    timers = {"native": lambda: measure_forward_cost(native, sizes, prefix=200, repeats=3),
              "kernels": lambda: [kernel_seconds(native, n) for n in sizes],  # right after native: paired
              "native-python": lambda: measure_forward_cost(native, sizes, prefix=200, repeats=3,
                                                            new_session=TreeSession),
              "llamacpp": lambda: measure_forward_cost(models["llamacpp"], sizes, prefix=200, repeats=3)}
    runs = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            time.sleep(0.5)  # the previous timer's threads (torch's or llama.cpp's pool) stop spinning first
            runs[name].append(timer())
    result = {"model": model_name, "sizes": sizes, "rounds": rounds, "cpu": this_cpu().describe(), "isa": library().isa,
              "threads": torch.get_num_threads(),
              "ms": {b: [1e3 * statistics.median(r[i] for r in runs[b]) for i in range(len(sizes))] for b in runs}}
    result["rounds_ms"] = {b: [[1e3 * t for t in r] for r in runs[b]] for b in ("native", "kernels")}  # every round
    return {**result, **summary(sizes, runs["native"], runs["kernels"])}


def summary(sizes: list[int], native: list[list[float]], kernels: list[list[float]]) -> dict:
    """From each round's native and kernel seconds per size: the time outside the kernels per size (ms, the fastest
    round's native time less the fastest round's kernel time), its least-squares slope over n (ms per extra row), and
    t(1) / kernels' t(1), fastest rounds again."""
    fastest = lambda runs, i: min(r[i] for r in runs)  # noqa: E731
    outside = [1e3 * (fastest(native, i) - fastest(kernels, i)) for i in range(len(sizes))]
    mean_n, mean_o = statistics.fmean(sizes), statistics.fmean(outside)
    var = sum((n - mean_n) ** 2 for n in sizes)
    slope = sum((n - mean_n) * (o - mean_o) for n, o in zip(sizes, outside)) / var if var else float("nan")
    ratio = fastest(native, 0) / fastest(kernels, 0)
    return {"outside_ms": outside, "outside_ms_per_row": slope, "t1_over_kernels": ratio}


def kernel_seconds(model, m: int, repeats: int = 3) -> float:
    """The native model's matrix products of one forward over m rows (every layer's q/k/v, o, gate/up and down, and
    the head), as the step calls them, on random activations: best of `repeats`."""
    fast = model.forward
    products = [p for layer in fast.layers for p in (*layer.qkv, layer.o, *layer.gate_up, layer.down)] + [fast.head]
    x = {k: torch.randn(m, k) for k in {p.matrix.k for p in products}}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for p in products:
            p.matrix(x[p.matrix.k])
        best = min(best, time.perf_counter() - start)
    return best


def markdown(result: dict) -> str:
    sizes, ms = result["sizes"], result["ms"]
    base = ms["llamacpp"][0]
    lines = ["| n | native ms | t(n)/t(1) | kernels ms | outside the kernels ms (fastest rounds) | Python forward ms | llama.cpp ms | "
             "llama.cpp t(n)/t(1) | native t(n) / llama.cpp t(1) |", "|---|---|---|---|---|---|---|---|---|"]
    for i, n in enumerate(sizes):
        nat, kern = ms["native"][i], ms["kernels"][i]
        lines.append(f"| {n} | {nat:.1f} | {nat / ms['native'][0]:.2f} | {kern:.1f} | {result['outside_ms'][i]:.1f} | "
                     f"{ms['native-python'][i]:.1f} | {ms['llamacpp'][i]:.1f} | {ms['llamacpp'][i] / base:.2f} | "
                     f"{nat / base:.2f} |")
    lines.append(f"\noutside the kernels per extra row: {result['outside_ms_per_row']:.2f} ms (least squares over n); "
                 f"native t({sizes[0]}) / kernels t({sizes[0]}): {result['t1_over_kernels']:.2f}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    base = result["ms"]["llamacpp"][0]
    for b, style in (("native", "o-"), ("native-python", "^-."), ("llamacpp", "s--")):
        label = {"native": "native (C++ step)", "native-python": "native, Python forward"}.get(b, b)
        ax.plot(result["sizes"], [t / base for t in result["ms"][b]], style, label=label)
    ax.plot(result["sizes"], result["sizes"], ":", color="grey", label="n separate tokens")
    ax.set(xlabel="tree size n (tokens verified in one forward)", ylabel="t(n) / llama.cpp's t(1)",
           title=f"verification cost, {Path(result['model']).name}")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--sizes", default="1,2,3,4,6,8,12,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/native/costs.json")
    parser.add_argument("--figure", default="docs/figures/native_costs.png")
    args = parser.parse_args()
    result = measure(args.model, [int(s) for s in args.sizes.split(",")], args.rounds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    plot(result, Path(args.figure))
    print(markdown(result))


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
