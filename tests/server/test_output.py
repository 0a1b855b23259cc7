"""What a client sees of a generation (server/output.py), without a server: OpenAI's response and stream-chunk
shapes, the text held back while a stop string may be starting, and the `arborspec` statistics."""
from __future__ import annotations

import json
import random

from arborspec.engine.stats import GenerationResult, GenerationStats, StepStats
from arborspec.server.output import Reply, speculative_stats, visible_text


def finished(text: str, reason: str = "length", steps: list[StepStats] | None = None) -> GenerationResult:
    stats = GenerationStats("static", "greedy", False, prompt_tokens=5, new_tokens=3, finish_reason=reason,
                            t_first_token=1.0, t_total=2.0, steps=steps or [])
    return GenerationResult(text, [7, 8, 9], stats)


def step(tree_size: int, accepted: int, committed: int, prefill: bool = False) -> StepStats:
    return StepStats(tree_size, depth=tree_size, widths=[1] * (tree_size + 1), accepted=accepted, committed=committed,
                     draft_calls=1, t_draft=0.0, t_verify=0.0, t_other=0.0, prefill=prefill)


def data(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")  # one server-sent event: a blank line ends it
    return json.loads(event[len("data: "):])


def held_back(text: str, stop: list[str]) -> int:
    """By the definition: the longest end of `text` that could still grow into one of the stop strings."""
    return max(k for k in range(len(text) + 1) if k == 0 or any(len(s) > k and s.startswith(text[-k:]) for s in stop))


def test_a_stream_holds_back_the_longest_end_that_any_stop_string_may_grow_from():
    """Stop strings whose starts repeat ("aab" after "aa": "a" and "aa" both begin it) and several stop strings:
    the whole of the longest candidate is held back, not the first or shortest one found."""
    assert visible_text("xaa", ["aab"], done=False) == "x"
    assert visible_text("ab", ["bc", "abc"], done=False) == ""
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 8)))
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        if any(s in text for s in stop):
            continue  # cut at the stop string: test_protocol.py
        assert visible_text(text, stop, done=False) == text[:len(text) - held_back(text, stop)], (text, stop)


def test_a_whole_response_keeps_an_end_that_only_might_have_become_a_stop_string():
    body = Reply("m", chat=False, stop=["world"]).body(finished("hello wor", "length"))
    assert body["choices"][0]["text"] == "hello wor" and body["choices"][0]["finish_reason"] == "length"


def test_responses_and_chunks_have_openais_ids_and_objects():
    """chat: `chatcmpl-` ids, chat.completion / chat.completion.chunk; completions: `cmpl-` ids and text_completion,
    streamed or not. A stream's chunks share one id and one creation time."""
    result = finished("hi")
    for chat, prefix, whole, chunk in ((True, "chatcmpl-", "chat.completion", "chat.completion.chunk"),
                                       (False, "cmpl-", "text_completion", "text_completion")):
        reply = Reply("m", chat=chat, stop=[])
        body = reply.body(result)
        assert body["id"].startswith(prefix) and body["object"] == whole and body["model"] == "m"
        chunks = [data(reply.text_event("hi", result, "hi")), *map(data, reply.last_events(result, "hi"))]
        assert {c["id"] for c in chunks} == {body["id"]} and {c["object"] for c in chunks} == {chunk}
        assert {c["created"] for c in chunks} == {body["created"]}


def test_a_chat_response_is_the_assistants_message_and_its_stream_opens_with_the_role():
    reply = Reply("m", chat=True, stop=[])
    result = finished("hi", "eos")
    assert reply.body(result)["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                              "logprobs": None, "finish_reason": "stop"}]
    first = data(reply.first_event())
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert data(reply.text_event("hi", result, "hi"))["choices"][0]["delta"] == {"content": "hi"}
    finish = data(reply.last_events(result, "hi")[0])["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "stop"  # no content of its own, as OpenAI's
    assert Reply("m", chat=False, stop=[]).first_event() is None  # completions' streams have no role chunk


def test_a_completion_streams_text_strings_its_finish_chunk_an_empty_one():
    reply = Reply("m", chat=False, stop=[])
    result = finished("hi")
    assert data(reply.text_event("hi", result, "hi"))["choices"][0]["text"] == "hi"
    finish = data(reply.last_events(result, "hi")[0])["choices"][0]
    assert finish == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}


def test_usage_goes_in_the_finish_chunk_or_with_include_usage_in_a_chunk_of_its_own_after_it():
    """Without stream_options.include_usage no chunk names `usage` but the finish chunk, which carries it and the
    statistics; with it, every chunk has `"usage": null` and one more chunk with no choices carries them."""
    result = finished("hi")
    plain = Reply("m", chat=True, stop=[])
    assert "usage" not in data(plain.first_event()) and "usage" not in data(plain.text_event("hi", result, "hi"))
    [finish] = map(data, plain.last_events(result, "hi"))
    assert finish["usage"]["total_tokens"] == 8 and finish["arborspec"]["method"] == "static"
    asked = Reply("m", chat=True, stop=[], include_usage=True)
    assert data(asked.first_event())["usage"] is None and data(asked.text_event("hi", result, "hi"))["usage"] is None
    finish, last = map(data, asked.last_events(result, "hi"))
    assert finish["usage"] is None and "arborspec" not in finish and finish["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3 and last["arborspec"]["steps"] == 0
    assert asked.body(result)["usage"]["prompt_tokens"] == 5  # a whole response has its usage whatever was asked


def test_the_arborspec_statistics_sum_the_steps_and_name_how_the_generation_ended():
    steps = [step(0, 0, 1, prefill=True), step(4, 2, 3), step(6, 1, 2)]
    result = finished("abc", "eos", steps)
    stats = result.stats
    assert speculative_stats(result) == {
        "method": "static", "verifier": "greedy", "lossy": False, "steps": stats.n_steps,
        "tokens_per_step": stats.tokens_per_step, "acceptance_rate": stats.acceptance_rate,
        "drafted_tokens": 4 + 6, "accepted_tokens": 2 + 1, "tokens_per_s": stats.tokens_per_s,
        "finish_reason": "eos"}
    assert speculative_stats(result, token_ids=True)["token_ids"] == [7, 8, 9]
    assert Reply("m", chat=False, stop=[], token_ids=True).body(result)["arborspec"]["token_ids"] == [7, 8, 9]
