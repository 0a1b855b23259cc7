"""auto: hardware-aware trees. Each step grows a DySpec-valued tree one draft layer at a time while the next layer
raises the expected tokens per second *on this machine*, and a guard falls back to plain decoding when speculation
is measured slower than plain decoding.

Costs (measured once per model, dtype, thread count and machine; cached, `budget.profile_model`): t(n), one target
forward over n tree tokens (root included), and d(w), one draft call over w nodes (the cost of drafting one layer).
A step whose draft calls forwarded w_1, ..., w_L nodes (w_1 = 1: the root) and which drafted N nodes takes

    T(S) = sum_l d(w_l) + t(1 + N) + c                                   (c: per-step overhead, measured online)

and commits, in expectation (linearity over the nodes; the bonus token always comes),

    E(S) = 1 + sum_{u in S} a(score_u),      a(score) = P(node u is on the accepted path | its score).

The objective is the rate R(S) = E(S) / T(S), tokens per second (STree's t/tau, eqs. 7-8, with tau = E). Plain
decoding is the root-only tree: R_0 = 1 / (t(1) + c).

Scores (DySpec's node values). At temperature 0 a node's score is its path probability under the draft,
x_u = product of draft probabilities along its path (DySpec Fig. 2: draft probability approximates acceptance), and
the children of u are its top draft tokens. At temperature > 0 children are drawn one at a time without replacement
(verified by multi-branch rejection, `mbr`); the j-th draw under u comes from the residual R_j (the draft's q with
the earlier draws removed) and its score is its *expected* path probability x_u * sum_y R_j(y) q(y), known before
the token is drawn; the drawn child's own path probability x_u * q(y_j) scores its children.

Calibration (learned per run; persisted per model pair, dtype, thread count, sampling setting and library versions
in cache_dir()/profiles/calibration-*.json, and loaded with each bin capped at 100 observations): a(.) starts as the identity and is
estimated in score bins [e_b, e_{b+1}) with a Beta(k * m_b, k * (1 - m_b)) prior (m_b the bin centre, k =
`PRIOR_STRENGTH`): after every step each drafted node adds a hit (it is on the accepted path) or a miss to its bin.
The posterior means are made non-decreasing (pool adjacent violators) and a(.) is linear between bin centres.
Old evidence is down-weighted once a bin holds `MAX_EVIDENCE` observations, so the estimate follows the text.

Growing the tree, one draft call per layer; F = the newest layer (the frontier), best score first:

1. Whether to call the draft (before the call). Children are predicted as x_u * c_j, with c_j a running mean of
   the draft's j-th largest probability (T = 0) or of the j-th draw's expected probability (T > 0). For f in
   1, 2, 3, 4, 5, 6, 8, ..., 64 (f <= |F|):

       R_pred(f) = max_m (E + [m best predicted gains among the children of the f best frontier nodes])
                         / (D + d(f) + t(1 + N + m) + c)

   with D the draft time spent so far. The f* best frontier nodes are forwarded iff max_f R_pred(f) > R(S);
   otherwise the tree is final.
2. Which children to add (after the call), `budget.best_prefix`: with the real candidates' gains g_1 >= g_2 >= ...,
   add the m* best, m* = argmax_m (E + g_1 + ... + g_m) / (D + t(1 + N + m) + c), D now including the call just
   made. m* = 0 ends the tree (that call was wasted: `wasted` in the per-step stats). At T > 0 the candidates are
   drawn one at a time and the test runs before each draw over the slots already known, so whether a child exists
   never depends on its own token (this is what keeps multi-branch rejection exact).

Why stop at the first layer that does not pay: adding a layer of gain g and cost D_l turns R = E/T into
(E + g)/(T + D_l), a weighted mean of R and g/D_l; it raises R iff g/D_l > R. When layer gains shrink and layer costs
do not (the usual case: values are products of probabilities), once g/D_l < R the next layer's ratio is smaller still
while R stays above it, so R is unimodal in the depth and the first non-paying layer is the optimum. Within a layer
the choice of m is exact. tests/drafting/test_auto.py checks both against brute force on synthetic costs.

The guard. The measured rate of the last `guard_window` drafted steps (committed tokens / measured step seconds,
the slowest step left out) is compared with the plain-decoding rate (the median of recent measured root-only steps when there are some, else
1 / (t(1) + c) from the scaled profile). If it falls below (1 - `guard_margin`) times that, the next
`guard_cooldown` steps are plain (root-only trees, no draft call), then speculation is probed again; each failed
probe doubles the cooldown (up to 16x), a passed one resets it. After `guard_cooldown` consecutive steps in which
the objective itself chose plain decoding, one step drafts anyway (a probe), so the calibration can recover.

Cost adaptation (`adapt_costs`): measured draft and verify seconds rescale d and t (the median of the last
`COST_WINDOW` measured / predicted ratios, starting from two prior ratios of 1, clamped to [0.1, 20]; a median shrugs off one-off stalls; the draft's
first call is predicted with the tokens it catches up on), and c is the
median of the engine's other time; load that slows both models alike leaves the trees unchanged, a draft that got
relatively slower makes them smaller.

Exactness: a tree depends only on the draft's outputs for this step, on draws from the step's generator, and on
the past (calibration, timings, guard state), never on the target's verdict for the step being drafted. Timing
makes trees vary from run to run, so sampled outputs with a fixed seed can differ between runs (each one exact).

`result.stats.policy` (GenerationStats) explains the choices: per step the mode, layer widths, predicted tokens and
seconds and why growth stopped; the calibration curve; the predictor; the cost model and its source; the guard's
decisions.
"""
from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass

