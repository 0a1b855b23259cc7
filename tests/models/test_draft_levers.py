"""Cheaper drafts keep the output exact: pruned heads, quantized weights."""
import random

import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.models.draft_levers import PrunedHead, frequent_tokens, prune_head, quantize, token_counts
from tests.conftest import noisy_copy, tiny_model


def test_pruned_head_zeroes_every_other_token():
    model = tiny_model("llama")
    head = model.get_output_embeddings()
    keep = torch.tensor([3, 7, 1, 20])
    pruned = PrunedHead(head, keep)
    x = torch.randn(2, 5, head.in_features)
    full, small = head(x), pruned(x)
    torch.testing.assert_close(small[..., keep], full[..., keep])
    probs = small.float().softmax(-1)
    outside = torch.ones(head.out_features, dtype=torch.bool)
    outside[keep] = False
    assert probs[..., outside].max() == 0  # exactly zero, not just small
    assert torch.isfinite(small).all()  # the engine refuses inf logits


def test_frequent_tokens_and_counts(tokenizer):
    counts = token_counts(tokenizer, ["aaa b", "a c"], vocab_size=64)
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    assert counts[a] == 4 and counts[b] == 1
    top = frequent_tokens(counts, 2, always=[1])
    assert a in top.tolist() and 1 in top.tolist() and len(top) == 3
    with pytest.raises(ValueError):
        frequent_tokens(counts, 0)


@pytest.mark.parametrize("lever", ["prune", "int8", "int4", "prune+int8"])
def test_greedy_equivalence_with_a_cheaper_draft(lever):
    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, 0.2)
    if "prune" in lever:
        prune_head(draft, torch.arange(2, 40))
    if "int8" in lever:
        draft = quantize(draft, "int8")
    if lever == "int4":
        pytest.importorskip("torchao")
        draft = quantize(draft, "int4")
    rng = random.Random(0)
    accepted = 0
    for _ in range(3):
        prompt = [rng.randrange(2, 56) for _ in range(6)]
        ref = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=20, ignore_eos=True)
        res = SpeculativeDecoder(target, draft, method="static", depth=3, branch=2).generate(
            prompt, max_new_tokens=20, ignore_eos=True)
        assert res.token_ids == ref.token_ids
        accepted += sum(s.accepted for s in res.stats.steps)
    assert accepted > 0


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="unknown draft quantization"):
        quantize(tiny_model("llama"), "int3")
