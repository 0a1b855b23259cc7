"""arborspec's GGUF kernels against this machine's rooflines, per layer shape of a model and M = 1..32 rows.

For every distinct (tensor kind, block type, shape) of the model's matrices (all layers of a kind together, as one
decoding step runs them) and every M, the kernels' time (each matrix's best call over R rounds, summed), next to
  - the memory roofline: the time of a streaming read (`stream_sum`, on torch's threads) of the matrices' own bytes,
    timed as the kernels are (each matrix's best over the rounds), what M = 1 cannot beat (a streaming read of 1 GiB
    is reported beside it: calls of a few MB in turn read faster than one read of 1 GiB on a Zen 4 host);
  - the compute roofline: M x multiply-adds / the measured u8 x s8 multiply-add rate (`multiply_add_loop`:
    independent chains of the one instruction every kernel is built on), what large M cannot beat.
The whole-model line sums every matrix (the linear layers and the output head: what the kernels do in a step).

`--isa avx2` times the AVX2 code on a host whose build runs AVX-512 VNNI (the matrices in the layouts the AVX2 code
reads), for the two side by side; the rooflines are the machine's either way (VNNI's 64 multiply-adds an instruction
where the build has it).

Usage: python benchmarks/kernel_shapes.py [--model PATH.gguf] [--sizes 1,2,...] [--repeats 5] [--isa avx2]
       [--out results/kernels]
Writes kernels.json and kernels.md into --out and a plot (docs/figures/kernels.png by default).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
import torch

from arborspec.console import run_command
from arborspec.core.host import this_cpu
from arborspec.kernels import QuantMatrix, supported
from arborspec.kernels.build import library
from arborspec.viz.canvas import pyplot, save_figure

SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)


def bandwidth(repeats: int = 5) -> float:
    """Bytes per second of a streaming read of 1 GiB (best of `repeats`)."""
    buf = torch.ones(1 << 30, dtype=torch.uint8)
    best = min(_timed(lambda: library().ops.stream_sum(buf)) for _ in range(repeats))
    return buf.numel() / best


def multiply_add_rate(repeats: int = 3, iterations: int = 5_000_000) -> float:
    """u8 x s8 multiply-adds per second on all of torch's threads (8 chains a thread of the widest instruction the
    build has: 64 products each for vpdpbusd, 32 for vpmaddubsw)."""
    best = min(_timed(lambda: library().ops.multiply_add_loop(iterations)) for _ in range(repeats))
    return iterations * 8 * library().ops.multiply_add_width() * torch.get_num_threads() / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load_groups(path: Path, isa: str | None = None) -> dict[str, list[QuantMatrix]]:
    """The model's 2-D weights the kernels cover (the embedding table excepted: it is looked up, not multiplied),
    grouped by kind, type and shape: 'ffn_down Q6_K 1536x8960' -> its matrices over all layers; laid out for the
    build's best code, or for `isa`'s."""
    reader = gguf.GGUFReader(str(path))
    groups: dict[str, list[QuantMatrix]] = defaultdict(list)
    for t in reader.tensors:
        if len(t.shape) != 2 or t.name == "token_embd.weight" or not supported(t.tensor_type):
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0]
        matrix = QuantMatrix(np.array(t.data), t.tensor_type, n, k, isa=isa)
        groups[f"{kind} {t.tensor_type.name} {n}x{k}"].append(matrix)
    return dict(groups)


def time_calls(mats: list[QuantMatrix], m: int) -> list[float]:
    """Seconds of one call of each matrix of a group on m rows, the matrices in turn (a group larger than the caches
    streams from memory, as in a decoding step)."""
    xs = {mat.k: torch.randn(m, mat.k) for mat in mats}
    return [_timed(lambda: mat(xs[mat.k])) for mat in mats]


def stream_calls(mats: list[QuantMatrix]) -> list[float]:
    """Seconds of a streaming read (`stream_sum`) of each matrix's bytes, the matrices in turn: the memory floor of
    exactly those bytes, read in the same order and the same way as the kernels read them."""
    return [_timed(lambda: library().ops.stream_sum(mat.data)) for mat in mats]


def time_group(mats: list[QuantMatrix], m: int, repeats: int) -> float:
    """Seconds to apply every matrix of a group to m rows: each matrix's best of `repeats` calls, summed."""
    time_calls(mats, m)  # warm up (first touch of the activations, the thread pool)
    best = time_calls(mats, m)
    for _ in range(repeats - 1):
        best = [min(a, b) for a, b in zip(best, time_calls(mats, m))]
    return sum(best)


