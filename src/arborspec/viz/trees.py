"""Pictures of drafted trees: what a policy proposed at each step and what the target accepted.

`draw_trees(trees, tokenizer, path)` takes the `StepStats.tree` dicts a `SpeculativeDecoder(..., record_trees=True)`
records (tokens, parents, probs, path, bonus) and draws one panel per step: the root (last committed token) on the
left, depth to the right, every node labelled with its decoded token and its draft probability given its parent.
The accepted path is green, the target's bonus token orange (dashed edge); rejected nodes are grey.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

from .canvas import pyplot

ACCEPTED, REJECTED, BONUS, ROOT = "#2e9d48", "#c9c9c9", "#f08c1a", "#5b8bd9"


def token_label(tokenizer, token: int, width: int = 10) -> str:
    """A short, visible rendering of one token (spaces as middle dots, control characters escaped; a dollar sign
    escaped too: matplotlib reads a label with two as math, and Qwen's `$$` token failed `arborspec trees`)."""
    if tokenizer is None:
        text = str(token)
    else:
        text = tokenizer.decode([token])
    text = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r").replace(" ", "·")
    text = text.replace("$", "\\$")
    if not text:
        text = f"<{token}>"
    return text if len(text) <= width else text[: width - 1] + "…"


def tree_layout(parents: list[int]) -> tuple[list[float], int]:
    """(y of every node, number of leaves): leaves on consecutive rows in depth-first order, parents centred."""
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    y = [0.0] * len(parents)
    row = 0
    order, stack = [], [0]
    while stack:  # pre-order, first child first: leaves get consecutive rows, first child on top
        node = stack.pop()
        order.append(node)
        if not kids[node]:
            y[node] = row
            row += 1
        stack.extend(reversed(kids[node]))
    for node in reversed(order):  # children before parents
        if kids[node]:
            y[node] = sum(y[c] for c in kids[node]) / len(kids[node])
    return y, max(row, 1)


def draw_trees(trees: list[dict], tokenizer, path: str, title: str = "", max_nodes: int = 400) -> str:
    """Draw the recorded trees (one panel each) into a PNG at `path`; returns the path."""
    plt = pyplot()
    if not trees:
        raise ValueError("no trees to draw")
    layouts = []
    for t in trees:
        parents = t["parents"][:max_nodes]
        accepted = t.get("path", [])
        last = accepted[-1] if accepted else 0
        bonus = "bonus" in t and last < len(parents)
        y, leaves = tree_layout(parents + ([last] if bonus else []))  # the bonus gets a row of its own
        layouts.append((y, leaves))
    depths = []
    for t in trees:
        d = [0] * len(t["parents"])
        for i, p in enumerate(t["parents"]):
            if p >= 0:
                d[i] = d[p] + 1
        depths.append(d)
    max_depth = max(max(d) for d in depths) + 1  # + the bonus column
    heights = [max(1.8, 0.45 * (leaves + 1)) for _, leaves in layouts]
    fig, axes = plt.subplots(len(trees), 1, figsize=(1.25 * (max_depth + 1) + 0.8, sum(heights) + 0.5 * len(trees)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for k, (t, (y, leaves), d) in enumerate(zip(trees, layouts, depths)):
        ax = axes[k][0]
        n = min(len(t["parents"]), max_nodes)
        tokens, parents, probs = t["tokens"][:n], t["parents"][:n], t["probs"][:n]
        on_path = {0} | {i for i in t.get("path", []) if i < n}
        last = t["path"][-1] if t.get("path") else 0
        for i in range(1, n):
            p = parents[i]
            good = i in on_path
            ax.plot([d[p], d[i]], [y[p], y[i]], color=ACCEPTED if good else REJECTED, lw=2.2 if good else 0.8,
                    zorder=1)
        for i in range(n):
            color = ROOT if i == 0 else ACCEPTED if i in on_path else "white"
            label = token_label(tokenizer, tokens[i])
            if i:
                label += f"\n{probs[i]:.2f}"
            ax.text(d[i], y[i], label, ha="center", va="center", fontsize=8, zorder=3,
                    color="white" if i in on_path else "black", family="monospace",
                    bbox=dict(boxstyle="round,pad=0.25", fc=color, ec="#777777", lw=0.6))
        if len(y) > n:  # the bonus token, laid out as one more child of the last accepted node
            bx, by = d[last] + 1, y[n]
            ax.plot([d[last], bx], [y[last], by], color=BONUS, lw=1.6, ls="--", zorder=1)
            ax.text(bx, by, token_label(tokenizer, t["bonus"]) + "\nbonus", ha="center", va="center", fontsize=8,
                    family="monospace", zorder=3, bbox=dict(boxstyle="round,pad=0.25", fc=BONUS, ec="#777777", lw=0.6))
        ax.set_xlim(-0.6, max_depth + 0.6)
        ax.set_ylim(leaves - 0.4, -0.6)
        ax.set_xticks(range(max_depth + 1))
        ax.set_yticks([])
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        shown = "" if n == len(t["tokens"]) else f" (first {n} drawn)"
        ax.set_title(f"step {k + 1}: {len(t['tokens']) - 1} drafted, {len(t.get('path', []))} accepted{shown}",
                     fontsize=9, loc="left")
    axes[-1][0].set_xlabel("depth")
    top = 1.0
    if title:  # placed and wrapped in inches: a fraction of a 90-inch-tall figure put it over the first tree
        width, height = fig.get_size_inches()
        lines = textwrap.wrap(title, max(20, int(width * 11)))  # ~11 characters an inch at 10 pt
        fig.suptitle("\n".join(lines), fontsize=10, y=1 - 0.1 / height, va="top")
        top = 1 - (0.2 + 0.2 * len(lines)) / height
    fig.tight_layout(rect=(0, 0, 1, top))
    path = str(path) if Path(path).suffix else f"{path}.png"  # what matplotlib writes for a name without one
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
