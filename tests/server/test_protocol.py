"""Request parsing and validation, and what a client sees of the text: no server needed."""
from __future__ import annotations

import copy
import json

import pytest

from arborspec.server.app import check_context, render_chat
from arborspec.server.output import visible_text
from arborspec.server.protocol import (
    MAX_STOP_CHARS,
    APIError,
    ChatRequest,
    CompletionRequest,
    Limits,
    chat_messages,
    check_sampling,
    completion_prompt,
    max_tokens,
    parse_request,
    stop_strings,
)

LIMITS = Limits("tiny", max_tokens_limit=100, default_max_tokens=16, max_body_bytes=1000)


def parse(body: dict, model=CompletionRequest):
    return parse_request(json.dumps(body).encode(), model)


def refused(body, model=CompletionRequest) -> APIError:
    with pytest.raises(APIError) as info:
        req = parse(body, model) if isinstance(body, dict) else parse_request(body, model)
        max_tokens(req, LIMITS), stop_strings(req), completion_prompt(req) if model is CompletionRequest else None
    return info.value


def test_a_plain_request_parses_with_the_servers_defaults_filled_in_later():
    req = parse({"model": "tiny", "prompt": "hi", "temperature": 1, "stream": True, "user": "ignored"})
    assert req.temperature == 1.0 and req.top_p is None and req.stream and req.arborspec is None
    assert max_tokens(req, LIMITS) == 16 and stop_strings(req) == [] and completion_prompt(req) == "hi"
    assert completion_prompt(parse({"model": "t", "prompt": [[5, 6]]})) == [5, 6]
    assert stop_strings(parse({"model": "t", "prompt": "x", "stop": "\n"})) == ["\n"]


@pytest.mark.parametrize("body, param", [
    (b"{", None), (b'"text"', None), (b"\xff\xfe", None),
    ({"model": "t", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": "t", "prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    ({"model": "t", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "t", "prompt": 5}, "prompt"),
    ({"model": 5, "prompt": "x"}, "model"),
    ({"model": "t", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "t", "prompt": "x", "max_tokens": 101}, "max_tokens"),
    ({"model": "t", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "t", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "t", "prompt": "x", "stop": ["a\ud800"]}, "stop"),
    ({"model": "t", "prompt": []}, "prompt"),
    ({"model": "t", "prompt": "x", "n": 3}, "n"),
    ({"model": "t", "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": "t", "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": "t", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "t", "prompt": "x", "top_logprobs": 2}, "top_logprobs"),  # chat's field, not completions'
    ({"model": "t", "prompt": "x", "arborspec": {"budget": 0}}, "arborspec"),
    ({"model": "t", "prompt": "x", "arborspec": {"method": 3}}, "arborspec"),
    ({"model": "t", "prompt": "x", "seed": 2**64}, "seed"),
])
def test_bad_bodies_are_400s_naming_the_field(body, param):
    err = refused(body)
    assert err.status == 400 and err.param == param
    assert err.body()["error"]["type"] == "invalid_request_error" and err.body()["error"]["message"]


def test_neutral_values_of_unsupported_fields_pass():
    parse({"model": "t", "prompt": "x", "n": 1, "echo": False, "logprobs": None, "presence_penalty": 0.0,
           "logit_bias": {}, "best_of": 1, "repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0,
           "stop_token_ids": [], "include_stop_str_in_output": False, "guided_json": None})
    parse({"model": "t", "messages": [{"role": "user", "content": "a"}], "tool_choice": "auto", "modalities": ["text"],
           "function_call": "none"}, ChatRequest)


def test_null_means_the_default_as_openai_clients_send_it():
    req = parse({"model": "t", "prompt": "x", "stream": None, "echo": None, "logprobs": None, "ignore_eos": None})
    assert not req.stream and not req.echo and req.top_logprobs_asked() is None
    chat = parse({"model": "t", "messages": [{"role": "user", "content": "a"}], "logprobs": None, "stream": None},
                 ChatRequest)
    assert chat.top_logprobs_asked() is None


@pytest.mark.parametrize("field, value", [("tool_choice", "required"),
                                          ("tool_choice", {"type": "function", "function": {"name": "f"}}),
                                          ("function_call", {"name": "f"}), ("modalities", ["text", "audio"]),
                                          ("audio", {"voice": "alloy", "format": "wav"}),
                                          ("repetition_penalty", 1.2), ("min_p", 0.05),  # vLLM's: were dropped
                                          ("min_tokens", 50), ("stop_token_ids", [42]), ("guided_choice", ["a"]),
                                          ("include_stop_str_in_output", True), ("typical_p", 0.2),
                                          ("grammar", "root ::= \"a\""), ("repeat_penalty", 1.5),  # answered 200
                                          ("structured_outputs", {"choice": ["a"]}), ("top_n_sigma", 1.0),
                                          ("continue_final_message", True), ("chat_template", "{{ x }}")])
def test_fields_that_would_change_the_answer_are_refused_not_ignored(field, value):
    err = refused({"model": "t", "messages": [{"role": "user", "content": "a"}], field: value}, ChatRequest)
    assert err.status == 400 and err.param == field


def test_a_developer_message_is_a_system_message_and_tool_calls_are_refused():
    req = parse({"model": "t", "messages": [{"role": "developer", "content": "be brief"},
                                            {"role": "user", "content": "a"}]}, ChatRequest)
    assert chat_messages(req) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    err = refused({"model": "t", "messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": None, "tool_calls": [call]}]},
                  ChatRequest)
    assert err.param == "messages" and "tool calls" in err.message


