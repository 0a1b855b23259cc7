"""Pool adjacent violators: the non-decreasing sequence closest to some values, in weighted least squares.

Two quantities arborspec measures must not decrease but arrive noisy: the cost of a forward as the tree grows (more
tokens never cost less: `profile.CostCurve`) and the acceptance rate as the draft's score grows (the auto policy's
calibration). Both go through this one fit: scanning left to right, any run of values that breaks the order is pooled
into its weighted mean.
"""
from __future__ import annotations

import numpy as np


def pool_adjacent_violators(values, weights=None) -> np.ndarray:
    """The non-decreasing sequence closest to `values` in least squares weighted by `weights` (default: all 1)."""
    weights = [1.0] * len(values) if weights is None else weights
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.concatenate([[m] * c for m, _, c in blocks]) if blocks else np.zeros(0)
