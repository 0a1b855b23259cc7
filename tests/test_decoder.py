"""The draft -> verify -> commit loop (engine/decoder.py): what a decoder refuses, what its steps record and which
sessions it hands to the prefix cache. Exactness end to end is tests/test_engine.py's."""
import copy
import time
import types

import pytest

from arborspec import SpeculativeDecoder
from arborspec.engine.config import DecoderConfig
from tests.conftest import noisy_copy, tiny_model


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=0)
    return target, noisy_copy(target, noise=0.2)


class Clock:
    """The decoder's clock (engine/decoder.py's and generation.py's perf_counter), which a slowed model's forward
    moves on by its delay: timings compared without sleeping, and far beyond what a loaded machine's stalls reach."""

    def __init__(self):
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset


@pytest.fixture
def clock(monkeypatch) -> Clock:
    from arborspec.engine import decoder, generation

    clock = Clock()
    for module in (decoder, generation):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


def slow_down(model, clock: Clock, seconds: float) -> None:
    """Every forward of `model` `seconds` longer on `clock` (once a decoder has checked its forward's signature)."""

    def forward(*args, _forward=model.forward, **kwargs):
        clock.offset += seconds
        return _forward(*args, **kwargs)

    model.forward = forward


class Recorder:
    """A prefix cache that never has a session to start from and records what it is asked to keep."""

    def __init__(self):
        self.kept = []

    def start(self, model, role, context):
        return None

    def keep(self, model, role, session):
        self.kept.append((role, len(session.cached)))


def test_a_config_passed_in_the_wrong_place_is_refused(models):
    """A DecoderConfig as the draft, a dict as the config, a method that drafts without a draft model."""
    target, _ = models
    with pytest.raises(TypeError, match="as the draft model"):
        SpeculativeDecoder(target, DecoderConfig())
    with pytest.raises(TypeError, match="config must be a DecoderConfig"):
        SpeculativeDecoder(target, None, {"method": "ar"})
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeDecoder(target, method="chain", k=2)


def test_the_tokenizer_may_come_with_the_draft(models, tokenizer):
    """A bare target and a (draft, tokenizer) pair: the draft's tokenizer decodes the text."""
    target, draft = models
    dec = SpeculativeDecoder(target, (draft, tokenizer), method="chain", k=2)
    assert dec.tokenizer is tokenizer
    assert dec.generate("abc", max_new_tokens=4, ignore_eos=True).text != ""


def test_bad_step_options_are_refused(models):
    """A negative prefill_chunk (ignored by sessions that read a prompt at once), prompt_logprobs without logprobs."""
    dec = SpeculativeDecoder(models[0], method="ar")
    with pytest.raises(ValueError, match="prefill_chunk"):
        next(dec.steps([5, 9], 4, prefill_chunk=-1))
    with pytest.raises(ValueError, match="needs logprobs"):
        next(dec.steps([5, 9], 4, prompt_logprobs=True))


def test_a_fork_shares_the_prefix_cache(models):
    """generate_batch's forks start from (and keep into) the decoder's own prefix cache."""
    dec = SpeculativeDecoder(models[0], method="ar", prefix_cache=Recorder())
    assert dec.fork().prefix_cache is dec.prefix_cache


def test_the_stats_count_the_prompt_and_each_steps_own_draft_calls(models):
    """prompt_tokens is the prompt's length; a chain of k = 3 takes at most 3 draft forwards a step (the count is
    the step's own, not the session's running total)."""
    target, draft = models
    res = SpeculativeDecoder(target, draft, method="chain", k=3).generate([5, 9, 14, 3], 16, ignore_eos=True)
    assert res.stats.prompt_tokens == 4
    drafted = res.stats.steps[1:]
    assert len(drafted) > 2 and all(1 <= s.draft_calls <= 3 for s in drafted), [s.draft_calls for s in drafted]


def test_drafting_and_verifying_times_go_to_their_own_fields(models, clock):
    """A slow draft shows in t_draft, not in t_verify."""
    target, draft = models[0], copy.deepcopy(models[1])
    dec = SpeculativeDecoder(target, draft, method="chain", k=2)
    slow_down(draft, clock, 100.0)
    res = dec.generate([5, 9, 14], 4, ignore_eos=True)
    drafted = res.stats.steps[1:]
    assert drafted and all(s.t_draft >= 100 > s.t_verify for s in drafted)


def test_the_prompts_forward_counts_as_prefill_not_as_the_first_steps_verify_time(models, clock):
    """The plain loop's first step: its forward is t_prefill; its t_verify is the pick alone."""
    target = copy.deepcopy(models[0])
    dec = SpeculativeDecoder(target, method="ar")
    slow_down(target, clock, 100.0)
    res = dec.generate([5, 9, 14], 3, ignore_eos=True)
    first = res.stats.steps[0]
    assert first.prefill and res.stats.t_prefill >= 100 > first.t_verify


