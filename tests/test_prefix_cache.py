"""The prefix cache (engine/prefix_cache.py) on tiny native GGUFs: a request that begins with an earlier one's tokens
starts from its kept cache, prefills only the rest, and decodes exactly what a fresh session decodes (greedy and
seeded sampling, plain and speculative); what is kept is bounded, newest first, and sessions that cannot be copied
(transformers') or whose rows depend on how a prompt was cut are not kept."""
from __future__ import annotations

import pytest

from arborspec.backends import make_session
from arborspec.engine import SpeculativeDecoder
from arborspec.engine.prefix_cache import MIN_REUSE, PrefixCache, can_keep
from tests.backends.tiny_gguf import native_models
from tests.conftest import noisy_copy, tiny_model

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/conftest.py

FILES = {"target": {"dtype": "q4_k", "hidden": 256, "ffn": 512},
         "draft": {"dtype": "q4_k", "hidden": 256, "ffn": 512, "noise": 0.2}}
FIRST = "def fib(n):\n    if n < 2:\n        return n\n    return"


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return native_models(tmp_path_factory.mktemp("prefix-cache"), FILES)


@pytest.mark.parametrize("method,temperature", [("ar", 0.0), ("static", 0.0), ("static", 0.8), ("auto", 0.0)])
def test_a_follow_up_starts_from_the_kept_cache_and_decodes_the_same_tokens(native, method, temperature):
    target, draft = native("target"), native("draft")
    cache = PrefixCache(1 << 30)
    kept = SpeculativeDecoder(target, draft, method=method, temperature=temperature, prefix_cache=cache)
    fresh = SpeculativeDecoder(target, draft, method=method, temperature=temperature)
    first = kept.generate(FIRST, max_new_tokens=12, seed=3, ignore_eos=True)
    assert first.stats.cached_tokens == 0
    follow_up = kept.encode(FIRST) + first.token_ids + kept.encode("\n\nprint(fib(10))")  # a chat's next turn
    again = kept.generate(follow_up, max_new_tokens=16, seed=4, ignore_eos=True)
    alone = fresh.generate(follow_up, max_new_tokens=16, seed=4, ignore_eos=True)
    assert again.token_ids == alone.token_ids
    # the first request's prompt and every generated token but the last, which no forward has read yet
    assert again.stats.cached_tokens == len(kept.encode(FIRST)) + len(first.token_ids) - 1
    assert cache.hits >= 1
    other = kept.generate("import os\nprint(os.getcwd())", max_new_tokens=4, seed=0, ignore_eos=True)
    assert other.stats.cached_tokens == 0  # nothing in common


def test_a_speculative_request_that_ends_at_its_first_token_is_kept(native):
    """The first token comes from the prompt's forward, before the draft reads anything: a request that ends there
    (one token asked for, or EOS first) keeps its target's cache like any other."""
    target, draft = native("target"), native("draft")
    dec = SpeculativeDecoder(target, draft, method="static", prefix_cache=PrefixCache(1 << 30))
    one = dec.generate(FIRST, max_new_tokens=1, ignore_eos=True)
    again = dec.generate(dec.encode(FIRST) + one.token_ids + dec.encode(" 1"), max_new_tokens=2, ignore_eos=True)
    assert again.stats.cached_tokens == len(dec.encode(FIRST))


def test_what_is_kept_is_bounded_and_a_longer_conversation_replaces_its_start(native):
    target = native("target")
    dec = SpeculativeDecoder(target, method="ar", prefix_cache=(cache := PrefixCache(1 << 30)))
    first = dec.generate(FIRST, max_new_tokens=6, ignore_eos=True)
    assert len(cache._entries) == 1
    turn = dec.encode(FIRST) + first.token_ids + dec.encode(" fib(n - 1)")
    dec.generate(turn, max_new_tokens=6, ignore_eos=True)
    assert len(cache._entries) == 1  # the second conversation begins with the first: it replaces it
    dec.generate("import os\nimport sys\nprint(sys.argv, os.getcwd())", max_new_tokens=6, ignore_eos=True)
    assert len(cache._entries) == 2
    one = cache._entries[-1].nbytes
    small = PrefixCache(one + one // 2)  # room for one entry
    dec.prefix_cache = small
    dec.generate(FIRST, max_new_tokens=6, ignore_eos=True)
    dec.generate("import os\nimport sys\nprint(sys.argv, os.getcwd())", max_new_tokens=6, ignore_eos=True)
    assert len(small._entries) == 1 and small._entries[0].tokens[:3] == dec.encode("import os")[:3]  # the newest
    assert small.nbytes <= small.max_bytes
    with pytest.raises(ValueError, match=">= 0"):
        PrefixCache(-1)


def test_short_common_prefixes_and_uncopyable_sessions_start_fresh(native):
    target = native("target")
    cache = PrefixCache(1 << 30)
    dec = SpeculativeDecoder(target, method="ar", prefix_cache=cache)
    ids = dec.encode(FIRST)
    assert len(ids) > MIN_REUSE
    dec.generate(ids[:MIN_REUSE - 2], max_new_tokens=4, ignore_eos=True)
    assert dec.generate(ids, max_new_tokens=4, ignore_eos=True).stats.cached_tokens == 0  # too short to be worth it
    hf = tiny_model("llama", seed=0)
    hf_cache = PrefixCache(1 << 30)
    torch_dec = SpeculativeDecoder(hf, noisy_copy(hf, 0.2), method="static", prefix_cache=hf_cache)
    torch_dec.generate(list(range(3, 40)), max_new_tokens=4, ignore_eos=True)
    assert hf_cache._entries == []  # transformers' sessions cannot be copied: not kept
    session = make_session(target.model, "target")
    session.prefill(ids)
    assert can_keep(session)
    session.rows_alone = False  # a session that could be copied, but whose rows depend on how a prompt was cut
    assert not can_keep(session)


@pytest.mark.parametrize("method", ["ar", "static"])
def test_a_generation_stopped_early_keeps_what_it_committed_and_a_follow_up_decodes_the_same(native, method):
    """Ctrl-C in `arborspec chat`, or a client that leaves: the generation's caches hold its committed tokens, so
    they are kept, and a next turn that begins with them starts there and decodes what a fresh session decodes."""
    target, draft = native("target"), native("draft")
    kept = SpeculativeDecoder(target, draft, method=method, prefix_cache=(cache := PrefixCache(1 << 30)))
    fresh = SpeculativeDecoder(target, draft, method=method)
    steps = kept.steps(FIRST, max_new_tokens=40, ignore_eos=True)
    for _ in range(3):
        shown = next(steps)
    steps.close()
    assert len(cache._entries) == (2 if method == "static" else 1)  # the target's, and the draft's once it drafted
    follow_up = kept.encode(FIRST) + shown.token_ids + kept.encode("\n\nprint(fib(10))")
    again = kept.generate(follow_up, max_new_tokens=12, ignore_eos=True)
    assert again.token_ids == fresh.generate(follow_up, max_new_tokens=12, ignore_eos=True).token_ids
    assert again.stats.cached_tokens >= len(kept.encode(FIRST)) + len(shown.token_ids) - 1
