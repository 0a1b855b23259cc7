"""OpenAI's logprobs shapes (server/logprobs.py) on a byte-level tokenizer (a tiny GGUF's, GPT-2's byte table): a
token's entry goes out once the text shown covers it, a token that splits a character carries its own bytes and
waits for the rest of the character, and a stop string's tokens never go out."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from arborspec.backends.llamacpp import gguf_tokenizer
from arborspec.engine.logprobs import TokenLogprob, token_logprobs
from arborspec.engine.stats import GenerationResult, GenerationStats
from arborspec.server.logprobs import Logprobs, grown
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


def test_completions_name_half_characters_by_their_bytes_and_count_whole_characters_in_offsets(tokenizer):
    """Every byte token decodes to "\ufffd": as keys of one dict they were one entry holding the runner-up's value."""
    ids = [ord("a"), 0xC3, 0xA9, ord("b")]  # "a", "é" as two byte tokens, "b"
    done = result(tokenizer, ids)
    done.logprobs[1] = TokenLogprob(0xC3, -0.1, [(0xC3, -0.1), (0xC4, -2.0), (0xC5, -3.0)])
    out = Logprobs(tokenizer, chat=False).take(done, "aéb")
    assert out["tokens"] == ["a", "bytes:\\xc3", "bytes:\\xa9", "b"]
    assert out["top_logprobs"][1] == {"bytes:\\xc3": -0.1, "bytes:\\xc4": -2.0, "bytes:\\xc5": -3.0}
    assert out["text_offset"] == [0, 1, 1, 2]  # both halves of "é" start where it starts


def test_each_tokens_text_length_is_the_one_its_whole_prefix_decodes_to(tokenizer):
    """`grown` decodes a window, not the prefix; on text mixing byte tokens, whole characters, special tokens and
    invalid bytes it must give the length decoding every prefix gives, and on valid text the length of its whole
    characters."""
    rng = random.Random(0)
    chars = ["a", "b", " ", "\n", "é", "€", "😀"]
    special = tokenizer.eos_token_id
    for case in range(60):
        if case % 2:  # any bytes at all: invalid UTF-8 included
            ids = [rng.choice([0x61, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, special])
                   for _ in range(rng.randint(1, 30))]
        else:  # whole characters, each one byte token per byte, now and then a special token
            ids = [b for _ in range(rng.randint(1, 12))
                   for b in ([special] if rng.random() < 0.1 else list(rng.choice(chars).encode()))]
        for skip in (False, True):
            length, start = 0, 0
            for i in range(len(ids)):
                before = tokenizer.decode(ids[:i], skip_special_tokens=skip)
                length, start = grown(tokenizer, ids, i, length, skip)
                text = tokenizer.decode(ids[:i + 1], skip_special_tokens=skip)
                assert length == len(text)
                if case % 2 == 0:  # a token starts after the whole characters before it
                    assert start == len(before.rstrip("\ufffd"))


@pytest.mark.parametrize("ids, starts", [
    ([0x78, 0xE9, 0x93, 0x61], [0, 1, 1, 2]),  # "x", two bytes of a character that never comes (one U+FFFD), "a"
    ([0xE9, 0x93, 0xF0, 0x9F, 0x98, 0x80], [0, 0, 1, 1, 1, 1]),  # the same, then an emoji's four byte tokens
    ([0xC3, 0xC3, 0xA9], [0, 1, 1]),  # a lone lead byte, then "é"
])
def test_a_token_after_bytes_that_stay_invalid_starts_after_their_replacement_character(tokenizer, ids, starts):
    """Every trailing U+FFFD was taken for a half character, so the token after one that stays put its text_offset
    one character early (Qwen, T = 1: an invalid two-byte run, then a whole character)."""
    out = Logprobs(tokenizer, chat=False).take(result(tokenizer, ids), tokenizer.decode(ids))
    assert out["text_offset"] == starts


class Pieces:
    """A tokenizer whose tokens are any byte strings (as byte-level BPE merges them), decoded as HF decodes bytes."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_a_token_continuing_a_character_starts_where_the_character_does():
    """Qwen writes " 🍉" as " \xf0\x9f", "\x8d", "\x89": the middle token was given the offset of the space (where
    the token before it started), not of the emoji it continues."""
    tok = Pieces([b"a", b" \xf0\x9f", b"\x8d", b"\x89", b"b"])
    length, starts = 0, []
    for i in range(5):
        length, start = grown(tok, [0, 1, 2, 3, 4], i, length)
        starts.append(start)
    assert starts == [0, 1, 2, 2, 3] and length == len("a 🍉b")


def test_chat_leaves_out_every_token_the_content_skips_and_an_empty_answer_has_empty_lists(tokenizer):
    """Qwen's <|im_start|> is an added special token that all_special_ids does not name: its entry went out though
    the content never shows it. With no token shown, the logprobs were null; clients read that as "not asked for"."""
    import copy

    from tokenizers import AddedToken
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<|turn|>", special=True)]})
    turn = tok.convert_tokens_to_ids("<|turn|>")
    ids = [ord("o"), turn, ord("k")]
    assert tok.decode(ids, skip_special_tokens=True) == "ok"
    chat = Logprobs(tok, chat=True).take(result(tok, ids), "ok")
    assert [e["token"] for e in chat["content"]] == ["o", "k"]
    assert Logprobs(tokenizer, chat=True).empty() == {"content": [], "refusal": None}
    assert Logprobs(tokenizer, chat=False).empty() == {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                       "text_offset": []}


def test_an_echoed_prompt_the_tokenizer_normalizes_has_offsets_into_the_text_as_sent(tokenizer):
    """Qwen's tokenizer normalizes to NFC: "e" + U+0301 reads as "é", so offsets counted on the decoding pointed at
    other characters of the echoed prompt from there on; the tokenizer's own offset mapping indexes the text sent."""
    import copy

    from tokenizers import normalizers
    tok = copy.deepcopy(tokenizer)
    tok.backend_tokenizer.normalizer = normalizers.NFC()
    text = "cafe\u0301 ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]  # c a f, "é" as two byte tokens, " ", o, k
    scored = result(tok, [])
    scored.prompt_logprobs = [TokenLogprob(t, -1.0, [(t, -1.0)]) for t in ids]
    offsets = Logprobs(tok, chat=False).prompt(scored, text)["text_offset"]
    assert offsets == [0, 1, 2, 3, 3, 5, 6, 7]