def test_stop_strings_are_bounded_in_length():
    assert stop_strings(parse({"model": "t", "prompt": "x", "stop": "s" * MAX_STOP_CHARS})) == ["s" * MAX_STOP_CHARS]
    assert refused({"model": "t", "prompt": "x", "stop": "s" * (MAX_STOP_CHARS + 1)}).param == "stop"


def test_max_tokens_past_the_context_window_is_a_400_and_none_asked_runs_to_its_end():
    asked = parse({"model": "t", "prompt": "x", "max_tokens": 10})
    check_context([1] * 90, 10, asked, window=100, chat=False)  # fits exactly
    with pytest.raises(APIError, match="91 in the prompt, 10 in the completion") as info:
        check_context([1] * 91, 10, asked, window=100, chat=False)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    check_context([1] * 91, 10, parse({"model": "t", "prompt": "x"}), window=100, chat=False)


def test_logprobs_are_asked_for_as_openai_asks_per_endpoint():
    assert parse({"model": "t", "prompt": "x", "logprobs": 0}).top_logprobs_asked() == 0
    assert parse({"model": "t", "prompt": "x", "logprobs": 5}).top_logprobs_asked() == 5
    assert parse({"model": "t", "prompt": "x"}).top_logprobs_asked() is None
    chat = {"model": "t", "messages": [{"role": "user", "content": "a"}]}
    assert parse({**chat, "logprobs": True, "top_logprobs": 20}, ChatRequest).top_logprobs_asked() == 20
    assert parse({**chat, "logprobs": True}, ChatRequest).top_logprobs_asked() == 0
    assert parse({**chat, "logprobs": False, "top_logprobs": 0}, ChatRequest).top_logprobs_asked() is None
    assert refused({**chat, "top_logprobs": 3}, ChatRequest).param == "top_logprobs"  # needs "logprobs": true
    assert refused({**chat, "logprobs": True, "top_logprobs": 21}, ChatRequest).param == "top_logprobs"
    assert refused({**chat, "echo": True}, ChatRequest).param == "echo"  # completions' field only
    assert parse({"model": "t", "prompt": "x", "echo": True, "logprobs": 1}).echo


