"""Load on a live `arborspec serve`: total throughput and per-request latency against concurrency, and a
per-request overhead probe (for Ray Serve's router, docs/ray.md).

It starts the server itself (`--serve "FLAGS"`: `arborspec serve FLAGS --port 0`, stopped by its PID afterwards)
or drives one already running (`--url`). At each concurrency c, c client threads each send streamed completions
(HumanEval prompts, greedy, `ignore_eos`, so every request generates exactly --max-tokens tokens) one after another
until --requests requests per thread have finished. Reported per c: tokens/s over all requests (total completion
tokens / wall time), requests/s, and per-request latency, TTFT and TPOT (p50 and p90). `--probe N`: N sequential
one-token requests; their median latency is what one request costs beyond its tokens (with and without Ray's proxy
in front, the difference is the router's overhead).

Each run is appended to --out (a JSON list), with the command line and the machine, so runs of different server
settings measured back to back land in one file; `--plot FILE` draws throughput and latency against concurrency
for every run in FILE.

    python benchmarks/serve_load.py --serve "--method ar" --label plain --concurrency 1,2,4 --out results/serve/load.json
    python benchmarks/serve_load.py --serve "" --label auto --concurrency 1,2,4 --out results/serve/load.json
    python benchmarks/serve_load.py --plot results/serve/load.json --figure docs/figures/serve_load.png
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from itertools import islice
from pathlib import Path

import httpx

from arborspec.bench.datasets import DATASETS, fetch
from arborspec.console import run_command
from arborspec.core.disk_cache import write_json
from arborspec.core.host import machine_id

START_TIMEOUT_S = 900  # loading the real pair (and, with --ray, starting Ray) on a busy 2-core machine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--serve", help="flags for `arborspec serve` (quoted); the server is started and stopped here")
    where.add_argument("--url", help="a running server's base URL")
    where.add_argument("--plot", help="draw the runs in this results file (with --figure)")
    p.add_argument("--label", default=None, help="the run's name in tables and plots (default: the flags)")
    p.add_argument("--concurrency", default="1,2,4", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=2, help="requests each client sends at each concurrency")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--probe", type=int, default=0, help="also send N sequential 1-token requests (overhead)")
    p.add_argument("--model", default=None, help="the model name requests carry (default: the server's first)")
    p.add_argument("--out", default="results/serve/load.json")
    p.add_argument("--figure", default="docs/figures/serve_load.png")
    args = p.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), args.figure)
        return 0
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    server = Launched(args.serve) if args.serve is not None else None
    try:
        url = server.url() if server else args.url.rstrip("/")
        model = args.model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        prompts = [p.text for p in islice(DATASETS["humaneval"][1](fetch("humaneval"), None), 64)]
        run = {"label": args.label or args.serve or args.url, "serve": args.serve, "url": args.url,
               "command": "python " + shlex.join(sys.argv), "machine": machine_id(), "max_tokens": args.max_tokens,
               "levels": [], "probe_ms": None}
        send(url, model, prompts[0], 4)  # warm-up: the first request pays one-time costs
        for c in levels:
            level = load(url, model, prompts, c, args.requests, args.max_tokens)
            run["levels"].append(level)
            print(f"{run['label']}: c={c} {level['tokens_per_s']:.1f} tok/s, {level['requests_per_s']:.2f} req/s, "
                  f"latency p50 {level['latency_p50_s']:.2f} s, TTFT p50 {level['ttft_p50_s']:.3f} s, "
                  f"TPOT p50 {level['tpot_p50_s'] * 1000:.1f} ms", flush=True)
        if args.probe:
            times = [send(url, model, "x", 1)["latency_s"] for _ in range(args.probe)]
            run["probe_ms"] = 1000 * statistics.median(times)
            print(f"{run['label']}: a 1-token request takes {run['probe_ms']:.1f} ms (median of {args.probe})")
    finally:
        if server:
            server.stop()
    out = Path(args.out)
    runs = json.loads(out.read_text()) if out.exists() else []
    write_json(out, [*runs, run])
    print(f"appended to {out}")
    return 0


def load(url: str, model: str, prompts: list[str], clients: int, each: int, max_tokens: int) -> dict:
    """`clients` threads, each sending `each` streamed requests in turn; what they measured, summarized."""
    results: list[dict] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for j in range(each):
            r = send(url, model, prompts[(k * each + j) % len(prompts)], max_tokens, stream=True)
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)

    def pct(key: str, q: float) -> float:
        values = sorted(r[f"{key}_s"] for r in results)
        return values[min(len(values) - 1, int(q * len(values)))]

    return {"concurrency": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "requests_per_s": len(results) / wall,
            **{f"{k}_p{int(q * 100)}_s": pct(k, q) for k in ("latency", "ttft", "tpot") for q in (0.5, 0.9)},
            "tokens_per_step": statistics.mean(r["tokens_per_step"] for r in results)}


def send(url: str, model: str, prompt: str, max_tokens: int, stream: bool = False) -> dict:
    """One greedy completion: its latency, time to first token, time per later token, tokens and tokens/step."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    start = time.perf_counter()
    first, last = None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        if not stream:
            last = json.loads(response.read())
        for line in response.iter_lines() if stream else ():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
            last = chunk
    end = time.perf_counter()
    tokens = last["usage"]["completion_tokens"]
    first = first or end
    return {"latency_s": end - start, "ttft_s": first - start, "tpot_s": (end - first) / max(1, tokens - 1),
            "tokens": tokens, "tokens_per_step": last["arborspec"]["tokens_per_step"]}


class Launched:
    """`arborspec serve FLAGS --port 0` in its own process group, stopped by SIGTERM to its PID."""

    def __init__(self, flags: str):
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_load_{os.getpid()}.log"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "arborspec.server", *shlex.split(flags), "--port", "0"],
                                         stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

    def url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            m = re.search(r"serving .* on (http://[\w.\[\]:]+:\d+)", self.log.read_text())
            if m:
                return m[1]
            time.sleep(0.5)
        raise SystemExit(f"the server did not start in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def plot(runs: list[dict], figure: str) -> None:
    from arborspec.viz.canvas import pyplot, save_figure

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        cs = [lv["concurrency"] for lv in run["levels"]]
        ax1.plot(cs, [lv["tokens_per_s"] for lv in run["levels"]], marker="o", label=run["label"])
        ax2.plot(cs, [lv["latency_p50_s"] for lv in run["levels"]], marker="o", label=run["label"])
    for ax, ylabel in ((ax1, "tokens/s, all requests"), (ax2, "request latency p50 (s)")):
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"arborspec serve under load ({runs[0]['max_tokens']} tokens a request, {runs[0]['machine']})")
    save_figure(fig, figure)
    print(f"wrote {figure}")


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
