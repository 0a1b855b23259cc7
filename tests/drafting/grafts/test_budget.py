"""The budget of draft-free branches (drafting/grafts/budget.py): grafted rows are kept only where they pay."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.core.tree import DrawRule, TokenTree
from arborspec.drafting.auto.objective import CostModel
from arborspec.drafting.grafts import ngram
from arborspec.drafting.grafts.budget import PATIENCE, WARMUP, GraftBudget
from arborspec.tuning.costs import CostCurve
from tests.drafting.equivalence import make_pair

pytestmark = pytest.mark.usefixtures("private_cache")  # auto's profiles and calibrations: not in ~/.cache

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


def test_the_draft_free_mode_prices_its_branches_with_the_targets_measured_costs(monkeypatch):
    """`ar` with free branches (the draft-free mode) measures the target's curve when the decoder is built (only then:
    plain `ar` measures nothing) and prices the branches as auto does: left out once measured where rows are as steep
    as llama.cpp's, kept where they are free; the output is the target's greedy text either way."""
    from arborspec.tuning import costs

    measured = []
    monkeypatch.setattr(costs, "profile_model", lambda model, **kw: measured.append(model) or (curve(0.0), "cache"))
    target, _ = make_pair("llama", seed=3, noise=0.0)
    prompt = repetitive_prompt()
    ref = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=60, ignore_eos=True)
    assert measured == [] and ref.stats.n_steps == 59  # decoding steps: the first token is the prompt's forward's
    for per_row, dropped in ((0.05, True), (0.0, False)):
        dec = SpeculativeDecoder(target, method="ar", suffix=4, lookahead=2)
        assert measured[-1] is target and dec.policy.estimate() == [1.0, 0.05]
        dec.policy.costs = CostModel(curve(per_row), curve(per_row))
        res = dec.generate(prompt, max_new_tokens=60, ignore_eos=True)
        assert res.token_ids == ref.token_ids
        grafts = res.stats.policy["grafts"]
        late = res.stats.steps[-10:]
        if dropped:
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


def chain_graft(tokens: list[int], scores: dict[int, float], prob: float = 1.0):
    """An `add` that grafts `tokens` as one suffix chain under the root, filling `scores` with path probabilities."""
    def add(tree: TokenTree) -> None:
        parent, path = 0, 1.0
        for tok in tokens:
            parent = tree.add(parent, tok, prob, source="suffix")
            path *= prob
            scores[parent] = path
    return add


def judged(budget: GraftBudget, depth_hits: list[tuple[int, int]]) -> GraftBudget:
    """`budget` with judged suffix nodes of count ratio 1: (exposed nodes, accepted) at depths 1, 2, ..."""
    budget.observe({"suffix": {"proposed": WARMUP, "accepted": WARMUP // 2}})
    budget.by_depth["suffix"] = [[0.0, 0.0]] + [[float(n), float(a)] for n, a in depth_hits]
    return budget


def test_the_conditional_acceptance_starts_at_the_prior_and_inherits_it_downwards():
    budget = GraftBudget(costs(0.01))
    assert budget.calibration("suffix") == [0.5] and budget.reach("suffix", 3) == [0.5, 0.25, 0.125]
    judged(budget, [(9, 9), (0, 0), (3, 0)])  # depth 2 unexplored: as good as depth 1
    q = budget.calibration("suffix")
    assert abs(q[0] - 9.5 / 10) < 1e-12 and q[1] == q[0] and abs(q[2] - q[1] / 4) < 1e-12
    reach = budget.reach("suffix", 5)
    assert abs(reach[2] - q[0] * q[1] * q[2]) < 1e-12 and abs(reach[4] / reach[3] - q[2]) < 1e-12  # deeper: the last


def test_a_scored_branch_is_cut_where_its_expected_gain_stops_paying():
    """A 12-node copy whose conditional acceptance holds for 5 tokens and collapses after: the best prefix keeps the
    5 that pay; with free rows all 12; with rows at a full forward's cost, none."""
    hits = [(100, 95)] * 5 + [(100, 2)] * 7
    plain = [1.0, 0.05]
    kept_rows = {}
    for per_row in (0.005, 0.0, 0.05):
        budget = judged(GraftBudget(costs(per_row)), hits)
        scores, estimate = {}, list(plain)
        out, kept = budget.graft(TokenTree.root(1), "suffix", chain_graft(list(range(10, 22)), scores), estimate,
                                 scores)
        kept_rows[per_row] = len(out) - 1
        assert kept == (len(out) > 1)
        if kept:
            assert out.tokens[1:] == list(range(10, 10 + len(out) - 1))  # a prefix of the chain
            assert estimate[0] > plain[0]
    assert kept_rows == {0.005: 5, 0.0: 12, 0.05: 0}


