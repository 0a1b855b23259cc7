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


class Kept:
    """A session the cache may keep, without a model: its committed tokens, a cache of `nbytes` bytes (keys and
    values, half each), and copies that remember where they came from."""

    rows_alone = True

    def __init__(self, tokens, nbytes: int = 64, origin=None):
        import numpy as np
        self.cached = list(tokens)
        self.keys, self.values = np.zeros(nbytes // 2, np.uint8), np.zeros(nbytes - nbytes // 2, np.uint8)
        self.origin = origin

    def fork(self):
        return Kept(self.cached, self.keys.nbytes + self.values.nbytes, origin=self)

    def truncate(self, n: int) -> None:
        self.cached = self.cached[:n]


def test_common_prefix_counts_the_leading_tokens_two_lists_share():
    from arborspec.engine.prefix_cache import common_prefix
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3 and common_prefix([5], [6]) == 0 and common_prefix([], [1]) == 0


def test_a_kept_session_is_reused_from_min_reuse_tokens_in_common_and_never_up_to_the_root():
    model, tokens = object(), list(range(100, 100 + MIN_REUSE + 4))
    cache = PrefixCache(1 << 20)
    cache.keep(model, "target", kept := Kept(tokens))
    assert cache.start(model, "target", tokens[:MIN_REUSE - 1] + [1, 2]) is None  # too little in common
    at_least = cache.start(model, "target", tokens[:MIN_REUSE] + [1, 2])
    assert at_least.origin is kept and at_least.cached == tokens[:MIN_REUSE]
    longer = cache.start(model, "target", tokens + [1])
    assert longer.cached == tokens and kept.cached == tokens  # a copy cut, the kept one whole
    same = cache.start(model, "target", tokens)  # the last token is the next forward's root: not read from the cache
    assert same.cached == tokens[:-1]
    assert cache.hits == 3 and cache.reused_tokens == MIN_REUSE + len(tokens) + len(tokens) - 1


def test_entries_are_per_model_and_role():
    """A target's session never starts a draft (or another model's target), and a longer conversation replaces the
    start of its own model and role only; a chat keeps the newest entry of each model and role."""
    one, two, tokens = object(), object(), list(range(MIN_REUSE + 4))
    cache = PrefixCache(1 << 20)
    sessions = {(m, role): Kept(tokens) for m in (one, two) for role in ("target", "draft")}
    for (m, role), session in sessions.items():
        cache.keep(m, role, session)
    for (m, role), session in reversed(sessions.items()):  # the newest first: the others come before it
        assert cache.start(m, role, tokens + [1]).origin is session
    cache.keep(one, "target", longer := Kept(tokens + [7, 8]))
    remaining = [e.session for e in cache._entries]
    assert sessions[one, "target"] not in remaining and longer in remaining
    assert all(s in remaining for key, s in sessions.items() if key != (one, "target"))
    cache.keep(two, "draft", other := Kept([9] * 20))  # not a continuation: both of two's drafts stay
    cache.keep_newest()
    assert {(id(e.model), e.role): e.session for e in cache._entries} == {
        (id(one), "target"): longer, (id(one), "draft"): sessions[one, "draft"],
        (id(two), "target"): sessions[two, "target"], (id(two), "draft"): other}


def test_the_kept_bytes_are_the_keys_and_values_up_to_the_bound_and_the_least_recently_used_go_first():
    model = object()
    runs = [[k] * (MIN_REUSE + 2) for k in range(4)]
    cache = PrefixCache(200)
    cache.keep(model, "target", Kept(runs[0], nbytes=201))  # bigger than the whole cache: not kept
    cache.keep(model, "target", Kept([], nbytes=10))  # nothing committed: nothing to reuse
    assert cache._entries == []
    cache.keep(model, "target", Kept(runs[0], nbytes=100))
    cache.keep(model, "target", Kept(runs[1], nbytes=100))
    assert cache.nbytes == 200 and len(cache._entries) == 2  # exactly full
    assert cache.start(model, "target", runs[0] + [5]) is not None  # used: now the most recent
    cache.keep(model, "target", Kept(runs[2], nbytes=100))
    assert [e.tokens for e in cache._entries] == [runs[0], runs[2]]  # the one used longest ago went
    cache.keep(model, "target", Kept(runs[3], nbytes=200))
    assert [e.tokens for e in cache._entries] == [runs[3]]
    cache.keep(model, "target", Kept(runs[0], nbytes=201))  # one too big for the cache leaves the others in it
    assert [e.tokens for e in cache._entries] == [runs[3]]
    off = PrefixCache(0)  # a cache of no bytes: nothing is kept
    off.keep(model, "target", Kept(runs[0], nbytes=0))
    assert off._entries == []
