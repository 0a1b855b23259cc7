"""Tokens/step and tokens/s of the tree policies on the real model pair, against plain decoding (`ar`).

Every method decodes the same prompts greedily (T=0) and must reproduce `ar`'s tokens exactly (checked). The
defaults are sized for a 2-core CPU (WETAP's paper widths, 16-128 per layer over 8 layers, draft ~900 tokens per
step; here 4-16 over 6 layers); pass --methods to change the line-up and --max-new-tokens / --prompts to run larger.
Methods are named as for `arborspec bench` (arborspec/runspec.py); the draft runs unquantized unless a name says
otherwise (`+int8`).

    python benchmarks/policies.py [--max-new-tokens 64] [--methods 'dyspec@16,beam(steps=4,beams=3)']
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import sys

from arborspec import SpeculativeDecoder
from arborspec.console import run_command
from arborspec.loading.pair import DEFAULT_DRAFT, DEFAULT_DTYPE, DEFAULT_TARGET, load_pair
from arborspec.runspec import build_decoder, parse, split_methods

PROMPTS = [
    'def quicksort(arr):\n    """Sort a list of numbers in ascending order using quicksort."""\n',
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
    "class LinkedList:\n    def __init__(self):\n        self.head = None\n\n    def append(self, value):\n",
]

METHODS = ("ar,chain(k=5),static(depth=4,branch=2),dyspec@16,dyspec@32,dyspec(batch=false)@32,dyspec-threshold@32,"
           "dynatree,wetap(w_min=4,w_max=16,length=6)@32,beam(steps=4,beams=3),sequoia@32")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2, help=f"how many of the {len(PROMPTS)} built-in prompts")
    ap.add_argument("--methods", default=METHODS, help="comma-separated method names, as for `arborspec bench`")
    ap.add_argument("--token-order", default="bfs")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    if args.prompts < 1:  # checked, as the methods are, before the pair's minute of loading
        raise ValueError(f"--prompts must be at least 1, got {args.prompts}")
    methods = [parse(name, draft_quant="none") for name in split_methods(args.methods)]
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft = load_pair(args.target, args.draft, draft_quant="none", dtype=args.dtype)
    prompts = PROMPTS[: args.prompts]
    # warm-up (first calls allocate)
    SpeculativeDecoder(target, draft, method="chain", k=2).generate(prompts[0], max_new_tokens=4)
    reference: dict[int, list[int]] = {}
    rows = []
    print("| method | tokens/step | tokens/s | speed-up | tree size | draft calls/step | t_draft | t_verify | same as ar |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    ar_tps = None
    for method in methods:
        per = []
        for i, prompt in enumerate(prompts):
            dec = build_decoder(method, target, draft, token_order=args.token_order)
            res = dec.generate(prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True)
            if method.policy == "ar":
                reference[i] = res.token_ids
            per.append(res)
        st = [r.stats for r in per]
        new = sum(s.new_tokens for s in st)
        steps = sum(s.n_steps for s in st)
        decode = sum(s.decode_time for s in st)
        row = dict(
            method=method.name,
            tokens_per_step=new / steps,
            tokens_per_s=new / decode,
            tree_size=statistics.mean(x.tree_size for s in st for x in s.steps),
            draft_calls_per_step=sum(x.draft_calls for s in st for x in s.steps) / steps,
            t_draft=sum(x.t_draft for s in st for x in s.steps),
            t_verify=sum(x.t_verify for s in st for x in s.steps),
            same=all(r.token_ids == reference.get(i) for i, r in enumerate(per)) if reference else None,
        )
        if method.policy == "ar":
            ar_tps = row["tokens_per_s"]
        row["speedup"] = row["tokens_per_s"] / ar_tps if ar_tps else float("nan")
        rows.append(row)
        print(f"| {row['method']} | {row['tokens_per_step']:.2f} | {row['tokens_per_s']:.2f} | {row['speedup']:.2f}x | "
              f"{row['tree_size']:.1f} | {row['draft_calls_per_step']:.1f} | {row['t_draft']:.1f}s | "
              f"{row['t_verify']:.1f}s | {row['same']} |", flush=True)
    print(f"\n{args.target} / {args.draft}, {args.dtype}, T=0, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"token order {args.token_order}, torch threads {torch.get_num_threads()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    t0 = time.time()
    code = run_command(lambda _: main(), None)  # a bad value: one line and exit 2, as arborspec's own commands
    print(f"({time.time() - t0:.0f}s)")
    sys.exit(code)
