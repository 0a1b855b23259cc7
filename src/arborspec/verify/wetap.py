"""WETAP's deep-to-shallow beam verification (WETAP sec. 3.3, Alg. 1 lines 27-51). LOSSY: it does not preserve the
target distribution, so the engine uses it only with allow_lossy=True and flags the result (`stats.lossy`).

A node is accepted when its whole path ("beam") passes min(1, prod p_target / prod q_draft) > tau, products over
the path's tokens (eq. 9), regardless of whether each token would pass alone. Layers are scanned from the deepest up;
the first layer with an accepted node ends the scan, and among its accepted nodes the one with the highest cumulative
target probability wins (the listing's `if x_j > eta` compares tokens; the text says cumulative probability). The bonus
is drawn from the target at that node (from the root if nothing passed).

The paper gives tau no default; `DEFAULT_TAU` is ours. At temperature 0 (one-hot p and q) a path's ratio is 1 (or
p/0 = inf) exactly when it matches the target's argmax everywhere, and 0 otherwise, so any tau in [0, 1) gives greedy.
Zero guards: a cumulative target probability of 0 gives ratio 0; a positive one over a draft probability of 0 (a
deterministic child the draft's warp excluded) gives ratio inf.
"""
from __future__ import annotations

import torch

from ..core.sampling import SamplingConfig
from ..core.tree import TokenTree
from .base import Verdict, Verifier, draft_dist, draw, target_probs

DEFAULT_TAU = 0.5


class WETAPVerifier(Verifier):
    name = "wetap"
    summary = "WETAP beam acceptance, deep to shallow, threshold tau (changes the output distribution)"
    exact = False

    def __init__(self, tau: float = DEFAULT_TAU):
        if not 0 <= tau < 1:
            raise ValueError(f"tau must be in [0, 1), got {tau!r}")
        self.tau = tau

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator) -> Verdict:
        p = target_probs(target_logits, sampling)
        n = len(tree)
        cum_p, cum_q = [1.0] * n, [1.0] * n
        q = {}
        for i in range(1, n):
            par, tok = tree.parents[i], tree.tokens[i]
            if par not in q:
                q[par] = draft_dist(tree, par, self.name)
            cum_p[i] = cum_p[par] * float(p[par, tok])
            cum_q[i] = cum_q[par] * float(q[par][tok])
        best = 0
        for depth in range(tree.depth, 0, -1):
            passed = [i for i in range(n) if tree.depths[i] == depth and self._ratio(cum_p[i], cum_q[i]) > self.tau]
            if passed:
                best = max(passed, key=lambda i: cum_p[i])
                break
        return Verdict(tree.path(best)[1:], draw(p[best], generator))

    @staticmethod
    def _ratio(cp: float, cq: float) -> float:
        if cp <= 0:
            return 0.0
        return 1.0 if cq <= 0 else min(1.0, cp / cq)
