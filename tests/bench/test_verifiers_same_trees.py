"""benchmarks/verifiers_same_trees.py: recording every rule's expectation leaves the text as the committing rule
alone writes it; each family's rules are exact for its trees (the engine would refuse one that is not); the summary's
gains are ratios of tokens per step, averaged over prompts."""
import numpy as np
import pytest

from arborspec import SpeculativeDecoder
from tests.conftest import load_benchmark, noisy_copy, tiny_model


@pytest.fixture(scope="module")
def script():
    return load_benchmark("verifiers_same_trees")


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0)
    return target, noisy_copy(target, 0.5)


@pytest.mark.parametrize("family", ["chain", "sampled", "iid", "greedy"])
def test_recording_leaves_the_text_alone(script, pair, family):
    method, options, candidates = script.FAMILIES[family]
    per_prompt = script.measure(*pair, family, 0.8, [[4, 9, 12], [7, 3]], max_new_tokens=8, seed=5)
    assert len(per_prompt) == 2 and all(a.shape[1] == len(candidates) for a in per_prompt)
    assert sum(len(a) for a in per_prompt) > 0 and np.all(np.concatenate(per_prompt) >= 0)
    plain = SpeculativeDecoder(*pair, method=method, temperature=0.8, top_k=0, top_p=1.0, **options)
    recorded = SpeculativeDecoder(*pair, method=method, temperature=0.8, top_k=0, top_p=1.0, **options)
    recorded.verifier = script.SameTrees(recorded.verifier, candidates)
    a = plain.generate([4, 9, 12], max_new_tokens=8, seed=5)
    b = recorded.generate([4, 9, 12], max_new_tokens=8, seed=5)
    assert a.token_ids == b.token_ids


def test_summary_gains_are_per_prompt_ratios(script):
    per_prompt = [np.array([[1.0, 2.0], [1.0, 2.0]]), np.array([[0.0, 1.0]]), np.zeros((0, 2))]
    s = script.summarize(per_prompt, ["a", "b"])
    assert s["steps"] == 3 and s["prompts"] == 2
    assert s["rules"]["a"]["tokens_per_step"] == pytest.approx(5 / 3)
    assert s["rules"]["b"]["gain"] == pytest.approx((3 / 2 - 1 + 2 / 1 - 1) / 2)
    assert "| f | 1 | 2 | 3 | b | 2.667 | +75.00% ± 25.00 |" in script.table({"families": {"f": {"1": s}}})
