"""What a prompt may be (engine/prompts.py): one sequence of token ids in any of the shapes transformers users hold
it, text, or a conversation; anything else is refused with a message that says what was expected."""
import numpy as np
import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.engine.prompts import prompt_ids
from tests.conftest import char_tokenizer, noisy_copy, tiny_model


@pytest.fixture(scope="module")
def tokenizer_module():
    return char_tokenizer()


@pytest.fixture(scope="module")
def decoder(tokenizer_module):
    target = tiny_model("llama", seed=0)
    return SpeculativeDecoder((target, tokenizer_module), (noisy_copy(target, 0.2), tokenizer_module),
                              method="chain")  # a (model, tokenizer) pair each


def test_one_sequence_in_every_shape_is_the_same_prompt(decoder, tokenizer_module):
    ids = [5, 6, 7]
    want = decoder.generate(ids, max_new_tokens=6, ignore_eos=True).token_ids
    for form in (tuple(ids), [ids], torch.tensor(ids), torch.tensor([ids]), np.array(ids), np.array([ids]),
                 [np.int64(i) for i in ids], {"input_ids": [ids]}):
        assert decoder.encode(form) == ids
        assert decoder.generate(form, max_new_tokens=6, ignore_eos=True).token_ids == want
    encoding = tokenizer_module("abc", return_tensors="pt")  # a BatchEncoding with a (1, 3) tensor
    assert decoder.encode(encoding) == decoder.encode("abc")


@pytest.mark.parametrize("prompt,match", [
    (torch.tensor([[5, 6], [7, 8]]), "2 sequences.*generate_batch"),
    ([[5, 6], [7, 8]], "2 sequences"),
    (["abc", "xyz"], "integers, got 'abc'.*generate_batch"),
    ({"role": "user", "content": "hi"}, "not dict"),
    (b"abc", "not bytes"),
    (5, "not int"),
    ([5.7, 6.2], "integers, got 5.7"),
    (torch.tensor([5.0, 6.0]), "integers, got 5.0"),
    ([True, 5], "integers, got True"),
    ([5, 64], "token id 64 is outside the target's vocabulary \\[0, 64\\)"),
    ([-1], "token id -1"),
    ([], "empty"),
])
def test_anything_else_is_refused_with_what_was_expected(decoder, prompt, match):
    with pytest.raises(ValueError, match=match):
        decoder.generate(prompt, max_new_tokens=2)


def test_text_needs_a_tokenizer():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        prompt_ids(None, "abc")
    assert prompt_ids(None, [1, 2]) == [1, 2]


def test_a_stream_stopped_early_leaves_its_result_so_far(decoder):
    stream = decoder.stream([5, 6, 7], max_new_tokens=30, ignore_eos=True)
    shown = next(stream)
    stream.close()
    assert decoder.last_result.text.startswith(shown) and 0 < decoder.last_result.stats.new_tokens < 30
    "".join(decoder.stream([5, 6, 7], max_new_tokens=5, ignore_eos=True))
    assert decoder.last_result.stats.new_tokens == 5 and decoder.last_result.stats.finish_reason == "length"


def test_text_that_is_not_utf8_is_refused(decoder):
    """A byte that is not UTF-8, in a command-line argument or a file, reaches Python as a lone surrogate; the
    tokenizer failed on it with a type error (a traceback, or a server's 500)."""
    with pytest.raises(ValueError, match="not valid Unicode text .* at character 3"):
        decoder.generate("caf\udce9", max_new_tokens=2)