def test_a_cut_branch_gives_its_parents_back_the_rule_their_children_were_drawn_by():
    """Grafting marks each parent of a new node DETERMINISTIC; where the cut leaves a parent none of them, it gets
    back its drafted rule (or none, as a drafted leaf), and a kept node whose children were all cut has no rule."""
    tree = TokenTree.root(1)
    for node in (0, 1):
        tree.set_children_dist(node, torch.full((40,), 1 / 40), DrawRule.WITHOUT_REPLACEMENT)
        tree.add(node, 5 + node, 1 / 40)  # root -> 5 -> 6: drafted, without replacement

    def add(trial: TokenTree) -> None:  # a chain 10 .. 14 under the root, then 30 under node 1, 31 under leaf 2
        scores.update({n: 1.0 for n in ngram.graft(trial, [10, 11, 12, 13, 14], "suffix")})
        scores.update({n: 1e-6 for n in ngram.graft(trial, [30], "suffix", under=1)})
        scores.update({n: 1e-6 for n in ngram.graft(trial, [31], "suffix", under=2)})

    budget, scores = judged(GraftBudget(costs(0.005)), [(100, 95)] * 6), {}
    out, kept = budget.graft(tree, "suffix", add, [1.0, 0.05], scores)
    assert kept and out.tokens == [1, 5, 6, 10, 11, 12, 13, 14]  # the low-scored 30 and 31 are cut
    assert out.child_rule == {0: DrawRule.DETERMINISTIC, 1: DrawRule.WITHOUT_REPLACEMENT,
                              **{n: DrawRule.DETERMINISTIC for n in range(3, 7)}}  # 14 (node 7): a leaf, no rule
    assert out.child_dist[1] is tree.child_dist[1]


def test_a_scored_source_needs_no_warm_up_its_prior_decides_from_the_first_step():
    scores = {}
    out, kept = GraftBudget(costs(0.02)).graft(TokenTree.root(1), "suffix", chain_graft(list(range(10, 26)), scores),
                                               [1.0, 0.05], scores)
    assert kept and 1 <= len(out) - 1 < 16  # the prior's 1/2, 1/4, ... pays for the first nodes only


def test_kept_and_cut_nodes_are_judged_by_the_committed_tokens():
    """Nodes whose parent was accepted teach their depth's conditional acceptance, those below a rejected node
    nothing; the cut nodes also count as proposed (the kept ones are counted from the step's own sources)."""
    budget = judged(GraftBudget(costs(0.005)), [(100, 95)] * 5 + [(100, 2)] * 7)
    scores = {}
    out, _ = budget.graft(TokenTree.root(1), "suffix", chain_graft(list(range(10, 22)), scores), [1.0, 0.05], scores)
    assert len(out) - 1 == 5
    before = [row[:] for row in budget.by_depth["suffix"]]
    proposed = budget.proposed["suffix"]
    budget.settle([10])  # a step that committed one token decides the depth-1 node alone
    table = budget.by_depth["suffix"]
    assert [table[d][0] - before[d][0] for d in (1, 2)] == [1, 0] and table[1][1] - before[1][1] == 1
    assert budget.proposed["suffix"] == proposed  # the branch's cut nodes wait until all of it is decided
    budget.settle([11, 12, 99])  # the copy breaks at depth 4
    assert [table[d][0] - before[d][0] for d in range(1, 13)] == [1] * 4 + [0] * 8  # depth 4 had its chance
    assert [table[d][1] - before[d][1] for d in range(1, 13)] == [1] * 3 + [0] * 9
    assert budget.proposed["suffix"] == proposed + 7 and budget.accepted["suffix"] == WARMUP // 2  # cut nodes: 0 hits


