"""Plain autoregressive decoding with the target: a tree with nothing but the root, one token per step."""
from __future__ import annotations

from ..tree import TokenTree
from .base import DraftContext, Policy


class AutoregressivePolicy(Policy):
    name = "ar"
    summary = "plain decoding with the target model (the baseline every speed-up is measured against)"
    needs_draft = False
    plain = True  # the engine's plain loop runs it; `draft` serves callers that step the policy themselves

    def draft(self, ctx: DraftContext) -> TokenTree:
        return TokenTree.root(ctx.context[-1])
