"""Which verifier a decoder runs: the policy's default for the sampling settings, or the caller's, refused when it
would lose exactness for the trees the policy draws (with the free branches grafted onto them) or when it is lossy
and the caller did not allow that (`allow_lossy`).

Exactness depends on how a tree's children are drawn (verify/base.py: `fits`): a policy states its draw rules for
the draft's warp (`Policy.draw_rules`; a greedy draft picks children deterministically) and whether it draws chains;
free branches (n-gram, suffix, lookahead: drafting/grafts/) add deterministic children and make chains into trees.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from ..core.sampling import SamplingConfig
from ..core.tree import DrawRule, TokenTree
from ..verify import VERIFIERS, Verifier, fits


class Verifiers(NamedTuple):
    """The decoder's verifiers: `verifier` for the drafted trees, `free` for a tree that got free branches (naive
    when they go onto bare trees only, else `verifier` itself), and whether they go onto bare trees only."""

    verifier: Verifier
    free: Verifier
    bare_grafts: bool


def choose_verifiers(policy, sampling: SamplingConfig, draft_sampling: SamplingConfig, name: str | None,
                     allow_lossy: bool, grafts: bool, by_default: bool) -> Verifiers:
    """The verifiers for `policy`'s trees (`grafts`: free branches are grafted; `by_default`: the caller did not ask
    for them, they are the method's default). At T > 0 default free branches may stay off the drafted trees, whose
    verifier need not take them then (`grafts_bare_trees_only` says when they do)."""
    may_stay_off = by_default and grafts and not sampling.greedy
    verifier = pick_verifier(policy, sampling, draft_sampling, name, allow_lossy, free=grafts and not may_stay_off)
    bare = may_stay_off and grafts_bare_trees_only(policy, draft_sampling, verifier)
    return Verifiers(verifier, VERIFIERS["naive"]() if bare else verifier, bare)


def drafts_no_tree(policy, grafts: bool) -> bool:
    """A plain policy without free branches: every step's tree is the bare root, so no verifier checks a drafted
    token (`ar` + sps was refused for "trees with several children per node", `ar` + wetap flagged lossy)."""
    return policy.plain and not grafts


def changes_outputs(verifier: Verifier, sampling: SamplingConfig, policy, grafts: bool) -> bool:
    """Whether a run's outputs may part from the target's distribution (`stats.lossy`): a lossy verifier checking
    drafted trees at T > 0. Not at T = 0, where a lossy rule's accepted path is the target's greedy one (WETAP's: its
    path ratios are 1 or 0), nor where no tree is drafted (`drafts_no_tree`)."""
    return not verifier.exact and not sampling.greedy and not drafts_no_tree(policy, grafts)


def grafts_bare_trees_only(policy, draft_sampling: SamplingConfig, verifier: Verifier) -> bool:
    """Whether free branches go only onto the trees the policy leaves bare (the root alone), each such step
    verified by naive, and the drafted trees, without them, by the policy's own verifier.

    Why: at T > 0 free branches are deterministic children, which only verifiers exact for any tree (naive)
    handle, and naive accepts fewer of a sampled draft's tokens than the policy's own rule (auto's traversal).
    Mixing them would trade draft tokens for free ones; on a bare tree there is nothing to trade, so a step with
    nothing drafted still gets them. Exact because the choice is made before anything is drawn: a policy decides
    whether the root gets children before drawing any (auto: tree_builder.py; a plain or guard step, or no draft
    model at all), so the drafted trees keep their distribution given that choice, and naive is exact for
    whatever tree it is given. Only for free branches the caller did not ask for (auto's default suffix
    branches, at T > 0: `choose_verifiers` asks only then), and only where the verifier picked for the drafted trees
    is not exact for them (a greedy draft's: naive, which takes them on every tree); `+suffixN` (or ngram,
    lookahead) at T > 0 asks for naive on every tree, and gets it."""
    rules = policy.draw_rules(draft_sampling) | {DrawRule.DETERMINISTIC}
    return not fits(type(verifier), rules, False)


def pick_verifier(policy, sampling: SamplingConfig, draft_sampling: SamplingConfig, name: str | None,
                  allow_lossy: bool, free: bool) -> Verifier:
    """The verifier for the drafted trees; with `free`, for the free branches grafted onto them too (ValueError,
    naming the exact alternatives, for one that is not exact for them, or lossy without `allow_lossy`)."""
    # how children are really drawn depends on the draft's own warp (a greedy draft picks them deterministically)
    rules = policy.draw_rules(draft_sampling)
    chain = policy.draws_chains
    if free:  # grafted branches are deterministic children, and make chains into trees
        rules, chain = rules | {DrawRule.DETERMINISTIC}, False
    if name is None:
        name = policy.default_verifier(sampling)
        if not sampling.greedy and not fits(VERIFIERS[name], rules, chain):
            name = "naive"  # exact for any tree
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; choose one of: {', '.join(sorted(VERIFIERS))}")
    cls = VERIFIERS[name]
    undrawn = free or not (policy.needs_draft or policy.plain)  # some nodes have no draft distribution to read
    if not sampling.greedy and name == "greedy":
        raise ValueError("verifier 'greedy' needs temperature 0; use a sampling verifier (e.g. 'naive')")
    # at T=0 every rule is greedy, so only the tree shape matters; with no tree drafted there is none to fit
    drawn = set() if sampling.greedy else rules
    if not drafts_no_tree(policy, free) and not fits(cls, drawn, chain):
        alternatives = exact_alternatives(sampling, drawn, chain, undrawn)
        what = (
            "trees with several children per node (it handles chains only)" if cls.chain_only and not chain
            else f"trees whose children are drawn {'/'.join(sorted(r.value for r in rules))}"
        )
        raise ValueError(
            f"verifier {name!r} is not exact for {what} (method {policy.name!r} with these options and "
            f"sampling settings); exact alternatives: {', '.join(alternatives) or 'none'}"
        )
    if undrawn and cls.reads_draft:  # (at T = 0 `fits` sees shapes only)
        alternatives = ", ".join(exact_alternatives(sampling, drawn, chain, undrawn)) + (
            ", or drop the branches (e.g. +suffix0 on auto)" if free else "")
        raise ValueError(f"verifier {name!r} reads the draft distribution of every node's children, and nodes no draft "
                         f"model drew (n-gram, suffix or lookahead branches, method {policy.name!r}) have none; exact "
                         f"alternatives: {alternatives}")
    if not cls.exact and not allow_lossy:
        raise ValueError(
            f"verifier {name!r} does not preserve the target distribution; pass allow_lossy=True (--allow-lossy) "
            "to use it anyway"
        )
    return cls()


def exact_alternatives(sampling: SamplingConfig, drawn: set[DrawRule], chain: bool, undrawn: bool) -> list[str]:
    """The registered verifiers a refusal offers instead: exact, for `sampling` ('greedy' at temperature 0 only),
    for trees drawn by the rules `drawn` (chains only with `chain`), reading no draft row where some nodes have none
    (`undrawn`). Derived from the registry, so a new verifier is offered where it fits without a word here."""
    return sorted(n for n, v in VERIFIERS.items()
                  if v.exact and (n != "greedy" or sampling.greedy) and fits(v, drawn, chain)
                  and not (undrawn and v.reads_draft))


def with_free_branches(tree: TokenTree, graft: Callable[[TokenTree], TokenTree], bare_only: bool, verifier,
                       free_verifier) -> tuple[TokenTree, object]:
    """(the step's tree, its verifier): `graft` adds the free branches (n-gram, suffix, lookahead) to the drafted
    `tree`, or, with `bare_only`, only to a tree the policy left bare; a tree that got some is verified by
    `free_verifier` (`grafts_bare_trees_only` says why and when that is naive)."""
    drafted = len(tree)
    if bare_only and drafted > 1:
        return tree, verifier
    tree = graft(tree)
    return tree, (free_verifier if len(tree) > drafted else verifier)