def test_a_finished_generation_hands_both_sessions_to_the_prefix_cache(models):
    """At the end of a speculative generation the target's and the draft's sessions are kept; one that ends at its
    first token keeps the target's alone (the draft never read the prompt)."""
    target, draft = models
    cache = Recorder()
    dec = SpeculativeDecoder(target, draft, method="chain", k=2, prefix_cache=cache)
    dec.generate([5, 9, 14, 3], 6, ignore_eos=True)
    assert sorted(role for role, _ in cache.kept) == ["draft", "target"]
    cache.kept.clear()
    dec.generate([5, 9, 14, 3], 1, ignore_eos=True)
    assert [role for role, _ in cache.kept] == ["target"]


def test_a_policy_whose_draft_cannot_pay_decodes_plainly(models, monkeypatch):
    """uses_draft() False: the plain loop, one target token a step; the draft model is never called, and the
    policy's account still comes with the result."""
    from arborspec.drafting import POLICIES

    class NeverPays(POLICIES["chain"]):
        def uses_draft(self, prompt_tokens=0, new_tokens=0):
            return False

        def explain(self):
            return {"plain": True}
    monkeypatch.setitem(POLICIES, "never-pays", NeverPays)
    target, draft = models
    calls = []
    hook = draft.register_forward_hook(lambda *a: calls.append(1))
    try:
        res = SpeculativeDecoder(target, draft, method="never-pays", k=3).generate([5, 9, 14], 8, ignore_eos=True)
    finally:
        hook.remove()
    assert not calls and res.stats.n_steps == 7 and all(s.tree_size == 0 for s in res.stats.steps)
    assert res.stats.policy == {"plain": True}


def test_the_policy_is_updated_with_every_drafted_step(models, monkeypatch):
    """policy.update() sees each speculative step's stats, in order (not the prompt's forward)."""
    from arborspec.drafting import POLICIES

    seen = []

    class Counting(POLICIES["chain"]):
        def update(self, step):
            super().update(step)
            seen.append(step.committed)
    monkeypatch.setitem(POLICIES, "counting", Counting)
    target, draft = models
    res = SpeculativeDecoder(target, draft, method="counting", k=3).generate([5, 9, 14, 3], 12, ignore_eos=True)
    assert len(seen) > 2 and seen == [s.committed for s in res.stats.steps[1:]]  # the first is the prompt's forward


@pytest.mark.parametrize("method,options", [("ar", {}), ("chain", {"k": 3})])
def test_recorded_trees_hold_each_steps_accepted_path_and_bonus(models, method, options):
    """record_trees: each step's tree, the path it accepted and its bonus token; read back, the paths' tokens and the
    bonuses are the generated tokens."""
    target, draft = models
    res = SpeculativeDecoder(target, draft, method=method, record_trees=True, **options).generate(
        [5, 9, 14, 3], 12, ignore_eos=True)
    out = []
    for step in res.stats.steps:
        assert step.tree["path"] == step.path
        out += [step.tree["tokens"][n] for n in step.tree["path"]] + [step.tree["bonus"]]
    assert out == res.token_ids


def test_a_prompt_read_in_pieces_yields_after_each_and_its_prefill_time_counts_them_all(models, monkeypatch, clock):
    """prefill_chunk where rows are computed alone (native's; here the HF session is told so): the target reads all
    but the prompt's last `chunk` tokens in pieces, a None after each, and its first forward the rest; after the first
    token the draft reads the prompt in pieces, a None between two, none after the last. t_prefill adds them up."""
    from arborspec.backends import hf

    monkeypatch.setattr(hf.TreeSession, "rows_alone", True, raising=False)
    target, draft = models[0], copy.deepcopy(models[1])
    dec = SpeculativeDecoder(target, draft, method="chain", k=2)
    slow_down(draft, clock, 100.0)
    prompt = [5, 9, 14, 3, 7, 2, 11, 4]
    out = list(dec.steps(prompt, 4, ignore_eos=True, prefill_chunk=2))
    # the target: 3 pieces (6 of the 7 tokens before the root), the first token; the draft: 4 pieces of 8 tokens
    assert [r is None for r in out[:8]] == [True] * 3 + [False] + [True] * 3 + [False]
    assert out[-1].stats.t_prefill >= 4 * 100  # every piece of the slow draft's
    assert out[-1].token_ids == dec.generate(prompt, 4, ignore_eos=True).token_ids


def test_a_prompt_scored_with_prefill_chunk_is_read_in_chains_of_that_many_tokens(models):
    """prompt_logprobs with prefill_chunk: the prompt (but its last token) is read in chains of `prefill_chunk`
    tokens, a None after each, not in the default chains of 64."""
    dec = SpeculativeDecoder(models[0], method="ar")
    prompt = [5, 9, 14, 3, 7, 2, 11, 4]
    out = list(dec.steps(prompt, 2, ignore_eos=True, prefill_chunk=2, logprobs=0, prompt_logprobs=True))
    assert [r is None for r in out] == [True] * 4 + [False] * 2  # 7 tokens in 4 chains, then 2 tokens
    assert len(out[-1].prompt_logprobs) == len(prompt)
