"""The benchmark's pure metric functions against direct computations."""
import math

import pytest
import torch

from arborspec.bench import metrics


def test_mat_counts_the_bonus_token():
    assert metrics.mat([1, 1, 1]) == 1.0  # plain decoding
    assert metrics.mat([3, 1, 5]) == pytest.approx(3.0)
    assert metrics.mat([]) is None
    assert metrics.mean_accepted_drafted([2, 0, 4]) == pytest.approx(2.0)


def test_acceptance_rate():
    assert metrics.acceptance_rate([2, 0, 4], [4, 4, 4]) == pytest.approx(0.5)
    assert metrics.acceptance_rate([0, 0], [0, 0]) is None


def test_median_iqr():
    assert metrics.median_iqr([4.0, 1.0, 3.0, 2.0, 5.0]) == (3.0, 2.0, 4.0)
    assert metrics.median_iqr([2.0]) == (2.0, 2.0, 2.0)
    assert metrics.median_iqr([]) is None
    med, q1, q3 = metrics.median_iqr([1.0, 2.0, 3.0, 4.0])
    assert (med, q1, q3) == pytest.approx((2.5, 1.75, 3.25))  # linear interpolation, like numpy's default


def test_speedup_pairs_prompts_and_uses_aggregate_throughput():
    base = [dict(prompt_key="a", new_tokens=10, wall=10.0), dict(prompt_key="b", new_tokens=10, wall=5.0),
            dict(prompt_key="c", new_tokens=10, wall=1.0)]
    runs = [dict(prompt_key="a", new_tokens=10, wall=5.0), dict(prompt_key="b", new_tokens=10, wall=2.5),
            dict(prompt_key="c", new_tokens=10, wall=0.1, error="boom")]  # c failed: left out on both sides
    assert metrics.speedup(runs, base) == pytest.approx((20 / 7.5) / (20 / 15.0))
    assert metrics.speedup(base, base) == pytest.approx(1.0)
    assert metrics.speedup(runs, []) is None


def test_tpot_and_throughput():
    assert metrics.tpot(2.0, 0.5, 4) == pytest.approx(0.5)
    assert metrics.tpot(2.0, None, 4) is None and metrics.tpot(2.0, 0.5, 1) is None
    assert metrics.throughput(10, 2.0) == 5.0 and metrics.throughput(10, 0) is None


def test_perplexity_matches_a_direct_computation():
    torch.manual_seed(0)
    logits = torch.randn(7, 11)
    ids = torch.randint(0, 11, (7,))
    nll = [-math.log(torch.softmax(logits[i].double(), -1)[ids[i]].item()) for i in range(7)]
    assert metrics.perplexity(logits, ids.tolist()) == pytest.approx(math.exp(sum(nll) / 7), rel=1e-9)
    assert metrics.perplexity(torch.zeros(3, 5), [0, 1, 2]) == pytest.approx(5.0)  # uniform over 5 tokens
    assert metrics.perplexity(torch.zeros(0, 5), []) is None
    with pytest.raises(ValueError):
        metrics.perplexity(torch.zeros(2, 5), [1])


def test_perplexity_under_a_model_equals_per_position_likelihoods():
    from arborspec.bench.perplexity import target_perplexity
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    prompt, new = [3, 4, 5], [6, 7, 8, 9]
    nll = []
    for i, tok in enumerate(new):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + new[:i]])).logits[0, -1]
        nll.append(-torch.log_softmax(logits.double(), -1)[tok].item())
    assert target_perplexity(model, prompt, new) == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)


def test_node_outcomes_keep_only_reached_nodes():
    # root 0 -> 1 (accepted) -> 3 (rejected), 1 -> 4 (rejected); root -> 2 (rejected) -> 5 (never reached)
    tree = dict(tokens=[9, 10, 11, 12, 13, 14], parents=[-1, 0, 0, 1, 1, 2], probs=[1, .6, .3, .5, .2, .9], path=[1])
    assert metrics.node_outcomes(tree) == [(0.6, True), (0.3, False), (0.5, False), (0.2, False)]


