"""Classic speculative decoding: the draft proposes a chain of k tokens (Leviathan et al.; Chen et al.)."""
from __future__ import annotations

from dataclasses import dataclass

from ..core.options import check_int, opt
from ..core.sampling import SamplingConfig
from ..core.tree import MAX_TREE_NODES, DrawRule, TokenTree
from .base import DraftContext, Policy
from .layers import draw_children, layer_probs


@dataclass
class ChainOptions:
    k: int = opt(5, "number of tokens the draft proposes per step")

    def __post_init__(self):
        check_int(self.k, "k", high=MAX_TREE_NODES)


class ChainPolicy(Policy):
    name = "chain"
    summary = "draft k tokens one after another (classic speculative decoding)"
    Options = ChainOptions
    sampled_rule = DrawRule.WITHOUT_REPLACEMENT  # one draw per node: also "with replacement" (verify/base.py)

    @property
    def max_tree_depth(self) -> int:
        return self.options.k

    def default_verifier(self, sampling: SamplingConfig) -> str:
        return "greedy" if sampling.greedy else "sps"

    @property
    def draws_chains(self) -> bool:
        return True

    def draft(self, ctx: DraftContext) -> TokenTree:
        tree = TokenTree.root(ctx.context[-1])
        node = 0
        for _ in range(min(self.options.k, ctx.max_depth)):
            warped, plain = layer_probs(ctx, tree, [node])
            (node,) = draw_children(ctx, tree, node, warped[0], plain[0], 1)
        return tree
