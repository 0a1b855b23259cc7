"""The guard: never much slower than plain decoding, whatever the cost model predicted.

The measured rate of the last `window` drafted steps (committed tokens / measured step seconds, the slowest step left
out) is compared with the plain-decoding rate (the median of recent measured root-only steps when there are some,
else 1 / (t(1) + c) from the scaled profile). If it falls below (1 - `margin`) times that, the next `cooldown` steps
are plain (root-only trees, no draft call), then speculation is probed again; each failed probe doubles the cooldown
(up to 16x), a passed one resets it. After `cooldown` consecutive steps in which the objective itself chose not to
call the draft (plain steps, and steps with grafted free branches only), one step drafts anyway (a probe), so the
calibration can recover: counting grafted steps as drafted had left the draft unused for whole runs on a Zen 4 host,
every step carrying suffix branches, while a stale predictor said no layer would pay.
"""
from __future__ import annotations

import collections

import numpy as np


class Guard:
    """Falls back to plain decoding while speculation is measured slower (the module docstring). Pure bookkeeping on
    measured step times."""

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

    def observe(self, seconds: float, tokens: int, mode: str, drafted: bool, model_plain: float,
                draft_used: bool = True) -> dict | None:
        """Record one finished step (its measured seconds and committed tokens; `mode` as planned, `drafted` whether
        the tree had drafted nodes, `draft_used` whether the draft model was called for them); returns the decision
        it caused, if any."""
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
        self.idle = 0 if draft_used else self.idle + 1
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
