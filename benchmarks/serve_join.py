"""A long prompt joining a live `arborspec serve` while another request streams: how long the streaming request
pauses, and how long the joining one waits for its first token, at each `--prefill-chunk` (docs/serve.md, "A long
prompt joining").

For each chunk size the server is started (`arborspec serve FLAGS --prefill-chunk N --prefix-cache-mb 0 --port 0`,
stopped by its PID afterwards). Each repeat: request A streams --a-tokens greedy tokens of code (`A_PROMPT`);
--delay seconds in, request B joins with a long prompt (HumanEval prompts joined to --long-chars characters, ~1000
tokens at the default, with the repeat's number at the end so no cache could serve it) and --b-tokens tokens.
Reported: A's longest pause between chunks after B joined, and B's time to first token. Runs are appended to --out
with the command line and the machine.

A's prompt is a fixed one whose answer runs past --a-tokens before its end of sequence, so A streams code all the
while B is read. The default pair answers a HumanEval prompt in ~60-100 tokens: A would run on past its end of
sequence (it ignores it), and with HumanEval/0 as A's prompt its longest pause at --prefill-chunk 256 read 1.7 s in
one run and 4.0 s in another, a spread this prompt does not show.

    python benchmarks/serve_join.py --chunks 0,256,128,64 --repeats 2 --out results/serve/join.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from itertools import islice
from pathlib import Path

import httpx
from serve_load import Launched  # this directory's: the server in its own process group

from arborspec.bench.datasets import DATASETS, fetch
from arborspec.console import run_command
from arborspec.core.disk_cache import write_json
from arborspec.core.host import machine_id

A_PROMPT = "def quicksort(xs):\n"  # the default pair writes 160+ tokens of code from it, no end of sequence


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", default="", help="other flags for `arborspec serve` (quoted)")
    p.add_argument("--chunks", default="0,256,128,64", help="comma-separated --prefill-chunk values")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--a-tokens", type=int, default=160)
    p.add_argument("--b-tokens", type=int, default=16)
    p.add_argument("--long-chars", type=int, default=4000)
    p.add_argument("--delay", type=float, default=1.5, help="seconds A streams before B joins")
    p.add_argument("--out", default="results/serve/join.json")
    args = p.parse_args()
    prompts = [q.text for q in islice(DATASETS["humaneval"][1](fetch("humaneval"), None), 40)]  # B's
    long = ""
    for text in prompts:
        if len(long) >= args.long_chars:
            break
        long += text
    run = {"command": "python " + shlex.join(sys.argv), "machine": machine_id(), "rows": []}
    for chunk in [int(c) for c in args.chunks.split(",") if c.strip()]:
        server = Launched(f"{args.serve} --prefill-chunk {chunk} --prefix-cache-mb 0")
        try:
            url = server.url()
            stream(url, A_PROMPT, 4)  # warm-up: the first request pays one-time costs
            for rep in range(args.repeats):
                row = join(url, A_PROMPT, f"{long}\n# {rep}\n", args)
                run["rows"].append({"prefill_chunk": chunk, **row})
                print(f"--prefill-chunk {chunk}: A's longest pause {row['a_pause_s']:.2f} s, B's TTFT "
                      f"{row['b_ttft_s']:.2f} s ({row['b_prompt_tokens']} prompt tokens)", flush=True)
        finally:
            server.stop()
    out = Path(args.out)
    write_json(out, [*(json.loads(out.read_text()) if out.exists() else []), run])
    print(f"appended to {out}")
    return 0


def join(url: str, short: str, long: str, args) -> dict:
    """One repeat: A streaming, B joining after --delay; A's longest pause after B joined, B's TTFT."""
    a: list[float] = []
    streaming = threading.Thread(target=stream, args=(url, short, args.a_tokens, a))
    streaming.start()
    time.sleep(args.delay)
    joined, b = time.perf_counter(), []
    usage = stream(url, long, args.b_tokens, b)
    streaming.join()
    pauses = [later - earlier for earlier, later in zip(a, a[1:]) if later >= joined]
    return {"a_pause_s": max(pauses, default=0.0), "b_ttft_s": b[0] - joined,
            "b_prompt_tokens": usage["prompt_tokens"]}


def stream(url: str, prompt: str, max_tokens: int, stamps: list[float] | None = None) -> dict:
    """A greedy streamed completion; when each chunk with text arrived goes to `stamps`; returns its usage."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    usage = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if stamps is not None and chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    return usage


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
