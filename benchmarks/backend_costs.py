"""Whole-model verification cost t(n) of one GGUF on two backends, measured interleaved: native vs llama.cpp.

t(n) is one forward over an n-node tree (a complete binary tree after a 200-token prefix, as `arborspec profile`
measures it), the median over rounds that alternate the backends so both see the same machine state.

Usage: python benchmarks/backend_costs.py [--model ALIAS|PATH.gguf] [--sizes 1,2,...] [--rounds 3]
           [--out results/native/costs.json] [--figure docs/figures/native_costs.png]
Prints a markdown table: t(n) in ms, t(n)/t(1) per backend, and native's t(n) over llama.cpp's t(1).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from arborspec.models.loading import load_model
from arborspec.plotting import pyplot, save_figure
from arborspec.profile import measure_forward_cost

BACKENDS = ("native", "llamacpp")


def measure(model_name: str, sizes: list[int], rounds: int) -> dict:
    models = {b: load_model(model_name, backend=b, progress=False).model for b in BACKENDS}
    runs = {b: [] for b in BACKENDS}
    for _ in range(rounds):
        for b in BACKENDS:
            runs[b].append(measure_forward_cost(models[b], sizes, prefix=200, repeats=3))
    return {"model": model_name, "sizes": sizes, "rounds": rounds,
            "ms": {b: [1e3 * statistics.median(r[i] for r in runs[b]) for i in range(len(sizes))] for b in BACKENDS}}


def markdown(result: dict) -> str:
    sizes, ms = result["sizes"], result["ms"]
    base = ms["llamacpp"][0]
    lines = ["| n | native ms | native t(n)/t(1) | llama.cpp ms | llama.cpp t(n)/t(1) | native t(n) / llama.cpp t(1) |",
             "|---|---|---|---|---|---|"]
    for i, n in enumerate(sizes):
        lines.append(f"| {n} | {ms['native'][i]:.1f} | {ms['native'][i] / ms['native'][0]:.2f} | "
                     f"{ms['llamacpp'][i]:.1f} | {ms['llamacpp'][i] / base:.2f} | {ms['native'][i] / base:.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    base = result["ms"]["llamacpp"][0]
    for b, style in zip(BACKENDS, ("o-", "s--")):
        ax.plot(result["sizes"], [t / base for t in result["ms"][b]], style, label=b)
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
    main()
