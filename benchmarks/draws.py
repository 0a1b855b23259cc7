"""What a draft's draw costs: `arborspec.core.sampling.sample` against `torch.multinomial`, one thread.

Every sampled tree pays one draw per expanded node (DySpec: one per child; static, beam and the greedy multi-draft
rule: one set of children per node), so at T > 0 over the default pair's 152k-token vocabulary a multinomial's
exponential per token (3.1-3.4 ms a draw, Intel Xeon host, 2026-11-29) cost a 16-node DySpec tree ~50 ms, about a
step of the target. `sample` draws one token by inverse CDF on the cumulative sums, and distinct tokens from large
vocabularies by redrawing until new; this prints both, per vocabulary size and draw, in microseconds (the median of
`--repeats` calls), with the host.

    python benchmarks/draws.py [--vocabs 8,512,2048,32768,151936] [--repeats 200]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from arborspec.console import run_command
from arborspec.core.host import this_cpu
from arborspec.core.options import parse_int_list
from arborspec.core.sampling import sample

DRAWS = [(1, False), (2, False), (4, False), (2, True)]  # (tokens, with replacement)


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocabs", default="8,512,2048,32768,151936")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    vocabs = parse_int_list(args.vocabs, "--vocabs")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    torch.set_num_threads(1)
    print(f"host: {this_cpu().describe()}; one thread; median microseconds a call\n")
    print("| vocab | tokens | replacement | torch.multinomial | sample | ratio |")
    print("|---:|---:|---|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for vocab in vocabs:
        q = torch.softmax(torch.randn(vocab, generator=gen) * 3, 0)  # a draft row: a few likely tokens, a long tail
        for num, replacement in DRAWS:
            if num > vocab:
                continue
            torch_us = median_us(lambda: torch.multinomial(q, num, replacement=replacement, generator=gen),
                                 args.repeats)
            ours_us = median_us(lambda: sample(q, gen, num=num, replacement=replacement), args.repeats)
            print(f"| {vocab} | {num} | {'with' if replacement else 'without'} | {torch_us:.1f} | {ours_us:.1f} | "
                  f"{torch_us / ours_us:.1f}x |", flush=True)


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
