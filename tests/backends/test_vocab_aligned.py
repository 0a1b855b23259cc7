"""A draft whose output table has fewer or more rows than the target's (one tokenizer, tables padded differently, as
Qwen2.5's 7B and 0.5B are): its logits are cut or padded to the target's width (backends/session.py, VocabAligned),
and once the target commits an id the draft has no row for, the draft drafts no more (engine/generation.py,
draft_room). Greedy output is the target's own, sampled output follows the target's exact distribution; before,
such a pair crashed at T > 0 (a broadcast error in the verifiers) or on the draft's first padding id (IndexError)."""
from __future__ import annotations

import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.backends.session import VocabAligned, vocab_aligned
from tests.conftest import tiny_model
from tests.verify.harness import assert_same_distribution, exact_target_distribution, plan_samples, sample_outputs

VOCAB = 8


class Rows:
    """A session stand-in whose forward gives `width` logits a node."""

    cached, forwards = [], 0

    def __init__(self, width: int):
        self.width = width

    def forward(self, context, tree, nodes):
        return torch.arange(float(self.width)).repeat(len(nodes), 1)


def test_logits_are_cut_or_padded_to_the_targets_width():
    assert vocab_aligned(Rows(8), 8, 8).__class__ is Rows  # the same width: the session itself
    cut, padded = VocabAligned(Rows(10), 8), VocabAligned(Rows(6), 8)
    assert torch.equal(cut.forward([1], None, [0, 1]), torch.arange(8.0).repeat(2, 1))
    wide = padded.forward([1], None, [0])
    assert wide.shape == (1, 8) and torch.equal(wide[0, :6], torch.arange(6.0)) and wide[0, 6:].eq(-torch.inf).all()
    assert wide.softmax(-1)[0, 6:].sum() == 0 and padded.cached == [] and padded.width == 6  # the rest: the session's


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0, vocab=VOCAB, scale=1.0)


@pytest.mark.parametrize("rows", [6, 10])
def test_greedy_output_is_the_targets_own(target, rows):
    draft = tiny_model("llama", seed=0, vocab=rows, scale=1.0)
    prompt = [2, 5, 3, 1]
    want = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids
    for method in ("chain", "dyspec"):
        got = SpeculativeDecoder(target, draft, method=method).generate(prompt, max_new_tokens=24, ignore_eos=True)
        assert got.token_ids == want
    if rows < VOCAB:  # a prompt the draft cannot read is refused before anything runs
        with pytest.raises(ValueError, match=f"token id 7 is outside the vocabulary \\[0, {rows}\\)"):
            SpeculativeDecoder(target, draft, method="chain").generate([2, 7], max_new_tokens=4)


@pytest.mark.parametrize("rows,method,verifier", [(6, "chain", "sps"), (10, "dyspec", "mbr")])
def test_sampled_output_follows_the_targets_distribution(target, rows, method, verifier):
    """The first 2 tokens over many seeded runs (catches a 0.1 TV error with power 0.95). With 6 rows the target
    draws ids 6 and 7 (a padding id to the draft) about a quarter of the time, and the draft then stops."""
    draft = tiny_model("llama", seed=0, vocab=rows, scale=1.0)
    dec = SpeculativeDecoder(target, draft, method=method, verifier=verifier, temperature=1.0)
    prompt, k = [2, 5, 3, 1], 2
    probs = exact_target_distribution(target, prompt, k, dec.sampling)
    if rows < VOCAB:
        assert probs.reshape(VOCAB, VOCAB)[rows:].sum() > 0.05  # the case is reached
    counts = sample_outputs(dec, prompt, k, plan_samples(probs, tv=0.1), seed=11, max_new_tokens=4)
    assert_same_distribution(counts, probs, tv=0.1)
