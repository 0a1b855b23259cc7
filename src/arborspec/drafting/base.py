"""What every tree policy shares: its options, the context it drafts in, and its contract with verifiers.

A policy turns the draft model's view of the committed text into a `TokenTree`. It must record, for every node it
expands, the draft distribution the children came from and how they were drawn (`TokenTree.set_children_dist`), so
the engine can pick a verifier that is exact for that drawing rule.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..backends.session import Session
from ..core.options import check_numbers
from ..core.sampling import SamplingConfig
from ..core.tree import DrawRule, TokenTree


@dataclass
class DraftContext:
    """Everything a policy may look at while drafting one step."""

    session: Session | None  # the draft model's state (None for policies that need no draft model)
    context: list[int]  # committed token ids; the tree's root is context[-1]
    sampling: SamplingConfig  # the draft's own warp (its temperature may differ from the target's)
    generator: torch.Generator | None
    max_depth: int  # the tree may not go deeper than this (context window, tokens left to generate)
    sharing: int = 1  # requests whose steps share this step's forwards (a batching round: backends/batching.py)


@dataclass
class NoOptions:
    pass


class Policy:
    """Base class of tree policies. Subclasses set `name`, `Options`, and implement `draft`."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    needs_draft: ClassVar[bool] = True
    # Every tree is the bare root (plain decoding, one target token a step): the engine then runs its plain loop
    # (SpeculativeDecoder._plain_steps), which calls neither `draft` nor `update`.
    plain: ClassVar[bool] = False
    # How children are drawn when the draft samples (T > 0); at T = 0 every policy picks them deterministically.
    sampled_rule: ClassVar[DrawRule] = DrawRule.DETERMINISTIC

    def __init__(self, **options):
        names = {f.name for f in dataclasses.fields(self.Options)}
        unknown = sorted(set(options) - names)
        if unknown:
            known = ", ".join(sorted(names)) or "none"
            raise ValueError(f"method {self.name!r} takes no option {unknown[0]!r} (its options: {known})")
        check_numbers(self.Options, options)
        self.options = self.Options(**options)

    def draw_rules(self, sampling: SamplingConfig) -> set[DrawRule]:
        """The drawing rules this policy's trees may contain under `sampling` (used to pick/check verifiers)."""
        return {DrawRule.DETERMINISTIC} if sampling.greedy else {self.sampled_rule}

    def default_verifier(self, sampling: SamplingConfig) -> str:
        """The exact verifier for this policy's trees: greedy at T = 0, else the one made for its drawing rule."""
        if sampling.greedy:
            return "greedy"
        return EXACT_VERIFIER[next(iter(self.draw_rules(sampling)))] if len(self.draw_rules(sampling)) == 1 else "naive"

    @property
    def draws_chains(self) -> bool:
        """True if every tree this policy drafts has at most one child per node (chain-only verifiers need it)."""
        return False

    @property
    def max_tree_depth(self) -> int:
        """The deepest tree this policy can build (for context-window checks)."""
        return 0

    def draft(self, ctx: DraftContext) -> TokenTree:
        raise NotImplementedError

    def uses_draft(self, prompt_tokens: int = 0, new_tokens: int = 0) -> bool:
        """Whether the next generation (a prompt of `prompt_tokens`, up to `new_tokens` to generate) calls the draft
        model at all; the engine neither opens nor prefills a draft session otherwise (auto says no when its measured
        costs leave no tree expected to beat plain decoding). A policy that needs a draft and says no drafts only
        bare roots: the engine decodes plainly (see `plain`)."""
        return self.needs_draft

    def update(self, step) -> None:
        """Called after each step with its `StepStats`; policies that adapt (DynaTree, auto) override it."""

    def bind(self, target, draft, sampling: SamplingConfig, draft_sampling: SamplingConfig, tokenizer=None,
             verifier: str = "", ssm_tree: str = "packed") -> None:
        """Called once by `SpeculativeDecoder` after construction with its models (bare model objects; `draft` may be
        None), the target's and the draft's sampling settings, the tokenizer, the name of the verifier that checks
        the drafted trees and the tree scan of Mamba2 / hybrid models: auto profiles the models (with that scan) and
        loads the calibration it saved for this pair, these settings and (at T > 0) this verifier (or, for a new
        pair, measures its agreement)."""

    def explain(self) -> dict:
        """The policy's account of its choices so far, copied into `GenerationStats.policy` when the generation ends."""
        return {}

    def price_free_branches(self, target) -> None:
        """Called by the engine when free branches (n-gram, suffix, lookahead) are grafted onto this policy's trees:
        a policy that drafts nothing itself may measure the target's costs here, so that the budget keeps only the
        rows that pay (grafts/budget.py; `ar` does). By default nothing: a policy without a cost model keeps every
        branch, as asked."""

    def estimate(self) -> list[float] | None:
        """[expected tokens, predicted seconds] of the step `draft` just built, under measured costs, for the budget
        of draft-free branches (grafts/budget.py); None for a policy without a cost model."""
        return None


EXACT_VERIFIER = {  # the verifier derived for each drawing rule at T > 0 (core/tree.py says why each is exact for its rule)
    DrawRule.WITHOUT_REPLACEMENT: "mbr",
    DrawRule.WITH_REPLACEMENT: "mss",
    DrawRule.DETERMINISTIC: "naive",
    DrawRule.GREEDY_TOPK_PLUS_ONE: "greedy-draft",
}


