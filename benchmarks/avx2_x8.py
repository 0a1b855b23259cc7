"""The AVX2 layouts of 8 interleaved rows (x8, q4_K x8, q6_K x8: kernels/gguf_mm.cpp) against the file's row
layout, on an AVX2-only build.

Why a build of its own: the production build is compiled with -march=native, so on an AVX-512 host (Zen 4) even its
AVX2 code is compiled with 32 vector registers and AVX-512 encodings, which an AVX2-only CPU (Zen 3) does not have.
Here the same sources are compiled with `-march=x86-64-v3 -mtune=znver3` (AVX2, FMA, F16C: no AVX-512, so no VNNI
code is defined either) and loaded beside the native build under their own operator namespace
(torch.ops.arborspec_kernels_avx2), as build.emulated_library does for SIMDe. Timings on an AVX-512 host are a proxy
for an AVX2-only one: the same instructions, another core.

(a) `--part matrices`: the 0.5B draft's matrix shapes (all 24 layers' copies of a shape in turn, so they stream from
    memory as in a step; the head once), for each 32-block type and M, the row layout and x8 timed in the same rounds
    (each matrix's best call over the rounds, summed), next to a streaming read of the x8 bytes (the memory floor).
(b) `--part drafts`: whole-model forwards d(n) (`tuning.costs.measure_forward_cost`, n-node tree after a 200-token
    prefix) of GGUF drafts loaded on the AVX2 build, each twice (32-blocks in the row layout / in x8), and of the 1.5B
    target, interleaved over rounds, fastest round kept.
(c) `--part target --target PATH.gguf [--sizes 1,4,8]`: the target's t(n), its K-quants in the file's rows, with
    Q4_K in x8 (the layouts before q6_K x8), and with both in x8, interleaved over rounds, fastest round kept.
(d) `--part bench ARGS`: `arborspec bench ARGS` with every native model on the AVX2-only build, end to end (the
    Zen 3 proxy; `--methods ar,auto`: llama.cpp's own build is not AVX2-only).

Usage: python benchmarks/avx2_x8.py --part matrices [--types q4_0,iq4_nl,q5_0,q8_0] [--sizes 1,4,8] [--rounds 5]
       python benchmarks/avx2_x8.py --part drafts --drafts PATH.gguf,... [--target PATH.gguf] [--rounds 5]
           [--heads 0,65536]
       python benchmarks/avx2_x8.py --part target --target PATH.gguf [--sizes 1,4,8] [--rounds 5]
       python benchmarks/avx2_x8.py --part bench --backend native --methods ar,auto [other `arborspec bench` flags]
Prints markdown tables (ratios are what to compare: absolute times move with the shared host's state).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.kernels.blocks: random GGUF blocks

from arborspec.console import run_command
from arborspec.core.host import this_cpu  # noqa: E402
from arborspec.kernels import QuantMatrix, matrix as matrix_module  # noqa: E402
from arborspec.kernels.build import HERE, Kernels, build_dir, compile_extension  # noqa: E402
from tests.kernels.blocks import random_blocks  # noqa: E402

NAMESPACE = "arborspec_kernels_avx2"
TYPES = {"q4_0": QT.Q4_0, "iq4_nl": QT.IQ4_NL, "q5_0": QT.Q5_0, "q8_0": QT.Q8_0}
# the 0.5B draft's products, (n outputs, k inputs, how many of them a step runs): q / o, k / v, gate / up, down, head
SHAPES = [(896, 896, 24), (128, 896, 24), (4864, 896, 24), (896, 4864, 24), (151936, 896, 1)]


@functools.cache
def avx2_library() -> Kernels:
    """The kernels compiled for an AVX2-only CPU (no AVX-512 instructions, 16 vector registers)."""
    compile_extension(NAMESPACE, build_dir() / "avx2-only", ["-O3", "-march=x86-64-v3", "-mtune=znver3", "-fopenmp",
                                                            f"-DARB_OPS={NAMESPACE}", "-Darborspec=arborspec_avx2"])
    kernels = Kernels(NAMESPACE)
    assert kernels.isa == "avx2", kernels.isa
    return kernels


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matrices(types: list[str], sizes: list[int], rounds: int) -> str:
    kernels = avx2_library()
    lines = ["| type | shape (n x k) x count | M | rows ms | x8 ms | rows / x8 | x8 / memory floor |",
             "|---|---|---|---|---|---|---|"]
    totals = []
    for name in types:
        qtype = TYPES[name]
        rng = np.random.default_rng(0)
        groups = []
        for n, k, count in SHAPES:
            raw = [random_blocks(qtype, n, k, rng) for _ in range(count)]
            groups.append(((n, k, count), {
                "rows": [QuantMatrix(r, qtype, n, k, pack=False, kernels=kernels) for r in raw],
                "x8": [QuantMatrix(r, qtype, n, k, kernels=kernels) for r in raw]}))
            assert groups[-1][1]["x8"][0].layout == kernels.layouts[f"{name}_rows8"]
        best: dict = {}
        for _ in range(rounds):
            for shape, mats in groups:
                for m in [0, *sizes]:  # 0: a streaming read of the x8 bytes
                    for layout in ("rows", "x8") if m else ("x8",):
                        x = torch.randn(max(m, 1), shape[1])
                        if m:
                            times = [_timed(lambda: mat(x)) for mat in mats[layout]]
                        else:
                            times = [_timed(lambda: kernels.ops.stream_sum(mat.data)) for mat in mats[layout]]
                        key = (shape, m, layout)
                        best[key] = [min(a, b) for a, b in zip(best.get(key, times), times)]
        whole = {}
        for shape, _ in groups:
            floor = sum(best[shape, 0, "x8"])
            for m in sizes:
                rows, x8 = sum(best[shape, m, "rows"]), sum(best[shape, m, "x8"])
                whole.setdefault(m, [0.0, 0.0, 0.0])
                whole[m] = [whole[m][0] + rows, whole[m][1] + x8, whole[m][2] + floor]
                lines.append(f"| {name} | {shape[0]}x{shape[1]} x {shape[2]} | {m} | {rows * 1e3:.2f} | "
                             f"{x8 * 1e3:.2f} | {rows / x8:.2f} | {x8 / floor:.2f} |")
        for m, (rows, x8, floor) in whole.items():
            totals.append(f"| {name} | {m} | {rows * 1e3:.1f} | {rows / whole[sizes[0]][0]:.2f} | {x8 * 1e3:.1f} | "
                          f"{x8 / whole[sizes[0]][1]:.2f} | {rows / x8:.2f} | {rows / floor:.2f} | {x8 / floor:.2f} |")
        del groups
    head = ["| type | M | rows ms | rows t(M)/t(1) | x8 ms | x8 t(M)/t(1) | rows / x8 | rows / floor | x8 / floor |",
            "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(["All of a step's products (the shapes below, summed):", "", *head, *totals, "",
                      "Per shape:", "", *lines])


@contextlib.contextmanager
def on_avx2_build(rows: tuple = ()):
    """Within: native models load and run on the AVX2-only build (products and step); the GGUF types in `rows` keep
    the file's row layout (what ran before their 8-row layouts). Everything is put back on leaving."""
    from arborspec.backends import native_step
    kernels = avx2_library()
    original_layout = QuantMatrix._layout

    def layout(self, pack, isa):
        chosen = original_layout(self, pack, isa)
        return int(self.qtype) if self.qtype in rows else chosen

    saved = (matrix_module._kernels, native_step.Step.__init__.__defaults__, QuantMatrix._layout)
    matrix_module._kernels = lambda: kernels
    native_step.Step.__init__.__defaults__ = (NAMESPACE,)
    QuantMatrix._layout = layout
    try:
        yield
    finally:
        matrix_module._kernels, native_step.Step.__init__.__defaults__, QuantMatrix._layout = saved


