"""budget="auto" on policies with a size knob: the tuner finds the best measured budget, follows changes, falls
back to plain decoding, and never changes the output (greedy identity, sampled distribution)."""
import pytest

from arborspec import SpeculativeDecoder
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
