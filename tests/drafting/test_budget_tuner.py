"""budget="auto" on policies with a size knob: the tuner finds the best measured budget, follows changes, falls
back to plain decoding, and never changes the output (greedy identity, sampled distribution)."""
from types import SimpleNamespace

import pytest

from arborspec import SpeculativeDecoder
from arborspec.core.tree import TokenTree
from arborspec.drafting import POLICIES
from arborspec.drafting.budget_tuner import BudgetTuner, TunedBudget, make_policy
from tests.drafting.equivalence import check_greedy_equivalence, make_pair


def simulate(tuner: BudgetTuner, rate, steps: int) -> list[int]:
    """Run the tuner against a known rate(B) (tokens per second); a step of budget B commits rate(B) tokens in 1 s."""
    chosen = []
    for _ in range(steps):
        b = tuner.choose()
        tuner.observe(b, rate(b), 1.0)
        chosen.append(b)
    return chosen


def test_finds_the_best_budget_and_mostly_stays_there():
    peak = {0: 1.0, 4: 2.0, 8: 2.6, 16: 3.0, 32: 2.7, 64: 2.0}
    tuner = BudgetTuner(start=64)
    chosen = simulate(tuner, peak.get, 80)
    assert tuner.best() == 16
    assert chosen[-40:].count(16) >= 30  # probes of the neighbours only now and then
    assert set(chosen[-40:]) <= {8, 16, 32}


def test_follows_a_change_of_the_text_and_falls_back_to_plain_decoding():
    tuner = BudgetTuner(start=16)
    simulate(tuner, {0: 1.0, 4: 2.0, 8: 2.6, 16: 3.0, 32: 2.7, 64: 2.0}.get, 40)
    # the draft stops agreeing: every tree is now slower than plain decoding, bigger ones more so
    chosen = simulate(tuner, {0: 1.0, 4: 0.8, 8: 0.7, 16: 0.6, 32: 0.5, 64: 0.4}.get, 120)
    assert tuner.best() == 0 and chosen[-30:].count(0) >= 25
    assert 4 in chosen[-30:]  # still re-probing trees
    chosen = simulate(tuner, {0: 1.0, 4: 2.0, 8: 3.0, 16: 3.5, 32: 4.0, 64: 3.0}.get, 200)  # agreement is back
    assert tuner.best() == 32 and chosen[-20:].count(32) >= 15


def test_make_policy_wraps_only_size_knobs():
    for name in ("dynatree", "wetap", "sequoia", "dyspec-threshold"):
        policy = make_policy(POLICIES[name], {"budget": "auto"})
        assert isinstance(policy, TunedBudget) and policy.name == name
        assert policy.max_tree_depth >= 1
    assert not isinstance(make_policy(POLICIES["dyspec"], {"budget": "auto"}), TunedBudget)  # dyspec: the auto policy
    assert not isinstance(make_policy(POLICIES["dynatree"], {"budget": 16}), TunedBudget)
    with pytest.raises(ValueError, match="has no budget to size"):
        make_policy(POLICIES["static"], {"budget": "auto"})


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama")


@pytest.mark.parametrize("method", ["dynatree", "wetap", "sequoia", "dyspec-threshold"])
def test_greedy_output_is_unchanged(pair, method):
    check_greedy_equivalence(pair, method, {"budget": "auto"}, orders=("bfs",))


def test_the_engine_reports_the_chosen_budgets(pair):
    target, draft = pair
    dec = SpeculativeDecoder(target, draft, method="dynatree", budget="auto")
    res = dec.generate([5, 9, 2], max_new_tokens=40, ignore_eos=True)
    policy = res.stats.policy
    # a budget for every decoding step (the first token came from the prompt's forward, which is none)
    assert policy["budget"] == "auto" and len(policy["budgets_chosen"]) == res.stats.n_steps
    assert set(policy["budgets_chosen"]) >= {16, 8}  # the start and a neighbour were both measured
    assert 0 < res.stats.steps[1].tree_size <= 16


def test_sampled_output_follows_the_target_distribution():
    from tests.drafting.equivalence import assert_samples_target, table_pair
    from tests.drafting.test_auto import LearningTableDecoder
    from tests.verify.harness import TableDecoder

    t_table, d_table, prompt, probs = table_pair()
    policy = TunedBudget(POLICIES["sequoia"](budget=8), BudgetTuner(candidates=(0, 1, 2, 4, 8), start=2, window=2,
                                                                      probe_every=2))
    dec = LearningTableDecoder(TableDecoder(t_table, d_table, method=policy, verifier="mbr", temperature=1.0,
                                            horizon=4))
    assert_samples_target(dec, prompt, probs)
    assert set(policy.tuner.history) >= {0, 1, 2, 4}  # the budget really moved while sampling


def test_ties_go_to_the_smaller_budget():
    tuner = BudgetTuner(candidates=(0, 4, 8), start=4)
    for b in (4, 8):
        tuner.observe(b, 3, 1.0)
    assert tuner.rate(4) == tuner.rate(8) == 3.0 and tuner.best() == 4


def test_a_step_of_the_best_budget_adds_to_its_measurements():
    """Only a probe that beats the best restarts its own measurements; the best's own good step is averaged in."""
    tuner = BudgetTuner(candidates=(0, 4), start=4)
    tuner.observe(4, 1, 1.0)
    tuner.observe(4, 3, 1.0)  # faster than 4's rate so far, but 4 is the best: (1 + 3) / 2 s
    assert tuner.rate(4) == 2.0


