"""Every exact verifier on the very same trees: exact expected tokens per step on the default pair, no sampling noise.

`benchmarks/verifiers.py` runs each verifier on its own generation, so two rules see different trees and different
text, and a gain of a few percent drowns in the spread between prompts. Here one generation drafts each tree once,
and on that tree and the target's logits for it every candidate rule's *exact* expected number of accepted tokens is
computed (`Verifier.expected_accepted`); the text then advances with the policy's own default rule. The difference
between two rules on the same tree is then only the rules'.

Tree families (each with the rules exact for it; the engine's own `fits` check refuses any other):

    chain      chain@4                                    sps, asps, block
    sampled    static(depth=3,branch=2), without repl.    naive, mbr, traversal
    iid        static(depth=3,branch=2,draw=iid)          naive, mss, traversal
    greedy     static(depth=3,branch=2,draw=greedy)       naive, greedy-draft
    auto       auto(guard=false), its own trees           naive, mbr, traversal

`auto` drafts only where it expects to win; on a backend whose extra rows are expensive (llama.cpp, arborspec's
kernels on AVX2) it expects nothing at T > 0 and drafts no tree, so its family runs on the PyTorch backend
(`--backend torch`), where verification is flat and auto builds its real trees.

    python benchmarks/verifiers_same_trees.py --backend native --families chain,sampled,iid,greedy --prompts 10
    python benchmarks/verifiers_same_trees.py --backend torch --families auto --prompts 10

The table (also written to --out as same_trees.md / same_trees.json, which keep the families of earlier runs, so the
two commands above fill one file): per family and temperature, tokens per step (accepted + 1) of each rule, and each
rule's gain over the family's first rule: the mean over prompts of the per-prompt relative gain, with its standard
error over prompts. docs/reproduction.md's verifier section is generated from it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from arborspec import SpeculativeDecoder
from arborspec.bench.datasets import load_prompts, prompt_ids
from arborspec.console import run_command
from arborspec.engine.verifier_choice import pick_verifier
from arborspec.loading.pair import DEFAULT_DRAFT, DEFAULT_TARGET, load_pair
from arborspec.verify import VERIFIERS
from arborspec.verify.base import Verifier, target_probs

TREE = dict(depth=3, branch=2)
FAMILIES = {  # name: (method, options, candidate rules, the first being the reference)
    "chain": ("chain", dict(k=4), ["sps", "asps", "block"]),
    "sampled": ("static", TREE, ["naive", "mbr", "traversal"]),
    "iid": ("static", dict(TREE, draw="iid"), ["naive", "mss", "traversal"]),
    "greedy": ("static", dict(TREE, draw="greedy"), ["naive", "greedy-draft"]),
    "auto": ("auto", dict(guard=False, suffix=0), ["naive", "mbr", "traversal"]),  # the drafted trees alone
}


class SameTrees(Verifier):
    """Advances the text with `commit`; before that, records every candidate's exact expected accepted tokens on
    the step's tree (bare roots, which every rule treats alike, are left out)."""

    def __init__(self, commit: Verifier, candidates: list[str]):
        self.commit, self.candidates = commit, [VERIFIERS[name]() for name in candidates]
        self.name, self.exact = commit.name, commit.exact
        self.rows: list[list[float]] = []

    def verify(self, tree, target_logits, sampling, generator):
        if len(tree) > 1:
            p = target_probs(target_logits, sampling)
            self.rows.append([v.expected_accepted(tree, p) for v in self.candidates])
        return self.commit.verify(tree, target_logits, sampling, generator)


