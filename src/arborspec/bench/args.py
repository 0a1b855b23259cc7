"""Command-line arguments of `arborspec bench` and `arborspec report` (importing them loads the policy registry, and
with it torch: the flags' choices come from it)."""
from __future__ import annotations

import argparse

from ..flags import add_pair_arguments
from ..runspec import GRAMMAR

DEFAULT_METHODS = "ar,hf-assisted,chain,static,auto"


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    add_pair_arguments(p)
    p.add_argument("--dataset", default=None,
                   help="comma-separated: humaneval, code-edit, mt-bench, multi-turn, sharegpt, sharegpt-text "
                        "(default humaneval, or none with --prompt-file)")
    p.add_argument("--prompt-file", default=None, help="JSONL prompts: \"prompt\", optional \"id\", \"category\", "
                                                       "\"chat\"")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated methods, each {GRAMMAR} (default {DEFAULT_METHODS}); see "
                        "docs/benchmarks.md")
    p.add_argument("--allow-lossy", action="store_true",
                   help="run methods whose verifier changes the output distribution (e.g. wetap-lossy)")
    p.add_argument("--temperatures", default="0", help="comma-separated sampling temperatures (0 = greedy)")
    p.add_argument("--budgets", default=None,
                   help="comma-separated drafted tokens per step, mapped to each method's size option (default: "
                        "each method's defaults)")
    p.add_argument("--prompts", type=int, default=20, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="results", help="directory for results.json, report.md and plots")
    p.add_argument("--seed", type=int, default=0, help="seed of prompt i is seed + i, the same for every method")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--draft-temperature", type=float, default=None,
                   help="the draft's own temperature (default: each run's temperature)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer prompts")
    p.add_argument("--text-tokens", type=int, default=128, help="sharegpt-text: prompt length in tokens")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each method")
    p.add_argument("--no-perplexity", action="store_true", help="skip the extra target forward per run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume", action="store_true",
                   help="carry on an interrupted run in --out (same command; finished prompts are kept)")
    p.add_argument("--concurrency", default=None, metavar="C,...",
                   help="instead of comparing methods one prompt at a time: run each method's prompts C at once "
                        "for every C listed (e.g. 1,2,4) and report total tokens/s and per-request latency against "
                        "C (OUT/concurrency.json, OUT/concurrency.png); one target forward per round on --backend "
                        "native")


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="directory with results.json (or the file itself)")
    p.add_argument("--reproduction", default=None, metavar="FILE",
                   help="RESULTS is the results root (one directory per experiment): write the paper-by-paper "
                        "reproduction report to FILE (e.g. docs/reproduction.md)")
    p.add_argument("--check-equal", action="store_true",
                   help="check that every exact method's greedy (T=0) output equals plain decoding's on its own "
                        "kernels (ar; the llama.cpp peers: llamacpp-ar), run by run; exit 1 if not")
