"""One generation's bookkeeping (engine/generation.py) without a model: the room a step's tree has, the stop-string
check's edges, and the clocks `record` keeps."""
from __future__ import annotations

import time
from types import SimpleNamespace

from arborspec.engine.generation import Generation
from arborspec.engine.stats import GenerationStats, StepStats

TEXT = {1: "\ufffd", 2: "x", 3: "y"}  # 1: a byte that stays invalid, decoded alone as U+FFFD


def generation(prompt: list[int], max_new_tokens: int = 100, window: int = 1000, stop=None, t_start=None,
               eos=frozenset()):
    stats = GenerationStats("static", "greedy", False, prompt_tokens=len(prompt))
    decode = lambda ids: "".join(TEXT.get(t, "z") for t in ids)  # noqa: E731
    t_start = time.perf_counter() if t_start is None else t_start
    return Generation(prompt, max_new_tokens, stop, set(eos), window, decode, stats, None, t_start)


def step() -> StepStats:
    return StepStats(0, 0, [1], 0, 1, 0, 0.0, 0.0, 0.0)


def test_a_steps_room_leaves_its_bonus_a_place_in_the_budget_and_in_the_window():
    assert generation([5] * 8, max_new_tokens=100, window=10).room() == 10 - 8 - 1  # the window is the tighter
    assert generation([5] * 8, max_new_tokens=3, window=100).room() == 3 - 1
    assert generation([5] * 8, max_new_tokens=100, window=8).room() == 0


def test_a_drafts_room_ends_at_its_own_window():
    """A node at depth d sits at position len(context) - 1 + d: the draft's last position is its window - 1."""
    run = generation([5] * 8, window=1000)
    draft = SimpleNamespace(config=SimpleNamespace(vocab_size=10, max_position_embeddings=12))
    assert run.draft_room(50, draft) == 12 - 8
    assert run.draft_room(2, draft) == 2 and run.draft_room(50, None) == 50


def test_a_whole_generations_leading_u_fffd_is_text_a_stop_string_may_hold():
    """The tail checked for a stop string drops U+FFFD at its start only where it was cut from longer text (the end
    of a character whose start it left out); a generation decoded from its first token has no such cut."""
    run = generation([5], stop=["\ufffdx"])
    assert run.commit([1, 2, 3]) == [1, 2] and run.stats.finish_reason == "stop"


def test_the_reasons_to_stop_are_checked_in_order_eos_first():
    run = generation([5], stop=["xy"], max_new_tokens=2, eos={3})  # "y" ends the stop string, the budget, and is EOS
    assert run.commit([2, 3, 2]) == [2, 3] and run.stats.finish_reason == "eos"


def test_record_keeps_the_first_tokens_time_and_leaves_the_measured_time_out():
    run = generation([5], t_start=time.perf_counter() - 100.0)
    run.stats.t_measure = 60.0  # measure_optimum's statistics took that long
    before = time.perf_counter() - run.t_start
    run.commit([2])
    run.record(step())
    after = time.perf_counter() - run.t_start
    first = run.stats.t_first_token
    assert first == run.stats.t_total and before <= first + 60.0 <= after
    run.commit([3])
    run.record(step())
    assert run.stats.t_first_token == first and run.stats.t_total >= first