def load_on_avx2(path: str, rows: tuple = (), head: int = 0):
    """A GGUF model on the native backend, its products on the AVX2-only build (`on_avx2_build`); `head` > 0 prunes
    its head to that many tokens (tuning/draft_levers.prune_native_draft: what `auto` runs as "+vocabK")."""
    from arborspec.loading import load_model
    from arborspec.tuning.draft_levers import prune_native_draft
    with on_avx2_build(rows):
        loaded = load_model(path, backend="native", progress=False)
        return (prune_native_draft(loaded, head, progress=False) if head else loaded).model


def drafts(paths: list[str], target: str | None, rounds: int, heads: list[int]) -> str:
    from arborspec.tuning.costs import measure_forward_cost
    models = {}
    if target:
        models["target " + Path(target).name] = load_on_avx2(target)
    for path in paths:
        for x8 in (False, True):
            for head in heads:
                name = f"{Path(path).name}{f' +vocab{head}' if head else ''} {'x8' if x8 else 'rows'}"
                models[name] = load_on_avx2(path, () if x8 else matrix_module.ROWS8_TYPES, head)
    runs = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            time.sleep(0.3)
            runs[name].append(measure_forward_cost(model, [1, 4], prefix=200, repeats=3))
    fastest = {name: [min(r[i] for r in rs) for i in range(2)] for name, rs in runs.items()}
    t1 = fastest[next(iter(models))][0] if target else None
    lines = ["| model | d(1) ms | d(4) ms | d(4)/d(1) |" + (" d(1)/t(1) |" if t1 else ""),
             "|---|---|---|---|" + ("---|" if t1 else "")]
    for name, (one, four) in fastest.items():
        lines.append(f"| {name} | {one * 1e3:.2f} | {four * 1e3:.2f} | {four / one:.2f} |"
                     + (f" {one / t1:.3f} |" if t1 else ""))
    return "\n".join(lines)


