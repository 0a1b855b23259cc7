"""`budget="auto"` for policies that only expose a size knob: choose each step's budget from measured step rates.

DySpec's `budget="auto"` is the auto policy (drafting/auto/), which grows its tree node by node against a cost
model. DynaTree, WETAP, Sequoia and DySpec's threshold variant build trees their own way and take a budget, so for
them the budget itself is tuned, by measuring what each size delivers on this machine and this text:

    rate(B) = sum of tokens committed / sum of step seconds (draft + verify + bookkeeping),

over the last `window` steps that ran with budget B. B = 0 is a plain decoding step (the root alone, no draft call),
so the tuner falls back to plain decoding when no tree pays, and keeps re-probing trees.

Choice (deterministic hill climbing over the sorted candidates, which suits a rate that is roughly unimodal in B):
start at `start`; a step runs an untried neighbour of the best candidate if one exists (so both sides of the best
are always measured), every `probe_every`-th step it re-runs the neighbour whose measurements are oldest (the text
changes, so old rates go stale); otherwise it runs the candidate with the best rate. A probe that beats the best
rate replaces that candidate's older measurements, so the climb follows a change of the text within a few probes
instead of waiting for a whole window of stale numbers to age out. Measurements are of past steps
only, so the tree never depends on the target's verdict for the current step and exactness is untouched.
"""
from __future__ import annotations

from collections import deque

from ..core.tree import TokenTree

CANDIDATES = (0, 4, 8, 16, 32, 64)


class BudgetTuner:
    def __init__(self, candidates=CANDIDATES, start: int = 16, window: int = 6, probe_every: int = 8):
        self.candidates = sorted(set(candidates))
        if start not in self.candidates:
            raise ValueError(f"the start budget {start} is not a candidate ({self.candidates})")
        self.window, self.probe_every = window, probe_every
        self.obs = {b: deque(maxlen=window) for b in self.candidates}  # budget -> (tokens, seconds, step index)
        self.current, self.steps, self.history = start, 0, []

    def rate(self, budget: int) -> float | None:
        obs = self.obs[budget]
        seconds = sum(s for _, s, _ in obs)
        return sum(t for t, _, _ in obs) / seconds if obs and seconds > 0 else None

    def best(self) -> int:
        rated = [b for b in self.candidates if self.rate(b) is not None]
        return max(rated, key=lambda b: (self.rate(b), -b)) if rated else self.current  # ties: the smaller tree

    def choose(self) -> int:
        """The budget for the next step."""
        best = self.best()
        i = self.candidates.index(best)
        neighbours = [self.candidates[j] for j in (i - 1, i + 1) if 0 <= j < len(self.candidates)]
        untried = [b for b in neighbours if not self.obs[b]]
        if not self.obs[best]:
            choice = best
        elif untried:
            choice = untried[0]
        elif self.steps and self.steps % self.probe_every == 0:
            choice = min(neighbours, key=lambda b: self.obs[b][-1][2])  # the stalest neighbour
        else:
            choice = best
        self.current = choice
        return choice

    def observe(self, budget: int, tokens: int, seconds: float) -> None:
        best = self.best()
        if budget != best and seconds > 0 and tokens / seconds > (self.rate(best) or 0.0):
            self.obs[budget].clear()  # a probe beat the best: its older measurements are stale, start afresh
        self.obs[budget].append((tokens, seconds, self.steps))
        self.history.append(budget)
        self.steps += 1

    def explain(self) -> dict:
        return {"budget": "auto", "best_budget": self.best(), "budgets_chosen": list(self.history[-64:]),
                "rates": {str(b): self.rate(b) for b in self.candidates}}


class TunedBudget:
    """A policy whose `budget` option is chosen each step by a BudgetTuner; everything else is the wrapped policy."""

    def __init__(self, inner, tuner: BudgetTuner | None = None):
        self.inner, self.tuner = inner, tuner or BudgetTuner()
        self.chosen = self.tuner.current

    def __getattr__(self, name):  # name, Options, needs_draft, draw_rules, default_verifier, draws_chains, bind...
        return getattr(self.inner, name)

    @property
    def max_tree_depth(self) -> int:
        saved = self.inner.options.budget
        self.inner.options.budget = max(self.tuner.candidates)
        try:
            return self.inner.max_tree_depth
        finally:
            self.inner.options.budget = saved

    def draft(self, ctx) -> TokenTree:
        self.chosen = self.tuner.choose()
        if self.chosen == 0:
            return TokenTree.root(ctx.context[-1])  # a plain decoding step
        self.inner.options.budget = self.chosen
        return self.inner.draft(ctx)

    def update(self, step) -> None:
        self.tuner.observe(self.chosen, step.committed, step.t_draft + step.t_verify + step.t_other)
        if self.chosen:  # the inner policy learns (DynaTree's history) only from its own trees
            self.inner.update(step)

    def explain(self) -> dict:
        return {**self.inner.explain(), **self.tuner.explain()}


def tuned_options(cls, options: dict) -> dict | None:
    """The options the policy `cls` is made with inside TunedBudget when `options` ask for budget="auto" and it only
    has a size knob (DySpec handles "auto" itself); None when they do not. ValueError for a policy with no budget."""
    budget = options.get("budget")
    if not isinstance(budget, str) or budget.strip().lower() != "auto" or getattr(cls, "handles_auto_budget", False):
        return None
    if "budget" not in {f for f in getattr(cls.Options, "__dataclass_fields__", {})}:
        raise ValueError(f"method {cls.name!r} has no budget to size automatically")
    return {**options, "budget": max(CANDIDATES)}


def make_policy(cls, options: dict):
    """`cls(**options)`, wrapped in TunedBudget when options ask for budget="auto" (`tuned_options`)."""
    tuned = tuned_options(cls, options)
    return cls(**options) if tuned is None else TunedBudget(cls(**tuned))