def test_the_count_ratio_not_the_path_probability_is_what_a_node_is_judged_against():
    budget = judged(GraftBudget(costs(0.005)), [(100, 95)] * 3)
    scores = {}
    budget.graft(TokenTree.root(1), "suffix", chain_graft([10, 11, 12], scores, prob=0.5), [1.0, 0.05], scores)
    before = [row[:] for row in budget.by_depth["suffix"]]
    budget.settle([10, 11, 99])
    assert [budget.by_depth["suffix"][d][0] - before[d][0] for d in (1, 2, 3)] == [0.5, 0.5, 0.5]


def test_in_a_shared_forward_a_row_must_pay_for_every_request_it_delays():
    """A row that pays for one request alone (a 1/4 chance against a tenth of a forward) does not when four
    requests share the forward (objective.py, `CostModel.sharing`): it delays all four, whose round commits 4 tokens
    in t(4)."""
    shared = costs(0.005)
    shared.sharing = 4
    budget = seasoned(GraftBudget(costs(0.005)), "ngram", 40, 9)
    assert budget.pays("ngram", 2, 0, 1.0, 0.05)
    budget = seasoned(GraftBudget(shared), "ngram", 40, 9)
    assert not budget.pays("ngram", 2, 0, 1.0, float(shared.verify(1)))
    assert abs(budget.extra_seconds(0, 2) - 0.04) < 1e-12  # 4 x 2 more rows of the round's forward
    lengths = []
    for model in (costs(0.005), shared):
        budget = judged(GraftBudget(model), [(100, 70)] * 6)
        scores = {}
        out, _ = budget.graft(TokenTree.root(1), "suffix", chain_graft(list(range(10, 16)), scores),
                              [1.0, float(model.verify(1))], scores)
        lengths.append(len(out))
    assert lengths[1] < lengths[0]


def test_a_sources_acceptance_has_one_hit_and_one_miss_as_prior():
    """acceptance = (accepted + 1) / (proposed + 2): 1/2 before anything is measured, then the counts dominate."""
    budget = GraftBudget(costs(0.01))
    assert budget.acceptance("ngram") == 0.5
    assert seasoned(budget, "ngram", 10, 4).acceptance("ngram") == 5 / 12


