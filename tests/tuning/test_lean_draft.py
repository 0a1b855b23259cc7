"""Lean GGUF drafts (tuning/gguf_requant.py): the requantized file, the variant levers, greedy identity, and `auto`
measuring the lean variants of a native draft."""
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize

from arborspec import SpeculativeDecoder, runspec
from arborspec.loading import load_model
from arborspec.loading import pair as pair_loader
from arborspec.loading.model import LoadedModel
from arborspec.tuning import costs, draft_choice, gguf_requant
from tests.backends.tiny_gguf import write_tiny_gguf
from tests.conftest import char_tokenizer, tiny_model

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.usefixtures("private_cache")  # tests/conftest.py
LEAN = {"q4_0": QT.Q4_0, "iq4_nl": QT.IQ4_NL}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean")
    return {"target": write_tiny_gguf(root / "target.gguf", dtype="q8_0"),
            "draft": write_tiny_gguf(root / "draft.gguf", dtype="q8_0", noise=0.05)}


def matrices(path) -> dict:
    return {t.name: t for t in GGUFReader(path).tensors if len(t.shape) == 2}


@pytest.mark.parametrize("kind", list(LEAN))
def test_the_lean_file_holds_every_matrix_in_its_type_close_to_the_source(files, kind):
    path = gguf_requant.requantized(files["draft"], kind, progress=False)
    lean, source = matrices(path), matrices(files["draft"])
    assert set(lean) == set(source)
    for name, tensor in lean.items():
        want = QT.Q8_0 if name == "token_embd.weight" else LEAN[kind]  # looked up, never read whole: kept
        assert tensor.tensor_type == want, name
        a = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        b = dequantize(source[name].data, source[name].tensor_type).astype(np.float32)
        assert np.linalg.norm(a - b) < 0.2 * np.linalg.norm(b), name  # 4-bit blocks: a real requantization


def test_the_lean_file_is_built_once(files, monkeypatch):
    first = gguf_requant.requantized(files["draft"], "q4_0", progress=False)
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_model_quantize", lambda *a: pytest.fail("quantized twice"))
    assert gguf_requant.requantized(files["draft"], "q4_0", progress=False) == first
    with pytest.raises(ValueError, match="unknown lean draft type"):
        gguf_requant.requantized(files["draft"], "q3_x")


