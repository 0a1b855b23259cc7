"""STree on this CPU: one packed tree pass vs every path unrolled (Fig. 3 / Table 1), and the runtime models (Fig. 2).

For Mamba2 configs the size of Mamba2-130M (d_model 768, 24 layers, state 128, head_dim 64, vocab 50280, tied
embeddings) and Mamba2-370M (d_model 1024, 48 layers), random weights, on a committed prefix of --prefix tokens:

* forward time (median of --repeats) and peak tensor memory of one target forward over
  - full binary trees of depth 4, 5, 6 (15 / 31 / 63 tokens: the paper's "4/5/6 layers"), and
  - beam trees: M beams x N steps (M tokens per layer; each token's parent is a random token of the layer above,
    seeded, as beam search keeps every generated token even when its beam later dies), 1 + M*N tokens,
  once packed (`ssm_tree="packed"`: one sequence, one state, the tree-masked scan) and once unrolled
  (`"unrolled"`: each root-to-leaf path is its own sequence in a batch, one state per path);
* the fitted runtime models: t(N) = k*N + C for Mamba2-130M and a*N^2 + b*N + c for a Bamba hybrid of the same
  width (24 layers, 4 of them attention, MLP 2048), N = 1..128 (`arborspec.tuning.costs`, `arborspec.tuning.runtime_model`).

Both modes use the same SSD math per sequence, so the difference is the packing alone, not a different kernel: the
unrolled batch recomputes shared prefixes once per path and, like any state-carrying scan (the paper's fused
selective scan), ends with one SSM state per path and layer, which it holds until commit. A third column runs the
unrolled batch without those per-path states (`path_states=False`), to separate the two costs.

Peak memory: the largest total size of live tensors allocated during the forward (a TorchDispatchMode tracks every
aten op's outputs until they are freed), weights and the committed state excluded; the CPU analogue of
torch.cuda.max_memory_allocated. It includes the logits (tokens x 50280) and, for the unrolled batch, the per-path
states it keeps.

Timing is noisy on a shared machine: the default is one torch thread (with two threads on two busy cores, the
numbers mostly measured thread hand-offs); pass --threads 2 on an idle machine.

    python benchmarks/stree_packed_vs_unrolled.py --quick           # 130M only, fewer trees, 1 repeat (~1 min)
    python benchmarks/stree_packed_vs_unrolled.py [--dtype bf16|fp32] [--repeats 3] [--configs 130m,370m] [--out F]
                                                                    # everything: ~7.5 min on this 2-core machine
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, BambaConfig, Mamba2Config

from arborspec.backends.ssm import SSMTreeSession
from arborspec.console import run_command
from arborspec.core.tree import TokenTree
from arborspec.tuning.costs import full_tree, measure_forward_cost
from arborspec.tuning.runtime_model import fit_runtime, required_tau_ratio

CONFIGS = {
    "130m": dict(hidden_size=768, num_hidden_layers=24),
    "370m": dict(hidden_size=1024, num_hidden_layers=48),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def mamba2(size: str, dtype) -> torch.nn.Module:
    c = CONFIGS[size]
    cfg = Mamba2Config(vocab_size=50280, state_size=128, head_dim=64, expand=2, n_groups=1,
                       num_heads=2 * c["hidden_size"] // 64, tie_word_embeddings=True, **c)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval().requires_grad_(False)


def hybrid(dtype) -> torch.nn.Module:
    cfg = BambaConfig(vocab_size=50280, hidden_size=768, num_hidden_layers=24, intermediate_size=2048,
                      num_attention_heads=12, num_key_value_heads=4, attn_layer_indices=[5, 11, 17, 23],
                      mamba_n_heads=24, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_expand=2,
                      tie_word_embeddings=True, pad_token_id=None)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval().requires_grad_(False)


def beam_tree(m: int, n: int, seed: int) -> TokenTree:
    rng = random.Random(seed)
    tree, layer = TokenTree.root(0), [0]
    for _ in range(n):
        parents = sorted(rng.choice(layer) for _ in range(m)) if layer != [0] else [0] * m
        layer = [tree.add(p, rng.randrange(50000)) for p in parents]
    return tree


def unrolled_cost(tree: TokenTree) -> tuple[int, int]:
    """(paths = states, tokens computed) when every root-to-leaf path is its own sequence."""
    has_child = set(tree.parents[1:])
    leaves = [i for i in range(len(tree)) if i not in has_child]
    return len(leaves), sum(tree.depths[i] + 1 for i in leaves)


class PeakMemory(TorchDispatchMode):
    """Peak bytes of live tensors allocated by aten ops inside the `with` block (storages deduplicated)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and storage.nbytes():
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def run_tree(session: SSMTreeSession, context: list[int], tree: TokenTree, repeats: int, rng) -> tuple[float, int]:
    """(median seconds, peak bytes) of forwards over `tree` rooted at the last committed token."""
    def once(measure=None):
        t = TokenTree.from_parents([context[-1]] + tree.tokens[1:], tree.parents)
        start = time.perf_counter()
        if measure is None:
            session.forward(context, t, list(range(len(t))))
        else:
            with measure:
                session.forward(context, t, list(range(len(t))))
        elapsed = time.perf_counter() - start
        session.commit([0])
        context.append(rng.randrange(50000))
        return elapsed

    once()  # warm-up
    times = [once() for _ in range(repeats)]
    mem = PeakMemory()
    once(mem)
    return statistics.median(times), mem.peak


