"""How big a tree pays: the runtime model of STree (Wu et al., Sec. 4, eqs. 7-8).

Wall time per token is t(N) / tau: the cost t(N) of one target forward over a tree of N tokens, divided by the tokens
tau committed per step. A state-space model's forward costs about t(N) = k*N + C (linear in the input); attention
and hybrids about t(N) = a*N^2 + b*N + c. A larger tree (N2 tokens, tau2 per step) beats a smaller one (N1, tau1) iff

    tau2 / tau1 >= t(N2) / t(N1).

`measure_forward_cost` times a model's tree forwards (median of repeats, on a ~200-token prefix) through the same
sessions generation uses; `fit_runtime` fits the curve by least squares; `larger_tree_pays` is the decision rule.
`arborspec profile --model SPEC` runs all three and plots them.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import numpy as np

KINDS = ("linear", "quadratic")
DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class RuntimeModel:
    """t(N) = k*N + C (kind 'linear', coeffs (k, C)) or a*N^2 + b*N + c ('quadratic', coeffs (a, b, c)); seconds."""

    kind: str
    coeffs: tuple[float, ...]

    def __call__(self, n: float) -> float:
        return float(np.polyval(self.coeffs, n))

    def describe(self, unit: float = 1e3, suffix: str = "ms") -> str:
        c = [x * unit for x in self.coeffs]
        if self.kind == "linear":
            return f"t(N) = {c[0]:.4g}*N + {c[1]:.4g} {suffix}"
        return f"t(N) = {c[0]:.4g}*N^2 + {c[1]:.4g}*N + {c[2]:.4g} {suffix}"


def fit_runtime(sizes, times, kind: str = "linear") -> RuntimeModel:
    """Least-squares fit of measured forward times (seconds) against tree sizes."""
    if kind not in KINDS:
        raise ValueError(f"unknown runtime model {kind!r}; choose one of: {', '.join(KINDS)}")
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    degree = 1 if kind == "linear" else 2
    if n.shape != t.shape or len(set(n.tolist())) < degree + 1:
        raise ValueError(f"a {kind} fit needs at least {degree + 1} distinct sizes with one time each")
    design = np.vander(n, degree + 1)  # columns N^degree ... N^0
    coeffs, *_ = np.linalg.lstsq(design, t, rcond=None)
    return RuntimeModel(kind, tuple(float(c) for c in coeffs))


def required_tau_ratio(model: RuntimeModel, n1: float, n2: float) -> float:
    """t(N2) / t(N1): how many times more tokens per step the N2-token tree must commit to pay (eqs. 7-8)."""
    t1 = model(n1)
    if t1 <= 0:
        raise ValueError(f"the runtime model predicts a non-positive time {t1} at N = {n1}")
    return model(n2) / t1


def larger_tree_pays(tau1: float, n1: float, tau2: float, n2: float, model: RuntimeModel) -> bool:
    """True iff the N2-token tree (tau2 tokens per step) is at least as fast as the N1-token one (tau1): eqs. 7-8."""
    if tau1 <= 0 or tau2 <= 0:
        raise ValueError("acceptance lengths (tokens per step) must be positive")
    return tau2 / tau1 >= required_tau_ratio(model, n1, n2)


def default_kind(model) -> str:
    """'linear' for a pure SSM (no attention layer), 'quadratic' for attention models and hybrids."""
    kind = getattr(model.config, "model_type", "")
    return "linear" if kind in ("mamba", "mamba2", "falcon_mamba") else "quadratic"


# ---- measuring ------------------------------------------------------------------------------------------------------
def full_tree(n: int, root: int, tokens: list[int], arity: int = 2):
    """An n-token complete `arity`-ary tree (parents first), root token `root`, other tokens from `tokens`."""
    from .tree import TokenTree

    tree = TokenTree.root(root)
    for i in range(1, n):
        tree.add((i - 1) // arity, tokens[(i - 1) % len(tokens)])
    return tree


def measure_forward_cost(model, sizes=DEFAULT_SIZES, prefix: int = 200, repeats: int = 3, ssm_tree: str = "packed",
                         seed: int = 0) -> list[float]:
    """Median seconds of one forward over an N-token complete binary tree, for each N in `sizes`.

    One session is prefilled with `prefix` random tokens; each timed forward is followed by commit([0]), so the
    prefix grows by one token per call (by len(sizes) * (repeats + 1) in all). One untimed warm-up call per size.
    """
    from .models import make_session

    rng = random.Random(seed)
    vocab = int(model.config.vocab_size)
    context = [rng.randrange(vocab) for _ in range(prefix)]
    session = make_session(model, "target", ssm_tree=ssm_tree)
    session.prefill(context[:-1])
    out = []
    for n in sizes:
        times = []
        for rep in range(repeats + 1):
            tree = full_tree(n, context[-1], [rng.randrange(vocab) for _ in range(max(n - 1, 1))])
            start = time.perf_counter()
            session.forward(context, tree, list(range(len(tree))))
            elapsed = time.perf_counter() - start
            session.commit([0])
            context.append(rng.randrange(vocab))
            if rep:
                times.append(elapsed)
        out.append(statistics.median(times))
    return out


def plot_profile(sizes, times, model: RuntimeModel, out: str, title: str = "", n1: int = 5) -> str:
    """Two panels: measured t(N) with the fitted curve, and the required tau2/tau1 against N2 for N1 = n1 (Fig. 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    grid = np.linspace(min(sizes), max(sizes), 200)
    ax1.plot(sizes, [t * 1e3 for t in times], "o", label="measured (median)")
    ax1.plot(grid, [model(g) * 1e3 for g in grid], "-", label=model.describe())
    ax1.set_xlabel("tree tokens N")
    ax1.set_ylabel("forward time (ms)")
    ax1.legend(fontsize=8)
    ax1.set_title(title or "forward cost")
    n2 = np.arange(n1, max(max(sizes), n1 + 1) + 1)
    ax2.plot(n2, [required_tau_ratio(model, n1, x) for x in n2])
    ax2.axhline(1.0, color="grey", lw=0.5)
    ax2.set_xlabel("larger tree N2")
    ax2.set_ylabel(f"required tau2 / tau1 (N1 = {n1})")
    ax2.set_title("a larger tree pays above this curve")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