def target(path: str, sizes: list[int], rounds: int) -> str:
    """The target's t(n) with its K-quants in the file's rows, with Q4_K in x8 (the layouts before q6_K x8), and with
    both in x8: which of its extra rows the 8-row layouts make cheaper."""
    from arborspec.tuning.costs import measure_forward_cost
    variants = {"Q4_K, Q6_K rows": (QT.Q4_K, QT.Q6_K), "Q4_K x8, Q6_K rows": (QT.Q6_K,), "Q4_K x8, Q6_K x8": ()}
    models = {name: load_on_avx2(path, rows) for name, rows in variants.items()}
    runs = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            time.sleep(0.3)
            runs[name].append(measure_forward_cost(model, sizes, prefix=200, repeats=3))
    lines = ["| layouts | " + " | ".join(f"t({n}) ms" for n in sizes) + " | "
             + " | ".join(f"t({n})/t(1)" for n in sizes[1:]) + " |", "|---" * (2 * len(sizes)) + "|"]
    for name, rs in runs.items():
        best = [min(r[i] for r in rs) for i in range(len(sizes))]
        lines.append(f"| {name} | " + " | ".join(f"{t * 1e3:.1f}" for t in best) + " | "
                     + " | ".join(f"{t / best[0]:.2f}" for t in best[1:]) + " |")
    return "\n".join(lines)


def bench(bench_args: list[str]) -> int:
    """`arborspec bench` with every native model's products and step on the AVX2-only build. Its cost profiles,
    draft choice and calibrations go to a cache of their own (cache_dir()/avx2-proxy: the build key, which keys
    them, is the same for both builds), its models, lean drafts and data are the real cache's (linked)."""
    from arborspec.cli import main as cli_main
    from arborspec.core.disk_cache import cache_dir
    real = cache_dir()
    proxy = real / "avx2-proxy"
    proxy.mkdir(parents=True, exist_ok=True)
    for sub in ("models", "drafts", "vocab", "datasets", "kernels", "downloads"):
        if (real / sub).exists() and not (proxy / sub).exists():
            (proxy / sub).symlink_to(real / sub)
    os.environ["ARBORSPEC_CACHE"] = str(proxy)
    with on_avx2_build():
        return cli_main(["bench", *bench_args])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("matrices", "drafts", "target", "bench"), required=True)
    parser.add_argument("--types", default="q4_0,iq4_nl,q5_0,q8_0")
    parser.add_argument("--sizes", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--drafts", default="")
    parser.add_argument("--target", default=None)
    parser.add_argument("--heads", default="0", help="drafts' head sizes (0: the whole vocabulary)")
    args, rest = parser.parse_known_args()
    if args.part == "bench":
        sys.exit(bench(rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    print(f"host: {this_cpu().describe()}, "
          f"{torch.get_num_threads()} threads, build {NAMESPACE} ({HERE.name}, -march=x86-64-v3)\n")
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.part == "matrices":
        print(matrices(args.types.split(","), sizes, args.rounds))
    elif args.part == "target":
        if not args.target:
            parser.error("--part target needs --target PATH.gguf")
        print(target(args.target, sizes, args.rounds))
    else:
        print(drafts([p for p in args.drafts.split(",") if p], args.target, args.rounds,
                     [int(h) for h in args.heads.split(",")]))


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