def packed_vs_unrolled(size: str, dtype, trees: dict[str, TokenTree], prefix: int, repeats: int) -> list[dict]:
    t0 = time.perf_counter()
    model = mamba2(size, dtype)
    print(f"# Mamba2-{size}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters "
          f"(built in {time.perf_counter() - t0:.0f} s)", flush=True)
    rng = random.Random(0)
    rows = []
    sessions, contexts = {}, {}
    modes = {"packed": dict(ssm_tree="packed"), "unrolled": dict(ssm_tree="unrolled"),
             "unrolled_nostate": dict(ssm_tree="unrolled", path_states=False)}
    for mode, opts in modes.items():
        contexts[mode] = [rng.randrange(50000) for _ in range(prefix)]
        sessions[mode] = SSMTreeSession(model, **opts)
        sessions[mode].prefill(contexts[mode][:-1])
    print("| tree | tokens | unrolled paths (states) | unrolled tokens | packed ms | unrolled ms | speed-up "
          "| unrolled w/o path states ms | packed MiB | unrolled MiB | packed/unrolled memory |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name, tree in trees.items():
        paths, tokens = unrolled_cost(tree)
        res = {mode: run_tree(sessions[mode], contexts[mode], tree, repeats, rng) for mode in modes}
        row = dict(model=f"mamba2-{size}", tree=name, tokens=len(tree), paths=paths, unrolled_tokens=tokens,
                   packed_ms=res["packed"][0] * 1e3, unrolled_ms=res["unrolled"][0] * 1e3,
                   unrolled_nostate_ms=res["unrolled_nostate"][0] * 1e3,
                   packed_mib=res["packed"][1] / 2**20, unrolled_mib=res["unrolled"][1] / 2**20,
                   unrolled_nostate_mib=res["unrolled_nostate"][1] / 2**20)
        rows.append(row)
        print(f"| {name} | {len(tree)} | {paths} | {tokens} | {row['packed_ms']:.0f} | {row['unrolled_ms']:.0f} | "
              f"{row['unrolled_ms'] / row['packed_ms']:.2f}x | {row['unrolled_nostate_ms']:.0f} | "
              f"{row['packed_mib']:.1f} | {row['unrolled_mib']:.1f} | {row['packed_mib'] / row['unrolled_mib']:.2f} |",
              flush=True)
    del model, sessions
    return rows


def runtime_models(dtype, sizes: list[int], prefix: int, repeats: int) -> list[dict]:
    out = []
    for name, build, kind in [("mamba2-130m", lambda: mamba2("130m", dtype), "linear"),
                              ("bamba-hybrid-130m", lambda: hybrid(dtype), "quadratic")]:
        model = build()
        times = measure_forward_cost(model, sizes, prefix=prefix, repeats=repeats)
        fit = fit_runtime(sizes, times, kind)
        print(f"# runtime model {name}: {fit.describe()}")
        print("| N | " + " | ".join(str(n) for n in sizes) + " |\n|---|" + "---|" * len(sizes))
        print("| measured ms | " + " | ".join(f"{t * 1e3:.0f}" for t in times) + " |")
        print("| fit ms | " + " | ".join(f"{fit(n) * 1e3:.0f}" for n in sizes) + " |")
        bigger = [n for n in sizes if n > 5]
        print("| tau2/tau1 needed vs N1=5 | " + " | ".join(
            f"{required_tau_ratio(fit, 5, n):.2f}" if n > 5 else "-" for n in sizes) + " |", flush=True)
        out.append(dict(model=name, kind=kind, coeffs=fit.coeffs, sizes=sizes, times_ms=[t * 1e3 for t in times],
                        required_tau_ratio_vs_5={n: required_tau_ratio(fit, 5, n) for n in bigger}))
        del model
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="130M only, fewer trees and sizes, 1 repeat")
    p.add_argument("--configs", default="130m,370m")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefix", type=int, default=200)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine, 2 threads mostly measure contention)")
    p.add_argument("--no-fit", action="store_true", help="skip the runtime-model fits")
    p.add_argument("--out", default=None, help="write all numbers to this JSON file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    configs = ["130m"] if args.quick else args.configs.split(",")
    if unknown := [c for c in configs if c not in CONFIGS]:  # was a KeyError after the first config's minutes
        raise ValueError(f"--configs: unknown config {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    repeats = 1 if args.quick else args.repeats
    trees = {f"binary depth {d}": full_tree(2**d - 1, 0, list(range(7, 50007))) for d in (4, 5, 6)}
    beams = [(2, 4), (5, 4), (2, 16), (5, 16)] if args.quick else [(m, n) for n in (4, 8, 16) for m in (2, 3, 4, 5)]
    trees.update({f"beam M={m} N={n}": beam_tree(m, n, seed=m * 100 + n) for m, n in beams})
    sizes = [1, 2, 4, 8, 16, 32, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128]
    print(f"# dtype {args.dtype}, {torch.get_num_threads()} threads, prefix {args.prefix}, median of {repeats}")
    start = time.perf_counter()
    result = dict(dtype=args.dtype, threads=torch.get_num_threads(), prefix=args.prefix, repeats=repeats, trees=[])
    for size in configs:
        result["trees"] += packed_vs_unrolled(size, dtype, trees, args.prefix, repeats)
    if not args.no_fit:
        result["runtime_models"] = runtime_models(dtype, sizes, args.prefix, repeats)
    print(f"# total {time.perf_counter() - start:.0f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
