"""Cheaper drafts keep the output exact: pruned heads, quantized weights."""
import random

import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.tuning import draft_levers
from arborspec.tuning.draft_levers import PrunedHead, frequent_tokens, prune_head, quantize, token_counts
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


def test_a_pruned_head_counts_chat_and_code_as_equal_halves(tokenizer, tmp_path, monkeypatch):
    """Code weighs as much as chat however few tokens it has (ShareGPT alone left code out of small heads), and the
    counts are computed once per tokenizer."""
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(draft_levers, "sharegpt_turns", lambda records, progress: iter(["aaa b"] * 20))
    monkeypatch.setattr(draft_levers, "stdlib_sources", lambda: iter(["c"]))
    counts = draft_levers.corpus_counts(tokenizer, 64, progress=False)
    a, b, c = tokenizer.convert_tokens_to_ids(["a", "b", "c"])
    assert counts.sum().item() == pytest.approx(2.0)  # each half sums to 1
    assert counts[c] == pytest.approx(1.0) and counts[a] == pytest.approx(3 * counts[b])
    assert frequent_tokens(counts, 1).tolist() == [c]  # one code token outranks chat's commonest
    monkeypatch.setattr(draft_levers, "stdlib_sources", lambda: iter(["b b b b"]))
    assert torch.equal(draft_levers.corpus_counts(tokenizer, 64, progress=False), counts)  # from the cache
    (saved,) = (tmp_path / "vocab").glob("*.pt")
    saved.write_bytes(saved.read_bytes()[:40])  # a damaged file raised on every --draft-vocab run: counted again
    assert draft_levers.corpus_counts(tokenizer, 64, progress=False)[tokenizer.convert_tokens_to_ids("b")] > counts[b]
    assert not list((tmp_path / "vocab").glob("*.tmp"))


def test_the_code_half_is_the_python_standard_library():
    from arborspec.tuning.corpus import stdlib_sources
    texts = list(stdlib_sources())
    assert len(texts) > 100 and sum(map(len, texts)) > 1_000_000  # ~4.7 MB of Python
    assert sum(t.count("\ndef ") for t in texts) > 1000


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


@pytest.mark.slow
@pytest.mark.parametrize("lever", ["prune", "int8"])
def test_cheaper_draft_keeps_the_target_distribution(lever):
    """Sampled trees from a pruned / quantized draft, verified by mbr, emit exactly the target's distribution."""
    from tests.drafting.equivalence import assert_samples_target, table_pair
    from tests.verify.harness import TableDecoder

    def cheaper(draft):
        return prune_head(draft, torch.tensor([0, 2, 3])) if lever == "prune" else quantize(draft, "int8")

    t_table, d_table, prompt, probs = table_pair(lever=cheaper)
    if lever == "prune":
        assert d_table.logits(()).float().softmax(-1)[[1, 4]].max() == 0  # the draft never proposes pruned tokens
    dec = TableDecoder(t_table, d_table, method="static", verifier="mbr", temperature=1.0, horizon=4, depth=2, branch=2)
    assert_samples_target(dec, prompt, probs)


def test_an_int8_draft_is_prepared_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    from arborspec.loading.model import LoadedModel
    from arborspec.tuning import draft_levers

    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    calls = []
    real = draft_levers.quantize
    monkeypatch.setattr(draft_levers, "quantize", lambda m, mode: calls.append(mode) or real(m, mode))
    base = tiny_model("qwen2", seed=3)
    x = torch.tensor([[5, 9, 2, 7]])

    def prepared():
        return draft_levers.prepare_draft(LoadedModel(noisy_copy(base, 0.0), None, "d", "memory"), "int8").model

    first, second = prepared(), prepared()
    assert calls == ["int8"]  # the second came from the cache
    assert type(second.model.layers[0].mlp.up_proj) is torch.ao.nn.quantized.dynamic.Linear
    assert torch.equal(first(x).logits, second(x).logits)
    other = draft_levers.prepare_draft(LoadedModel(noisy_copy(base, 0.3), None, "d", "memory"), "int8").model
    assert calls == ["int8", "int8"] and not torch.equal(other(x).logits, first(x).logits)  # other weights: a new key
    for path in (tmp_path / "drafts").glob("*.pt"):
        path.write_bytes(b"truncated")
    assert torch.equal(prepared()(x).logits, first(x).logits) and len(calls) == 3  # a broken file is re-made


def test_an_int8_draft_runs_from_a_read_only_cache(tmp_path, monkeypatch, capsys):
    """A kept copy in a read-only cache failed the run ("Read-only file system"): its utime raised inside the
    load's try, and the unlink of the except raised again; a copy not kept yet failed on its save."""
    import errno

    from arborspec.loading.model import LoadedModel
    from arborspec.tuning import draft_levers

    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    base = tiny_model("qwen2", seed=3)
    x = torch.tensor([[5, 9, 2, 7]])

    def prepared():
        return draft_levers.prepare_draft(LoadedModel(noisy_copy(base, 0.0), None, "d", "memory"), "int8").model

    kept = prepared()(x).logits

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(draft_levers.os, "utime", read_only)
    monkeypatch.setattr(draft_levers, "save_atomically", read_only)
    calls = []
    real = draft_levers.quantize
    monkeypatch.setattr(draft_levers, "quantize", lambda m, mode: calls.append(mode) or real(m, mode))
    assert torch.equal(prepared()(x).logits, kept) and calls == []  # the kept copy, loaded
    for path in (tmp_path / "drafts").glob("*.pt"):
        path.unlink()
    assert torch.equal(prepared()(x).logits, kept) and calls == ["int8"]  # prepared, not kept: the run goes on
    assert "cannot write to the cache" in capsys.readouterr().err


def test_prepared_drafts_beyond_the_most_recently_used_are_removed(tmp_path):
    """Every new fingerprint, lever or library made a new ~600 MB copy, and nothing removed the old ones."""
    import os
    drafts = tmp_path / "drafts"
    drafts.mkdir()
    for i in range(6):  # d0 the least recently used
        (drafts / f"d{i}.pt").write_bytes(b"x")
        os.utime(drafts / f"d{i}.pt", (1000 + i, 1000 + i))
    new = drafts / "new.pt"
    new.write_bytes(b"x")
    os.utime(new, (10, 10))  # just written, whatever its clock says: never removed
    removed = draft_levers.prune_drafts(new, keep=4)
    assert sorted(p.name for p in removed) == ["d0.pt", "d1.pt", "d2.pt"]
    assert sorted(p.name for p in drafts.iterdir()) == ["d3.pt", "d4.pt", "d5.pt", "new.pt"]
