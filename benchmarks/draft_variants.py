"""The draft's variants on the native backend, side by side with the target: d(1), d(4) and agreement (issue 34).

Every variant `auto` can choose for a native GGUF draft (the file as shipped, its lean 4-bit copies, and those with a
pruned head) is loaded in one process beside the target, and all are timed in turn for several rounds, so each round
sees the same machine state; a model's figure is its fastest round (interference on a shared host only ever adds
time). One forward over n tree nodes after a 200-token prefix (`tuning.costs.measure_forward_cost`, the measurement
`arborspec profile` makes). Agreement: greedy top-1 and top-4 coverage of the draft against the target, teacher-forced
on `tuning/reference_texts.py` (the measurement `auto` scores variants by), and with `--held-out` on the first 768
tokens of each of those files too (text the pruned heads' token counts never saw).

Usage: python benchmarks/draft_variants.py [--target ALIAS] [--draft ALIAS] [--quants none,q4_0,iq4_nl]
           [--heads 0,65536,32768] [--rounds 7] [--held-out FILE,...] [--out results/lean-draft/variants.json]
Prints a markdown table: d(1) ms, d(1)/t(1), d(4)/d(1), agreement, MB the head reads.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import sys

from arborspec.console import run_command
from arborspec.core.host import this_cpu
from arborspec.loading import load_model
from arborspec.tuning.agreement import agreement_with, fitting, reference_ids, target_choices
from arborspec.tuning.costs import measure_forward_cost
from arborspec.tuning.draft_choice import label, variant


def head_mb(model) -> float:
    """MB the model's output head reads a token (a pruned head holds its kept rows only)."""
    return model.lm_head.matrix.data.numel() / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--quants", default="none,q4_0,iq4_nl")
    p.add_argument("--heads", default="0,65536,32768", help="head sizes (0: the whole vocabulary)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--held-out", default="", help="comma-separated files: agreement on their first 768 tokens too")
    p.add_argument("--out", default="")
    args = p.parse_args()
    target = load_model(args.target, backend="native", progress=False)
    draft = load_model(args.draft, backend="native", progress=False)
    models = {"target": target}
    for quant in args.quants.split(","):
        lean = variant(draft, quant, progress=False)
        for vocab in (int(k) for k in args.heads.split(",")):
            models[label(quant, vocab)] = variant(lean, "none", vocab, progress=False) if vocab else lean
    times = {name: [] for name in models}
    for r in range(args.rounds):
        for name, loaded in models.items():
            times[name].append(measure_forward_cost(loaded.model, [1, 4], prefix=200, repeats=3, seed=r))
        print(f"round {r + 1}/{args.rounds}", flush=True)
    text_sets = {"reference": reference_ids(target.tokenizer)}
    if args.held_out:
        text_sets["held-out"] = [target.tokenizer(Path(f).read_text(), add_special_tokens=False)["input_ids"][:768]
                                 for f in args.held_out.split(",")]
    agree = {}
    for kind, ids in text_sets.items():
        texts = fitting(ids, target.model, draft.model)
        with torch.inference_mode():
            choices = target_choices(target.model, texts)
            agree[kind] = {name: agreement_with(choices, m.model, texts) for name, m in models.items()
                           if name != "target"}
    best = {name: [min(t[i] for t in ts) for i in range(2)] for name, ts in times.items()}
    t1 = best["target"][0]
    print(f"\nhost: {this_cpu().describe()}, {torch.get_num_threads()} threads; fastest of {args.rounds} rounds; "
          f"target t(1) = {t1 * 1e3:.1f} ms, t(4)/t(1) = {best['target'][1] / t1:.2f}\n")
    extra = " top-1 agreement, held-out |" if args.held_out else ""
    print(f"| draft variant | head MB | d(1) ms | d(1)/t(1) | d(4)/d(1) | top-1 agreement | top-4 coverage |{extra}")
    print("|---|---|---|---|---|---|---|" + ("---|" if extra else ""))
    rows = {}
    for name, (d1, d4) in best.items():
        if name == "target":
            continue
        a = agree["reference"][name]
        rows[name] = dict(d1=d1, d4=d4, d1_over_t1=d1 / t1, d4_over_d1=d4 / d1, agreement=a.top1, coverage4=a.cover,
                          head_mb=head_mb(models[name].model))
        held = ""
        if "held-out" in agree:
            rows[name]["agreement_held_out"] = agree["held-out"][name].top1
            held = f" {agree['held-out'][name].top1:.3f} |"
        print(f"| {name} | {rows[name]['head_mb']:.0f} | {d1 * 1e3:.2f} | {d1 / t1:.3f} | {d4 / d1:.2f} | "
              f"{a.top1:.3f} | {a.cover:.3f} |{held}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(host=this_cpu().describe(), threads=torch.get_num_threads(),
                                                  rounds=args.rounds, target=dict(t1=t1, t4=best["target"][1]),
                                                  variants=rows, times=times), indent=1))


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
