"""Block verification vs ASpS vs SpS on random toy distributions, by exact enumeration (no sampling at all).

Each instance is a random target p(. | prefix) and draft q(. | prefix) over a small vocabulary for every prefix up to
n tokens: target logits ~ N(0, scale^2), draft logits = target logits + N(0, noise^2). For every chain of n tokens the
draft can draw, weighted by its draft probability, it computes the exact expected tokens per step (drafted tokens
accepted + the bonus) of each rule on that same chain, for every prefix length 1..n
(`arborspec.verify.rules.{sps,asps,block}_expected_tokens_by_prefix`), and averages over instances.

The table reports, per n: tokens per step of each rule, block's gain over SpS and over ASpS in percent, the largest
per-chain difference between block and ASpS (their outcome distributions coincide chain by chain, so this is
rounding), and the share of drafted chains on which block accepts *fewer* than SpS (its advantage holds on average
over the draft's draws, not chain by chain).

A second table (`--children K`) looks at one node with K children, on the same instances' first position: the exact
acceptance rate of each multi-draft rule for its drawing rule (mss: i.i.d. children, mbr: without replacement,
greedy-draft: K-1 top tokens plus one sample) next to the best any exact verifier can do for that drawing rule
(`rules.optimal_acceptance_iid` / `optimal_acceptance_greedy`; without replacement by linear program, which needs
scipy and a small vocabulary). What both tables show is written up in docs/verifiers.md.

    python benchmarks/block_vs_asps.py                              # 5 tokens, chains up to 4, 40 instances
    python benchmarks/block_vs_asps.py --vocab 6 --n 4 --noise 2    # a worse draft
    python benchmarks/block_vs_asps.py --n 2 --vocab 8 --children 3 # and the multi-draft table
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import numpy as np

from arborspec.console import run_command
from arborspec.verify.rules import (
    asps_expected_tokens_by_prefix,
    block_expected_tokens_by_prefix,
    greedy_draft_plan,
    mbr_plan,
    mss_plan,
    optimal_acceptance_greedy,
    optimal_acceptance_iid,
    sps_expected_tokens_by_prefix,
)

RULES = {"sps": sps_expected_tokens_by_prefix, "asps": asps_expected_tokens_by_prefix,
         "block": block_expected_tokens_by_prefix}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=5, help="vocabulary size (chains enumerated: vocab^n)")
    p.add_argument("--n", type=int, default=4, help="longest drafted chain; prefixes 1..n are evaluated")
    p.add_argument("--instances", type=int, default=40, help="random (target, draft) pairs")
    p.add_argument("--scale", type=float, default=2.0, help="std of the target logits (larger = more peaked)")
    p.add_argument("--noise", type=float, default=1.0, help="std of the draft's logit noise (larger = worse draft)")
    p.add_argument("--children", type=int, default=0, help="also compare multi-draft rules on K children (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the per-n results here")
    args = p.parse_args(argv)
    if args.vocab < 2 or args.n < 1 or args.instances < 1 or args.scale < 0 or args.noise < 0:
        p.error("need --vocab >= 2, --n >= 1, --instances >= 1, --scale >= 0, --noise >= 0")
    if args.children < 0 or args.vocab ** args.children > 200_000:
        p.error("--children must be >= 0 with vocab^children small enough to enumerate")
    if args.vocab ** args.n > 200_000:
        p.error(f"vocab^n = {args.vocab ** args.n} chains is too many to enumerate; lower --vocab or --n")
    return args


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def random_instance(rng: np.random.Generator, vocab: int, n: int, scale: float, noise: float):
    """p[prefix] for prefixes of length 0..n, q[prefix] for length 0..n-1."""
    p, q = {}, {}
    for length in range(n + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            logits = rng.normal(0.0, scale, vocab)
            p[prefix] = softmax(logits)
            if length < n:
                q[prefix] = softmax(logits + rng.normal(0.0, noise, vocab))
    return p, q


def evaluate(p, q, vocab: int, n: int) -> dict:
    """Exact expected tokens per step of each rule for every prefix length, and per-chain comparisons."""
    tokens = {name: np.zeros(n) for name in RULES}
    max_gap, worse = np.zeros(n), np.zeros(n)  # max |block - asps| per chain; draft mass of chains with block < sps
    for chain in itertools.product(range(vocab), repeat=n):
        prefixes = [chain[:i] for i in range(n + 1)]
        w = float(np.prod([q[prefixes[i]][chain[i]] for i in range(n)]))
        if w == 0:
            continue
        qs, ps = np.stack([q[s] for s in prefixes[:n]]), np.stack([p[s] for s in prefixes])
        got = {name: np.array(fn(list(chain), qs, ps)) for name, fn in RULES.items()}
        for name in RULES:
            tokens[name] += w * got[name]
        max_gap = np.maximum(max_gap, np.abs(got["block"] - got["asps"]))
        worse += w * (got["block"] < got["sps"] - 1e-12)
    return dict(tokens=tokens, max_gap=max_gap, worse=worse)


def summarise(results: list[dict], n: int) -> list[dict]:
    rows = []
    for m in range(n):
        mean = {name: float(np.mean([r["tokens"][name][m] for r in results])) for name in RULES}
        gains = np.array([r["tokens"]["block"][m] - r["tokens"]["sps"][m] for r in results])
        rows.append(dict(
            n=m + 1, **{f"{name}_tokens": v for name, v in mean.items()},
            block_over_sps_pct=100 * (mean["block"] / mean["sps"] - 1),
            block_over_asps_pct=100 * (mean["block"] / mean["asps"] - 1),
            min_instance_gain=float(gains.min()),
            max_chain_gap_block_asps=float(max(r["max_gap"][m] for r in results)),
            worse_than_sps_share=float(np.mean([r["worse"][m] for r in results])),
        ))
    return rows


def print_table(rows: list[dict], file=sys.stdout):
    head = (f"{'n':>2} | {'SpS tok/step':>12} | {'ASpS tok/step':>13} | {'block tok/step':>14} | {'block vs SpS':>12} | "
            f"{'block vs ASpS':>13} | {'min gain (inst.)':>16} | {'max |block-ASpS| (chain)':>24} | "
            f"{'chains block < SpS':>18}")
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in rows:
        print(f"{r['n']:>2} | {r['sps_tokens']:>12.4f} | {r['asps_tokens']:>13.4f} | {r['block_tokens']:>14.4f} | "
              f"{r['block_over_sps_pct']:>+11.2f}% | {r['block_over_asps_pct']:>+12.2f}% | "
              f"{r['min_instance_gain']:>16.2e} | {r['max_chain_gap_block_asps']:>24.1e} | "
              f"{100 * r['worse_than_sps_share']:>17.1f}%", file=file)


# ---- one node, several children ------------------------------------------------------------------------------------
def iid_draws(q, k):
    for kids in itertools.product(range(len(q)), repeat=k):
        yield list(kids), float(np.prod(q[list(kids)]))


def without_replacement_draws(q, k):
    for kids in itertools.permutations(np.flatnonzero(q > 0).tolist(), min(k, int((q > 0).sum()))):
        w, left = 1.0, 1.0
        for y in kids:
            w, left = w * q[y] / left, left - q[y]
        yield list(kids), w


def greedy_draws(q, k):
    fixed = np.argsort(-q, kind="stable")[: k - 1].tolist()
    rest = q.copy()
    rest[fixed] = 0
    for z in np.flatnonzero(rest > 0).tolist():
        yield fixed + [z], rest[z] / rest.sum()


def rate(plan_fn, p: np.ndarray, q: np.ndarray, draws) -> float:
    """Exact acceptance rate: P(some child is accepted), averaged over the draws."""
    return sum(w * plan_fn(p, q, kids).acceptance() for kids, w in draws)


def lp_optimum(p: np.ndarray, draws: list) -> float:
    """Best coupling of the draws with the target (linear program); nan without scipy."""
    try:
        from scipy.optimize import linprog  # optional: only this column needs it
    except ImportError:
        return float("nan")
    vocab, n = len(p), len(draws) * len(p)
    gain, rows, rhs = np.zeros(n), [], []
    for i, (kids, w) in enumerate(draws):
        gain[[i * vocab + y for y in set(kids)]] = 1
        row = np.zeros(n)
        row[i * vocab : (i + 1) * vocab] = 1
        rows.append(row)
        rhs.append(w)
    for y in range(vocab - 1):
        row = np.zeros(n)
        row[y::vocab] = 1
        rows.append(row)
        rhs.append(p[y])
    res = linprog(-gain, A_eq=np.array(rows), b_eq=rhs, bounds=(0, None), method="highs")
    return -res.fun if res.status == 0 else float("nan")


def multi_draft_rates(p: np.ndarray, q: np.ndarray, k: int) -> dict:
    wo = list(without_replacement_draws(q, k))
    return dict(mss=rate(mss_plan, p, q, iid_draws(q, k)), best_iid=optimal_acceptance_iid(p, q, k),
                mbr=rate(mbr_plan, p, q, wo), best_without=lp_optimum(p, wo),
                greedy=rate(greedy_draft_plan, p, q, greedy_draws(q, k)), best_greedy=optimal_acceptance_greedy(p, q, k),
                one_draft=float(np.minimum(p, q).sum()))


def print_multi_draft(rates: list[dict], k: int, file=sys.stdout):
    mean = {key: float(np.mean([r[key] for r in rates])) for key in rates[0]}
    print(f"\none node, {k} children, {len(rates)} instances: acceptance rate (exact) / best any exact verifier can do "
          f"for that drawing rule", file=file)
    print(f"  i.i.d. (mss):                    {mean['mss']:.4f} / {mean['best_iid']:.4f}", file=file)
    print(f"  without replacement (mbr):       {mean['mbr']:.4f} / {mean['best_without']:.4f} (linear program)", file=file)
    print(f"  {k - 1} top + 1 sample (greedy-draft): {mean['greedy']:.4f} / {mean['best_greedy']:.4f}", file=file)
    print(f"  one child (sps), for reference:  {mean['one_draft']:.4f}", file=file)


def main(argv=None):
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    instances = [random_instance(rng, args.vocab, args.n, args.scale, args.noise) for _ in range(args.instances)]
    results = [evaluate(p, q, args.vocab, args.n) for p, q in instances]
    rows = summarise(results, args.n)
    print(f"{args.instances} random instances, vocab {args.vocab}, target logit std {args.scale}, draft noise std "
          f"{args.noise}; every drafted chain enumerated exactly ({time.perf_counter() - start:.1f} s)")
    print("tok/step = drafted tokens accepted + the bonus, in expectation over the draft's draws; 'min gain (inst.)' "
          "= smallest block - SpS over instances;\n'chains block < SpS' = draft mass of chains on which block "
          "accepts fewer than SpS\n")
    print_table(rows)
    rates = [multi_draft_rates(p[()], q[()], args.children) for p, q in instances] if args.children else []
    if rates:
        print_multi_draft(rates, args.children)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows, multi_draft=rates), f, indent=2)


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
