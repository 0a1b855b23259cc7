"""Block sparsity of the tree attention mask under different token orders (DySpec App. C, Table 5 / Fig. 9).

A block-sparse attention kernel skips all-zero b x b tiles of the mask, so the number of non-zero tiles is the work.
Rows are the tree's nodes, columns the committed prefix plus the tree; every node sees the whole prefix and its own
ancestors (`arborspec.core.tree.block_count`). We count tiles for

* random trees (each new node hangs under a uniformly chosen earlier node: Table 5's "random tree structure"), and
* DySpec-like trees: DySpec Alg. 1 run on a synthetic draft whose next-token distributions mix confident and flat
  ones (Fig. 9's "real workload" trees came from the real model pair),

laid out in their original (creation) order, BFS, DFS and heavy-path order, for sizes 256-1024, tiles of 32 and 64,
and prefixes of 0 (Table 5 counts the tree part only) and 128 / 512 tokens (Fig. 9 varies the prefix; the paper's
prompts are 128 tokens). Each cell is the mean over `--seeds` trees.

    python benchmarks/block_sparsity.py [--sizes 256,512,768,1024] [--seeds 5] [--prefixes 0,128,512] [--json F]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time

import torch

from arborspec.console import run_command
from arborspec.core.options import parse_int_list
from arborspec.core.sampling import SamplingConfig
from arborspec.core.tree import ORDERS, TokenTree, block_count
from arborspec.drafting import POLICIES, DraftContext


def random_tree(n: int, seed: int) -> TokenTree:
    rng = random.Random(seed)
    tree = TokenTree.root(0)
    for i in range(1, n):
        tree.add(rng.randrange(i), rng.randrange(1000))
    return tree


class SyntheticDraft:
    """A stand-in draft session: next-token logits are a seeded function of the path. Each context draws its own
    sharpness, so some positions are confident (one dominant token) and others flat, as with real models."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed
        self.forwards = 0

    def forward(self, context, tree, nodes):
        rows = []
        for node in nodes:
            key = repr((self.seed, tuple(tree.tokens[i] for i in tree.path(node))))
            g = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(),
                                                             "little") & (2**62 - 1))
            sharp = float(torch.empty(()).uniform_(0.5, 6.0, generator=g))
            rows.append(torch.randn(self.vocab, generator=g) * sharp)
        self.forwards += 1
        return torch.stack(rows)


def dyspec_tree(n: int, seed: int, vocab: int = 64) -> TokenTree:
    policy = POLICIES["dyspec"](budget=n - 1)
    ctx = DraftContext(SyntheticDraft(vocab, seed), [0], SamplingConfig(0.0), None, max_depth=n)
    return policy.draft(ctx)


def original_order(tree: TokenTree) -> list[int]:
    return list(range(len(tree)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,512,768,1024")
    ap.add_argument("--blocks", default="32,64")
    ap.add_argument("--prefixes", default="0,128,512")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the rows here (read by `arborspec report --reproduction`)")
    args = ap.parse_args(argv)
    sizes, blocks = parse_int_list(args.sizes, "--sizes"), parse_int_list(args.blocks, "--blocks")
    prefixes = [int(x) for x in args.prefixes.split(",") if x.strip().isdigit()]  # 0 is a prefix too
    if len(prefixes) != len(args.prefixes.split(",")):
        raise ValueError(f"--prefixes must be a comma-separated list of integers >= 0, got {args.prefixes!r}")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    orders = {"original": original_order, **ORDERS}
    t0 = time.time()
    rows = []
    print("| tree | nodes | depth | prefix | block | " + " | ".join(orders) + " | original/dfs | bfs/dfs |")
    print("|---|---:|---:|---:|---:|" + "---:|" * (len(orders) + 2))
    for kind, build in (("random", random_tree), ("dyspec", dyspec_tree)):
        for n in sizes:
            trees = [build(n, seed) for seed in range(args.seeds)]
            permuted = {name: [t.permute(fn(t)) for t in trees] for name, fn in orders.items()}
            depth = statistics.mean(t.depth for t in trees)
            for prefix in prefixes:
                for b in blocks:
                    mean = {name: statistics.mean(block_count(t, prefix, b) for t in ts) for name, ts in permuted.items()}
                    rows.append(dict(tree=kind, nodes=n, depth=depth, prefix=prefix, block=b, tiles=mean))
                    cells = " | ".join(f"{mean[name]:.1f}" for name in orders)
                    print(f"| {kind} | {n} | {depth:.1f} | {prefix} | {b} | {cells} | "
                          f"{mean['original'] / mean['dfs']:.2f}x | {mean['bfs'] / mean['dfs']:.2f}x |", flush=True)
    print(f"\n({args.seeds} trees per row, {time.time() - t0:.0f}s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(args=vars(args), rows=rows, seconds=time.time() - t0), fh, indent=1)


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
