"""Helpers shared by policies that grow a tree one layer per draft call."""
from __future__ import annotations

import torch

from ..sampling import sample
from ..tree import DrawRule, TokenTree
from .base import DraftContext


def layer_probs(ctx: DraftContext, tree: TokenTree, frontier: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft call over `frontier`: returns (warped, plain) probabilities, each (len(frontier), vocab).

    `warped` is the distribution children are drawn from (one-hot at temperature 0); `plain` is the softmax at
    temperature 1, which greedy policies use to rank candidates and to value nodes.
    """
    logits = ctx.session.forward(ctx.context, tree, frontier)
    return ctx.sampling.probs(logits), logits.softmax(dim=-1)


def draw_children(
    ctx: DraftContext, tree: TokenTree, node: int, warped: torch.Tensor, plain: torch.Tensor, k: int
) -> list[int]:
    """Give `node` k children: the top-k draft tokens when greedy, else k samples without replacement.

    Returns the new node indices. Records the distribution and drawing rule on the tree.
    """
    if ctx.sampling.greedy:
        tokens = torch.topk(plain, k).indices.tolist()
        tree.set_children_dist(node, warped, DrawRule.DETERMINISTIC)
        return [tree.add(node, t, float(plain[t])) for t in tokens]
    k = min(k, int((warped > 0).sum()))  # cannot draw more distinct tokens than the support holds
    tokens = sample(warped, ctx.generator, num=k, replacement=False)
    tree.set_children_dist(node, warped, DrawRule.WITHOUT_REPLACEMENT)
    return [tree.add(node, t, float(warped[t])) for t in tokens]
