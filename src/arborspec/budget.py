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


# ---- profiles: measured cost curves, cached per model, dtype, thread count, machine and library version ---------
# `arborspec.drafting.auto` sizes every tree from two measured curves: the target's t(n) (one forward over n tree
# tokens, root included) and the draft's d(w) (one draft call over w nodes: the cost of one drafted layer). Both come
# from `measure_forward_cost` and are cached under cache_dir()/profiles/ as JSON. A cached profile is used only when
# its key (model fingerprint, dtype, torch threads, machine) and its versions (profile format, arborspec, torch,
# transformers) equal the current ones; otherwise it is measured again and overwritten.
PROFILE_FORMAT = 1
PROFILE_SIZES = DEFAULT_SIZES


def library_versions() -> dict:
    """What a cached profile or calibration was made with; any change invalidates it."""
    import torch
    import transformers

    from . import __version__

    return {"format": PROFILE_FORMAT, "arborspec": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def machine_id() -> str:
    """CPU model, logical cores and architecture (not the host name: containers rename hosts, not CPUs)."""
    import os
    import platform
    from pathlib import Path

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu or platform.processor() or 'cpu'} x{os.cpu_count()} {platform.machine()}"


def model_fingerprint(model) -> str:
    """A short hash that changes when the model does: class, config, module types (quantized layers are other
    classes), parameter count, dtypes, and a sample of the first and last weights."""
    import hashlib

    h = hashlib.sha256(type(model).__name__.encode())
    try:
        h.update(model.config.to_json_string(use_diff=False).encode())
    except Exception:  # an exotic config: its repr still names the architecture
        h.update(repr(model.config).encode())
    h.update(",".join(sorted({type(m).__name__ for m in model.modules()})).encode())
    params = list(model.named_parameters())
    h.update(str(sum(p.numel() for _, p in params)).encode())
    for name, p in params[:2] + params[-2:]:
        h.update(f"{name}:{type(p).__name__}:{p.dtype}:{tuple(p.shape)}".encode())
        try:
            h.update(np.asarray(p.detach().reshape(-1)[:64].float().cpu()).tobytes())
        except Exception:  # a packed / quantized tensor without a plain view
            pass
    return h.hexdigest()[:20]


def profile_key(model) -> dict:
    import torch

    return {"model": model_fingerprint(model), "name": str(getattr(model.config, "_name_or_path", "") or ""),
            "dtype": str(model.dtype), "threads": torch.get_num_threads(), "machine": machine_id()}


def _key_file(kind: str, key: dict):
    import hashlib
    import json

    from .models.loading import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "profiles" / f"{kind}-{digest}.json"


