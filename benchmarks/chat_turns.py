"""A conversation of several turns, as `arborspec chat` holds it, with the kept KV cache and without: each turn's
prompt, the prompt tokens read from the kept cache, the time to the first token and the speed (README, "Command
line"). The two ways alternate, --repeats times each, on one loaded pair; the rows are appended to --out with the
command line and the machine.

    python benchmarks/chat_turns.py --repeats 2 --out results/chat/turns.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from arborspec.chat import Conversation
from arborspec.console import run_command
from arborspec.core.disk_cache import write_json
from arborspec.core.host import machine_id
from arborspec.loading.pair import DEFAULT_DRAFT, DEFAULT_TARGET, load_pair
from arborspec.runspec import build_decoder, parse

TURNS = ("Write a Python class for a bank account with deposit and withdraw.",
         "Add a transfer method between two accounts.",
         "Now add type hints and docstrings everywhere.",
         "Write pytest tests for it.")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--method", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=160, help="the longest answer")
    p.add_argument("--repeats", type=int, default=2, help="conversations each way, alternating")
    p.add_argument("--out", default="results/chat/turns.json")
    args = p.parse_args()
    for flag, value in (("--repeats", args.repeats), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:  # found after the pair's minute of loading
            p.error(f"{flag} must be at least 1, got {value}")
    target, draft = load_pair(args.target, args.draft)
    run = {"command": "python " + shlex.join(sys.argv), "machine": machine_id(), "rows": []}
    for repeat in range(args.repeats):
        for kept in (True, False):
            decoder = build_decoder(parse(args.method), target, draft)
            chat = Conversation(decoder, max_new_tokens=args.max_new_tokens)
            if not kept:
                decoder.prefix_cache = None  # every turn reads the whole conversation
            for turn, text in enumerate(TURNS):
                for _ in chat.answer(text):
                    pass
                s = chat.last.stats
                row = dict(repeat=repeat, kept=kept, turn=turn + 1, prompt_tokens=s.prompt_tokens,
                           cached_tokens=s.cached_tokens, ttft_s=s.t_first_token, tokens_per_s=s.tokens_per_s,
                           new_tokens=s.new_tokens)
                run["rows"].append(row)
                print(f"{'kept ' if kept else 'fresh'} turn {turn + 1}: prompt {s.prompt_tokens} tokens "
                      f"({s.cached_tokens} kept), first token {s.t_first_token:.2f} s, {s.tokens_per_s:.1f} tokens/s",
                      flush=True)
    out = Path(args.out)
    write_json(out, [*(json.loads(out.read_text()) if out.exists() else []), run])
    print(f"appended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
