"""A commit's native kernels against the working tree's, paired in one process.

Why in one process: this host's memory moves between a fast and a slow state within minutes (the 1.5B target's t(1)
16 against 22-28 ms), more than most kernel changes move a forward, so two builds timed in turn by two processes
compare two states. Here the commit's `kernels/*.cpp` are compiled under their own operator namespace
(torch.classes.arborspec_kernels_base, as kernels/build.emulated_library loads SIMDe's build beside the native one),
both builds get a step over the same model's blocks, and one session alternates them every `--forwards` forwards at
each size n (an n-token complete binary tree after a `--prefix`-token prompt, each forward committed and the context
cut back, as tuning/costs.measure_forward_cost does). Each round gives a paired ratio per n; their median is the
figure to quote (session 21: changes of 1-4% were read from 30-40 rounds, where alternating processes gave noise).

Usage: python benchmarks/kernels_ab.py [--base HEAD] [--model qwen2.5-coder-0.5b] [--quant iq4_nl] [--vocab 65536]
           [--sizes 1,4] [--rounds 30] [--forwards 16] [--prefix 200]
`--quant none --vocab 0` times the model's own file (the target: `--model qwen2.5-coder-1.5b --quant none --vocab 0
--sizes 1,16`). Prints a markdown table with the host; the working tree's build is "new", the commit's "base".
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time

from arborspec.backends import make_session, native_step
from arborspec.console import run_command
from arborspec.core.disk_cache import cache_dir
from arborspec.core.host import this_cpu
from arborspec.kernels.build import HERE, SOURCES, compile_extension, prune_builds
from arborspec.loading import load_model
from arborspec.tuning.costs import full_tree
from arborspec.tuning.draft_choice import variant

NAMESPACE = "arborspec_kernels_base"


def build_base(rev: str) -> None:
    """The kernels' sources at `rev`, compiled as the native build is, under NAMESPACE."""
    repo = HERE.parents[2]
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", rev], capture_output=True, text=True, check=True)
    folder = cache_dir() / "kernels-ab" / sha.stdout.strip()[:16]
    sources = folder / "src"
    sources.mkdir(parents=True, exist_ok=True)
    for path in [*SOURCES, *HERE.glob("*.h")]:
        relative = path.relative_to(repo).as_posix()
        text = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{relative}"], capture_output=True, check=True)
        (sources / path.name).write_bytes(text.stdout)
    compile_extension(NAMESPACE, folder, ["-O3", "-march=native", "-fopenmp", f"-DARB_OPS={NAMESPACE}",
                                          "-Darborspec=arborspec_base"], sources=[sources / p.name for p in SOURCES])
    prune_builds(folder)  # the baselines built before, as the native builds are


def time_forwards(session, context: list[int], n: int, count: int, rng: random.Random, vocab: int) -> list[float]:
    """Seconds of `count` forwards of an n-token tree, each committed (its root) and the context then cut back."""
    prefix, times = len(context), []
    for _ in range(count):
        tree = full_tree(n, context[-1], [rng.randrange(vocab) for _ in range(max(n - 1, 1))])
        start = time.perf_counter()
        session.forward(context, tree, list(range(len(tree))))
        times.append(time.perf_counter() - start)
        session.commit([0])
        context.append(rng.randrange(vocab))
    del context[prefix:]
    session.truncate(prefix - 1)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the commit whose kernels are the baseline")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--quant", default="iq4_nl", help="the lean variant's block type, or none")
    parser.add_argument("--vocab", type=int, default=65536, help="the pruned head's size (0: the whole head)")
    parser.add_argument("--sizes", default="1,4")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--forwards", type=int, default=16, help="forwards per build, size and round")
    parser.add_argument("--prefix", type=int, default=200)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    build_base(args.base)
    loaded = variant(load_model(args.model, backend="native", progress=False), args.quant, args.vocab, progress=False)
    forward = loaded.model.forward
    steps = {"new": forward.step, "base": native_step.Step(forward, ops=NAMESPACE)}
    vocab = steps["new"].vocab
    rng = random.Random(0)
    context = [rng.randrange(vocab) for _ in range(args.prefix)]
    session = make_session(loaded.model, "target")
    session.prefill(context[:-1])
    times = {(side, n): [] for side in steps for n in sizes}
    ratios = {n: [] for n in sizes}
    for round_ in range(args.rounds):
        medians = {}
        for side in (["base", "new"] if round_ % 2 == 0 else ["new", "base"]):
            forward.step = session.step = steps[side]
            for n in sizes:
                got = time_forwards(session, context, n, args.forwards, rng, vocab)
                times[side, n] += got
                medians[side, n] = statistics.median(got)
        for n in sizes:
            ratios[n].append(medians["new", n] / medians["base", n])

    print(f"host: {this_cpu().describe()}; {args.model} ({args.quant}, head {args.vocab or 'whole'}), "
          f"{args.prefix}-token prefix, {args.rounds} rounds of {args.forwards} forwards; base {args.base}\n")
    print("| n | base median ms (fastest) | new median ms (fastest) | new / base, median of paired rounds |")
    print("|---|---|---|---|")
    for n in sizes:
        cells = [f"{statistics.median(times[side, n]) * 1e3:.2f} ({min(times[side, n]) * 1e3:.2f})"
                 for side in ("base", "new")]
        print(f"| {n} | {cells[0]} | {cells[1]} | {statistics.median(ratios[n]):.3f} |")


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