def test_steps_that_took_no_measurable_time_give_no_rate():
    tuner = BudgetTuner(candidates=(0, 4), start=4)
    tuner.observe(4, 2, 0.0)
    assert tuner.rate(4) is None and tuner.best() == 4 and tuner.choose() == 0  # then its untried neighbour


class RecordingInner:
    """A policy with a budget knob that records what it is asked."""

    def __init__(self):
        self.options = type("Options", (), {"budget": 16})()
        self.budgets, self.updates = [], []

    def draft(self, ctx):
        self.budgets.append(self.options.budget)
        return TokenTree.root(ctx.context[-1])

    def update(self, step):
        self.updates.append(step)


def test_the_inner_policy_drafts_with_the_chosen_budget_and_learns_only_from_its_own_trees():
    inner = RecordingInner()
    policy = TunedBudget(inner, BudgetTuner(candidates=(0, 4), start=0))
    steps = []
    for _ in range(4):
        policy.draft(SimpleNamespace(context=[1, 2]))
        step = SimpleNamespace(committed=1, t_draft=0.0, t_verify=1.0, t_other=0.0, chosen=policy.chosen)
        policy.update(step)
        steps.append(step)
    assert [s.chosen for s in steps] == [0, 4, 0, 0]  # start, its untried neighbour, then 0 (a tie)
    assert inner.budgets == [4] and inner.updates == [steps[1]]


# ---- pins found by mutating budget_tuner.py -------------------------------------------------------------------------
def test_candidates_are_sorted_sizes_and_the_start_must_be_one():
    """Neighbours are the next smaller and larger budgets, whatever order the candidates are given in."""
    tuner = BudgetTuner(candidates=(8, 0, 4, 4), start=4)
    assert tuner.candidates == [0, 4, 8]
    tuner.observe(4, 2, 1.0)
    assert tuner.choose() == 0 and tuner.current == 0  # the smaller untried neighbour first
    with pytest.raises(ValueError, match="start budget 5 is not a candidate"):
        BudgetTuner(candidates=(0, 4, 8), start=5)


def test_the_stalest_neighbour_is_the_one_measured_longest_ago():
    """Staleness is the step of a neighbour's latest measurement, not its first: 0 was measured at steps 0 and 2,
    8 at step 1 only, so at the probe step 8 is re-run."""
    tuner = BudgetTuner(candidates=(0, 4, 8), start=4, probe_every=8)
    for budget, tokens in [(0, 1), (8, 1), (0, 1)] + [(4, 5)] * 5:
        tuner.observe(budget, tokens, 1.0)
    assert tuner.steps == 8 and tuner.best() == 4
    assert [tuner.obs[b][-1][2] for b in (0, 8)] == [2, 1]
    assert tuner.choose() == 8


def test_a_probe_only_as_fast_as_the_best_keeps_its_older_measurements():
    """Only a probe that beats the best rate starts its budget's measurements afresh."""
    tuner = BudgetTuner(candidates=(0, 4), start=4)
    tuner.observe(0, 1, 1.0)
    tuner.observe(4, 3, 1.0)  # 4 is now the best, at 3 tokens/s
    tuner.observe(0, 3, 1.0)  # a probe of 0 at 3 tokens/s: a tie, not a win
    assert len(tuner.obs[0]) == 2 and tuner.rate(0) == 2.0


def test_with_nothing_measured_the_best_is_the_budget_chosen_last():
    tuner = BudgetTuner(candidates=(0, 4, 8), start=4)
    tuner.observe(4, 2, 0.0)  # no measurable time: no rate
    assert tuner.choose() == 0 and tuner.best() == 0


def test_explain_lists_the_last_64_budgets_chosen():
    tuner = BudgetTuner(candidates=(0, 4), start=4)
    simulate(tuner, {0: 1.0, 4: 2.0}.get, 70)
    assert tuner.history[:64] != tuner.history[-64:]  # 70 steps: the first 64 are not the last
    assert tuner.explain()["budgets_chosen"] == tuner.history[-64:]


def test_the_depth_limit_is_the_largest_candidates_and_leaves_the_budget_alone():
    """The engine sizes the window for the deepest tree any chosen budget can draft."""
    policy = make_policy(POLICIES["sequoia"], {"budget": "auto"})
    policy.inner.options.budget = 4
    deepest = POLICIES["sequoia"](budget=max(policy.tuner.candidates)).max_tree_depth
    assert deepest > POLICIES["sequoia"](budget=4).max_tree_depth
    assert policy.max_tree_depth == deepest and policy.inner.options.budget == 4


def test_a_step_is_timed_with_its_bookkeeping():
    inner = RecordingInner()
    policy = TunedBudget(inner, BudgetTuner(candidates=(0, 4), start=4))
    policy.draft(SimpleNamespace(context=[1, 2]))
    policy.update(SimpleNamespace(committed=3, t_draft=0.5, t_verify=1.0, t_other=0.5))
    assert policy.tuner.rate(4) == 3 / 2.0


@pytest.mark.parametrize("budget", ["auto", " Auto ", "AUTO"])
def test_budget_auto_is_read_whatever_its_case_and_spacing(budget):
    assert isinstance(make_policy(POLICIES["sequoia"], {"budget": budget}), TunedBudget)
