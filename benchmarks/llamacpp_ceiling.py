"""What llama.cpp's measured cost curves allow speculation to reach at best, on this machine.

A speculative step that drafts a chain of k tokens costs k draft forwards plus one target forward over k + 1 tokens,
t(k + 1), and commits on average E(k) = (1 - a^(k+1)) / (1 - a) tokens when each drafted token is accepted with
probability a (independently: the usual model). Plain decoding commits one token per t(1). So the best speed-up a
chain can reach is

    max over k of  E(k) * t(1) / (k * c + t(k + 1))

with c the draft's cost per token (c = 0 for free drafts: n-gram / suffix branches). Trees do no better here: on
llama.cpp's kernels t(n) grows nearly linearly, so a second branch costs as much as lengthening the chain.

Usage: python benchmarks/llamacpp_ceiling.py [--repeats 5] [--out docs/figures/llamacpp_costs.png]
Prints a markdown table of t(n)/t(1) and of the ceilings; draws t(n)/t(1) of both models with the PyTorch bf16 target
curve measured earlier on this machine (README) for comparison.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from arborspec.console import run_command
from arborspec.loading import load_model
from arborspec.tuning.costs import full_tree
from arborspec.viz.canvas import pyplot, save_figure

SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)
ACCEPTANCE = (0.6, 0.7, 0.8, 0.9)
TORCH_BF16_TARGET = {1: 1.0, 4: 1.0, 8: 1.17, 16: 1.45, 32: 2.03, 64: 3.45}  # README, `arborspec profile --pair`


def forward_times(model, sizes, repeats: int, prefix: int = 200) -> dict[int, float]:
    """Median seconds of one target forward over an n-node tree (a complete binary tree, as `arborspec profile`)."""
    session = model.new_session("profile")
    context = [(7 * i + 3) % 1000 + 10 for i in range(prefix)]
    session.prefill(context[:-1])
    out = {}
    for n in sizes:
        times = []
        for _ in range(repeats + 1):
            tree = full_tree(n, context[-1], [(13 * i + 5) % 1000 + 10 for i in range(n)])
            start = time.perf_counter()
            session.forward(context, tree, list(range(n)))
            times.append(time.perf_counter() - start)
            session.commit([0])
            context = context + [context[-1]]
        out[n] = statistics.median(times[1:])
    return out


def ceiling(t: dict[int, float], draft_cost: float, a: float, max_k: int = 8) -> tuple[float, int]:
    """(best speed-up over plain decoding, its chain length k) under the cost curve t and draft cost per token."""
    best = (1.0, 0)
    for k in range(1, max_k + 1):
        if k + 1 not in t:
            continue
        expected = (1 - a ** (k + 1)) / (1 - a)
        best = max(best, (expected * t[1] / (k * draft_cost + t[k + 1]), k))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="docs/figures/llamacpp_costs.png")
    args = p.parse_args()
    curves = {}
    for role, name in (("target", args.target), ("draft", args.draft)):
        model = load_model(name, backend="llamacpp").model  # threads: all cores this process may use
        curves[role] = forward_times(model, SIZES, args.repeats)
    t, d = curves["target"], curves["draft"]
    print("| model | t(1) ms | " + " | ".join(f"t({n})" for n in SIZES[1:]) + " |")
    print("|---" * (len(SIZES) + 1) + "|")
    for role, curve in curves.items():
        print(f"| {role} | {curve[1] * 1e3:.1f} | " + " | ".join(f"{curve[n] / curve[1]:.2f}" for n in SIZES[1:]) + " |")
    c = d[1] / t[1]
    print(f"\ndraft cost per token: {c:.2f} of a target token\n")
    print("| acceptance a | ceiling, 0.5B draft on llama.cpp (best k) | ceiling, free drafts (best k) |")
    print("|---|---|---|")
    for a in ACCEPTANCE:
        (s_d, k_d), (s_f, k_f) = ceiling(t, d[1], a), ceiling(t, 0.0, a)
        print(f"| {a:.1f} | {s_d:.2f}x (k={k_d}) | {s_f:.2f}x (k={k_f}) |")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for role, curve in curves.items():
        ax.plot(list(curve), [curve[n] / curve[1] for n in curve], "o-", label=f"llama.cpp Q4_K_M {role}")
    ax.plot(list(TORCH_BF16_TARGET), list(TORCH_BF16_TARGET.values()), "s--", label="PyTorch bf16 target (earlier run)")
    ax.plot([1, 64], [1, 64], ":", color="grey", label="t(n) = n t(1)")
    ax.set(xscale="log", yscale="log", xlabel="tokens in one forward (n)", ylabel="t(n) / t(1)",
           title="verification cost on this CPU (2 threads)")
    ax.legend(fontsize=8)
    print("\n" + save_figure(fig, args.out))


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