def test_chat_messages_take_text_parts_and_max_completion_tokens():
    req = parse({"model": "t", "max_completion_tokens": 7, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, ChatRequest)
    assert req.messages[0].text() == "ab" and max_tokens(req, LIMITS) == 7
    assert refused({"model": "t", "messages": []}, ChatRequest).param == "messages"
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    err = refused({"model": "t", "messages": [{"role": "user", "content": [image]}]}, ChatRequest)
    assert err.param == "messages" and "'image_url' are not supported" in err.message
    assert refused({"model": "t", "messages": [{"role": "robot", "content": "x"}]}, ChatRequest).param == "messages"
    assert refused({"model": "t", "max_completion_tokens": 0, "max_tokens": 5,
                    "messages": [{"role": "user", "content": "x"}]}, ChatRequest).param == "max_completion_tokens"


def test_a_completion_reads_max_completion_tokens_too():
    # it was read on chat only: a completion that sent it got the server's default length unasked
    assert max_tokens(parse({"model": "t", "prompt": "x", "max_completion_tokens": 7}), LIMITS) == 7
    assert max_tokens(parse({"model": "t", "prompt": "x", "max_completion_tokens": 7, "max_tokens": 3}), LIMITS) == 7
    assert refused({"model": "t", "prompt": "x", "max_completion_tokens": 101}).param == "max_completion_tokens"
    with pytest.raises(APIError, match="context window"):
        check_context([1] * 95, 7, parse({"model": "t", "prompt": "x", "max_completion_tokens": 7}), 100, chat=False)


def test_a_messages_name_reaches_the_chat_template():
    req = parse({"messages": [{"role": "user", "name": "ada", "content": "x"}, {"role": "user", "content": "y"}]},
                ChatRequest)
    assert chat_messages(req) == [{"role": "user", "content": "x", "name": "ada"}, {"role": "user", "content": "y"}]
    assert refused({"messages": [{"role": "user", "name": 3, "content": "x"}]}, ChatRequest).param == "messages"


def test_add_special_tokens_is_refused_unless_it_is_the_endpoints_own_choice():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert parse({**chat, "add_special_tokens": False}, ChatRequest)
    assert refused({**chat, "add_special_tokens": True}, ChatRequest).param == "add_special_tokens"
    assert parse({"prompt": "x", "add_special_tokens": True})
    assert refused({"prompt": "x", "add_special_tokens": False}).param == "add_special_tokens"


def test_only_an_assistants_message_may_leave_content_out():
    req = parse({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]}, ChatRequest)
    assert req.model is None and [m.text() for m in req.messages] == ["x", ""]
    for role in ("system", "developer", "user", "tool"):
        err = refused({"model": "t", "messages": [{"role": role, "content": None}]}, ChatRequest)
        assert err.status == 400 and err.param == "messages" and "needs 'content'" in err.message


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("temperature", float("nan")), ("temperature", 2.5),
                                          ("top_p", 0.0),
                                          ("top_p", 1.01), ("top_k", -2), ("stream_options", {"include_usage": True})])
def test_sampling_fields_and_stream_options_are_refused_naming_themselves(field, value):
    with pytest.raises(APIError) as info:
        check_sampling(parse({"model": "t", "prompt": "x", field: value}))
    assert info.value.status == 400 and info.value.param == field


