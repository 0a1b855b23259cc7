"""Plain autoregressive decoding with the target: a tree with nothing but the root, one token per step.

With free branches (`ar+suffix8`, `ar+lookahead`: draft-free speculation) the engine asks it to price them: it
measures (or loads) the target's cost curve, and the budget keeps only the rows whose measured acceptance pays for
them (grafts/budget.py), so the draft-free mode is never much slower than plain decoding where the text does not
repeat. Measured in docs/suffix.md ("The draft-free mode, budgeted").
"""
from __future__ import annotations

from ..core.tree import TokenTree
from ..tuning import costs
from .auto.objective import CostModel
from .base import DraftContext, Policy


class AutoregressivePolicy(Policy):
    name = "ar"
    summary = "plain decoding with the target model (the baseline every speed-up is measured against)"
    needs_draft = False
    plain = True  # the engine's plain loop runs it; `draft` serves callers that step the policy themselves

    def __init__(self, **options):
        super().__init__(**options)
        self.costs: CostModel | None = None  # the target's measured costs, once free branches are to be priced

    def price_free_branches(self, target) -> None:
        if self.costs is None:
            curve, _ = costs.profile_model(target, progress=True)
            self.costs = CostModel(curve, curve)  # no draft calls: only the target curve is read

    def draft(self, ctx: DraftContext) -> TokenTree:
        if self.costs is not None:
            self.costs.sharing = ctx.sharing  # rows of a batching round count for every request (objective.py)
        return TokenTree.root(ctx.context[-1])

    def estimate(self) -> list[float] | None:
        """One token in a plain step's predicted seconds: what a free branch must beat (grafts/budget.py)."""
        return None if self.costs is None else [1.0, float(self.costs.plain_step())]