def test_a_cut_short_copy_is_built_again_and_a_file_replaced_within_a_second_gets_its_own(files, tmp_path):
    """A truncated copy was trusted for good (every load failed, --refresh did not help); a copy was keyed by the
    source's mtime in whole seconds, so a file replaced within one kept the old file's copy."""
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(files["draft"].read_bytes())
    second = 1_700_000_000 * 10**9
    os.utime(draft, ns=(second, second))
    out = gguf_requant.requantized(draft, "q4_0", progress=False)
    whole = out.read_bytes()
    out.write_bytes(whole[: len(whole) // 2])
    assert gguf_requant.requantized(draft, "q4_0", progress=False) == out and out.read_bytes() == whole
    size = draft.stat().st_size
    write_tiny_gguf(draft, dtype="q8_0", noise=0.3)  # another draft, the same size ...
    os.utime(draft, ns=(second, second + 1000))  # ... replaced within the same second
    assert draft.stat().st_size == size
    assert gguf_requant.requantized(draft, "q4_0", progress=False) != out


def test_a_new_copy_replaces_the_stale_ones_of_its_variant(files, tmp_path):
    draft, lookalike = tmp_path / "draft.gguf", tmp_path / "draft-q4_0-x.gguf"  # its copies' names start alike
    for path in (draft, lookalike):
        path.write_bytes(files["draft"].read_bytes())
    old_q4, old_nl, other = (gguf_requant.requantized(path, kind, progress=False)
                             for path, kind in ((draft, "q4_0"), (draft, "iq4_nl"), (lookalike, "q4_0")))
    os.utime(draft, (draft.stat().st_atime, draft.stat().st_mtime + 60))  # the file changed: a new key
    new_q4 = gguf_requant.requantized(draft, "q4_0", progress=False)
    assert new_q4 != old_q4 and new_q4.exists() and not old_q4.exists()
    assert old_nl.exists() and other.exists()  # another variant, another file's copy: left alone
    namesake = tmp_path / "elsewhere" / "draft.gguf"  # each copy of two files of one name deleted the other's
    namesake.parent.mkdir()
    namesake.write_bytes(files["draft"].read_bytes())
    theirs = gguf_requant.requantized(namesake, "q4_0", progress=False)
    assert theirs != new_q4 and theirs.exists() and new_q4.exists()


def test_the_levers_name_the_lean_variants_and_refuse_the_wrong_backend(files):
    assert runspec.parse("chain+q4_0").quant == "q4_0" and runspec.parse("auto+iq4_nl").quant == "iq4_nl"
    native = load_model(str(files["draft"]), backend="native", progress=False)
    with pytest.raises(ValueError, match="PyTorch drafts"):
        pair_loader.resolve_draft(native, native, "int8", progress=False)
    tok = char_tokenizer()
    dense = LoadedModel(tiny_model("llama", seed=0), tok, "d", "memory")
    with pytest.raises(ValueError, match="native backend"):
        pair_loader.resolve_draft(dense, dense, "q4_0", progress=False)


@pytest.mark.parametrize("kind", gguf_requant.lean_types())
def test_a_lean_draft_keeps_greedy_decoding_identical(files, kind):
    target = load_model(str(files["target"]), backend="native", progress=False)
    draft = load_model(str(files["draft"]), backend="native", progress=False)
    lean, quant, vocab = pair_loader.prepare_draft(target, draft, kind, vocab=0, progress=False)
    assert (quant, vocab) == (kind, 0) and lean.model is not draft.model and lean.source.endswith(".gguf")
    prompt = [5, 17, 42, 9]
    plain = SpeculativeDecoder(target, None, method="ar").generate(prompt, max_new_tokens=24, seed=0).token_ids
    for method in ("chain", "dyspec"):
        out = SpeculativeDecoder(target, lean, method=method).generate(prompt, max_new_tokens=24, seed=0)
        assert out.token_ids == plain, method
        assert out.stats.mean_accepted > 0  # the lean draft was used, not bypassed


def test_auto_measures_each_lean_variant_with_each_pruned_head_once(files, monkeypatch):
    """`auto` on a native draft: every quantization with the whole head and with each pruned head size (corpus counts
    faked: ShareGPT is a download), all in the same rounds; the choice is the best score of all, and a run resolves
    "auto" to its quantization and head size, or to the best whole-head quantization when the run names a head."""
    import torch

    from arborspec.tuning import draft_levers
    monkeypatch.setattr(draft_choice, "HEAD_SIZES", (96, 48, 200))  # 200: over half the 261-token vocabulary
    monkeypatch.setattr(draft_levers, "corpus_counts", lambda tok, size, progress=True: torch.arange(size, 0, -1))
    together = []
    monkeypatch.setattr(draft_choice, "profile_together",
                        lambda models, **kw: together.append(len(models)) or costs.profile_together(models, **kw))
    target = load_model(str(files["target"]), backend="native", progress=False)
    draft = load_model(str(files["draft"]), backend="native", progress=False)
    kw = dict(sizes=(1, 2, 4), prefix=8, repeats=1, progress=False)
    choice, record, source = draft_choice.choose_draft_quant(target, draft, **kw)
    variants = record["variants"]
    types = set(draft_choice.available_variants(native=True))
    assert types == {"none", "iq4_nl"}  # q4_0 falls outside the agreement bound on held-out code: never auto's
    assert source == "measured" and together == [3 * len(types)]  # one measurement of every variant
    assert set(variants) == {draft_choice.label(q, k) for q in types for k in (0, 96, 48)}
    assert variants[choice]["score"] == max(v["score"] for v in variants.values())
    assert all(0 <= v["agreement"] <= v["coverage4"] <= 1 for v in variants.values())
    best_type = draft_choice.best_variant(variants, full_head=True)
    pruned = variants[draft_choice.label(best_type, 48)]
    assert (pruned["quant"], pruned["vocab"]) == (best_type, 48)
    assert draft_choice.choose_draft_quant(target, draft, **kw)[2] == "cache"
    resolved = pair_loader.resolve_draft(target, draft, "auto", progress=False)
    assert resolved == (variants[choice]["quant"], variants[choice]["vocab"])
    assert pair_loader.resolve_draft(target, draft, "auto", 64, progress=False) == (best_type, 64)


def test_a_cached_lean_choice_is_found_before_loading_and_the_shipped_draft_is_never_read(files, monkeypatch):
    """A native pair whose `auto` draft variant is cached finds the choice from the files' headers (the same key the
    loaded models give) and loads the lean file in place of the shipped draft; a choice that keeps the shipped file
    loads it as before. Greedy decoding stays the target's."""
    from pathlib import Path

    import torch

    from arborspec.backends import native
    from arborspec.core.disk_cache import write_record
    from arborspec.tuning import draft_levers
    monkeypatch.setattr(draft_choice, "HEAD_SIZES", (96,))
    monkeypatch.setattr(draft_levers, "corpus_counts", lambda tok, size, progress=True: torch.arange(size, 0, -1))
    target = load_model(str(files["target"]), backend="native", progress=False)
    draft = load_model(str(files["draft"]), backend="native", progress=False)
    key = draft_choice.choice_key(costs.profile_key(target.model), costs.profile_key(draft.model), True,
                                  draft.model.config.vocab_size)
    (t_info, _), (d_info, d_config) = native.read_header(files["target"]), native.read_header(files["draft"])
    assert key == draft_choice.choice_key(costs.native_profile_key(t_info), costs.native_profile_key(d_info), True,
                                          d_config.vocab_size)

    def entry(quant, vocab, score):  # a whole record's fields: a damaged one is measured again
        return dict(quant=quant, vocab=vocab, agreement=0.9, coverage4=0.95, draft_sizes=[1], draft_times=[1e-3],
                    score=score, best_chain=3)

    read, real = [], native.load_native
    monkeypatch.setattr(native, "load_native", lambda path: read.append(Path(path).resolve()) or real(path))
    plain = SpeculativeDecoder(target, None, method="ar").generate([5, 17, 42, 9], max_new_tokens=24).token_ids
    for choice, file in (("iq4_nl+vocab96", gguf_requant.requantized(files["draft"], "iq4_nl", progress=False)),
                         ("none", files["draft"])):
        variants = {"none": entry("none", 0, 1.0 + (choice == "none")), "iq4_nl": entry("iq4_nl", 0, 1.5),
                    "iq4_nl+vocab96": entry("iq4_nl", 96, 2.0)}
        write_record("draft-quant", key, {"choice": choice, "variants": variants, "target_sizes": [1],
                                          "target_times": [4e-3]})
        read.clear()
        pair = pair_loader.load_pair(str(files["target"]), str(files["draft"]), backend="native", progress=False)
        assert read == [files["target"].resolve(), file.resolve()]  # the target, then the draft's one file
        assert (pair.quant, pair.vocab) == (variants[choice]["quant"], variants[choice]["vocab"])
        assert Path(pair.draft.source).resolve() == file.resolve()
        out = SpeculativeDecoder(pair.target, pair.draft, method="chain").generate([5, 17, 42, 9], max_new_tokens=24)
        assert out.token_ids == plain


def test_a_killed_builds_temporary_file_goes_with_the_next_build(files, tmp_path):
    """A requantization killed midway left its ~430 MB temporary file for good."""
    import llama_cpp
    draft = tmp_path / "d.gguf"
    draft.write_bytes(files["draft"].read_bytes())
    out = gguf_requant.requantized_path(draft, "q4_0", llama_cpp.__version__)
    out.parent.mkdir(parents=True, exist_ok=True)
    stale = out.with_name(f"{out.name}.99999.tmp")
    stale.write_bytes(b"half a file")
    assert gguf_requant.requantized(draft, "q4_0", progress=False) == out and not stale.exists()
