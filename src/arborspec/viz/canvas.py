"""matplotlib, set up once: every figure arborspec draws (bench plots, cost profiles, trees) goes through here.

The Agg backend draws into files without a display (servers, CI); it is chosen before pyplot is first imported.
matplotlib is imported lazily, so `import arborspec` stays fast for users who never plot.
"""
from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grid(n: int, width: float = 6.5, height: float = 3.6, cols: int = 1):
    """A figure with `n` panels in `cols` columns: (figure, flat list of axes; spare axes included)."""
    rows = -(-n // cols)
    fig, axes = pyplot().subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    return fig, [ax for row in axes for ax in row]


def save_figure(fig, path: Path | str, dpi: int = 110) -> str:
    """Lay out, write (creating the directory) and close `fig`; returns the path written, as a string (a name
    without a suffix gets ".png", as matplotlib writes it: the path printed was the one given)."""
    path = Path(path) if Path(path).suffix else Path(f"{path}.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return str(path)