def test_acceptance_by_probability_bins():
    outcomes = [(0.05, True), (0.05, False), (0.95, True), (1.0, True), (0.55, False)]
    assert metrics.acceptance_by_probability(outcomes, bins=10) == [(0.05, 0.5, 2), (0.55, 0.0, 1), (0.95, 1.0, 2)]


def test_first_divergence():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_divergence([1, 2, 3], [1, 2]) == 2


def test_acceptance_by_depth_zero_share_and_root_acceptance_by_hand():
    accepted, depths, drafted = [0, 2, 1, 3, 0], [2, 3, 1, 3, 0], [4, 7, 2, 7, 0]
    # depth 1: 4 steps reached it, 3 accepted >= 1; depth 2: 3 reached, 2 accepted >= 2; depth 3: 2 reached, 1 did
    assert metrics.accepted_at_depth(accepted, depths) == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert metrics.accepted_at_depth([], []) == []
    assert metrics.zero_accept_share(accepted, drafted) == pytest.approx(1 / 4)  # the last step drafted nothing
    assert metrics.zero_accept_share([0], [0]) is None
    assert metrics.root_acceptance(accepted, [0.5, None, 0.9, 0.7, None]) == pytest.approx((2 / 3, 0.7))
    assert metrics.root_acceptance(accepted, [None] * 5) is None


def test_the_pooled_metrics_are_the_engines_own_on_one_run():
    from arborspec.engine import GenerationStats, StepStats

    steps = [StepStats(tree_size=n, depth=d, widths=[], accepted=a, committed=a + 1, draft_calls=0, t_draft=0,
                       t_verify=0, t_other=0, root_optimum=o)
             for a, d, n, o in [(0, 2, 4, 0.5), (2, 3, 7, None), (1, 1, 2, 0.9), (3, 3, 7, 0.7), (0, 0, 0, None)]]
    st = GenerationStats("m", "v", False, 3, steps=steps)
    accepted = [s.accepted for s in steps]
    assert metrics.accepted_at_depth(accepted, [s.depth for s in steps]) == st.accepted_at_depth
    assert metrics.zero_accept_share(accepted, [s.tree_size for s in steps]) == st.zero_accept_share
    assert metrics.root_acceptance(accepted, [s.root_optimum for s in steps]) == (st.root_acceptance, st.root_optimum)


def test_by_source_pools_runs_per_step_by_hand():
    runs = [{"draft": {"proposed": 10, "accepted": 4, "also_accepted": 0},
             "suffix": {"proposed": 6, "accepted": 2, "also_accepted": 3}},
            {"suffix": {"proposed": 4, "accepted": 2, "also_accepted": 0},
             "ngram": {"proposed": 0, "accepted": 0, "also_accepted": 0}}]
    out = metrics.by_source(runs, steps=4)
    assert set(out) == {"draft", "suffix"}  # ngram proposed nothing
    assert out["draft"] == pytest.approx(dict(proposed=2.5, accepted=1.0, rate=0.4, share=0.5, also=0.0))
    assert out["suffix"] == pytest.approx(dict(proposed=2.5, accepted=1.0, rate=0.4, share=0.5, also=0.75))
    assert metrics.by_source([], steps=0) == {}
    assert metrics.by_source([{"ngram": {"proposed": 3, "accepted": 0, "also_accepted": 0}}], 3)["ngram"]["share"] is None


def test_pooled_perplexity_weights_each_run_by_its_tokens():
    """exp of the mean NLL over every token: the mean of per-run perplexities weighted a short answer as a long one."""
    runs = [(2.0, 1), (4.0, 3), (None, 5), (3.0, 0)]
    assert metrics.pooled_perplexity(runs) == pytest.approx(math.exp((math.log(2) + 3 * math.log(4)) / 4))
    assert metrics.pooled_perplexity([(None, 3)]) is None
