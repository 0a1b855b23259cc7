"""The native backend's C++ step on the real default pair (Qwen2.5-Coder 1.5B / 0.5B, Q4_K_M GGUFs): speculative
decoding is token for token plain greedy decoding, for tree policies of every shape, with no near-tie allowance
(each row is computed alone: kernels/forward.cpp)."""

import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.backends.native_step import NativeSession
from arborspec.core.host import usable_cores

pytestmark = [pytest.mark.real, pytest.mark.slow]

PROMPTS = [
    'def quicksort(arr):\n    """Sort a list of numbers in ascending order using quicksort."""\n',
    "Explain what a hash map is, in two sentences.",
]
N_TOKENS = 48


@pytest.fixture(scope="module")
def pair():
    from arborspec.loading import load_model

    before = torch.get_num_threads()
    torch.set_num_threads(usable_cores())  # tests/conftest.py runs the tiny models single-threaded
    target = load_model("qwen2.5-coder-1.5b", backend="native", progress=False)
    draft = load_model("qwen2.5-coder-0.5b", backend="native", progress=False)
    yield target, draft
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def plain(pair) -> list[list[int]]:
    """Plain greedy decoding of each prompt on the step: the reference every test below compares with, decoded once
    (~5 s of the target a test on one core)."""
    target = pair[0]
    assert isinstance(target.model.new_session(), NativeSession)
    return [SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=N_TOKENS, ignore_eos=True).token_ids
            for prompt in PROMPTS]


@pytest.mark.parametrize("method,options", [("chain", {"k": 4}), ("static", {"depth": 3, "branch": 2}),
                                            ("dyspec", {"budget": 16}), ("sequoia", {})])
def test_speculation_on_the_step_is_plain_greedy_decoding(pair, plain, method, options):
    target, draft = pair
    for prompt, ref in zip(PROMPTS, plain):
        res = SpeculativeDecoder(target, draft, method=method, **options).generate(prompt, max_new_tokens=N_TOKENS,
                                                                                   ignore_eos=True)
        assert res.token_ids == ref
        assert res.stats.tokens_per_step > 1.5  # the real draft is accepted most of the time


@pytest.mark.parametrize("kind,vocab", [("q4_0", 0), ("iq4_nl", 32768)])
def test_a_lean_draft_on_the_step_is_plain_greedy_decoding(pair, plain, kind, vocab):
    """The draft requantized to a lean 4-bit file (tuning/gguf_requant.py; built once, cached), with and without a
    pruned head: a different draft, the same output."""
    from arborspec.loading.pair import prepare_draft

    target, draft = pair
    lean, quant, _ = prepare_draft(target, draft, kind, vocab=vocab, progress=False)
    assert quant == kind and lean.source.endswith(".gguf") and kind in lean.source
    for prompt, ref in zip(PROMPTS, plain):
        res = SpeculativeDecoder(target, lean, method="dyspec", budget=16).generate(prompt, max_new_tokens=N_TOKENS,
                                                                                    ignore_eos=True)
        assert res.token_ids == ref
        assert res.stats.tokens_per_step > 1.5  # the lean draft still agrees with the target most of the time
