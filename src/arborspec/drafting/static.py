"""Static trees: the same shape every step, either k-ary (`depth` x `branch`) or explicit layer widths.

k-ary: every node of the first `depth` layers gets `branch` children — the top-`branch` draft tokens at temperature 0;
when the draft samples, `draw` picks how (drafting/layers.py: DRAW_RULES), each with the verifier made for it:

    draw=sample   `branch` samples without replacement (Sequoia-style; mbr, also traversal) — the default
    draw=iid      `branch` independent samples, duplicates allowed (SpecInfer; mss, also traversal)
    draw=greedy   the `branch` - 1 most probable draft tokens, then one sample off them (Hu et al., ICLR 2025;
                  greedy-draft, the optimal verifier for that scheme)

Widths (e.g. `--widths 4,3,3,3`, STree's "layers x tokens" shapes): layer d keeps the `widths[d]` candidates with the
highest path probability among the top children of the previous layer. That choice is deterministic, so under
sampling it is verified by target sampling (`naive`).

STree's trees (Table 1: N beam-search steps x M beams, every beam's tokens kept) are exactly these width trees with
N equal widths M; the `beam` policy builds the same tree. Examples:

    --widths 3,3,3,3          N=4 layers x M=3 tokens (12 drafted tokens)
    --widths 4,4,4,4,4,4,4,4  N=8 x M=4 (32)
    --widths 2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2   N=16 x M=2 (STree's deepest trees)
    --depth 3 --branch 2      a full binary tree of 15 nodes with the root (depth 4/5: 31/63): STree's Fig. 3 trees
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.options import check_int, opt, parse_int_list
from ..core.tree import MAX_TREE_NODES, DrawRule, TokenTree
from .base import DraftContext, Policy
from .layers import DRAW_HELP, DRAW_RULES, check_draw, draw_children, layer_probs


@dataclass
class StaticOptions:
    depth: int = opt(4, "k-ary tree: number of drafted layers")
    branch: int = opt(2, "k-ary tree: children per node")
    widths: str = opt("", "explicit layer widths, e.g. '4,3,3,3' (overrides depth/branch)")
    draw: str = opt("sample", DRAW_HELP)

    def __post_init__(self):
        for name in ("depth", "branch"):
            check_int(getattr(self, name), name, high=MAX_TREE_NODES)
        self.width_list = parse_int_list(self.widths, "widths") if self.widths else ()
        nodes = sum(self.width_list) or sum(self.branch ** i for i in range(1, self.depth + 1))
        if nodes > MAX_TREE_NODES:  # depth=1000,branch=1000 has a 3001-digit count: not printed
            count = nodes if nodes < 10 ** 9 else "more than a billion"
            raise ValueError(f"this tree has {count} drafted nodes; a step's tree may hold at most {MAX_TREE_NODES}")
        check_draw(self.draw)
        if self.width_list and self.draw != "sample":
            raise ValueError("draw applies to k-ary trees (depth, branch); a widths tree picks its tokens "
                             "deterministically")


class StaticPolicy(Policy):
    name = "static"
    summary = "a fixed tree shape: k-ary (--depth, --branch) or explicit layer widths (--widths)"
    Options = StaticOptions

    @property
    def max_tree_depth(self) -> int:
        return len(self.options.width_list) or self.options.depth

    @property
    def sampled_rule(self) -> DrawRule:
        """How children are drawn when the draft samples; the base class derives draw_rules and the default
        verifier (mbr, mss, greedy-draft, or naive for widths trees) from it."""
        return DrawRule.DETERMINISTIC if self.options.width_list else DRAW_RULES[self.options.draw]

    @property
    def draws_chains(self) -> bool:
        return self.options.branch == 1 and not self.options.width_list

    def draft(self, ctx: DraftContext) -> TokenTree:
        if self.options.width_list:
            return self._draft_widths(ctx)
        tree = TokenTree.root(ctx.context[-1])
        frontier = [0]
        for _ in range(min(self.options.depth, ctx.max_depth)):
            warped, plain = layer_probs(ctx, tree, frontier)
            frontier = [
                child
                for i, node in enumerate(frontier)
                for child in draw_children(ctx, tree, node, warped[i], plain[i], self.options.branch,
                                           self.options.draw)
            ]
        return tree

    def _draft_widths(self, ctx: DraftContext) -> TokenTree:
        tree = TokenTree.root(ctx.context[-1])
        frontier = [0]
        for width in self.options.width_list[: ctx.max_depth]:
            warped, plain = layer_probs(ctx, tree, frontier)
            # (len(frontier), width) candidates per parent, ranked by path probability across the layer
            top = torch.topk(plain, min(width, plain.shape[-1]), dim=-1)
            parent_p = torch.tensor([tree.path_prob(n) for n in frontier])[:, None]
            score = (parent_p * top.values).flatten()
            best = torch.topk(score, min(width, score.numel())).indices.tolist()
            for i, node in enumerate(frontier):
                tree.set_children_dist(node, warped[i], DrawRule.DETERMINISTIC)
            new = []
            for flat in sorted(best):
                row, col = divmod(flat, top.indices.shape[1])
                new.append(tree.add(frontier[row], int(top.indices[row, col]), float(top.values[row, col])))
            frontier = new
        return tree