def measure(path: Path, sizes, repeats: int, isa: str | None = None) -> dict:
    """Every group and M, `repeats` rounds over all of them; each matrix call is timed alone and its best round kept.
    Why rounds and per-call bests: on a shared machine another process takes a core (or the memory bus) for spells of
    milliseconds to seconds, which spoil a whole row when its repeats run back to back; spread over rounds, a spell
    spoils one round, and the best call of each matrix is what a quiet machine gives. The rooflines are measured in
    every round too, best kept."""
    groups = load_groups(path, isa)
    best: dict[tuple[str, int], list[float]] = {}
    bw = rate = 0.0
    for _ in range(repeats):
        bw, rate = max(bw, bandwidth(repeats=1)), max(rate, multiply_add_rate(repeats=1))
        for name, mats in groups.items():
            for m in [0, *sizes]:  # 0: the streaming read of the group's bytes (its memory roofline)
                times = stream_calls(mats) if m == 0 else time_calls(mats, m)
                best[name, m] = [min(a, b) for a, b in zip(best.get((name, m), times), times)]
    rows = []
    for name, mats in groups.items():
        nbytes = sum(m.nbytes for m in mats)
        macs = sum(m.n * m.k for m in mats)
        for m in sizes:
            rows.append({"group": name, "matrices": len(mats), "bytes": nbytes, "m": m, "seconds": sum(best[name, m]),
                         "memory_roofline": sum(best[name, 0]), "compute_roofline": m * macs / rate})
    return {"model": str(path), "bandwidth_GBps": bw / 1e9, "multiply_add_G_per_s": rate / 1e9,
            "threads": torch.get_num_threads(), "isa": isa or library().isa, "cpu": this_cpu().describe(),
            "rows": rows}


def totals(result: dict) -> dict[int, dict[str, float]]:
    """Per M: the whole model's kernel time and rooflines (sums over groups)."""
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in result["rows"]:
        for key in ("seconds", "memory_roofline", "compute_roofline"):
            out[r["m"]][key] += r[key]
    return {m: dict(v) for m, v in sorted(out.items())}


def markdown(result: dict, command: str) -> str:
    tot = totals(result)
    one = tot[min(tot)]["seconds"]
    lines = [f"# arborspec kernels on {result['cpu']} ({result['isa']}, {result['threads']} threads)", "",
             f"`{command}`", "",
             f"Measured read bandwidth (1 GiB) {result['bandwidth_GBps']:.1f} GB/s; u8 x s8 multiply-add rate "
             f"{result['multiply_add_G_per_s']:.0f} G/s. Model: `{result['model']}`.", "",
             "## Whole model (every linear layer and the head)", "",
             "| M | kernels ms | t(M)/t(1) | memory roofline ms | compute roofline ms | x max(rooflines) |",
             "|---|---|---|---|---|---|"]
    for m, v in tot.items():
        bound = max(v["memory_roofline"], v["compute_roofline"])
        lines.append(f"| {m} | {v['seconds'] * 1e3:.1f} | {v['seconds'] / one:.2f} | {v['memory_roofline'] * 1e3:.1f} "
                     f"| {v['compute_roofline'] * 1e3:.1f} | {v['seconds'] / bound:.2f} |")
    lines += ["", "## Per layer shape (all layers of a kind together)", "",
              "| group | matrices | MB | M | ms | memory roofline ms | compute roofline ms |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['group']} | {r['matrices']} | {r['bytes'] / 1e6:.0f} | {r['m']} | {r['seconds'] * 1e3:.2f} "
                     f"| {r['memory_roofline'] * 1e3:.2f} | {r['compute_roofline'] * 1e3:.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    tot = totals(result)
    ms = list(tot)
    left.plot(ms, [tot[m]["seconds"] * 1e3 for m in ms], "o-", label="arborspec kernels")
    left.plot(ms, [tot[m]["memory_roofline"] * 1e3 for m in ms], "--", label="memory roofline")
    left.plot(ms, [tot[m]["compute_roofline"] * 1e3 for m in ms], ":", label="compute roofline")
    left.set(xlabel="rows M (tokens verified together)", ylabel="ms per step (all matrices)",
             title="whole model: kernels vs rooflines")
    left.legend()
    by_group: dict[str, dict[int, float]] = defaultdict(dict)
    for r in result["rows"]:
        by_group[r["group"]][r["m"]] = r["seconds"] / max(r["memory_roofline"], r["compute_roofline"])
    for name, series in by_group.items():
        right.plot(list(series), list(series.values()), "o-", ms=3, label=name)
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xlabel="rows M", ylabel="time / max(memory, compute roofline)", title="per layer shape: distance to roofline")
    right.legend(fontsize=7)
    fig.suptitle(f"{Path(result['model']).name} on {result['cpu']} ({result['isa']}, {result['threads']} threads)")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default target's)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--isa", default=None, choices=["avx2"],
                        help="time this path's code instead of the build's best (its layouts; the same build)")
    parser.add_argument("--out", default="results/kernels")
    parser.add_argument("--figure", default="docs/figures/kernels.png")
    args = parser.parse_args()
    if args.model is None:
        from arborspec.loading.aliases import alias_gguf
        args.model = str(alias_gguf("qwen2.5-coder-1.5b"))
    result = measure(Path(args.model), [int(s) for s in args.sizes.split(",")], args.repeats, args.isa)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(result, indent=1))
    command = "python benchmarks/kernel_shapes.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if k != "model" and v is not None)
    (out / "kernels.md").write_text(markdown(result, command))
    plot(result, Path(args.figure))
    print(markdown(result, command).split("## Per layer")[0])


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
