"""WETAP: width from entropy (eqs. 3-6), then probability + length pruning with parent re-insertion (eqs. 7-8).

Construction, one draft call per layer (WETAP Alg. 1, lines 5-16): layer 1 holds the W_min most likely children of the
root; layer t+1 holds the W_{t+1} candidates with the highest cumulative (path) probability among the children of
layer t ("BeamSample"), where

    p'_i = p_i / sum_j p_j over the W_t nodes of layer t            (eq. 3, p = cumulative probability)
    H_t = -sum_i p'_i log p'_i                                      (eq. 4)
    H_norm = clip(H_t / log W_t, 0, 1)                              (eq. 6; 0 when W_t = 1)
    W_{t+1} = round(W_min + (W_max - W_min) * H_norm ** gamma)      (eq. 5)

for `length` layers. The tree is larger than the budget on purpose; `prune` then cuts it to `budget` tokens:

1. score_v = alpha * p_norm(v) + (1 - alpha) * depth(v) / D  (eqs. 7-8; p_norm min-max normalises the cumulative
   probabilities over the drafted nodes, D is the tree's depth) and keep the `budget` best;
2. re-insert the missing ancestors of kept nodes (the score is not monotone along a path, probability alone is);
3. if that overshoots the budget, drop the leaves that stop above the deepest layer, shallowest first (least likely
   first within a layer). This is one pass over the leaves present after re-insertion: a parent that becomes a leaf
   because its child was dropped is not dropped in this pass (App. D's example needs exactly this: after dropping
   leaf 12 its parent stays, and tokens 15 and 16 go in the next stage);
4. if it still overshoots, drop the least likely leaf, repeatedly (with cumulative probabilities a node is never less
   likely than its descendants, so this is "the tokens with the lowest probabilities").

Children are chosen deterministically (top candidates), so the exact verifier at temperature > 0 is target sampling
(`naive`). WETAP's own deep-to-shallow verifier is lossy; it is the separate verifier "wetap".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.options import check_int, opt
from ..core.tree import MAX_TREE_NODES, DrawRule, TokenTree
from .base import DraftContext, Policy
from .layers import layer_probs


@dataclass
class WetapOptions:
    budget: int = opt(64, "drafted tokens per step after pruning")
    length: int = opt(8, "layers of the constructed tree (L)")
    w_min: int = opt(16, "minimum layer width (also the first layer's width)")
    w_max: int = opt(128, "maximum layer width")
    gamma: float = opt(1.2, "exponent of the entropy -> width map (eq. 5)")
    alpha: float = opt(0.6, "pruning weight of probability vs. depth (eq. 8; 0.3 for dialogue)")

    def __post_init__(self):
        for name in ("budget", "length", "w_min", "w_max"):
            check_int(getattr(self, name), name, high=MAX_TREE_NODES)
        if self.w_min > self.w_max:
            raise ValueError(f"need w_min <= w_max, got {self.w_min} > {self.w_max}")
        if not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma!r}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")


def next_width(layer_probs: list[float], w_min: int, w_max: int, gamma: float) -> int:
    """Eqs. 3-6: the width of the next layer from the cumulative probabilities of this one."""
    w = len(layer_probs)
    total = sum(layer_probs)
    if w <= 1 or total <= 0:
        h_norm = 0.0
    else:
        h = -sum(p / total * math.log(p / total) for p in layer_probs if p > 0)
        h_norm = min(1.0, max(0.0, h / math.log(w)))
    return int(round(w_min + (w_max - w_min) * h_norm**gamma))


def prune(parents: list[int], depths: list[int], cum: list[float], budget: int, alpha: float,
          eps: float = 1e-6) -> list[int]:
    """WETAP pruning of a tree given as parent/depth/cumulative-probability lists (index 0 = root, always kept).

    Returns the kept node indices, sorted, root included; at most `budget` drafted nodes.
    """
    n = len(parents)
    nodes = list(range(1, n))
    if len(nodes) <= budget:
        return list(range(n))
    D = max(depths)
    pmin, pmax = min(cum[1:]), max(cum[1:])
    score = {v: alpha * (cum[v] - pmin) / (pmax - pmin + eps) + (1 - alpha) * depths[v] / D for v in nodes}
    # 1. the `budget` best scores (ties: more likely, then earlier)
    keep = set(sorted(nodes, key=lambda v: (-score[v], -cum[v], v))[:budget])
    # 2. re-insert missing ancestors
    for v in list(keep):
        u = parents[v]
        while u > 0 and u not in keep:
            keep.add(u)
            u = parents[u]

    def leaves() -> list[int]:
        has_child = {parents[v] for v in keep}
        return [v for v in keep if v not in has_child]

    # 3. one pass over the leaves above the deepest layer, shallow to deep, least likely first
    deepest = max(depths[v] for v in keep)
    for v in sorted((v for v in leaves() if depths[v] < deepest), key=lambda v: (depths[v], cum[v], -v)):
        if len(keep) <= budget:
            break
        keep.discard(v)
    # 4. the least likely leaf, repeatedly (ties: the deeper, then the later)
    while len(keep) > budget:
        keep.discard(min(leaves(), key=lambda v: (cum[v], -depths[v], -v)))
    return sorted(keep | {0})


class WetapPolicy(Policy):
    name = "wetap"
    summary = "WETAP: layer widths from the previous layer's entropy, then probability+depth pruning to --budget"
    Options = WetapOptions

    def __init__(self, **options):
        super().__init__(**options)
        self.last_widths: list[int] = []  # constructed layer widths of the last tree (before pruning)

    @property
    def max_tree_depth(self) -> int:
        return self.options.length

    def draft(self, ctx: DraftContext) -> TokenTree:
        o = self.options
        tree = TokenTree.root(ctx.context[-1])
        cum = [1.0]
        frontier, width = [0], o.w_min
        self.last_widths = []
        for _ in range(min(o.length, ctx.max_depth)):
            warped, plain = layer_probs(ctx, tree, frontier)
            k = min(width, plain.shape[-1])
            top = torch.topk(plain, k, dim=-1)  # (len(frontier), k)
            parent_p = torch.tensor([cum[u] for u in frontier], dtype=torch.float64)[:, None]
            score = (parent_p * top.values.double()).flatten()
            best = torch.topk(score, min(width, score.numel())).indices.tolist()
            for i, u in enumerate(frontier):
                tree.set_children_dist(u, warped[i], DrawRule.DETERMINISTIC)
            new = []
            for flat in sorted(best):  # grouped by parent, then by rank: parents first, siblings in rank order
                row, col = divmod(flat, k)
                new.append(tree.add(frontier[row], int(top.indices[row, col]), float(top.values[row, col])))
                cum.append(float(score[flat]))
            frontier = new
            self.last_widths.append(len(new))
            width = next_width([cum[v] for v in new], o.w_min, o.w_max, o.gamma)
        if len(tree) - 1 <= o.budget:
            return tree
        kept = prune(tree.parents, tree.depths, cum, o.budget, o.alpha)
        # the draft session still holds the constructed tree's state under the old numbers, and the engine commits
        # the accepted path by the numbers of the tree returned here (new node i is old node kept[i])
        if ctx.session is not None:
            ctx.session.renumber(kept)
        return tree.select(kept)
