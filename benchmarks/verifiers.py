"""Every exact verifier on the same drafts, on the default real pair: what each accepts and how fast it decodes.

One `arborspec bench` run (results.json + report.md in the usual format), every method interleaved per prompt so
that drift of the machine hits all alike, at sampling temperatures 0.6 and 1 (the verifiers differ only when
sampling), on HumanEval and MT-Bench, target qwen2.5-coder-1.5b drafted by qwen2.5-coder-0.5b on arborspec's own
kernels (`--backend native`: extra verification rows cost less there than on llama.cpp, so the trees run at 0.5-0.8x
plain decoding instead of 0.3-0.4x, and what a verifier accepts does not depend on the backend):

    ar                                          plain decoding on the same backend: the speed-up baseline
    sps@4, asps@4, chain(verifier=block)@4      a chain of 4 drafted tokens
    static(depth=3,branch=2,verifier=V)         a binary tree of 14 drafted tokens, children sampled without
                                                replacement, for V = naive, mbr, traversal
    static(depth=3,branch=2,draw=iid,verifier=V)    the same shape, children drawn i.i.d. (SpecInfer's scheme), for
                                                V = mss, traversal (mss is exact only for i.i.d. children)
    static(depth=3,branch=2,draw=greedy)        the same shape, greedy multi-draft (the draft's top token + one draw
                                                off it), verified by greedy-draft, the optimal rule for it

Per method and temperature the report gives tokens/step (MAT), tok/s and the speed-up over ar, the acceptance at
depths 1-3, the zero-accept share, and "root acc / opt": how often a first drafted token was accepted beside the best
any exact verifier could reach on the same trees (an upper bound for children drawn without replacement; docs/
verifiers.md, "distance to optimum"). This script also writes verifiers.md into --out: the same rows pooled over
both datasets, one table per temperature, and the paired per-prompt differences of MAT between the rules compared.
Each rule runs its own generation, so those differences carry the spread of sampled text; for a comparison on the
very same trees see benchmarks/verifiers_same_trees.py.

The full run (20 + 20 prompts x 10 methods x 2 temperatures x up to 64 tokens = 800 runs; about 10 s a run, some
2 hours on an otherwise idle 2-core CPU; `--resume` carries on an interrupted one):

    python benchmarks/verifiers.py

which runs

    arborspec bench --backend native --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --dataset humaneval,mt-bench --prompts 20 --temperatures 0.6,1 --max-new-tokens 64 --no-perplexity \\
        --out results/verifiers --methods 'ar,sps@4,asps@4,chain(verifier=block)@4,static(depth=3,branch=2,verifier=naive),static(depth=3,branch=2,verifier=mbr),static(depth=3,branch=2,verifier=traversal),static(depth=3,branch=2,draw=iid,verifier=mss),static(depth=3,branch=2,draw=iid,verifier=traversal),static(depth=3,branch=2,draw=greedy)'

A smoke check of the whole pipeline (one prompt of each dataset, 16 tokens, 40 runs; its timings mean nothing):

    python benchmarks/verifiers.py --prompts 1 --max-new-tokens 16 --out /tmp/verifiers-smoke
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from arborspec.bench import records
from arborspec.bench.reproduction import VERIFIER_METHODS as METHODS
from arborspec.bench.reproduction import paired_differences, pooled_verifier_tables
from arborspec.cli import main as arborspec_main
from arborspec.console import run_command
from arborspec.loading.pair import DEFAULT_DRAFT, DEFAULT_TARGET


def bench_argv(args) -> list[str]:
    """The `arborspec bench` arguments this benchmark runs."""
    argv = ["bench", "--backend", args.backend, "--target", args.target, "--draft", args.draft,
            "--dataset", args.dataset, "--prompts", str(args.prompts), "--temperatures", args.temperatures,
            "--max-new-tokens", str(args.max_new_tokens), "--no-perplexity", "--out", args.out,
            "--methods", ",".join(METHODS)]
    return argv + (["--resume"] if args.resume else [])


def pooled_tables(results: dict) -> str:
    """verifiers.md: the rows pooled over every dataset's prompts, one table per temperature, then the paired
    per-prompt differences of MAT (the same tables as docs/reproduction.md's section)."""
    lines = ["# Verifiers on the same drafts", "", f"Command: `{results.get('command', '')}`", "",
             "root acc / opt: first drafted token accepted / the best any exact verifier could reach (an upper "
             "bound for children drawn without replacement). report.md has the per-dataset tables.", ""]
    lines += pooled_verifier_tables(results) + ["## Paired differences in tokens per step (MAT)", ""]
    return "\n".join(lines + paired_differences(results))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0.6,1")
    ap.add_argument("--dataset", default="humaneval,mt-bench")
    ap.add_argument("--backend", default="native")
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--out", default="results/verifiers")
    ap.add_argument("--resume", action="store_true", help="carry on an interrupted run in --out")
    ap.add_argument("--print-only", action="store_true", help="print the arborspec bench command and stop")
    args = ap.parse_args(argv)
    bench = bench_argv(args)
    print("arborspec " + shlex.join(bench), flush=True)
    if args.print_only:
        return 0
    code = arborspec_main(bench)
    if code:
        return code
    results = records.read(Path(args.out))  # results.json, or .json.gz once it is large
    text = pooled_tables(results)
    (Path(args.out) / "verifiers.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
