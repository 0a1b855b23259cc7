"""Cost profiles drawn: one model's measured t(N) with STree's fitted runtime model (`plot_profile`, `arborspec profile
--model`), and the two curves the auto policy sizes its trees by (`plot_pair`, `arborspec profile --pair`). The
curves themselves are measured and cached in costs.py."""
from __future__ import annotations

import numpy as np

from ..viz.canvas import pyplot, save_figure
from .runtime_model import RuntimeModel, required_tau_ratio


def plot_profile(sizes, times, model: RuntimeModel, out: str, title: str = "", n1: int = 5) -> str:
    """Two panels: measured t(N) with the fitted curve, and the required tau2/tau1 against N2 for N1 = n1 (STree
    Fig. 2)."""
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(10, 4))
    grid = np.linspace(min(sizes), max(sizes), 200)
    ax1.plot(sizes, [t * 1e3 for t in times], "o", label="measured (fastest of repeats)")
    ax1.plot(grid, [model(g) * 1e3 for g in grid], "-", label=model.describe())
    ax1.set_xlabel("tree tokens N")
    ax1.set_ylabel("forward time (ms)")
    ax1.legend(fontsize=8)
    ax1.set_title(title or "forward cost")
    n2 = np.arange(n1, max(max(sizes), n1 + 1) + 1)
    if model(n1) > 0:
        ax2.plot(n2, [required_tau_ratio(model, n1, x) for x in n2])
    else:
        ax2.text(0.5, 0.5, f"the fit is not positive at N1 = {n1}", ha="center", transform=ax2.transAxes)
    ax2.axhline(1.0, color="grey", lw=0.5)
    ax2.set_xlabel("larger tree N2")
    ax2.set_ylabel(f"required tau2 / tau1 (N1 = {n1})")
    ax2.set_title("a larger tree pays above this curve")
    return save_figure(fig, out, dpi=120)


def plot_pair(target, draft, out: str, title: str = "") -> str:
    """The auto policy's cost model: t(n) of the target and d(w) of the draft (CostCurve each), absolute and
    relative to t(1)."""
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(10, 4))
    for curve, label in ((target, "target t(n): verify n tree tokens"), (draft, "draft d(n): one layer of n nodes")):
        grid = np.arange(1, max(curve.sizes) + 1)
        line, = ax1.plot(grid, curve(grid) * 1e3, "-", label=label)  # its dots and its right-hand line: its colour
        ax1.plot(curve.sizes, [t * 1e3 for t in curve.times], "o", color=line.get_color())
        ax2.plot(grid, curve(grid) / target(1), "-", label=label.split(":")[0], color=line.get_color())
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("tokens n")
    ax1.set_ylabel("ms per call")
    ax1.legend(fontsize=8)
    ax1.set_title(title or "cost profile")
    ax2.set_xscale("log", base=2)
    ax2.axhline(1.0, color="grey", lw=0.5)
    ax2.set_xlabel("tokens n")
    ax2.set_ylabel("cost / target t(1)")
    ax2.legend(fontsize=8)
    return save_figure(fig, out, dpi=120)
