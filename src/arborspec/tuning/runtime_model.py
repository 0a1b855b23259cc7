"""How big a tree pays: the runtime model of STree (Wu et al., Sec. 4, eqs. 7-8).

Wall time per token is t(N) / tau: the cost t(N) of one target forward over a tree of N tokens, divided by the tokens
tau committed per step. A state-space model's forward costs about t(N) = k*N + C (linear in the input); attention
and hybrids about t(N) = a*N^2 + b*N + c. A larger tree (N2 tokens, tau2 per step) beats a smaller one (N1, tau1) iff

    tau2 / tau1 >= t(N2) / t(N1).

`fit_runtime` fits the curve to measured times (`costs.measure_forward_cost`) by least squares; `larger_tree_pays`
is the decision rule. `arborspec profile --model SPEC` measures, fits and plots (`cost_plots.plot_profile`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("linear", "quadratic")
SSM_ONLY_TYPES = ("mamba", "mamba2", "falcon_mamba")  # model types without any attention layer


@dataclass(frozen=True)
class RuntimeModel:
    """t(N) = k*N + C (kind 'linear', coeffs (k, C)) or a*N^2 + b*N + c ('quadratic', coeffs (a, b, c)); seconds."""

    kind: str
    coeffs: tuple[float, ...]

    def __call__(self, n: float) -> float:
        return float(np.polyval(self.coeffs, n))

    def describe(self, unit: float = 1e3, suffix: str = "ms") -> str:
        """The fit as a formula, each sign written once ("+ -0.54*N" read as a typo)."""
        c = [x * unit for x in self.coeffs]
        terms = [f"{abs(v):.4g}{power}" for v, power in zip(c, ["*N^2", "*N", ""][-len(c):])]
        text = ("-" if c[0] < 0 else "") + terms[0]
        text += "".join(f" {'-' if v < 0 else '+'} {term}" for v, term in zip(c[1:], terms[1:]))
        return f"t(N) = {text} {suffix}"


def check_fit_sizes(sizes, kind: str) -> int:
    """The fit's degree; ValueError unless `sizes` has enough distinct sizes for it (the CLI asks before measuring)."""
    degree = 1 if kind == "linear" else 2
    if len(set(sizes)) < degree + 1:
        raise ValueError(f"a {kind} fit needs at least {degree + 1} distinct sizes with one time each")
    return degree


def fit_runtime(sizes, times, kind: str = "linear") -> RuntimeModel:
    """Least-squares fit of measured forward times (seconds) against tree sizes."""
    if kind not in KINDS:
        raise ValueError(f"unknown runtime model {kind!r}; choose one of: {', '.join(KINDS)}")
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    degree = check_fit_sizes(sizes, kind)
    if n.shape != t.shape:
        raise ValueError(f"a {kind} fit needs one time for each size")
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
    return "linear" if kind in SSM_ONLY_TYPES else "quadratic"
