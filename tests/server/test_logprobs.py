"""OpenAI's logprobs shapes (server/logprobs.py) on a byte-level tokenizer (a tiny GGUF's, GPT-2's byte table): a
token's entry goes out once the text shown covers it, a token that splits a character carries its own bytes and
waits for the rest of the character, and a stop string's tokens never go out."""
from __future__ import annotations

import pytest

from arborspec.backends.llamacpp import gguf_tokenizer
from arborspec.engine.logprobs import TokenLogprob
from arborspec.engine.stats import GenerationResult, GenerationStats
from arborspec.server.logprobs import Logprobs
from tests.backends.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return gguf_tokenizer(write_tiny_gguf(tmp_path_factory.mktemp("lp") / "m.gguf"))


def result(tokenizer, ids: list[int]) -> GenerationResult:
    stats = GenerationStats("ar", "greedy", False, prompt_tokens=3, new_tokens=len(ids))
    logprobs = [TokenLogprob(t, -0.5 - i, [(t, -0.5 - i), (65, -3.0)]) for i, t in enumerate(ids)]
    return GenerationResult(tokenizer.decode(ids, skip_special_tokens=True), ids, stats, logprobs)


def test_a_token_that_splits_a_character_waits_for_it_and_carries_its_own_bytes(tokenizer):
    ids = [ord("a"), 0xC3, 0xA9, ord("b")]  # "a", then "é" as two byte tokens, then "b"
    done = result(tokenizer, ids)
    assert done.text == "aéb"
    lp = Logprobs(tokenizer, chat=True)
    assert lp.bytes(0xC3) == b"\xc3" and lp.bytes(ord("a")) == b"a"
    first = lp.take(result(tokenizer, ids[:2]), "a")  # the stream holds back the half character
    assert [e["token"] for e in first["content"]] == ["a"]
    rest = lp.take(done, "aéb")
    assert [bytes(e["bytes"]) for e in rest["content"]] == [b"\xc3", b"\xa9", b"b"]
    assert b"".join(bytes(e["bytes"]) for e in first["content"] + rest["content"]) == "aéb".encode()
    assert [e["logprob"] for e in rest["content"]] == [-1.5, -2.5, -3.5]
    assert rest["content"][0]["top_logprobs"][1] == {"token": "A", "logprob": -3.0, "bytes": [65]}
    assert lp.take(done, "aéb") is None  # each entry goes out once


def test_completion_entries_have_offsets_and_a_stop_strings_tokens_never_go_out(tokenizer):
    ids = [ord(c) for c in "xy=12"]
    lp = Logprobs(tokenizer, chat=False)
    out = lp.take(result(tokenizer, ids), "xy")  # the text was cut before the stop string "=1"
    assert out == {"tokens": ["x", "y"], "token_logprobs": [-0.5, -1.5],
                   "top_logprobs": [{"x": -0.5, "A": -3.0}, {"y": -1.5, "A": -3.0}], "text_offset": [0, 1]}
    assert lp.take(result(tokenizer, ids), "xy") is None


def test_chat_leaves_the_end_of_turn_out_and_completions_keep_it(tokenizer):
    ids = [ord("o"), ord("k"), tokenizer.eos_token_id]
    chat = Logprobs(tokenizer, chat=True).take(result(tokenizer, ids), "ok")
    assert [e["token"] for e in chat["content"]] == ["o", "k"]
    completion = Logprobs(tokenizer, chat=False).take(result(tokenizer, ids), "ok")
    assert completion["tokens"] == ["o", "k", tokenizer.decode([tokenizer.eos_token_id])]
    assert completion["text_offset"] == [0, 1, 2]


def test_an_echoed_prompts_offsets_index_the_prompt_text_past_a_token_the_tokenizer_put_in_front(tokenizer):
    bos = tokenizer.eos_token_id  # a control token standing in for a BOS token the tokenizer added
    ids = [bos, ord("h"), ord("i")]
    scored = result(tokenizer, [])
    scored.prompt_logprobs = [TokenLogprob(bos, None, [])] + [TokenLogprob(t, -1.0, [(t, -1.0)]) for t in ids[1:]]
    echoed = Logprobs(tokenizer, chat=False).prompt(scored, "hi")  # the client sent "hi"; it never sees the BOS text
    assert echoed["text_offset"] == [0, 0, 1] and echoed["tokens"][1:] == ["h", "i"]
    written = tokenizer.decode([bos]) + "hi"  # the prompt itself spelled the special token out
    assert Logprobs(tokenizer, chat=False).prompt(scored, written)["text_offset"] == [0, len(written) - 2,
                                                                                      len(written) - 1]
