"""Shared end-to-end checks for tree policies on tiny models.

- `check_greedy_equivalence`: at temperature 0 every policy, in every token order, is token-identical to plain greedy
  decoding of the target (`ar`), and actually accepts drafted tokens.
- `check_distribution`: at temperature > 0 a policy with its exact verifier samples the target's distribution of the
  first k tokens (tests/verify/harness.py's chi-square test with a power guarantee).
"""
from __future__ import annotations

import random

from arborspec import SpeculativeDecoder
from arborspec.core.sampling import SamplingConfig
from tests.conftest import noisy_copy, tiny_model
from tests.verify.harness import (
    TableDecoder,
    TableModel,
    TableSession,
    assert_same_distribution,
    exact_target_distribution,
    sample_outputs,
    samples_needed,
)

ORDERS = ("bfs", "dfs", "heavy")


def make_pair(arch: str, seed: int = 0, noise: float = 0.3):
    target = tiny_model(arch, seed=seed)
    return target, noisy_copy(target, noise=noise)


def check_greedy_equivalence(pair, method: str, options: dict, orders=ORDERS, prompts: int = 3, seed: int = 1):
    target, draft = pair
    rng = random.Random(seed)
    accepted = 0
    for _ in range(prompts):
        prompt = [rng.randrange(2, 56) for _ in range(rng.randrange(1, 10))]
        n = rng.randrange(8, 30)
        ref = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=n, ignore_eos=True)
        for order in orders:
            dec = SpeculativeDecoder(target, draft, method=method, token_order=order, **options)
            res = dec.generate(prompt, max_new_tokens=n, ignore_eos=True)
            assert res.token_ids == ref.token_ids, f"{method} {options} order={order} prompt={prompt}"
            assert len(res.token_ids) == n
            accepted += sum(s.accepted for s in res.stats.steps)
    assert accepted > 0
    return accepted


def repetitive_prompts(n: int, period: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts that repeat a random `period`-token pattern three times: text draft-free sources can copy from."""
    rng = random.Random(seed)
    return [[rng.randrange(2, 56) for _ in range(period)] * 3 for _ in range(n)]


def greedy_results(dec, target, prompts: list[list[int]], max_new_tokens: int) -> list:
    """`dec`'s result for each prompt, each checked token-identical to the target's own greedy decoding."""
    results = []
    for prompt in prompts:
        ref = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
        res = dec.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
        assert res.token_ids == ref.token_ids, f"prompt {prompt}"
        results.append(res)
    return results


def table_pair(vocab: int = 5, k: int = 2, horizon: int = 4, temperature: float = 1.0, seed: int = 0,
               arch: str = "llama", prompt=(1, 3), lever=None):
    """(target table, draft table, prompt, exact distribution of the first k tokens) for distribution tests: a tiny
    target, a noisy copy as draft (`lever`: a function that changes it first, e.g. a pruned head), both enumerated
    into tables (tests/verify/harness.py). A repeating `prompt` gives draft-free sources something to copy."""
    target = tiny_model(arch, seed=seed, vocab=vocab, scale=1.0)
    draft = noisy_copy(target, noise=0.8, seed=seed + 7)
    if lever is not None:
        draft = lever(draft)
    prompt = list(prompt)
    t_table = TableModel.from_model(target, prompt, horizon - 1)
    d_table = TableModel.from_model(draft, prompt, horizon - 1)
    return t_table, d_table, prompt, exact_target_distribution(t_table, prompt, k, SamplingConfig(temperature))


def assert_samples_target(dec, prompt: list[int], probs, vocab: int = 5, k: int = 2, tv: float = 0.05,
                          seed: int = 100):
    """`dec`'s first k tokens, sampled as often as a chi-square test at total variation `tv` needs, follow `probs`."""
    counts = sample_outputs(dec, prompt, k, samples_needed(vocab**k - 1, tv), seed=seed)
    return assert_same_distribution(counts, probs, tv=tv)


def check_distribution(method: str, verifier: str, options: dict, vocab: int = 5, k: int = 2, horizon: int = 4,
                       temperature: float = 1.0, tv: float = 0.05, seed: int = 0, arch: str = "llama"):
    t_table, d_table, prompt, probs = table_pair(vocab, k, horizon, temperature, seed, arch)
    d_table.session = lambda: RenumberingTableSession(d_table)  # WETAP renumbers the draft's session after pruning
    dec = TableDecoder(t_table, d_table, method=method, verifier=verifier, temperature=temperature, horizon=horizon,
                       **options)
    return assert_samples_target(dec, prompt, probs, vocab, k, tv, seed + 100)


class RenumberingTableSession(TableSession):
    """The table harness's session (tests/verify/harness.py) plus the `Session` protocol's `has` and `renumber`,
    which a policy that prunes after drafting calls (a table session keys its rows by node number)."""

    def has(self, node: int) -> bool:
        return node in self.slot

    def renumber(self, kept: list[int]) -> None:
        self.slot = {new: self.slot[old] for new, old in enumerate(kept) if old in self.slot}
        self._keys = {new: self._keys[old] for new, old in enumerate(kept) if old in self._keys}