import numpy as np
import torch

from ..budget import CostModel, best_prefix
from ..tree import DrawRule, TokenTree
from .base import DraftContext, Policy, opt, parse_bool
from .dyspec import check_int

EDGES = (0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
PRIOR_STRENGTH = 2.0
MAX_EVIDENCE = 400.0
MAX_FORWARD = 64  # nodes one draft call may forward
FORWARD_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)  # frontier prefixes tried (bounded work)
PREDICTOR_RATE = 0.1  # running-mean step of the child-probability predictor, per forwarded row
COST_WINDOW = 15  # steps whose measured / predicted cost ratios set the cost scales (their median)
DEFAULT_CHILD_PROBS = (0.6, 0.15, 0.06, 0.03, 0.02, 0.01, 0.01, 0.005)


# ---- calibration -----------------------------------------------------------------------------------------------
def pool_adjacent_violators(values, weights) -> np.ndarray:
    """The non-decreasing sequence closest to `values` in weighted least squares."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.concatenate([[m] * c for m, _, c in blocks]) if blocks else np.zeros(0)


class Calibrator:
    """Binned Beta estimator of P(accepted | score), monotone, prior = identity (see the module docstring)."""

    def __init__(self, edges=EDGES, prior_strength: float = PRIOR_STRENGTH, max_evidence: float = MAX_EVIDENCE,
                 enabled: bool = True):
        self.edges = np.asarray(edges, dtype=np.float64)
        self.centers = (self.edges[:-1] + self.edges[1:]) / 2
        self.prior_strength, self.max_evidence, self.enabled = prior_strength, max_evidence, enabled
        self.hits = np.zeros(len(self.centers))
        self.trials = np.zeros(len(self.centers))
        self._curve: np.ndarray | None = None

    def observe(self, scores, accepted) -> None:
        if not self.enabled or len(scores) == 0:
            return
        idx = np.clip(np.searchsorted(self.edges, np.asarray(scores, dtype=np.float64), side="right") - 1,
                      0, len(self.centers) - 1)
        np.add.at(self.trials, idx, 1.0)
        np.add.at(self.hits, idx, np.asarray(accepted, dtype=np.float64))
        over = self.trials > self.max_evidence
        if over.any():  # forget old evidence proportionally
            scale = self.max_evidence / self.trials[over]
            self.trials[over] *= scale
            self.hits[over] *= scale
        self._curve = None

    def curve(self) -> np.ndarray:
        """Monotone posterior mean acceptance per bin."""
        if self._curve is None:
            k = self.prior_strength
            post = (k * self.centers + self.hits) / (k + self.trials)
            self._curve = np.clip(pool_adjacent_violators(post, k + self.trials), 0.0, 1.0)
        return self._curve

    def __call__(self, score):
        """a(score), vectorised; the identity when calibration is off."""
        s = np.clip(np.asarray(score, dtype=np.float64), 0.0, 1.0)
        if not self.enabled:
            return s
        c = self.curve()
        return np.interp(s, np.concatenate([[0.0], self.centers, [1.0]]), np.concatenate([[0.0], c, [c[-1]]]))

    def to_dict(self) -> dict:
        return {"edges": self.edges.tolist(), "hits": self.hits.tolist(), "trials": self.trials.tolist()}

    def load(self, data: dict, cap: float = 100.0) -> bool:
        """Start from saved evidence (each bin capped at `cap` observations, so this run can still move it)."""
        try:
            if list(data["edges"]) != self.edges.tolist():
                return False
            hits, trials = np.asarray(data["hits"], dtype=np.float64), np.asarray(data["trials"], dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            return False
        if hits.shape != self.hits.shape or trials.shape != self.trials.shape or (hits > trials + 1e-9).any():
            return False
        scale = np.where(trials > cap, cap / np.maximum(trials, 1e-12), 1.0)
        self.hits, self.trials = hits * scale, trials * scale
        self._curve = None
        return True

    def describe(self) -> list[dict]:
        c = self.curve() if self.enabled else self.centers
        return [{"score": [round(float(lo), 4), round(float(hi), 4)], "prior": round(float(m), 4),
                 "observed": round(float(n), 1), "hits": round(float(h), 1), "acceptance": round(float(a), 4)}
                for lo, hi, m, n, h, a in zip(self.edges[:-1], self.edges[1:], self.centers, self.trials, self.hits, c)]


# ---- the guard -------------------------------------------------------------------------------------------------
class Guard:
    """Never much slower than plain decoding: see the module docstring. Pure bookkeeping on measured step times."""

    def __init__(self, margin: float = 0.1, window: int = 8, cooldown: int = 16, max_backoff: int = 16,
                 enabled: bool = True):
        self.margin, self.window, self.cooldown, self.max_backoff, self.enabled = margin, window, cooldown, \
            max_backoff, enabled
        self.recent: collections.deque = collections.deque(maxlen=window)  # (seconds, tokens) of drafted steps
        self.plain: collections.deque = collections.deque(maxlen=16)  # measured seconds per token of plain steps
        self.ar_left = 0  # plain steps still to go in a fallback
        self.backoff = 1
        self.probing = False  # the window after a fallback decides whether speculation came back
        self.idle = 0  # consecutive steps the objective chose plain decoding
        self.steps = 0
        self.decisions: list[dict] = []

    def plan(self) -> str:
        """'ar' during a fallback, 'probe' when speculation must be tried (after a long plain stretch), else 'spec'."""
        if not self.enabled:
            return "spec"
        if self.ar_left > 0:
            return "ar"
        return "probe" if self.idle >= self.cooldown else "spec"

    def plain_time(self, model_estimate: float) -> tuple[float, str]:
        if len(self.plain) >= 2:
            return float(np.median(self.plain)), "measured"
        return model_estimate, "profile"

    def observe(self, seconds: float, tokens: int, mode: str, drafted: bool, model_plain: float) -> dict | None:
        """Record one finished step (its measured seconds and committed tokens; `mode` as planned, `drafted` whether
        the tree had drafted nodes); returns the decision it caused, if any."""
        self.steps += 1
        if not self.enabled:
            return None
        if not drafted and tokens >= 1:
            self.plain.append(seconds / tokens)
        if mode == "ar":
            self.ar_left -= 1
            if self.ar_left <= 0:
                self.ar_left, self.probing, self.idle = 0, True, 0
                self.recent.clear()
                return self._decide("probe", None, model_plain)
            return None
        if not drafted:
            self.idle += 1
            return None
        self.idle = 0
        self.recent.append((seconds, tokens))
        if len(self.recent) < self.window:
            return None
        rate = self.rate()
        plain, _ = self.plain_time(model_plain)
        if rate < (1 - self.margin) / plain:
            self.ar_left = self.cooldown * self.backoff
            self.backoff = min(self.backoff * 2, self.max_backoff)
            self.probing = False
            self.recent.clear()
            return self._decide("fallback", rate, model_plain, plain_steps=self.ar_left)
        if self.probing:
            self.probing, self.backoff = False, 1
            return self._decide("resume", rate, model_plain)
        return None

    def rate(self) -> float:
        """Tokens per second over the window, without its slowest step (per token) when it holds 4 or more: one stall
        (a first call with new shapes, a hiccup of the machine) must not trigger a fallback on its own."""
        steps = sorted(self.recent, key=lambda st: st[0] / max(st[1], 1))
        if len(steps) >= 4:
            steps = steps[:-1]
        return sum(t for _, t in steps) / max(sum(s for s, _ in steps), 1e-12)

    def _decide(self, action: str, rate, model_plain: float, **extra) -> dict:
        plain, source = self.plain_time(model_plain)
        d = dict(step=self.steps, action=action, measured_tokens_per_s=None if rate is None else round(rate, 3),
                 plain_tokens_per_s=round(1 / plain, 3), plain_from=source, **extra)
        self.decisions.append(d)
        del self.decisions[:-200]
        return d


# ---- the policy ------------------------------------------------------------------------------------------------
@dataclass
class AutoOptions:
    max_nodes: int = opt(128, "auto: at most this many drafted tokens per step (the profiled range)")
    max_layers: int = opt(16, "auto: at most this many drafted layers (tree depth)")
    max_children: int = opt(8, "auto: at most this many children per node")
    calibration: bool = opt(True, "auto: learn acceptance per draft score online (false: trust a(x) = x)")
    adapt_costs: bool = opt(True, "auto: rescale the profiled costs by measured step times")
    guard: bool = opt(True, "auto: fall back to plain decoding while speculation is measured slower")
    guard_margin: float = opt(0.1, "auto: fall back when measured tokens/s < (1 - margin) x plain decoding's")
    guard_window: int = opt(8, "auto: steps per guard comparison")
    guard_cooldown: int = opt(16, "auto: plain steps before speculation is probed again")
    reprofile: bool = opt(False, "auto: measure the cost profile again instead of using the cached one")
    remember: bool = opt(True, "auto: load and save the calibration in the cache directory")

    def __post_init__(self):
        for name in ("max_nodes", "max_layers", "max_children", "guard_window", "guard_cooldown"):
            check_int(getattr(self, name), name)
        for name in ("calibration", "adapt_costs", "guard", "reprofile", "remember"):
            setattr(self, name, parse_bool(getattr(self, name), name))
        if not 0 <= self.guard_margin < 1:
            raise ValueError(f"guard_margin must be in [0, 1), got {self.guard_margin!r}")


@dataclass
class _Built:
    """What the policy remembers about the tree it drafted last, until `update` sees the verdict."""

    size: int  # nodes of the tree as the policy built it (grafted extras come after)
    scores: list[float]  # per drafted node (index - 1): the calibration score
    draft_raw: float  # predicted draft seconds with the unscaled profile
    mode: str  # as planned: "spec", "probe", "ar" (a guard fallback step) or "room" (no room to draft)
    record: dict


class AutoPolicy(Policy):
    name = "auto"
    summary = "hardware-aware DySpec tree: grow layers while the measured-cost rate rises; plain decoding if it never does"
    Options = AutoOptions
    sampled_rule = DrawRule.WITHOUT_REPLACEMENT  # siblings drawn without replacement: verified exactly by mbr

    def __init__(self, **options):
        super().__init__(**options)
        o = self.options
        self.costs: CostModel | None = None
        self.calibrator = Calibrator(enabled=o.calibration)
        self.child_probs = {True: np.array(DEFAULT_CHILD_PROBS[: o.max_children] + (0.0,) * max(
            0, o.max_children - len(DEFAULT_CHILD_PROBS)))}
        self.child_probs[False] = self.child_probs[True].copy()
        self.guard = Guard(o.guard_margin, o.guard_window, o.guard_cooldown, enabled=o.guard)
        self.source: dict = {"costs": "unset"}
        self._calib_key: dict | None = None
        self._built: _Built | None = None
        self._prev_context: list[int] | None = None
        self._updates = 0
        # measured / predicted ratios; two prior observations of 1 (the profile) keep a first stall from ruling
        self._ratios = {k: collections.deque([1.0, 1.0], maxlen=COST_WINDOW) for k in ("draft", "verify")}
        self._ratios["other"] = collections.deque(maxlen=COST_WINDOW)
        self.run: dict = self._new_run()

    # ---- wiring ---------------------------------------------------------------------------------------------
    @property
    def max_tree_depth(self) -> int:
        return self.options.max_layers

    def use_costs(self, costs: CostModel, source: str = "given") -> "AutoPolicy":
        """Set the cost model directly (tests, or a profile measured elsewhere)."""
        self.costs = costs
        self.source = {"costs": source}
        return self

    def bind(self, decoder) -> None:
        """Profile (or load the cached profiles of) the decoder's target and draft; load the saved calibration."""
        from .. import budget

        if decoder.draft is None:
            return
        if self.costs is None:
            refresh = self.options.reprofile
            t_curve, t_src = budget.profile_model(decoder.target, refresh=refresh, progress=True)
            d_curve, d_src = budget.profile_model(decoder.draft, refresh=refresh, progress=True)
            self.costs = CostModel(t_curve, d_curve)
            self.source = {"costs": f"target {t_src}, draft {d_src}",
                           "target_profile": str(budget.profile_path(decoder.target)),
                           "draft_profile": str(budget.profile_path(decoder.draft))}
        if self.options.remember:
            s, ds = decoder.sampling, decoder.draft_sampling
            self._calib_key = {"target": budget.model_fingerprint(decoder.target),
                               "draft": budget.model_fingerprint(decoder.draft),
                               "dtype": [str(decoder.target.dtype), str(decoder.draft.dtype)],
                               "threads": torch.get_num_threads(),
                               "sampling": [s.temperature, s.top_k, s.top_p],
                               "draft_sampling": [ds.temperature, ds.top_k, ds.top_p]}
            saved = budget.read_cached("calibration", self._calib_key)
            loaded = bool(saved) and self.calibrator.load(saved.get("calibrator", {}))
            if loaded:
                for greedy in (True, False):
                    probs = saved.get("child_probs", {}).get(str(greedy).lower())
                    if isinstance(probs, list) and len(probs) >= 1:
                        arr = self.child_probs[greedy]
                        n = min(len(arr), len(probs))
                        arr[:n] = np.clip(np.asarray(probs[:n], dtype=np.float64), 0.0, 1.0)
            self.source["calibration"] = "cache" if loaded else "new"

    def save(self) -> None:
        """Write the calibration (and the child-probability predictor) to the cache directory."""
        if self._calib_key is None:
            return
        from .. import budget

        try:
            budget.write_cached("calibration", self._calib_key, {
                "calibrator": self.calibrator.to_dict(),
                "child_probs": {"true": self.child_probs[True].tolist(), "false": self.child_probs[False].tolist()}})
        except OSError:
            pass  # a read-only cache must not stop generation

    # ---- one step -------------------------------------------------------------------------------------------
    def draft(self, ctx: DraftContext) -> TokenTree:
        if self.costs is None:
            raise RuntimeError("the auto policy has no cost profile: build it through SpeculativeDecoder (which "
                               "profiles the models) or call use_costs()")
        self._track_generation(ctx.context)
        mode = self.guard.plan()
        session = ctx.session
        cached = getattr(session, "cached", None)
        pending = max(0, len(ctx.context) - 1 - len(cached)) if cached is not None else 0
        if mode == "ar" or ctx.max_depth < 1 or session is None:
            tree = TokenTree.root(ctx.context[-1])
            record = dict(mode="ar (guard)" if mode == "ar" else "ar (no room)", widths=[1], forwarded=[],
                          expected=1.0, seconds=self.costs.plain_step(), stop="guard" if mode == "ar" else "room")
            self._built = _Built(1, [], 0.0, "ar" if mode == "ar" else "room", record)
            return tree
        build = _Build(self, ctx, force=(mode == "probe"), pending=pending)
        tree = build.run()
        record = dict(mode="probe" if mode == "probe" else ("spec" if len(tree) > 1 else "ar (objective)"),
                      widths=tree.widths(), forwarded=build.forwarded, expected=round(build.expected, 4),
                      seconds=round(build.seconds(), 6), stop=build.stop, wasted=build.wasted, catch_up=pending)
        self._built = _Built(len(tree), build.scores, build.draft_raw, mode, record)
        return tree

    def update(self, step) -> None:
        built, self._built = self._built, None
        if built is None or self.costs is None:
            return
        path = getattr(step, "path", None)
        if path is None and getattr(step, "tree", None):
            path = step.tree.get("path")
        rec = built.record
        rec.update(accepted=step.accepted, committed=step.committed,
                   measured_seconds=round(step.t_draft + step.t_verify + step.t_other, 6))
        if path is not None and built.scores:
            on_path = set(path)
            self.calibrator.observe(built.scores, [i + 1 in on_path for i in range(len(built.scores))])
        if self.options.adapt_costs:
            self._adapt(step, built)
        drafted = step.tree_size > 0
        decision = self.guard.observe(step.t_draft + step.t_verify + step.t_other, step.committed, built.mode,
                                      drafted, self.costs.plain_step())
        if decision is not None:
            self.run["guard"].append(decision)
        self.run["steps"].append(rec)
        del self.run["steps"][:-2000]
        self._updates += 1
        if self._updates % 8 == 0:
            self.save()

    def _adapt(self, step, built: _Built) -> None:
        """Cost scales = medians of the last `COST_WINDOW` measured / predicted ratios (robust to one-off stalls:
        first calls with new shapes, the draft catching up after plain steps); overhead = their median other time."""
        c, r = self.costs, self._ratios
        if built.draft_raw > 0 and step.t_draft > 0:
            r["draft"].append(step.t_draft / built.draft_raw)
            c.draft_scale = float(np.clip(np.median(r["draft"]), 0.1, 20.0))
        raw_verify = float(c.target(1 + step.tree_size))
        if raw_verify > 0 and step.t_verify > 0:
            r["verify"].append(step.t_verify / raw_verify)
            c.verify_scale = float(np.clip(np.median(r["verify"]), 0.1, 20.0))
        r["other"].append(step.t_other)
        c.overhead = float(np.median(r["other"]))

    # ---- explaining -----------------------------------------------------------------------------------------
    def _new_run(self) -> dict:
        return {"steps": [], "guard": []}

    def _track_generation(self, context: list[int]) -> None:
        prev = self._prev_context
        if prev is None or len(context) <= len(prev) or context[: len(prev)] != prev:
            if prev is not None:
                self.save()
            self.run = self._new_run()
        self._prev_context = list(context)

    def explain(self) -> dict:
        steps = self.run["steps"]
        spec = [s for s in steps if s["mode"] in ("spec", "probe")]
        c = self.costs
        n = len(steps)
        summary = (f"auto: {len(spec)}/{n} steps drafted"
                   + (f", mean tree {np.mean([sum(s['widths']) - 1 for s in spec]):.1f} nodes in "
                      f"{np.mean([len(s['widths']) - 1 for s in spec]):.1f} layers, predicted "
                      f"{np.mean([s['expected'] for s in spec]):.2f} tokens/step, got "
                      f"{np.mean([s.get('committed', 0) for s in spec]):.2f}" if spec else "")
                   + f"; guard: {sum(d['action'] == 'fallback' for d in self.run['guard'])} fallback(s)"
                   + f"; costs: {self.source.get('costs', '?')}")
        out = {"summary": summary, "steps": steps, "guard": self.run["guard"],
               "calibration": self.calibrator.describe(), "source": dict(self.source),
               "child_probs": {"greedy": [round(float(v), 4) for v in self.child_probs[True]],
                               "sampled": [round(float(v), 4) for v in self.child_probs[False]]}}
        if c is not None:
            sizes = list(c.target.sizes)
            out["costs"] = {
                "target_ms": {int(s): round(float(c.target(s)) * 1e3, 3) for s in sizes},
                "draft_layer_ms": {int(s): round(float(c.draft(s)) * 1e3, 3) for s in c.draft.sizes},
                "draft_scale": round(c.draft_scale, 4), "verify_scale": round(c.verify_scale, 4),
                "overhead_ms": round(c.overhead * 1e3, 3), "plain_tokens_per_s": round(1 / c.plain_step(), 3)}
        return out


