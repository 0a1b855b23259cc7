"""Beam-search trees (STree, Table 1; SpecExec/recursive speculative decoding): N steps of M-beam search with the draft,
keeping every beam's tokens, even beams dropped later.

Step t extends each of the M current beams by its M most likely tokens and keeps the M best of those M*M sequences
(by draft log-probability); the M new last tokens become layer t of the tree, children of the beams they extend.
The result is an N-layer tree with M tokens per layer, one draft call per layer. The choice is deterministic, so it
is verified greedily at temperature 0 and by target sampling (`naive`) above it.
(The same tree as `static --widths M,M,...` with N entries.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.options import check_int, opt
from ..core.tree import MAX_TREE_NODES, DrawRule, TokenTree
from .base import DraftContext, Policy
from .layers import layer_probs


@dataclass
class BeamOptions:
    steps: int = opt(4, "beam-search steps N (tree depth)")
    beams: int = opt(3, "beams M (tokens per layer)")

    def __post_init__(self):
        check_int(self.steps, "steps", high=MAX_TREE_NODES)
        check_int(self.beams, "beams", high=MAX_TREE_NODES)
        if self.steps * self.beams > MAX_TREE_NODES:  # it read "beams must be at most 1, got 3" for steps=1000
            raise ValueError(f"steps x beams = {self.steps * self.beams} drafted tokens a step; at most "
                             f"{MAX_TREE_NODES}")


class BeamPolicy(Policy):
    name = "beam"
    summary = "beam search with the draft (--steps N x --beams M), keeping every beam's tokens (STree)"
    Options = BeamOptions

    @property
    def max_tree_depth(self) -> int:
        return self.options.steps

    def draft(self, ctx: DraftContext) -> TokenTree:
        m = self.options.beams
        tree = TokenTree.root(ctx.context[-1])
        beams = [0]
        logp = {0: 0.0}
        for _ in range(min(self.options.steps, ctx.max_depth)):
            warped, plain = layer_probs(ctx, tree, beams)
            k = min(m, plain.shape[-1])
            top = torch.topk(plain, k, dim=-1)
            score = torch.tensor([logp[b] for b in beams], dtype=torch.float64)[:, None] + top.values.double().log()
            best = torch.topk(score.flatten(), min(m, score.numel())).indices.tolist()
            for i, b in enumerate(beams):
                tree.set_children_dist(b, warped[i], DrawRule.DETERMINISTIC)
            new = []
            for flat in sorted(best):
                row, col = divmod(flat, k)
                node = tree.add(beams[row], int(top.indices[row, col]), float(top.values[row, col]))
                logp[node] = float(score.flatten()[flat])
                new.append(node)
            beams = new
        return tree
