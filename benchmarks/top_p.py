"""What a top-p warp costs a row: the bucketed nucleus cut (`arborspec.core.top_p`) against the whole sort, one thread.

At top_p < 1 every verified row and every drafted row is warped, and sorting the 152k-token vocabulary of the default
pair made a warp cost 12-14 ms a row (Intel Xeon host, 2026-11-29; 1.9-2.7 with the bucketed cut), a fifth of a target
token's forward. The rows here are real: the model's (default: the shipped 0.5B draft on the native backend) logits for
each token of the reference texts `auto` scores drafts on (tuning/reference_texts.py), one forward. For each temperature
and top_p this prints the median milliseconds a row of the whole warp (`SamplingConfig.probs`) with either cut, and how
many rows' cuts differ between them (the bucketed cut sums in float64 where the sort's sums are float32: core/top_p.py),
with the host.

    python benchmarks/top_p.py [--model qwen2.5-coder-0.5b] [--rows 96] [--temperatures 0.7,1,1.3]
                               [--top-ps 0.8,0.9,0.95,0.99] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from arborspec.console import run_command
from arborspec.core import top_p
from arborspec.core.host import this_cpu
from arborspec.core.options import parse_float_list
from arborspec.core.sampling import SamplingConfig
from arborspec.loading import load_model
from arborspec.tuning.agreement import next_token_logits, reference_ids


def real_rows(model_name: str, rows: int) -> torch.Tensor:
    """(rows, vocab): the model's next-token logits along the reference texts, a few rows from each."""
    loaded = load_model(model_name, backend="native", progress=False)
    texts = reference_ids(loaded.tokenizer)
    per_text = -(-rows // len(texts))  # (a text shorter than that gives fewer)
    logits = [next_token_logits(loaded.model, ids[:per_text + 1]).float() for ids in texts]
    return torch.cat(logits)[:rows]


def ms_a_row(logits: torch.Tensor, cfg: SamplingConfig, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        for row in logits:
            t0 = time.perf_counter()
            cfg.probs(row)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--temperatures", default="0.7,1,1.3")
    ap.add_argument("--top-ps", default="0.8,0.9,0.95,0.99")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    temperatures = parse_float_list(args.temperatures, "--temperatures")
    top_ps = parse_float_list(args.top_ps, "--top-ps")
    if args.rows < 1 or args.repeats < 1:
        raise ValueError(f"--rows and --repeats must be at least 1, got {args.rows} and {args.repeats}")
    settings = [SamplingConfig(t, 0, p) for t in temperatures for p in top_ps]  # refuses a bad value up front
    logits = real_rows(args.model, args.rows)
    torch.set_num_threads(1)
    print(f"host: {this_cpu().describe()}; one thread; {len(logits)} rows of {args.model}'s logits "
          f"({logits.shape[-1]} tokens); median ms a row\n")
    print("| temperature | top_p | whole sort | bucketed | ratio | rows cut otherwise |")
    print("|---:|---:|---:|---:|---:|---:|")
    sort_below = top_p.SORT_BELOW
    for cfg in settings:
        scaled = logits / cfg.temperature
        differ = sum(not torch.equal(top_p.nucleus_cut(r, cfg.top_p), top_p.sorted_cut(r, cfg.top_p)) for r in scaled)
        ours = ms_a_row(logits, cfg, args.repeats)
        top_p.SORT_BELOW = logits.shape[-1] + 1  # every row to the whole sort
        try:
            whole = ms_a_row(logits, cfg, args.repeats)
        finally:
            top_p.SORT_BELOW = sort_below
        print(f"| {cfg.temperature:g} | {cfg.top_p:g} | {whole:.2f} | {ours:.2f} | {whole / ours:.1f}x | {differ} |",
              flush=True)


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