def test_a_response_cut_to_nothing_by_a_stop_string_has_empty_logprobs_whole_and_streamed(tokenizer):
    from arborspec.server.output import Reply
    ids = [ord(c) for c in "xy"]
    done = result(tokenizer, ids)
    whole = Reply("m", chat=False, stop=["x"], logprobs=Logprobs(tokenizer, chat=False)).body(done)
    assert whole["choices"][0]["text"] == "" and whole["choices"][0]["logprobs"]["tokens"] == []
    chat = Reply("m", chat=True, stop=["x"], logprobs=Logprobs(tokenizer, chat=True))
    last = json.loads(chat.last_events(done, "")[0][len("data: "):])
    assert last["choices"][0]["logprobs"] == {"content": [], "refusal": None}
    shown = Reply("m", chat=True, stop=["y"], logprobs=Logprobs(tokenizer, chat=True))
    shown.text_event("x", done, "x")  # one entry went out: the last chunk has none of its own
    assert json.loads(shown.last_events(done, "x")[0][len("data: "):])["choices"][0]["logprobs"] is None


def test_a_token_a_stop_string_cuts_through_comes_with_the_last_piece_so_the_tokens_spell_the_text(tokenizer):
    from arborspec.server.output import Reply
    ids = tokenizer("xdefy", add_special_tokens=False)["input_ids"]  # x, "def" (one token), y
    assert [tokenizer.decode([t]) for t in ids] == ["x", "def", "y"]
    done = result(tokenizer, ids)
    whole = Reply("m", chat=False, stop=["ef"], logprobs=Logprobs(tokenizer, chat=False)).body(done)
    choice = whole["choices"][0]
    assert choice["text"] == "xd" and choice["logprobs"]["tokens"] == ["x", "def"]  # "def" was left out
    assert choice["logprobs"]["text_offset"] == [0, 1]
    streamed = Reply("m", chat=True, stop=["ef"], logprobs=Logprobs(tokenizer, chat=True))
    first = json.loads(streamed.text_event("x", done, "x")[len("data: "):])["choices"][0]["logprobs"]
    last = json.loads(streamed.last_events(done, "xd")[0][len("data: "):])["choices"][0]["logprobs"]
    assert [e["token"] for e in first["content"] + last["content"]] == ["x", "def"]


def test_two_alternatives_with_one_text_keep_the_likelier_ones_value():
    """Completions name alternatives by text: where two tokens read the same ("a" and a second spelling of it), the
    likelier one's logprob stays, whichever comes later."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "X": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("X", "a"), decoders.Fuse()])
    lp = Logprobs(PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>"), chat=False)
    assert lp.key(1) == lp.key(2) == "a"
    assert lp._top([(2, -0.1), (1, -2.0)]) == {"a": -0.1}  # top lists come likeliest first


def test_a_chunk_whose_text_covers_no_new_token_has_null_logprobs_and_only_the_last_one_the_empty_shape(tokenizer):
    """Mid-stream, text that completes no token's text (the start of "def", which a stop string may cut) comes with
    `logprobs: null`, even before any entry went out; the empty lists are for a last chunk of a response that sent
    no entry at all."""
    from arborspec.server.output import Reply
    ids = tokenizer("defy", add_special_tokens=False)["input_ids"]  # "def" (one token), y
    assert [tokenizer.decode([t]) for t in ids] == ["def", "y"]
    done = result(tokenizer, ids)
    streamed = Reply("m", chat=True, stop=["ef"], logprobs=Logprobs(tokenizer, chat=True))
    first = json.loads(streamed.text_event("d", done, "d")[len("data: "):])["choices"][0]
    assert first["delta"] == {"content": "d"} and first["logprobs"] is None
    last = json.loads(streamed.last_events(done, "d")[0][len("data: "):])["choices"][0]
    assert [e["token"] for e in last["logprobs"]["content"]] == ["def"]  # the token the stop string cuts through


def test_token_logprobs_are_each_rows_log_softmax_with_its_top_k_best_first():
    """engine/logprobs.py directly: the chosen token's log-probability in its own row, and the `top` likeliest
    (token, logprob) pairs, most likely first; `top` past the vocabulary gives the whole row, 0 none."""
    rows = [[0.0, 1.0, 2.0], [3.0, 1.0, 0.5]]
    logp = [[x - math.log(sum(math.exp(y) for y in row)) for x in row] for row in rows]
    tokens = [1, 0]
    for top in (1, 2, 3, 7):
        got = token_logprobs(torch.tensor(rows), tokens, top)
        assert [lp.token for lp in got] == tokens
        for lp, row in zip(got, logp):
            assert lp.logprob == pytest.approx(row[lp.token], abs=1e-6)
            want = sorted(range(len(row)), key=lambda t: -row[t])[:top]
            assert [t for t, _ in lp.top] == want
            assert [v for _, v in lp.top] == pytest.approx([row[t] for t in want], abs=1e-6)
    assert [lp.top for lp in token_logprobs(torch.tensor(rows), tokens, 0)] == [[], []]