def test_a_branch_that_only_matches_the_trees_rate_is_left_out():
    """Rows are kept when they *raise* the rate: at acceptance 1/2, one row costing exactly half a step's seconds for
    half a token of a one-token step leaves E / T where it was, so it is not kept (exact in binary floats)."""
    flat = SimpleNamespace(verify=lambda n: 0.25 * n)  # t(1 + 0 + 1) - t(1) = 0.25
    budget = seasoned(GraftBudget(flat), "ngram", WARMUP, WARMUP // 2)  # acceptance 9 / 18
    assert not budget.pays("ngram", 1, 0, 1.0, 0.5)
    assert budget.pays("ngram", 1, 0, 1.0, 0.51)
    scores = {}  # a scored branch of zero gain on free rows: no prefix beats the tree, none is kept
    out, kept = judged(GraftBudget(costs(0.0)), [(10, 5)]).graft(
        TokenTree.root(1), "suffix", chain_graft([10, 11], scores, prob=0.0), [1.0, 0.05], scores)
    assert len(out) == 1 and not kept


def test_a_kept_branch_adds_its_expected_tokens_and_its_rows_seconds_to_the_estimate():
    """An unscored branch kept whole adds m * acceptance tokens and t(1 + N + m) - t(1 + N) seconds, so the next
    source is judged against the tree as it now stands."""
    budget = seasoned(GraftBudget(costs(0.005)), "ngram", 40, 38)  # acceptance 39 / 42
    tree = TokenTree.root(5)
    tree.add(0, 6)
    estimate = [1.5, 0.055]
    out, kept = budget.graft(tree, "ngram", lambda t: [t.add(0, 7, source="ngram"), t.add(2, 8, source="ngram")],
                             estimate)
    assert kept and len(out) == 4
    assert abs(estimate[0] - (1.5 + 2 * 39 / 42)) < 1e-12 and abs(estimate[1] - (0.055 + 2 * 0.005)) < 1e-12


def test_rows_are_priced_after_the_drafted_nodes_on_a_curve_with_a_knee():
    """The extra seconds of m rows on a tree of N drafted nodes are t(1 + N + m) - t(1 + N): with t flat up to 4
    tokens and steep after, one row on a 2-node tree is free (kept), one more position to the right it would not be."""
    knee = CostCurve.from_measurements([1, 4, 5, 8], [0.05, 0.05, 0.15, 0.45])
    budget = GraftBudget(CostModel(knee, knee))
    assert budget.extra_seconds(2, 1) == 0.0 and abs(budget.extra_seconds(3, 1) - 0.1) < 1e-12
    tree = TokenTree.from_parents([1, 2, 3], [-1, 0, 0])
    scores, estimate = {}, [1.0, 0.05]
    out, kept = budget.graft(tree, "suffix", chain_graft([10], scores), estimate, scores)
    assert kept and out.tokens == [1, 2, 3, 10] and estimate == [1.5, 0.05]


def test_without_an_estimate_or_without_costs_the_branch_is_grafted_whole_onto_the_tree():
    """Either missing (a policy without a cost model) means no pricing: the tree itself gets the whole branch."""
    for budget, estimate in ((GraftBudget(costs(0.05)), None), (GraftBudget(None), [1.0, 0.05])):
        tree = TokenTree.root(5)
        out, kept = budget.graft(tree, "ngram", lambda t: [t.add(0, 7, source="ngram")], estimate)
        assert out is tree and kept and tree.tokens == [5, 7]


def test_an_undecided_left_out_branch_is_counted_after_patience_steps():
    """Steps that commit nothing decide nothing: the left-out branch waits exactly PATIENCE steps, then its nodes
    count as proposed and not accepted."""
    budget = seasoned(GraftBudget(costs(0.05)), "ngram", 40, 0)
    _, kept = budget.graft(TokenTree.root(5), "ngram", lambda t: [t.add(0, 7, source="ngram")], [1.0, 0.05])
    assert not kept
    for _ in range(PATIENCE - 1):
        budget.settle([])
    assert budget.proposed["ngram"] == 40
    budget.settle([])
    assert budget.proposed["ngram"] == 41 and budget.accepted["ngram"] == 0


def test_a_left_out_branch_is_counted_once_the_walk_ends_on_a_leaf():
    """A walk that ends on a leaf decides every node (the other children of its nodes were rejected), even above
    the branch's deepest node: 7 committed decides the branch {7, 9 -> 10} at once."""
    budget = seasoned(GraftBudget(costs(0.05)), "ngram", 40, 0)
    _, kept = budget.graft(TokenTree.root(5), "ngram", lambda t: [t.add(0, 7, source="ngram"),
                                                                 t.add(0, 9, source="ngram"),
                                                                 t.add(2, 10, source="ngram")], [1.0, 0.05])
    assert not kept
    budget.settle([7])
    assert budget.proposed["ngram"] == 43 and budget.accepted["ngram"] == 1


def test_the_account_lists_the_free_sources_only_and_eight_depths_at_most():
    """describe() is GenerationStats.policy["grafts"]: the draft model's counts are not a graft's, and a scored
    source's calibration is shown for depths 1..8."""
    budget = judged(GraftBudget(costs(0.01)), [(10, 9)] * 12)
    budget.observe({"draft": {"proposed": 10, "accepted": 5}, "ngram": {"proposed": 4, "accepted": 1}})
    out = budget.describe()
    assert set(out) == {"suffix", "ngram"} and out["ngram"] == {"proposed": 4, "accepted": 1, "acceptance": 0.3333,
                                                                "dropped": 0}
    assert len(out["suffix"]["by_depth"]) == 8 and "by_depth" not in out["ngram"]