def test_a_chat_template_that_refuses_the_messages_is_a_400(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(APIError, match="roles must alternate") as info:
        render_chat(tok, [{"role": "user", "content": "x"}], "tiny")
    assert info.value.status == 400
    tok.chat_template = None
    with pytest.raises(APIError, match="no chat template"):
        render_chat(tok, [{"role": "user", "content": "x"}], "tiny")


@pytest.mark.parametrize("text, stop, done, seen", [
    ("hello world", [], False, "hello world"),
    ("hello wor", ["world"], False, "hello "),  # "wor" may become the stop string: held back
    ("hello wox", ["world"], False, "hello wox"),
    ("hello world and more", ["world"], False, "hello "),
    ("hello wor", ["world"], True, "hello wor"),  # finished: nothing more can come
    ("ab\ufffd", [], False, "ab"),  # half a character
    ("x END y STOP", ["STOP", "END"], True, "x "),  # the earliest stop string wins
    ("\U00013018\ufffd", ["\U00013018\U00013019"], False, ""),  # a stop string's start before a half character
    ("\U00013018\U00013019\ufffd", ["\U00013019\U0001301a"], False, "\U00013018"),
])
def test_visible_text_cuts_at_stop_strings_and_holds_back_what_may_become_one(text, stop, done, seen):
    assert visible_text(text, stop, done) == seen


def test_streamed_visible_text_only_grows():
    stop = ["<end>"]
    full = "a < b <e <en and then <end> never"
    shown = ""
    for i in range(len(full) + 1):
        now = visible_text(full[:i], stop, done=False)
        assert now.startswith(shown)
        shown = now
    assert shown == "a < b <e <en and then "


def test_a_text_part_without_text_is_named_not_the_string_branch():
    """content: str | list of parts: the first error was the str branch's ("should be a valid string")."""
    err = refused({"model": "t", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, ChatRequest)
    assert err.status == 400 and "messages.0.content.0.text" in err.body()["error"]["message"]
    assert "Field required" in err.body()["error"]["message"]


def finished(text: str, reason: str, new_tokens: int = 4, cached: int = 0):
    from arborspec.engine.stats import GenerationResult, GenerationStats

    stats = GenerationStats("chain", "greedy", False, prompt_tokens=10, new_tokens=new_tokens, finish_reason=reason,
                            cached_tokens=cached)
    return GenerationResult(text, [7] * new_tokens, stats)


@pytest.mark.parametrize("reason,openai", [("eos", "stop"), ("stop", "stop"), ("length", "length"),
                                           ("context", "length")])
def test_the_finish_reasons_and_usage_a_client_reads(reason, openai):
    """The engine's reasons as OpenAI's: running into the context window is "length" (the client may ask for more
    room), a model's EOS "stop"; usage adds up and names the tokens an earlier request's cache held."""
    from arborspec.server.output import Reply

    body = Reply("m", chat=False, stop=[]).body(finished("abc", reason, cached=6))
    assert body["choices"][0]["finish_reason"] == openai
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                             "prompt_tokens_details": {"cached_tokens": 6}}


def test_text_cut_at_a_stop_string_finishes_with_stop_whatever_the_engine_said():
    """The engine may end for another reason with a stop string in its text (one the budget's last token completed
    in the middle of a character, which the engine's check leaves to the next token): the client gets the text cut
    before it, and "stop", in a whole response and at the end of a stream."""
    from arborspec.server.output import Reply

    result = finished("ab STOP cd", "length")
    body = Reply("m", chat=False, stop=["STOP"]).body(result)
    assert body["choices"][0]["text"] == "ab " and body["choices"][0]["finish_reason"] == "stop"
    last = Reply("m", chat=True, stop=["STOP"]).last_events(result, "ab ")[0]
    assert json.loads(last.removeprefix("data: "))["choices"][0]["finish_reason"] == "stop"


def test_the_arborspec_field_refuses_unknown_options_and_consents_to_nothing_unasked():
    assert refused({"model": "t", "prompt": "x", "arborspec": {"methd": "chain"}}).param == "arborspec"  # a typo
    opts = parse({"model": "t", "prompt": "x", "arborspec": {}}).arborspec
    assert opts.allow_lossy is False and opts.return_token_ids is False and opts.method is None


def test_stream_options_ask_for_nothing_unless_they_say_so_and_need_stream_true():
    req = parse({"model": "t", "prompt": "x", "stream": True, "stream_options": {}})
    check_sampling(req)
    assert not req.stream_options.include_usage
    for stream in (False, None):  # null is the default: no stream
        with pytest.raises(APIError) as info:
            check_sampling(parse({"model": "t", "prompt": "x", "stream": stream,
                                  "stream_options": {"include_usage": True}}))
        assert info.value.param == "stream_options"


def test_a_seed_is_refused_outside_the_range_a_generator_takes_at_either_end():
    from arborspec.core.sampling import SEED_RANGE
    for seed in SEED_RANGE:
        assert parse({"model": "t", "prompt": "x", "seed": seed}).seed == seed
    for seed in (SEED_RANGE[0] - 1, SEED_RANGE[1] + 1):
        assert refused({"model": "t", "prompt": "x", "seed": seed}).param == "seed"


def test_temperature_two_is_openais_top_of_the_range():
    check_sampling(parse({"model": "t", "prompt": "x", "temperature": 2}))
    with pytest.raises(APIError) as info:
        check_sampling(parse({"model": "t", "prompt": "x", "temperature": 2.001}))
    assert info.value.param == "temperature"


def test_a_message_with_a_legacy_function_call_is_refused():
    call = {"name": "f", "arguments": "{}"}
    err = refused({"model": "t", "messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": None, "function_call": call}]},
                  ChatRequest)
    assert err.param == "messages" and "tool calls" in err.message


@pytest.mark.parametrize("field, value", [("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("suffix", "}"),
                                          ("logit_bias", {"50256": -100}), ("best_of", 2),
                                          ("n", True), ("presence_penalty", False)])  # a bool is not a number here
def test_openais_completion_fields_that_would_change_the_answer_are_refused(field, value):
    assert refused({"model": "t", "prompt": "x", field: value}).param == field


def test_max_tokens_defaults_within_the_limit_and_reaches_it_and_zero_only_scores_an_echoed_prompt():
    assert max_tokens(parse({"model": "t", "prompt": "x"}), Limits("tiny", 10, 16, 1000)) == 10
    assert max_tokens(parse({"model": "t", "prompt": "x", "max_tokens": 100}), LIMITS) == 100
    assert max_tokens(parse({"model": "t", "prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 0}), LIMITS) == 0
    for body in ({"logprobs": 1}, {"echo": True}):  # scoring needs both: the prompt back, and its logprobs
        assert refused({"model": "t", "prompt": "x", "max_tokens": 0, **body}).param == "max_tokens"
    chat = {"model": "t", "messages": [{"role": "user", "content": "a"}], "logprobs": True, "max_tokens": 0}
    assert refused(chat, ChatRequest).param == "max_tokens"  # chat has no echo


def test_up_to_four_stop_strings_as_openai_takes_them():
    assert stop_strings(parse({"model": "t", "prompt": "x", "stop": ["a", "b", "c", "d"]})) == ["a", "b", "c", "d"]