def read_cached(kind: str, key: dict) -> dict | None:
    """The cached JSON record for `key`, or None if missing, unreadable, or made with another format or library
    version or for another key."""
    import json

    path = _key_file(kind, key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("versions") != library_versions() or data.get("key") != key:
        return None
    return data


def write_cached(kind: str, key: dict, record: dict):
    """Write `record` (plus key and versions) atomically; returns the path."""
    import json
    import os

    path = _key_file(kind, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(record, key=key, versions=library_versions(), written=time.strftime("%Y-%m-%d %H:%M:%S"))
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path


def _monotone_from(values: list[float], start: int) -> list[float]:
    """values[start:] made non-decreasing by pooling adjacent violators (least squares); values[:start] untouched."""
    out, blocks = list(values), []  # blocks: [mean, count]
    for v in values[start:]:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    i = start
    for mean, count in blocks:
        out[i : i + count] = [mean] * count
        i += count
    return out


@dataclass(frozen=True)
class CostCurve:
    """Measured seconds of one forward over n tree tokens, at `sizes`; piecewise linear in between, linear past the
    last size. From n = 2 on the curve is made non-decreasing (noise only: more tokens never cost less), while t(1)
    is kept as measured (in bf16 a one-token forward can be slower than a two-token one, shared notes)."""

    sizes: tuple[int, ...]
    times: tuple[float, ...]

    @classmethod
    def from_measurements(cls, sizes, times) -> "CostCurve":
        pairs = sorted(zip((int(s) for s in sizes), (float(t) for t in times)))
        if not pairs or any(t <= 0 for _, t in pairs) or len({s for s, _ in pairs}) != len(pairs):
            raise ValueError("a cost curve needs distinct sizes with positive times")
        s, t = zip(*pairs)
        start = next((i for i, n in enumerate(s) if n >= 2), len(s))
        return cls(tuple(s), tuple(_monotone_from(list(t), start)))

    def __call__(self, n):
        n = np.asarray(n, dtype=np.float64)
        out = np.interp(n, self.sizes, self.times)
        if len(self.sizes) > 1:
            slope = (self.times[-1] - self.times[-2]) / (self.sizes[-1] - self.sizes[-2])
            out = np.where(n > self.sizes[-1], self.times[-1] + max(slope, 0.0) * (n - self.sizes[-1]), out)
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "times": list(self.times)}


def profile_model(model, refresh: bool = False, sizes=PROFILE_SIZES, prefix: int = 200, repeats: int = 3,
                  measure=None, progress: bool = False) -> tuple[CostCurve, str]:
    """The model's cost curve t(n) from the cache, or measured now (and cached). Returns (curve, source), source
    'cache' or 'measured'. `measure` (default `measure_forward_cost`) is replaceable for tests."""
    key = profile_key(model)
    cached = None if refresh else read_cached("cost", key)
    if cached is not None:
        try:
            return CostCurve.from_measurements(cached["sizes"], cached["raw_times"]), "cache"
        except (KeyError, TypeError, ValueError):
            pass
    if progress:
        import sys

        print(f"[arborspec] profiling {key['name'] or type(model).__name__} ({key['dtype']}, {key['threads']} threads)"
              " for tree sizes " + ",".join(map(str, sizes)) + " ...", file=sys.stderr, flush=True)
    measure = measure or measure_forward_cost
    window = int(getattr(model.config, "max_position_embeddings", 0) or getattr(model.config, "n_positions", 0) or 0)
    if window:  # the profile's prefix grows by one token per timed call and must leave room for the deepest tree
        prefix = max(2, min(prefix, window - len(sizes) * (repeats + 1) - max(sizes) - 2))
    start = time.perf_counter()
    times = measure(model, sizes, prefix=prefix, repeats=repeats)
    curve = CostCurve.from_measurements(sizes, times)
    write_cached("cost", key, {"sizes": list(sizes), "raw_times": [float(t) for t in times], "prefix": prefix,
                               "repeats": repeats, "seconds": time.perf_counter() - start})
    return curve, "measured"


def profile_path(model):
    """Where `profile_model` keeps `model`'s curve (it may not exist yet)."""
    return _key_file("cost", profile_key(model))


# ---- the objective of automatic tree sizing (derivation: drafting/auto.py) ----------------------------------------
@dataclass
class CostModel:
    """Predicted seconds of one step: draft layers + one target forward + a per-step overhead.

    T(tree) = draft_scale * sum_layers d(w_l) + verify_scale * t(1 + N) + overhead, where w_l is the number of nodes a
    draft call forwards (the root for layer 1), N the drafted nodes. A step without drafting costs
    verify_scale * t(1) + overhead. The scales follow measured step times (machine load, Python work around the
    model calls) when the policy adapts them; with scales 1 and no overhead it is the bare profile.
    """

    target: CostCurve  # t(n), n = tree tokens including the root
    draft: CostCurve  # d(w), w = nodes forwarded by one draft call
    overhead: float = 0.0
    draft_scale: float = 1.0
    verify_scale: float = 1.0

    def layer(self, w):
        return self.draft_scale * self.draft(w)

    def verify(self, n):
        return self.verify_scale * self.target(n)

    def plain_step(self) -> float:
        """Predicted seconds per token of plain decoding (a root-only step)."""
        return self.verify(1) + self.overhead


def best_prefix(expected: float, draft_time: float, nodes: int, gains, costs: CostModel,
                max_add: int | None = None) -> tuple[int, float]:
    """How many of `gains` (expected accepted tokens of candidate nodes, best first) to add to a tree that already
    has `nodes` drafted nodes, `expected` tokens per step and `draft_time` seconds of draft calls, to maximise

        rate(m) = (expected + g_1 + ... + g_m) / (draft_time + t(1 + nodes + m) + overhead),   m = 0 .. len(gains).

    Returns (m*, rate(m*)); ties go to the smaller m (a node must strictly pay)."""
    g = np.asarray(gains, dtype=np.float64)[: max_add if max_add is not None else None]
    cum = np.concatenate([[0.0], np.cumsum(g)])
    m = np.arange(len(cum))
    rates = (expected + cum) / (draft_time + costs.verify(1 + nodes + m) + costs.overhead)
    best = int(np.argmax(rates))  # argmax returns the first maximum: the smallest m
    return best, float(rates[best])


def tree_rate(gains, layer_widths, costs: CostModel) -> float:
    """E[tokens] / T for a tree whose nodes have acceptance probabilities `gains` and whose draft calls forwarded
    `layer_widths` nodes each: (1 + sum gains) / (sum d(w) + t(1 + N) + overhead)."""
    draft = float(sum(costs.layer(w) for w in layer_widths))
    return (1.0 + float(np.sum(gains))) / (draft + costs.verify(1 + len(gains)) + costs.overhead)


def plot_pair(target: CostCurve, draft: CostCurve, out: str, title: str = "") -> str:
    """The auto policy's cost model: t(n) of the target and d(w) of the draft, absolute and relative to t(1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for curve, label in ((target, "target t(n): verify n tree tokens"), (draft, "draft d(n): one layer of n nodes")):
        grid = np.arange(1, max(curve.sizes) + 1)
        ax1.plot(curve.sizes, [t * 1e3 for t in curve.times], "o")
        ax1.plot(grid, curve(grid) * 1e3, "-", label=label)
        ax2.plot(grid, curve(grid) / target(1), "-", label=label.split(":")[0])
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
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
