"""Tiny randomly initialised models and a character tokenizer: fast, fp32, exact to ~1e-7."""
from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path


def pin_xdist_worker() -> None:
    """Under pytest-xdist (scripts/test.sh: a worker per core), worker i keeps to its own share of the cores, so its
    threads never wait on a core the other worker holds. Why: with both workers free to roam, the real-pair tests'
    two OpenMP / llama.cpp threads shared the cores with the other worker's tests and ran 2-6x slower (the default
    method's greedy check 84 -> 322 s on the 2-core Zen 4 host), the whole suite 17 min instead of ~13."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores, index = sorted(os.sched_getaffinity(0)), int(worker[2:])
    try:
        os.sched_setaffinity(0, cores[index::count] if count <= len(cores) else [cores[index % len(cores)]])
    except OSError:  # a sandbox that forbids it: the workers share the cores, slower but correct
        pass


pin_xdist_worker()  # before torch starts its thread pools

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the scripts are not a package), for tests of their pieces."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHARS = list("abcdefghijklmnopqrstuvwxyz ():=+-*/0123456789\n_.,'\"#[]")
VOCAB = 64  # 56 tokenizer entries + padding rows, like real models whose embedding is larger than the tokenizer
ARCHS = ["llama", "qwen2", "gpt_neox", "gpt2"]


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<eos>": 1}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def tiny_config(arch: str, vocab: int = VOCAB, layers: int = 2, context: int = 512):
    common = dict(vocab_size=vocab, num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=context,
                  eos_token_id=1, bos_token_id=None, pad_token_id=None)
    if arch == "llama":
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=2, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=32, intermediate_size=64, num_key_value_heads=2, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(hidden_size=32, intermediate_size=64, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=context, vocab_size=vocab,
                          eos_token_id=1, bos_token_id=1)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, attn: str = "eager", scale: float = 4.0, **kw):
    """A random fp32 model; `scale` sharpens the output distribution so greedy paths are not near-ties."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kw), attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model.eval().requires_grad_(False)


def noisy_copy(model, noise: float, seed: int = 1):
    """A draft that agrees with `model` most of the time: the same weights plus Gaussian noise."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn_like(p) if p.numel() > 1 else 0)
    return draft


def save_models(root, models: dict, tokenizer=None) -> dict[str, str]:
    """Each model with `tokenizer` (the character tokenizer by default) in a directory root/NAME, as the CLI, the
    server and `load_model` read them; returns {name: path}."""
    tok = tokenizer or char_tokenizer()
    for name, model in models.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return {name: str(root / name) for name in models}


@pytest.fixture(scope="module")
def loaded_pair():
    """A tiny (target, draft) as `load_pair` returns them (LoadedModels sharing the character tokenizer), for the
    benchmark's tests: the draft is the target with noise, so it is accepted often but not always."""
    from arborspec.loading.model import LoadedModel

    target = tiny_model("llama", seed=0)
    tok = char_tokenizer()
    return (LoadedModel(target, tok, "target", "memory"), LoadedModel(noisy_copy(target, 0.2), tok, "draft", "memory"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`--dist loadgroup`), tests that share a session-wide resource stay in one worker, in file
    order: the real pair (GBs, loaded once), the live servers (started once a session; the last test of
    test_capacity_and_shutdown.py stops one of them) and the emulated AVX-512 kernels (built once). Everything else
    is spread test by test: the statistical tests are single-threaded Python (`one_thread`), ~50% of the suite's
    time.
    First among the hooks: xdist's own (a plugin registered after this file, so called before it) reads the groups
    off the markers; the markers added after it grouped nothing, and two workers each started the Ray deployment in
    one Ray namespace, the second replacing the first's replicas (their metrics read 0 tokens, 2026-11-28)."""
    for item in items:
        if item.get_closest_marker("real"):
            item.add_marker(pytest.mark.xdist_group("real"))
        elif item.nodeid.startswith("tests/server/"):
            item.add_marker(pytest.mark.xdist_group("server"))
        elif "emulated" in item.nodeid:  # one worker compiles it (~40 s); split, the other waited that on its lock
            item.add_marker(pytest.mark.xdist_group("emulated"))


@pytest.fixture(scope="session")
def real_pair():
    """The default real pair as `load_model` returns it (Qwen2.5-Coder-1.5B target, 0.5B draft; bf16 on transformers),
    loaded once per session for every test marked `real` that only reads it (a test of loading itself loads its own).
    Tests must not change it."""
    from arborspec.loading import load_model

    return load_model("qwen2.5-coder-1.5b", progress=False), load_model("qwen2.5-coder-0.5b", progress=False)


@pytest.fixture(scope="module")
def private_cache(tmp_path_factory):
    """The module's cache directory in a temp dir (profiles, calibrations, choices the code measures and caches:
    not in ~/.cache). arborspec's kernels are loaded first, from the real cache: compiled once per CPU, not again
    for every test module (a no-op where no test needs them)."""
    try:
        from arborspec.kernels.build import KernelBuildError, library
        library()
    except KernelBuildError:
        pass  # the tests that need the kernels say so themselves
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ARBORSPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="session", autouse=True)
def machine_never_busy():
    """The suite's own workers keep the CPUs busy, which would mark the profiles tests measure as taken on a busy
    machine (core/cpu_load.py: measured again when quiet, comparisons not cached) by chance: never busy here.
    The rule's own tests turn it back on (`busy_rule`, `other_load`); a subprocess has its own."""
    from arborspec.core import cpu_load

    before, cpu_load.BUSY = cpu_load.BUSY, float("inf")
    yield
    cpu_load.BUSY = before


@pytest.fixture
def busy_rule(monkeypatch):
    """The busy-machine rule on for one test, at 0.1 of the CPUs (`machine_never_busy` turns it off)."""
    from arborspec.core import cpu_load

    monkeypatch.setattr(cpu_load, "BUSY", 0.1)


@pytest.fixture
def other_load(monkeypatch, busy_rule):
    """`shares`: the share of the CPUs other processes take during each measurement (`cpu_load.OtherLoad`), one
    popped per measurement in turn (an unexpected measurement finds the list empty and fails the test)."""
    from arborspec.core import cpu_load

    shares = []

    class Load:
        def __enter__(self):
            self.share = shares.pop(0)
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(cpu_load, "OtherLoad", Load)
    return shares


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a loaded 2-core machine two threads make tiny ops ~100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param
