"""a(score): how often a drafted node with a given score is accepted, learned online per model pair.

a(.) starts as the identity (DySpec's hypothesis: draft probability approximates acceptance) and is estimated in
score bins [e_b, e_{b+1}) with a Beta(k * m_b, k * (1 - m_b)) prior (m_b the bin centre, k = `PRIOR_STRENGTH`): after
every step each drafted node adds a hit (it is on the accepted path) or a miss to its bin. The posterior means are
made non-decreasing (pool adjacent violators) and a(.) is linear between bin centres. Old evidence is down-weighted
once a bin holds `MAX_EVIDENCE` observations, so the estimate follows the text.

The evidence is persisted per model pair, dtype, thread count, sampling setting and library versions in
cache_dir()/profiles/calibration-*.json (policy.py) and loaded with each bin capped at 100 observations.
"""
from __future__ import annotations

import numpy as np

from ...core.isotonic import pool_adjacent_violators

EDGES = (0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
PRIOR_STRENGTH = 2.0
MAX_EVIDENCE = 400.0


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
        if not (np.isfinite(hits).all() and np.isfinite(trials).all() and (hits >= 0).all()):
            return False  # NaN passed the comparison above (a ZeroDivisionError in uses_draft), negatives made 0 trials
        scale = np.where(trials > cap, cap / np.maximum(trials, 1e-12), 1.0)
        self.hits, self.trials = hits * scale, np.minimum(trials, cap)  # cap itself: 16 read 15.999999999999998
        self._curve = None
        return True

    def set_evidence(self, hits, trials) -> None:
        """Replace the evidence, bin by bin (a prior measured elsewhere, as if `trials` observations had shown it)."""
        self.hits = np.broadcast_to(np.asarray(hits, np.float64), self.hits.shape).copy()
        self.trials = np.broadcast_to(np.asarray(trials, np.float64), self.trials.shape).copy()
        self._curve = None

    def describe(self) -> list[dict]:
        c = self.curve() if self.enabled else self.centers
        return [{"score": [round(float(lo), 4), round(float(hi), 4)], "prior": round(float(m), 4),
                 "observed": round(float(n), 1), "hits": round(float(h), 1), "acceptance": round(float(a), 4)}
                for lo, hi, m, n, h, a in zip(self.edges[:-1], self.edges[1:], self.centers, self.trials, self.hits, c)]