def measure(target, draft, family: str, temperature: float, prompts: list, max_new_tokens: int, seed: int):
    """Per prompt, the (steps, rules) array of expected accepted tokens."""
    method, options, candidates = FAMILIES[family]
    dec = SpeculativeDecoder(target, draft, method=method, temperature=temperature, top_k=0, top_p=1.0, **options)
    for name in candidates:  # the engine's own check: refuses a rule that is not exact for these trees
        pick_verifier(dec.policy, dec.sampling, dec.draft_sampling, name, allow_lossy=False,
                      free=bool(dec.free) and not dec.bare_grafts)
    recorder = SameTrees(dec.verifier, candidates)
    dec.verifier = recorder
    per_prompt = []
    for i, ids in enumerate(tqdm(prompts, desc=f"{family} T={temperature:g}", file=sys.stderr)):
        start = len(recorder.rows)
        dec.generate(ids, max_new_tokens=max_new_tokens, seed=seed + i)
        per_prompt.append(np.array(recorder.rows[start:], dtype=float).reshape(-1, len(candidates)))
    return per_prompt


def summarize(per_prompt: list[np.ndarray], candidates: list[str]) -> dict:
    """Tokens per step of each rule over all steps, and each rule's relative gain over the first: mean over prompts
    (each prompt's own ratio of means) with the standard error over prompts."""
    used = [a for a in per_prompt if len(a)]
    steps = np.concatenate(used) if used else np.zeros((0, len(candidates)))
    out = {"steps": len(steps), "prompts": len(used), "rules": {},
           "per_prompt": [[float(a[:, j].mean() + 1) for j in range(len(candidates))] for a in used]}
    for j, name in enumerate(candidates):
        gains = np.array([(a[:, j].mean() + 1) / (a[:, 0].mean() + 1) - 1 for a in used])
        se = gains.std(ddof=1) / np.sqrt(len(gains)) if len(gains) > 1 else float("nan")
        out["rules"][name] = {"tokens_per_step": float(steps[:, j].mean() + 1) if len(steps) else None,
                              "gain": float(gains.mean()) if len(gains) else None, "gain_se": float(se)}
    return out


def table(results: dict) -> str:
    lines = ["| family | T | prompts | steps | rule | tokens/step | gain over the first rule ± s.e. |", "|---" * 7 + "|"]
    for family, by_temp in results["families"].items():
        for temp, s in by_temp.items():
            for name, r in s["rules"].items():
                tps = "–" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.3f}"
                gain = "–" if r["gain"] is None else f"{100 * r['gain']:+.2f}% ± {100 * r['gain_se']:.2f}"
                lines.append(f"| {family} | {temp} | {s['prompts']} | {s['steps']} | {name} | {tps} | {gain} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="chain,sampled,iid,greedy", help=f"comma-separated: {', '.join(FAMILIES)}")
    ap.add_argument("--backend", default="native", help="the models' backend (auto, torch, native, llamacpp)")
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--dataset", default="humaneval,mt-bench")
    ap.add_argument("--prompts", type=int, default=10, help="prompts per dataset")
    ap.add_argument("--temperatures", default="0.6,1")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/verifiers-same-trees")
    args = ap.parse_args(argv)
    for flag, value in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:  # --prompts -1 ran no prompt and exited 0
            ap.error(f"{flag} must be at least 1, got {value}")
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown family {unknown[0]!r}; choose from {', '.join(FAMILIES)}")
    target, draft = load_pair(args.target, args.draft, draft_quant="none", backend=args.backend)
    prompts = [prompt_ids(target.tokenizer, p) for name in args.dataset.split(",")
               for p in load_prompts(name, args.prompts, target.tokenizer)]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    command = "python benchmarks/verifiers_same_trees.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "same_trees.json"  # runs of other families (e.g. auto on another backend) are kept beside
    results = json.loads(path.read_text()) if path.exists() else {"commands": [], "families": {}}
    results["commands"] = [c for c in results["commands"] if c != command] + [command]
    for family in families:
        results["families"][family] = {
            f"{t:g}": summarize(measure(target, draft, family, t, prompts, args.max_new_tokens, args.seed),
                                FAMILIES[family][2])
            for t in temperatures}
        path.write_text(json.dumps(results, indent=2) + "\n")
    text = "\n".join(f"Command: `{c}`" for c in results["commands"]) + "\n\n" + table(results) + "\n"
    (out / "same_trees.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
