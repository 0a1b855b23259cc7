"""The budget of draft-free branches (drafting/graft_budget.py): grafted rows are kept only where they pay."""
from __future__ import annotations

from arborspec import SpeculativeDecoder
from arborspec.drafting.auto.objective import CostModel
from arborspec.drafting.graft_budget import WARMUP, GraftBudget
from arborspec.profile import CostCurve
from arborspec.tree import TokenTree
from tests.drafting.equivalence import make_pair

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def curve(per_row: float, base: float = 0.05) -> CostCurve:
    """t(n) = base + per_row * (n - 1): per_row = base is llama.cpp-steep, 0 is free verification."""
    return CostCurve.from_measurements(SIZES, [base + per_row * (n - 1) for n in SIZES])


def costs(per_row: float) -> CostModel:
    return CostModel(curve(per_row), curve(0.0, 0.02))


def seasoned(budget: GraftBudget, source: str, proposed: int, accepted: int) -> GraftBudget:
    budget.observe({source: {"proposed": proposed, "accepted": accepted}})
    return budget


def test_rows_pay_when_acceptance_beats_their_cost_against_the_trees_rate():
    cheap, steep = costs(0.005), costs(0.05)  # a row at 10% / 100% of a one-token forward
    plain = [1.0, 0.05]  # a root-only step: 1 token in t(1)
    assert seasoned(GraftBudget(cheap), "suffix", 40, 20).pays("suffix", 4, 0, *plain)  # 0.5/row vs 0.1 t(1)
    assert not seasoned(GraftBudget(steep), "suffix", 40, 20).pays("suffix", 4, 0, *plain)  # 0.5/row vs 1 t(1)
    assert not seasoned(GraftBudget(cheap), "suffix", 40, 1).pays("suffix", 4, 0, *plain)  # ~0.05/row vs 0.1
    # a tree already at 3 tokens per t(1): a row must bring more than 3 x its cost in t(1) units
    assert not seasoned(GraftBudget(cheap), "suffix", 40, 10).pays("suffix", 2, 6, 3.0, 0.05)
    assert GraftBudget(steep).pays("suffix", 4, 0, *plain)  # not measured yet: kept until WARMUP nodes proposed
    assert not seasoned(GraftBudget(steep), "suffix", WARMUP, 0).pays("suffix", 4, 0, *plain)


def test_a_dropped_branch_leaves_the_tree_untouched_and_a_kept_one_updates_the_estimate():
    tree = TokenTree.root(5)
    tree.add(0, 6)
    budget = seasoned(GraftBudget(costs(0.05)), "ngram", 40, 0)
    estimate = [1.5, 0.12]
    out, kept = budget.graft(tree, "ngram", lambda t: t.add(0, 7, source="ngram"), estimate)
    assert out is tree and not kept and len(tree) == 2 and estimate == [1.5, 0.12] and budget.describe()["ngram"]["dropped"] == 1
    budget = seasoned(GraftBudget(costs(0.0)), "ngram", 40, 38)
    out, kept = budget.graft(tree, "ngram", lambda t: t.add(0, 7, source="ngram"), estimate)
    assert kept and len(out) == 3 and len(tree) == 2 and out.sources[2] == "ngram"  # grafted on a copy
    assert estimate[0] > 1.5 and abs(estimate[1] - 0.12) < 1e-12  # free rows: more tokens, same seconds
    kept = []
    assert GraftBudget(None).graft(tree, "ngram", kept.append, None) == (tree, True) and kept == [tree]  # no costs: always


def repetitive_prompt() -> list[int]:
    return [5, 6, 7, 8, 9, 10, 11, 12] * 6


def test_auto_drops_free_branches_that_do_not_pay_and_keeps_them_where_rows_are_free():
    """Steep verification with a draft that cannot pay: auto decodes plainly, and suffix / lookahead rows, measured
    during their warm-up, are left out afterwards. With free rows they are kept. Greedy output is the target's in
    both cases (the budget only chooses rows)."""
    target, draft = make_pair("llama", seed=3, noise=0.0)
    prompt = repetitive_prompt()
    ref = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=60, ignore_eos=True)
    for per_row, dropped in ((0.05, True), (0.0, False)):
        dec = SpeculativeDecoder(target, draft, method="auto", suffix=4, lookahead=2)
        dec.policy.use_costs(CostModel(curve(per_row), curve(0.0, 0.1)))  # a draft token at 2 t(1)
        res = dec.generate(prompt, max_new_tokens=60, ignore_eos=True)
        assert res.token_ids == ref.token_ids
        grafts = res.stats.policy["grafts"]
        assert sum(s.draft_calls for s in res.stats.steps) == 0  # the draft model never pays here
        late = res.stats.steps[-10:]
        if dropped:  # at t(n) = n t(1) a row pays only if accepted for sure: never, once measured
            assert sum(g["dropped"] for g in grafts.values()) > 0 and all(s.tree_size == 0 for s in late)
        else:
            assert all(g["dropped"] == 0 for g in grafts.values()) and any(s.tree_size > 0 for s in late)


def test_a_left_out_branch_is_judged_once_the_tokens_after_it_are_known():
    tree = TokenTree.root(5)
    budget = seasoned(GraftBudget(costs(0.05)), "suffix", 40, 0)
    _, kept = budget.graft(tree, "suffix", lambda t: [t.add(0, 7, source="suffix"), t.add(1, 8, source="suffix"),
                                                      t.add(2, 9, source="suffix")], [1.0, 0.05])
    assert not kept
    budget.settle([7])  # plain steps: one token each; the branch is 3 deep, so it waits
    budget.settle([8])
    assert budget.proposed["suffix"] == 40
    budget.settle([4])  # 7, 8, 4: two of its three nodes would have been accepted
    assert budget.proposed["suffix"] == 43 and budget.accepted["suffix"] == 2
    budget.settle([7, 8, 9])  # nothing left out since: nothing more counted
    assert budget.proposed["suffix"] == 43
