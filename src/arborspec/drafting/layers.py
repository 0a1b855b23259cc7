"""Helpers shared by policies that grow a tree one layer per draft call."""
from __future__ import annotations

import torch

from ..core.sampling import sample
from ..core.tree import DrawRule, TokenTree
from .base import DraftContext

# How a policy with a `draw` option picks a node's k children when the draft samples (T > 0), and the drawing rule
# it records so the engine pairs the tree with a verifier that is exact for it (the verifier in brackets).
DRAW_RULES = {
    "sample": DrawRule.WITHOUT_REPLACEMENT,  # k distinct tokens, sampled one after another (mbr)
    "iid": DrawRule.WITH_REPLACEMENT,  # k independent samples, duplicates allowed, as SpecInfer draws (mss)
    "greedy": DrawRule.GREEDY_TOPK_PLUS_ONE,  # the k-1 most probable tokens, then one sample off them (greedy-draft)
}
DRAW_HELP = ("how children are drawn when sampling: sample (distinct draws; verifier mbr), iid (independent draws, "
             "duplicates allowed; mss), greedy (the k-1 most probable draft tokens plus one draw off them; greedy-draft)")


def check_draw(value: str) -> str:
    """`value` if it names a drawing scheme of DRAW_RULES (ValueError otherwise)."""
    if value not in DRAW_RULES:
        raise ValueError(f"draw must be one of {', '.join(DRAW_RULES)}, got {value!r}")
    return value


def layer_probs(ctx: DraftContext, tree: TokenTree, frontier: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft call over `frontier`: returns (warped, plain) probabilities, each (len(frontier), vocab).

    `warped` is the distribution children are drawn from (one-hot at temperature 0); `plain` is the softmax at
    temperature 1, which greedy policies use to rank candidates and to value nodes.
    """
    logits = ctx.session.forward(ctx.context, tree, frontier)
    return ctx.sampling.probs(logits), logits.softmax(dim=-1)


def draw_children(
    ctx: DraftContext, tree: TokenTree, node: int, warped: torch.Tensor, plain: torch.Tensor, k: int,
    draw: str = "sample",
) -> list[int]:
    """Give `node` k children: the top-k draft tokens when greedy, else drawn from `warped` as `draw` says
    (DRAW_RULES). Returns the new node indices (fewer than k where the draft's support runs out). Records the
    distribution and drawing rule on the tree; storage order is drawing order, which greedy-draft relies on.
    """
    if ctx.sampling.greedy:
        tokens = torch.topk(plain, min(k, plain.shape[-1])).indices.tolist()
        tree.set_children_dist(node, warped, DrawRule.DETERMINISTIC)
        return [tree.add(node, t, float(plain[t])) for t in tokens]
    tokens = sampled_children(warped, k, draw, ctx.generator)
    tree.set_children_dist(node, warped, DRAW_RULES[draw])
    return [tree.add(node, t, float(warped[t])) for t in tokens]


def sampled_children(q: torch.Tensor, k: int, draw: str, generator: torch.Generator | None) -> list[int]:
    """k children drawn from q (vocab,) by scheme `draw`, in drawing order."""
    if draw == "iid":
        return sample(q, generator, num=k, replacement=True)
    if draw == "greedy":
        return greedy_children(q, k, generator)
    k = min(k, int((q > 0).sum()))  # cannot draw more distinct tokens than the support holds
    return sample(q, generator, num=k, replacement=False)


def greedy_children(q: torch.Tensor, k: int, generator: torch.Generator | None) -> list[int]:
    """Greedy multi-draft (Hu et al., ICLR 2025): the k-1 most probable tokens of q (among those q can draw), then
    one sample from q with those tokens zeroed, last. When nothing is left to sample, only the top tokens."""
    fixed = torch.topk(q, min(k - 1, int(torch.count_nonzero(q)))).indices
    rest = q.index_fill(0, fixed, 0.0)
    if float(rest.sum()) <= 0:
        return fixed.tolist()
    return fixed.tolist() + sample(rest, generator)
