"""The auto policy: wiring the objective, the calibration, the tree builder and the guard into one policy.

Per step: the guard plans ('spec', 'probe' or a plain 'ar' step during a fallback); a drafted step grows its tree with
`TreeBuilder`; after the verdict, `update` feeds the calibration (which drafted nodes were accepted), the cost scales
and the guard.

Cost adaptation (`adapt_costs`): measured draft and verify seconds rescale d and t (the median of the last
`COST_WINDOW` measured / predicted ratios, starting from two prior ratios of 1, clamped to [0.1, 20]; a median shrugs
off one-off stalls; the draft's first call is predicted with the tokens it catches up on), and c is the median of the
engine's other time; load that slows both models alike leaves the trees unchanged, a draft that got relatively slower
makes them smaller.

Memory (`remember`): the calibration and the child-probability predictor are saved in the cache directory every 8
steps and when a new generation starts, keyed by the pair's fingerprints, dtypes, thread count, sampling settings and
(at T > 0) verifier.

`result.stats.policy` (GenerationStats) explains the choices (`explain`): per step the mode, layer widths, predicted
tokens and seconds and why growth stopped; the calibration curve; the predictor; the cost model and its source; the
guard's decisions.

Over 400 lines: the policy's state, its start (costs, agreement, memory) and its account of itself; the objective,
calibration, tree builder and guard are modules of their own.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
from dataclasses import dataclass

import numpy as np

from ...backends.model_info import branch_limit
from ...core.disk_cache import keep_record, model_fingerprint, read_record
from ...core.options import is_whole
from ...core.sampling import SamplingConfig, is_real
from ...core.tree import DrawRule, TokenTree
from ...tuning import costs as forward_costs
from ...tuning.agreement import pair_agreement, pair_overlap
from ...verify import VERIFIERS
from ..base import DraftContext, Policy
from .acceptance import Calibrator
from .guard import Guard
from .objective import CostModel, ceiling_rate, expected_ceiling
from .options import AutoOptions
from .tree_builder import TreeBuilder

COST_WINDOW = 15  # steps whose measured / predicted cost ratios set the cost scales (their median)
DEFAULT_CHILD_PROBS = (0.6, 0.15, 0.06, 0.03, 0.02, 0.01, 0.01, 0.005)
MIN_FIRST_EVIDENCE = 16  # drafted steps before the first child's measured acceptance is read (_expected_rate)
EXPLORE_EVERY = 8  # plain generations in a row, counted across runs, before one drafts anyway (uses_draft)


@dataclass
class _Built:
    """What the policy remembers about the tree it drafted last, until `update` sees the verdict."""

    size: int  # nodes of the tree as the policy built it (grafted extras come after)
    scores: list[float]  # per drafted node (index - 1): the calibration score
    draft_raw: float  # predicted draft seconds with the unscaled profile
    mode: str  # as planned: "spec", "probe", "ar" (a guard fallback step) or "room" (no room to draft)
    record: dict
    first: int | None = None  # the root's first drafted child (its first draw at T > 0), if any


class AutoPolicy(Policy):
    name = "auto"
    summary = "hardware-aware DySpec tree: grow layers while the measured-cost rate rises; plain decoding if it never does"
    Options = AutoOptions
    sampled_rule = DrawRule.WITHOUT_REPLACEMENT  # siblings drawn without replacement (tree_builder.py)

    def default_verifier(self, sampling: SamplingConfig) -> str:
        """Traversal verification at T > 0, not the drawing rule's own mbr. It stays exact when the tree's shape
        depends on the tokens already drawn, as auto's does (tests/verify/test_adaptive_trees.py); on every tree the
        tests enumerate it accepts at least as many tokens as mbr in expectation (measured, not a theorem); and on
        the default pair it accepted more per step at the same cost (docs/verifiers.md, "Which verifier auto
        uses"). A tree with grafted deterministic branches falls back to naive (the engine checks `fits`)."""
        return "greedy" if sampling.greedy else "traversal"

    def __init__(self, **options):
        super().__init__(**options)
        opts = self.options
        self.costs: CostModel | None = None
        self.cannot_pay = False  # no tree can beat plain decoding under the measured costs (uses_draft)
        self.plain_runs = 0  # generations decoded plainly since one last drafted (saved with the calibration)
        self.calibrator = Calibrator(enabled=opts.calibration)
        # the child-probability predictor c_j (tree_builder.py), one for greedy (T = 0) and one for sampled steps
        width = opts.max_children
        padding = (0.0,) * max(0, width - len(DEFAULT_CHILD_PROBS))
        self.child_probs = {True: np.array(DEFAULT_CHILD_PROBS[:width] + padding)}
        self.child_probs[False] = self.child_probs[True].copy()
        # how often the root's first child is accepted, this sampling setting's: one bin of the calibrator's kind
        # (a Beta(1, 1) prior, old evidence scaled down past 400 steps, loaded capped at 100)
        self.first_child = Calibrator(edges=(0.0, 1.0))
        self._start_state = None  # repeatable: the evidence each generation starts from (_restart)
        self.guard = Guard(opts.guard_margin, opts.guard_window, opts.guard_cooldown, enabled=opts.guard)
        self.source: dict = {"costs": "unset"}
        self._calib_key: dict | None = None
        self._greedy = True  # the sampling setting bound last (which child-probability predictor uses_draft reads)
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

    def bind(self, target, draft, sampling: SamplingConfig, draft_sampling: SamplingConfig, tokenizer=None,
             verifier: str = "", ssm_tree: str = "packed") -> None:
        """Profile (or load the cached profiles of) the target and the draft; load the saved calibration, or for a
        pair with none, start the greedy predictor from the pair's measured agreement (`seed_from_agreement`)."""
        self._greedy = sampling.greedy
        if draft is None:
            return
        if self.costs is None:
            refresh = self.options.reprofile
            t_curve, t_src = forward_costs.profile_model(target, refresh=refresh, progress=True, ssm_tree=ssm_tree)
            d_curve, d_src = forward_costs.profile_model(draft, refresh=refresh, progress=True, ssm_tree=ssm_tree)
            self.costs = CostModel(t_curve, d_curve)
            self.source = {"costs": f"target {t_src}, draft {d_src}",
                           "target_profile": str(forward_costs.profile_path(target, ssm_tree)),
                           "draft_profile": str(forward_costs.profile_path(draft, ssm_tree))}
        self._fit_branch_limit(target, draft)
        if self.options.remember:
            self._calib_key = _calibration_key(target, draft, sampling, draft_sampling, verifier)
            self._load_calibration()
        if tokenizer is not None and not self.has_evidence():
            self.seed_from_agreement(target, draft, tokenizer)
        if tokenizer is not None and not sampling.greedy and self.first_child.trials[0] < MIN_FIRST_EVIDENCE:
            self.seed_from_overlap(target, draft, tokenizer, sampling, draft_sampling)

    def _fit_branch_limit(self, target, draft) -> None:
        """At most as many drafted nodes as a forward of either model takes leaves (`branch_limit`: a llama.cpp model
        loaded with a small n_seq_max): its costs were measured on trees of at most that many leaves (tuning/costs.py),
        and a wider forward runs in pieces (backends/llamacpp.py), dearer than the curve says."""
        limit = min((n for n in (branch_limit(target), branch_limit(draft)) if n is not None), default=None)
        if limit is not None and limit < self.options.max_nodes:
            self.options = dataclasses.replace(self.options, max_nodes=limit)
            self.source["max_nodes"] = f"{limit} (the models' sequences: llama.cpp's n_seq_max - 1)"

    def seed_from_overlap(self, target, draft, tokenizer, sampling: SamplingConfig,
                          draft_sampling: SamplingConfig) -> None:
        """Start the first child's acceptance at T > 0 (`_expected_rate`) at the pair's teacher-forced overlap sum_y
        min(p, q) at these sampling settings (tuning/agreement.py), as if `MIN_FIRST_EVIDENCE` steps had shown it.
        Why: under the prior (c_1 = 0.6, a(.) the identity) the default pair's chain predicted 1.125x plain decoding,
        under the margin with the draft's prefill, so auto never drafted at T = 1 and never gathered the evidence
        (overlap 0.875; first child accepted 0.82-0.92; results/t1-fresh-calibration-20x20, docs/kernels.md)."""
        try:
            overlap, source = pair_overlap(target, draft, tokenizer, sampling, draft_sampling)
        except Exception as err:  # a backend whose sessions cannot run a long chain, other vocabularies: the prior
            self.source["overlap"] = f"unavailable ({type(err).__name__})"
            return
        self.first_child.set_evidence(overlap * MIN_FIRST_EVIDENCE, MIN_FIRST_EVIDENCE)
        self.source["overlap"] = f"{overlap:.3f} ({source})"

    def has_evidence(self) -> bool:
        """Whether a saved calibration with observations was loaded (a plain generation saves one without any)."""
        return self.source.get("calibration") == "cache" and bool(self.calibrator.trials.any())

    def seed_from_agreement(self, target, draft, tokenizer) -> None:
        """Start c_1 of the greedy predictor (the draft's top child, tree_builder.py) at the pair's greedy top-1
        agreement with the target, teacher-forced on reference text (tuning/agreement.py: ~1 s, cached).

        Why: without evidence the predictor starts at DEFAULT_CHILD_PROBS (c_1 = 0.6), and `uses_draft` judges a
        pair by it before the first step. For the default pair that prior was 0.3 below the truth (agreement 0.90)
        and ruled speculation out wherever the draft cost 0.4 of a target token, so auto never drafted and never
        gathered the evidence that would have corrected it. The sampled predictor keeps its prior: agreement with
        the target's argmax says little about acceptance at T > 0."""
        try:
            agreement, source = pair_agreement(target, draft, tokenizer)
        except Exception as err:  # a backend whose sessions cannot run a long chain: keep the prior
            self.source["agreement"] = f"unavailable ({type(err).__name__})"
            return
        self.child_probs[True][0] = agreement
        self.source["agreement"] = f"{agreement:.3f} ({source})"

    def uses_draft(self, prompt_tokens: int = 0, new_tokens: int = 0) -> bool:
        """False when no tree is expected to beat plain decoding by more than the guard's margin under the measured
        costs: then the generation decodes plainly and never touches the draft model, so it does not pay for the
        draft's prefill or for keeping its cache in step either.

        Expected, not hoped for: the rate is the best chain's at the acceptance measured for this pair so far
        (`expected_ceiling`: the calibration a(.) and the draft's mean top-1 probability, saved across runs; the
        identity and 0.6 before any evidence), with the draft's prefill of the `prompt_tokens` spread over the
        `new_tokens` to come. Why the margin: the guard lets a losing speculation run down to (1 - margin) x plain
        decoding before it falls back, so a tree that could win only a few percent would lose up to the margin in
        practice. Measured on arborspec's own kernels on an AVX2 CPU (t(2) = 1.15-1.25 t(1), the draft at 0.67
        t(1)): the full-acceptance ceiling is 1.04-1.11x, and `auto` drafting there ran at 0.82-0.92x of plain
        decoding, the draft's prefill alone costing ~0.9 s of a 6 s generation. With the guard off the line is
        plain decoding itself."""
        if self.costs is None:
            return self.needs_draft
        if self.options.repeatable:  # called once as each generation starts
            self._restart()
        rate = self._expected_rate()
        if new_tokens > 0 and prompt_tokens > 1:
            rate = new_tokens / (new_tokens / rate + self.costs.layer(prompt_tokens - 1))
        bar = (1.0 + self._margin) / self.costs.plain_step()
        self.cannot_pay = rate <= bar
        # a run that learns something: never where even full acceptance could not pay, nor a run that generates nothing
        if self.cannot_pay and not self.options.repeatable and new_tokens > 0 and ceiling_rate(self.costs) > bar:
            self.plain_runs += 1
            if self.plain_runs >= EXPLORE_EVERY:
                self._explore()
            self.save()
        elif not self.cannot_pay:
            self.plain_runs = 0
        return not self.cannot_pay

    def _explore(self) -> None:
        """Draft this generation though the evidence says it cannot pay, and let the guard judge it: a plain
        generation learns nothing, so one bad stretch saved with the calibration (100 first-child misses) kept every
        later run of the pair plain for good, a perfect draft included. The saved evidence is scaled down to
        MIN_FIRST_EVIDENCE observations a bin, so that this run's decides; a losing run costs at most the guard's
        margin before it falls back."""
        self.plain_runs, self.cannot_pay = 0, False
        for calibrator in (self.calibrator, self.first_child):
            calibrator.load(calibrator.to_dict(), cap=MIN_FIRST_EVIDENCE)

    def _restart(self) -> None:
        """A repeatable run starts from the acceptance evidence the policy was built with, whatever the decoder
        generated before: a seeded prompt drew other tokens after an unrelated generation had moved the calibration
        (`repeatable`: "this run alone")."""
        state = (self.calibrator, self.child_probs, self.first_child)
        if self._start_state is None:
            self._start_state = copy.deepcopy(state)
        else:
            self.calibrator, self.child_probs, self.first_child = copy.deepcopy(self._start_state)

    @property
    def _margin(self) -> float:
        """How much better than plain decoding speculation must be expected to be (uses_draft): the guard's margin."""
        return self.options.guard_margin if self.options.guard else 0.0

    def _expected_rate(self) -> float:
        """The best chain's rate at the acceptance measured so far (`expected_ceiling`). With evidence of
        `MIN_FIRST_EVIDENCE` steps, nodes are accepted at the root's first child's measured rate and its powers, not
        at a(.) of the mean score c_1 ** i. At T > 0 a sampled node's score sum q^2 says little about its acceptance
        sum min(p, q): on the default pair a(0.353) = 0.41 stood against 0.86-0.92 measured, so auto decoded plainly
        where drafting ran 1.14-1.29x (docs/kernels.md, "Which backend auto picks"). At T = 0 too: c_1, the running
        mean of the draft's top probability over every forwarded row, siblings' rows included, had fallen to 0.66
        on the default pair (0.47 for another variant) while the root's first child was accepted 0.79-0.81 of the
        time (top-1 agreement 0.906): on a Zen 4 host that under-read made auto leave the draft unused at T = 0
        (docs/kernels.md, "A real Zen 4 host"). Without that evidence a(c_1 ** i) decides, c_1 starting from the
        pair's measured agreement."""
        first = None
        if self.first_child.trials[0] >= MIN_FIRST_EVIDENCE:
            first = float(self.first_child.curve()[0])
        return expected_ceiling(self.costs, self.calibrator, float(self.child_probs[self._greedy][0]),
                                first_accept=first)

    def _load_calibration(self) -> None:
        """This machine's calibration from an earlier run. A record any part of which is damaged (edited, another
        tool's) is set aside as if there were none: its child probabilities and run count were read unchecked (a
        traceback, or trees sized from NaN)."""
        saved = read_record("calibration", self._calib_key)
        probs = _child_probs(saved.get("child_probs", {})) if isinstance(saved, dict) else None
        runs = saved.get("plain_runs", 0) if isinstance(saved, dict) else None
        loaded = (probs is not None and is_whole(runs) and runs >= 0
                  and self.calibrator.load(saved.get("calibrator", {})))
        if loaded:
            for greedy, given in probs.items():
                arr = self.child_probs[greedy]
                n = min(len(arr), len(given))
                arr[:n] = np.clip(given[:n], 0.0, 1.0)
            self.first_child.load(saved.get("first_child", {}))
            self.plain_runs = int(runs)
        self.source["calibration"] = "cache" if loaded else "new"

    def save(self) -> None:
        """Write the calibration (and the child-probability predictor) to the cache directory."""
        if self._calib_key is None:
            return
        keep_record("calibration", self._calib_key, {
            "calibrator": self.calibrator.to_dict(),
            "child_probs": {"true": self.child_probs[True].tolist(), "false": self.child_probs[False].tolist()},
            "first_child": self.first_child.to_dict(), "plain_runs": self.plain_runs})

    # ---- one step -------------------------------------------------------------------------------------------
    def draft(self, ctx: DraftContext) -> TokenTree:
        if self.costs is None:
            raise RuntimeError("the auto policy has no cost profile: build it through SpeculativeDecoder (which "
                               "profiles the models) or call use_costs()")
        self._track_generation(ctx.context)
        # rows of a batching round count for every request (objective.py); not for a repeatable run, whose trees must
        # not depend on how many requests share its rounds (a seeded batch drew other tokens than each alone)
        self.costs.sharing = 1 if self.options.repeatable else ctx.sharing
        mode = self.guard.plan()
        session = ctx.session
        cached = getattr(session, "cached", None)  # (test stand-ins may not track it: then nothing is pending)
        pending = max(0, len(ctx.context) - 1 - len(cached)) if cached is not None else 0
        if mode == "ar" or ctx.max_depth < 1 or session is None:
            tree = TokenTree.root(ctx.context[-1])
            why = "ar (guard)" if mode == "ar" else ("ar (cannot pay)" if self.cannot_pay else "ar (no room)")
            record = dict(mode=why, widths=[1], forwarded=[],
                          expected=1.0, seconds=self.costs.plain_step(), stop="guard" if mode == "ar" else "room")
            self._built = _Built(1, [], 0.0, "ar" if mode == "ar" else "room", record)
            return tree
        greedy = ctx.sampling.greedy
        build = TreeBuilder(ctx, self.costs, self.calibrator, self.child_probs[greedy], self.options,
                            force=(mode == "probe"), pending=pending)
        tree = build.run()
        record = dict(mode="probe" if mode == "probe" else ("spec" if len(tree) > 1 else "ar (objective)"),
                      widths=tree.widths(), forwarded=build.forwarded, expected=round(build.expected, 4),
                      seconds=round(build.seconds(), 6), stop=build.stop, wasted=build.wasted, catch_up=pending)
        first = next((i for i in range(1, len(tree)) if tree.parents[i] == 0), None)
        self._built = _Built(len(tree), build.scores, build.draft_raw, mode, record, first)
        return tree

    def estimate(self) -> list[float] | None:
        """The objective's [E, T] of the tree drafted last (objective.py), for the draft-free branches' budget."""
        if self._built is None or self.costs is None:
            return None
        return [float(self._built.record["expected"]), float(self._built.record["seconds"])]

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
            if built.first is not None and built.first <= len(built.scores):
                self.first_child.observe([0.5], [built.first in on_path])
        if self.options.adapt_costs:
            self._adapt(step, built)
        drafted = step.tree_size > 0
        decision = self.guard.observe(step.t_draft + step.t_verify + step.t_other, step.committed, built.mode,
                                      drafted, self.costs.plain_step(), draft_used=bool(rec.get("forwarded")))
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
        costs, ratios = self.costs, self._ratios
        if built.draft_raw > 0 and step.t_draft > 0:
            ratios["draft"].append(step.t_draft / built.draft_raw)
            costs.draft_scale = float(np.clip(np.median(ratios["draft"]), 0.1, 20.0))
        raw_verify = float(costs.raw_verify(1 + step.tree_size))
        if raw_verify > 0 and step.t_verify > 0:
            ratios["verify"].append(step.t_verify / raw_verify)
            costs.verify_scale = float(np.clip(np.median(ratios["verify"]), 0.1, 20.0))
        ratios["other"].append(step.t_other)
        costs.overhead = float(np.median(ratios["other"]))

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

    def _agreement_note(self) -> str:
        note = f"; pair agreement {self.source['agreement']}" if "agreement" in self.source else ""
        return note + (f"; overlap at this temperature {self.source['overlap']}" if "overlap" in self.source else "")

    def explain(self) -> dict:
        c = self.costs
        if self.cannot_pay:  # a plain generation: the engine consults the policy at no step (engine._plain_steps)
            steps, guard = [], []
            summary = (f"auto: plain decoding, the draft unused: no tree is expected to beat it by more than the "
                       f"guard's margin ({1 + self._margin:g} x) under the measured costs (best chain at the measured "
                       f"acceptance {self._expected_rate():.2f} tokens/s, with every token accepted "
                       f"{ceiling_rate(c):.2f}; plain {1 / c.plain_step():.2f}); "
                       f"costs: {self.source.get('costs', '?')}{self._agreement_note()}")
        else:
            steps, guard = self.run["steps"], self.run["guard"]
            spec = [s for s in steps if s["mode"] in ("spec", "probe")]
            summary = (f"auto: {len(spec)}/{len(steps)} steps drafted"
                       + (f", mean tree {np.mean([sum(s['widths']) - 1 for s in spec]):.1f} nodes in "
                          f"{np.mean([len(s['widths']) - 1 for s in spec]):.1f} layers, predicted "
                          f"{np.mean([s['expected'] for s in spec]):.2f} tokens/step, got "
                          f"{np.mean([s.get('committed', 0) for s in spec]):.2f}" if spec else "")
                       + f"; guard: {sum(d['action'] == 'fallback' for d in guard)} fallback(s)"
                       + f"; costs: {self.source.get('costs', '?')}{self._agreement_note()}")
        out = {"summary": summary, "plain": self.cannot_pay, "steps": steps, "guard": guard,
               "calibration": self.calibrator.describe(), "source": dict(self.source),
               "child_probs": {"greedy": [round(float(v), 4) for v in self.child_probs[True]],
                               "sampled": [round(float(v), 4) for v in self.child_probs[False]]},
               "first_child": {"accepted": round(float(self.first_child.hits[0]), 2),
                               "drafted": round(float(self.first_child.trials[0]), 2)}}
        if c is not None:
            sizes = list(c.target.sizes)
            out["costs"] = {
                "target_ms": {int(s): round(float(c.target(s)) * 1e3, 3) for s in sizes},
                "draft_layer_ms": {int(s): round(float(c.draft(s)) * 1e3, 3) for s in c.draft.sizes},
                "draft_scale": round(c.draft_scale, 4), "verify_scale": round(c.verify_scale, 4),
                "overhead_ms": round(c.overhead * 1e3, 3), "plain_tokens_per_s": round(1 / c.plain_step(), 3)}
        return out


def _calibration_key(target, draft, sampling: SamplingConfig, draft_sampling: SamplingConfig,
                     verifier: str = "") -> dict:
    """What a saved calibration is valid for: the pair, their dtypes, the thread count, both sampling settings and,
    at T > 0, the verifier of the drafted trees. Why the verifier: at T > 0 how many drafted nodes are accepted
    depends on it (naive accepts fewer of a sampled draft's tokens than traversal), and `auto+ngram`, a `--verifier`
    of the caller's or dyspec(budget=auto) runs the same policy under another one; one record for all let their
    evidence lower the acceptance auto plans its traversal-verified trees with. At T = 0 every exact verifier
    accepts the same path, so they share one record (a lossy one keys its own)."""
    key = {"target": model_fingerprint(target), "draft": model_fingerprint(draft),
           "dtype": [str(target.dtype), str(draft.dtype)], "threads": forward_costs.model_threads(target),
           "sampling": [sampling.temperature, sampling.top_k, sampling.top_p],
           "draft_sampling": [draft_sampling.temperature, draft_sampling.top_k, draft_sampling.top_p]}
    if verifier and (not sampling.greedy or not VERIFIERS[verifier].exact):
        key["verifier"] = verifier
    return key


def predicted_rates(target_curve, draft_curve, target=None, draft=None, margin: float | None = None,
                    tokenizer=None) -> dict:
    """What auto predicts for this pair from its cost curves before its first step, in tokens per second: `plain`
    (1 / t(1)), `speculative` (the best chain at the acceptance saved by earlier greedy runs of this pair, else -- as
    `bind` starts -- its measured agreement when a tokenizer is given, else the priors: a(x) = x and a draft top-1
    probability of 0.6; `expected_ceiling`), `ceiling` (every token accepted) and
    `rate`, what auto would run at: the speculative rate where it beats plain decoding by the guard's margin (as
    `uses_draft` decides), else the plain one. `draft_curve` None: plain decoding only. For `--backend auto`
    (loading/backend_choice.py), which compares backends by these."""
    plain = 1.0 / float(target_curve(1))
    margin = AutoOptions().guard_margin if margin is None else margin
    if draft_curve is None:
        return {"plain": plain, "speculative": None, "ceiling": None, "rate": plain, "acceptance": "none"}
    policy = AutoPolicy()
    greedy = SamplingConfig()
    policy.use_costs(CostModel(target_curve, draft_curve))
    if target is not None and draft is not None:  # the models: to look up their saved calibration
        policy._calib_key = _calibration_key(target, draft, greedy, greedy)
        policy._load_calibration()
        if tokenizer is not None and not policy.has_evidence():
            policy.seed_from_agreement(target, draft, tokenizer)
    speculative = policy._expected_rate()
    rate = speculative if speculative > (1.0 + margin) * plain else plain
    acceptance = "saved" if policy.has_evidence() else ("agreement " + policy.source["agreement"]
                                                         if "agreement" in policy.source else "prior")
    return {"plain": plain, "speculative": speculative, "ceiling": ceiling_rate(policy.costs), "rate": rate,
            "acceptance": acceptance}


def _child_probs(saved) -> dict[bool, np.ndarray] | None:
    """The record's child probabilities by greedy-ness (finite numbers), or None if they are not that."""
    if not isinstance(saved, dict):
        return None
    out = {}
    for greedy in (True, False):
        probs = saved.get(str(greedy).lower())
        if probs is None:
            continue
        if not (isinstance(probs, list) and probs and all(is_real(p) and np.isfinite(p) for p in probs)):
            return None
        out[greedy] = np.asarray(probs, dtype=np.float64)
    return out