class _Build:
    """One step's tree: the layer loop of the module docstring."""

    def __init__(self, policy: AutoPolicy, ctx: DraftContext, force: bool = False, pending: int = 0):
        self.p, self.ctx, self.force = policy, ctx, force
        self.pending = pending  # committed tokens the draft's first call must catch up on (after plain steps)
        self.costs = policy.costs
        self.a = policy.calibrator
        self.greedy = ctx.sampling.greedy
        self.o = policy.options
        self.tree = TokenTree.root(ctx.context[-1])
        self.x = [1.0]  # per node: path probability (the first-child slot value of its children)
        self.scores: list[float] = []  # per drafted node: calibration score
        self.expected = 1.0
        self.draft_time = 0.0  # predicted, scaled
        self.draft_raw = 0.0  # predicted, unscaled profile
        self.forwarded: list[int] = []
        self.stop = ""
        self.wasted = 0

    @property
    def nodes(self) -> int:
        return len(self.tree) - 1

    def seconds(self) -> float:
        return self.draft_time + float(self.costs.verify(1 + self.nodes)) + self.costs.overhead

    def rate(self) -> float:
        return self.expected / self.seconds()

    def run(self) -> TokenTree:
        frontier = [0]
        depth_limit = min(self.o.max_layers, self.ctx.max_depth)
        layer = 0
        while True:
            if layer >= depth_limit:
                self.stop = "max depth"
                break
            if self.nodes >= self.o.max_nodes:
                self.stop = "max nodes"
                break
            forced = self.force and layer == 0
            f = self.plan_forward(frontier)
            if f == 0 and not forced:
                self.stop = "next layer predicted not to pay" if layer else "drafting predicted not to pay"
                break
            fwd = frontier[: max(f, 1)]
            logits = self.ctx.session.forward(self.ctx.context, self.tree, fwd)  # (len(fwd), vocab)
            self.forwarded.append(len(fwd))
            raw = float(self.costs.draft(len(fwd) + (self.pending if layer == 0 else 0)))
            self.draft_raw += raw  # what the call really costs, catch-up included (for the measured/predicted ratio)
            self.draft_time += self.costs.draft_scale * float(self.costs.draft(len(fwd)))  # the steady-state cost
            warped = self.ctx.sampling.probs(logits)
            plain = logits.float().softmax(dim=-1)
            new = self.select_greedy(fwd, warped, plain, forced) if self.greedy else \
                self.select_sampled(fwd, warped, forced)
            if not new:
                self.wasted += 1
                self.stop = "no child pays"
                break
            frontier = sorted(new, key=lambda n: -self.x[n])
            layer += 1
        return self.tree

    # ---- 1. whether to call the draft -----------------------------------------------------------------------
    def predicted_scores(self, xs: np.ndarray) -> np.ndarray:
        """(len(xs), K) predicted scores of the children of frontier nodes with path probabilities xs: x_u * c_j."""
        return xs[:, None] * self.p.child_probs[self.greedy][None, :]

    def plan_forward(self, frontier: list[int]) -> int:
        """f*: forward the f* best frontier nodes, or 0 if no f is predicted to raise the rate."""
        room = self.o.max_nodes - self.nodes
        xs = np.asarray([self.x[n] for n in frontier[:MAX_FORWARD]], dtype=np.float64)
        if room <= 0 or len(xs) == 0:
            return 0
        gains = self.a(self.predicted_scores(xs))  # (F, K)
        now = self.rate()
        best_f, best = 0, now
        for f in FORWARD_SIZES:
            if f > len(xs):
                break
            merged = np.sort(gains[:f].ravel())[::-1][:room]
            _, r = best_prefix(self.expected, self.draft_time + float(self.costs.layer(f)), self.nodes, merged,
                               self.costs)
            if r > best * (1 + 1e-9):
                best_f, best = f, r
        return best_f

    # ---- 2. which children to add ---------------------------------------------------------------------------
    def _add(self, parent: int, token: int, prob: float, x: float, score: float, gain: float) -> int:
        child = self.tree.add(parent, token, prob)
        self.x.append(x)
        self.scores.append(score)
        self.expected += gain
        return child

    def select_greedy(self, fwd: list[int], warped: torch.Tensor, plain: torch.Tensor, forced: bool) -> list[int]:
        """Temperature 0: the children of a node are its top draft tokens; add the m* best by calibrated gain."""
        k = min(self.o.max_children, plain.shape[-1])
        top = torch.topk(plain, k, dim=-1)
        probs = top.values.double().numpy()  # (len(fwd), k), each row descending
        c = self.p.child_probs[True]
        kk = min(k, len(c))
        step = 1.0 - (1.0 - PREDICTOR_RATE) ** len(fwd)  # one running-mean step per forwarded row
        c[:kk] += step * (probs[:, :kk].mean(axis=0) - c[:kk])
        xs = np.asarray([self.x[n] for n in fwd])[:, None]
        scores = (xs * probs).ravel()
        gains = self.a(scores)
        order = np.lexsort((np.arange(len(scores)), -scores, -gains))  # best gain first; within a node: rank order
        room = self.o.max_nodes - self.nodes
        m, _ = best_prefix(self.expected, self.draft_time, self.nodes, gains[order], self.costs, max_add=room)
        if forced:
            m = max(m, 1)
        new = []
        for flat in order[:m]:
            i, j = divmod(int(flat), k)
            node = fwd[i]
            if node not in self.tree.child_rule:
                self.tree.set_children_dist(node, warped[i], DrawRule.DETERMINISTIC)
            token = int(top.indices[i, j])
            new.append(self._add(node, token, float(plain[i, token]), float(scores[flat]), float(scores[flat]),
                                 float(gains[flat])))
        return new

    def select_sampled(self, fwd: list[int], warped: torch.Tensor, forced: bool) -> list[int]:
        """Temperature > 0: children drawn one at a time without replacement (DySpec's slots). The j-th draw under u
        comes from the residual R_j (q with the earlier draws removed); its score, the expected path probability
        x_u * sum_y R_j(y) q(y) = x_u * (sum q^2 - sum_{l<j} q(y_l)^2) / (1 - sum_{l<j} q(y_l)), is known before the
        draw, and the marginal test runs over the known slots before each draw.

        A draw from R_j is a draw from q (inverse CDF on q's cumulative sums) repeated until the token is new, which is
        exact and costs microseconds instead of a multinomial over the whole vocabulary per draw."""
        q = warped.double()  # (len(fwd), vocab)
        cdf = torch.cumsum(q, dim=-1).numpy()
        total = cdf[:, -1].copy()
        square = (q * q).sum(dim=-1).tolist()
        row = {n: i for i, n in enumerate(fwd)}
        taken = {n: [] for n in fwd}  # tokens drawn so far under each node
        removed = {n: 0.0 for n in fwd}  # their probability mass
        removed_sq = {n: 0.0 for n in fwd}
        c = self.p.child_probs[False]
        heap: list[tuple] = []
        seq = 0

        def push(node: int) -> None:
            nonlocal seq
            i, j = row[node], len(taken[node])
            left = total[i] - removed[node]
            expected = max(square[i] - removed_sq[node], 0.0) / left  # E[q(y)], y ~ R_j
            score = self.x[node] * expected
            if j < len(c):
                c[j] += PREDICTOR_RATE * (expected - c[j])
            heapq.heappush(heap, (-float(self.a(score)), -score, seq, node, score))
            seq += 1

        for n in fwd:
            push(n)
        new: list[int] = []
        while heap and self.nodes < self.o.max_nodes:
            known = np.sort(np.asarray([-h[0] for h in heap]))[::-1]
            m, _ = best_prefix(self.expected, self.draft_time, self.nodes, known, self.costs,
                               max_add=self.o.max_nodes - self.nodes)
            if m == 0 and not (forced and not new):
                break
            neg_gain, _, _, node, score = heapq.heappop(heap)
            i = row[node]
            y = self._draw_new(q[i], cdf[i], float(total[i]), taken[node])
            if node not in self.tree.child_rule:
                self.tree.set_children_dist(node, warped[i], DrawRule.WITHOUT_REPLACEMENT)
            qy = float(q[i, y])
            taken[node].append(y)
            removed[node] += qy
            removed_sq[node] += qy * qy
            new.append(self._add(node, y, float(warped[i, y]), self.x[node] * qy, score, -neg_gain))
            if total[i] - removed[node] > 1e-9 * total[i] and len(taken[node]) < self.o.max_children:
                push(node)
        return new

    def _draw_new(self, q: torch.Tensor, cdf: np.ndarray, total: float, taken: list[int]) -> int:
        """One draw from q restricted to tokens not in `taken` (renormalised): rejection from q by inverse CDF,
        with an exact masked multinomial if the remaining mass is so small that rejection would take long."""
        gen = self.ctx.generator
        if total - sum(float(q[t]) for t in taken) > 0.01 * total:
            for _ in range(1000):
                u = float(torch.rand((), generator=gen, dtype=torch.float64)) * total
                y = min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)
                if y not in taken and float(q[y]) > 0:
                    return y
        rest = q.clone()
        rest[taken] = 0.0
        return int(torch.multinomial(rest, 1, generator=gen))
