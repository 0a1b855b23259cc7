"""The native backend (backends/native.py) on tiny random K-quant / Q5_0 / Q8_0 GGUFs written by tiny_gguf.py.

What is proved, and against what:
 (a) the model keeps every weight matrix as GGUF blocks (no float copy) and its modules equal their dequantized
     float counterparts up to the kernels' 8-bit activations;
 (b) its weights are transformers' own GGUF reading, exactly (llama's q/k rows put back in order included), and its
     logits agree with transformers' dequantized model within that activation rounding;
 (c) its logits agree with llama.cpp's on the same file (both quantize activations the same way);
 (d) a tree forward equals each root-to-node path run as a chain;
 (e) greedy speculative decoding equals plain greedy decoding token for token; sampled output follows the target;
 (f) a GGUF it does not cover loads on another backend with a note; the command line reaches it.

Why "equal" is statistical in (c) and (d): the kernels round activations to 8 bits per block. Two computations that
differ by float rounding (llama.cpp's accumulation order, or SDPA over a tree's rows instead of a chain's) agree to
~1e-7 relative, until one activation lands within that rounding of a step boundary: then it moves by a whole 8-bit
step, and that row (and every row attending to it) differs by about 1% of the logit scale. Measured over random
trees on these files: vs llama.cpp the median row differs by ~2e-7 of the scale, the worst by 1.6e-2, and up to 42%
of rows (a step early in the context reaches every later row) differ by more than 1e-5; tree vs chains differ in
0.6-5% of rows, by at most 1.5e-2. A tree mask or a llama row permutation gone wrong shows as 0.1-1 on every row.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from gguf import GGUFReader, GGUFValueType
from torch import nn

from arborspec.backends import check_session_support, llamacpp, make_session
from arborspec.backends.hf import TreeSession
from arborspec.backends.native import NotNative, QuantEmbedding, QuantLinear, is_native, load_native
from arborspec.core.tree import dfs_order
from arborspec.engine import SpeculativeDecoder
from arborspec.kernels import build
from arborspec.kernels.build import KernelBuildError
from arborspec.kernels.reference import reference_matmul
from arborspec.loading import ModelLoadError, load_model, load_pair
from arborspec.loading.model import resolve_backend

from .test_llamacpp import chain_logits, exact_first_two, needs_llama, random_tree
from .tiny_gguf import VOCAB, write_tiny_gguf

EXACT = 1e-5  # a row computed the same way up to float rounding: measured <= 3e-7 of the logit scale
STEP = 3e-2  # a row after one activation moved by an 8-bit step (measured up to 1.6e-2 of the scale)
QUANTIZED = 6e-2  # vs transformers' float activations: measured median 1.1-1.9e-2, worst 4.2e-2
K_QUANT = {"hidden": 256, "ffn": 512}  # K-quant rows hold 256 weights a block
FILES = {  # name -> write_tiny_gguf options
    "q4_k": {"dtype": "q4_k"},
    "q6_k": {"dtype": "q6_k"},
    "q5_0": {"dtype": "q5_0"},
    "mixed": {"dtype": "mixed", "ffn": 288},  # ffn_down rows of 288: Q8_0, the K-quant fallback
    "llama": {"dtype": "mixed", "ffn": 288, "arch": "llama"},  # attn_q / attn_k rows in llama.cpp's rope order
    "tied": {"dtype": "q4_k", "tied": True},  # no output.weight: the head reads the embedding's blocks
    "draft": {"dtype": "q4_k", "noise": 0.2},  # a noisy copy of q4_k
    "short": {"dtype": "q4_k", "noise": 0.2, "context": 40},  # the same draft with a shorter context window
}


pytestmark = pytest.mark.usefixtures("private_cache")  # tests/conftest.py


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    return {name: write_tiny_gguf(root / f"{name}.gguf", **{**K_QUANT, **options}) for name, options in FILES.items()}


@pytest.fixture(scope="module")
def native(ggufs):
    """name -> LoadedModel on the native backend, loaded once."""
    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_model(str(ggufs[name]), backend="native", progress=False)
        return loaded[name]
    return get


def tree_logits(session, context: list[int], tree, prefilled: int) -> torch.Tensor:
    session.prefill(context[:prefilled])  # the rest of the context rides in front of the tree as pending tokens
    return session.forward(context, tree, list(range(len(tree))))


def some_trees(n_trees: int = 3, size: int = 16):
    """(context, tree) pairs with random tokens."""
    rng = random.Random(5)
    for _ in range(n_trees):
        context = [rng.randrange(VOCAB) for _ in range(14)]
        yield context, random_tree(rng, context[-1], size)


def row_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each row's largest |a - b| relative to the row's largest |b| (logits reach ~50 on these models)."""
    return (a - b).abs().amax(-1) / b.abs().amax(-1)


# ------------------------------------------------------------------------------------ (a) blocks, no float copy


@pytest.mark.parametrize("name", ["q4_k", "llama", "tied"])
def test_every_weight_matrix_is_kept_as_gguf_blocks(native, ggufs, name):
    model = native(name).model
    assert is_native(model) and model.dtype == torch.float32
    check_session_support(model)  # TreeSession runs it as any transformers model
    assert not [m for m in model.modules() if type(m) in (nn.Linear, nn.Embedding)]
    layer = model.model.layers[0]
    linears = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
               layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, model.lm_head]
    assert all(isinstance(m, QuantLinear) for m in linears)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    if name == "tied":
        assert model.lm_head.matrix is model.model.embed_tokens.matrix
    file = GGUFReader(ggufs[name]).tensors
    block_bytes = sum(int(t.n_bytes) for t in file if len(t.shape) == 2)
    small_floats = sum(int(t.n_elements) for t in file if len(t.shape) == 1)  # norms and biases
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}.values()
    floats = sum(t.numel() for t in tensors if t.is_floating_point())
    blocks = sum(t.numel() for t in tensors if t.dtype == torch.uint8)
    rotary = sum(b.numel() for b in model.model.rotary_emb.buffers())
    assert floats == small_floats + rotary  # not one float weight matrix (the smallest holds 32k floats)
    assert block_bytes <= blocks <= 1.05 * block_bytes  # the file's blocks (Q4_K repacked by the kernels: +2.8%)


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q5_0", "mixed"])
def test_quant_modules_equal_their_dequantized_float_counterparts(native, name):
    model = native(name).model
    torch.manual_seed(0)
    layer = model.model.layers[0]
    for module in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj, model.lm_head):
        x = torch.randn(2, 3, module.in_features)  # (batch, seq, k): reshaped to rows and back
        y = module(x)
        assert y.shape == (2, 3, module.out_features)
        bias = module.bias if module.bias is not None else 0.0
        dense = x @ module.matrix.dequantize().T + bias  # float activations
        assert row_errors(y.reshape(6, -1), dense.reshape(6, -1)).max() < 2e-2  # 8-bit activations: ~0.5%
        same_numerics = reference_matmul(module.matrix, x.reshape(6, -1)) + bias
        assert row_errors(y.reshape(6, -1), same_numerics).max() < EXACT
    embed = model.model.embed_tokens
    ids = torch.tensor([[3, 260, 3], [0, 17, 255]])
    assert torch.equal(embed(ids), embed.matrix.dequantize()[ids])
    assert embed(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, embed.embedding_dim)


# ------------------------------------------------------------------- (b) the same model as transformers reads


@pytest.mark.parametrize("name", ["q4_k", "mixed", "llama", "tied"])
def test_weights_and_logits_match_transformers_dequantized(native, ggufs, name):
    ours = native(name).model
    theirs = load_model(str(ggufs[name]), dtype="fp32", progress=False).model  # the torch backend
    settings = [{k: v for k, v in m.config.to_dict().items() if k != "_name_or_path"} for m in (ours, theirs)]
    assert settings[0] == settings[1]  # the config native builds from the metadata is the one transformers reads
    for path, module in ours.named_modules():
        if isinstance(module, QuantLinear):  # transformers un-permutes llama's q/k rows as it dequantizes
            dense = theirs.get_submodule(path)
            assert torch.equal(module.matrix.dequantize(), dense.weight), path
            assert (module.bias is None) == (dense.bias is None) and (module.bias is None
                                                                        or torch.equal(module.bias, dense.bias))
    for path, p in ours.named_parameters():  # norms
        if not isinstance(ours.get_submodule(path.rpartition(".")[0]), QuantLinear):
            assert torch.equal(p, theirs.get_parameter(path)), path
    errors, same_top = [], []
    for context, tree in some_trees():
        a = tree_logits(TreeSession(ours), context, tree, 8)
        b = tree_logits(TreeSession(theirs), context, tree, 8)
        errors.append(row_errors(a, b))
        same_top.append(a.argmax(-1) == b.argmax(-1))
    errors, same_top = torch.cat(errors), torch.cat(same_top)
    assert errors.max() < QUANTIZED and errors.median() < QUANTIZED / 2
    assert errors.median() > EXACT  # the activations really are rounded to 8 bits
    assert same_top.float().mean() >= 0.9


# ----------------------------------------------------------------------------------- (c) agreement with llama.cpp


@needs_llama
@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q5_0", "mixed", "llama", "tied"])
def test_logits_agree_with_llamacpp(native, ggufs, name):
    ours = native(name).model
    theirs = llamacpp.load_llamacpp(ggufs[name], n_threads=1, kv_type="f32")
    errors, same_top = [], []
    for context, tree in some_trees():
        a = tree_logits(TreeSession(ours), context, tree, 8)
        b = tree_logits(theirs.new_session(), context, tree, 8)
        errors.append(row_errors(a, b))
        same_top.append(a.argmax(-1) == b.argmax(-1))
    errors, same_top = torch.cat(errors), torch.cat(same_top)
    assert errors.max() < STEP  # no row further apart than one activation step (see the module docstring)
    assert (errors < EXACT).float().mean() >= 1 / 3  # impossible without llama.cpp's 8-bit activations
    assert same_top.float().mean() >= 0.95


# --------------------------------------------------------------------------------------- (d) tree == path chains


@pytest.mark.parametrize("kind", ["step", "python"])
@pytest.mark.parametrize("name,order", [("q4_k", "bfs"), ("q4_k", "dfs"), ("llama", "bfs"), ("tied", "bfs")])
def test_tree_forward_equals_each_path_as_a_chain(native, name, order, kind):
    """On the C++ step (the backend's sessions) and on the Python forward (hf.TreeSession, the reference)."""
    model = native(name).model
    new_session = make_session if kind == "step" else TreeSession
    rng = random.Random(1)
    context = [rng.randrange(VOCAB) for _ in range(10)]
    tree = random_tree(rng, context[-1], 24)
    if order == "dfs":
        tree = tree.permute(dfs_order(tree))
    session = new_session(model)
    logits = tree_logits(session, context, tree, 5)  # four committed tokens pending in front of the tree
    assert session.cached == context[:-1] and logits.shape == (len(tree), VOCAB)
    chains = torch.stack([chain_logits(model, context, [tree.tokens[n] for n in tree.path(node)], new_session)
                          for node in range(len(tree))])
    # bit for bit: each row attends on its own to exactly its keys (kernels/forward.cpp, backends/native_forward.py),
    # the kernels are row-independent, so a node's logits do not depend on what else shares its forward
    assert torch.equal(logits, chains), row_errors(logits, chains).max()
    assert (logits[1:] - logits[0]).abs().amax() > 1.0  # the rows really differ from node to node


# ---------------------------------------------------------------------------------------------- (e) decoding


@pytest.mark.parametrize("method,options", [("chain", {"k": 4}), ("static", {"depth": 3, "branch": 2}),
                                            ("dyspec", {"budget": 12}), ("auto", {})])
def test_greedy_speculative_output_equals_plain_decoding(native, method, options):
    target, draft = native("q4_k"), native("draft")
    prompt = "def fib(n):\n    return"
    ar = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=40, ignore_eos=True)
    spec = SpeculativeDecoder(target, draft, method=method, **options).generate(prompt, max_new_tokens=40,
                                                                                 ignore_eos=True)
    assert spec.token_ids == ar.token_ids and spec.text == ar.text
    assert len(set(ar.token_ids)) > 3  # not a degenerate repeat of one token
    if method != "auto":  # auto may find that no tree pays on a model this small and decode plainly
        assert spec.stats.n_steps < ar.stats.n_steps  # the noisy draft is accepted sometimes


@pytest.mark.parametrize("method,options", [("chain", {}), ("dyspec", {}), ("static", {"depth": 4}),
                                            ("static", {"widths": "4,3,3,3"})])
def test_a_draft_with_a_shorter_window_drafts_up_to_its_end_then_the_target_goes_on(native, method, options):
    """The draft's window is 40 tokens, the target's 256: trees get shallower near position 40 and are bare roots
    past it (the draft's session raised ContextOverflow there), and the output is the target's own."""
    target, draft = native("q4_k"), native("short")
    prompt = list(range(5, 25))
    ar = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=60, ignore_eos=True)
    spec = SpeculativeDecoder(target, draft, method=method, **options).generate(prompt, max_new_tokens=60,
                                                                                 ignore_eos=True)
    assert spec.token_ids == ar.token_ids and spec.stats.finish_reason == "length"
    steps, length = [s for s in spec.stats.steps if not s.prefill], len(prompt) + 1
    for step in steps:
        assert length + step.depth <= 40 or step.tree_size == 0  # no node past the draft's window
        length += step.committed
    assert any(step.tree_size for step in steps) and steps[-1].tree_size == 0


def test_sampled_speculative_output_follows_the_target_distribution(native):
    """At T = 1, top-k 3, the first two tokens of dyspec trees verified by mbr on native sessions follow the target's
    exact distribution (read from the native model): a chi-square test with enough samples to catch an error of
    total variation 0.1 with probability 0.95 (the draft's own distribution is 0.19 away)."""
    from arborspec.core.sampling import SamplingConfig
    from tests.verify.harness import assert_same_distribution, plan_samples, sample_outputs

    target, draft = native("q4_k"), native("draft")
    prompt = target.tokenizer("x = ")["input_ids"]
    probs = exact_first_two(target.model, prompt, SamplingConfig(1.0, 3, 1.0))
    dec = SpeculativeDecoder(target, draft, method="dyspec", budget=4, temperature=1.0, top_k=3, verifier="mbr")
    counts = sample_outputs(dec, prompt, 2, plan_samples(probs, tv=0.1), seed=3, max_new_tokens=2)
    assert_same_distribution(counts, probs, tv=0.1)


# ----------------------------------------------------------------------------------- (f) choosing the backend


def test_a_gguf_the_kernels_do_not_cover_loads_elsewhere_with_a_note(tmp_path, capsys, monkeypatch):
    """F16 weights, another architecture, kernels that cannot be compiled here: llama.cpp (or transformers) runs
    the file instead, after one line on stderr."""
    f16 = write_tiny_gguf(tmp_path / "f16.gguf", dtype="f16")  # F16 weights: no native kernel
    with pytest.raises(NotNative, match="weight type\\(s\\) F16 have no native kernel"):
        load_native(f16)
    loaded = load_model(str(f16), backend="native", progress=False)
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and "note: " in note[0] and "F16" in note[0]
    want = llamacpp.LlamaCppModel if llamacpp.available() else nn.Module
    assert isinstance(loaded.model, want) and not is_native(loaded.model)
    pair = load_pair(str(f16), None, backend="native", progress=False)  # the pair names the backend that ran
    assert pair.backends == ("llamacpp" if llamacpp.available() else "torch", None)
    monkeypatch.setattr(llamacpp, "available", lambda: False)  # without llama.cpp: transformers
    loaded = load_model(str(f16), backend="native", dtype="fp32", progress=False)
    assert isinstance(loaded.model, nn.Module) and not is_native(loaded.model)
    assert "loading it on transformers (torch) instead" in capsys.readouterr().err
    yarn = {"qwen2.rope.scaling.type": ("yarn", GGUFValueType.STRING),
            "qwen2.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32)}  # llama.cpp applies it; native would not
    with pytest.raises(NotNative, match="rope scaling 'yarn'"):
        load_native(write_tiny_gguf(tmp_path / "yarn.gguf", dtype="q4_k", extra=yarn, **K_QUANT))
    other = write_tiny_gguf(tmp_path / "other.gguf", dtype="q4_k", arch="no-such-arch", **K_QUANT)
    with pytest.raises(NotNative, match="architecture 'no-such-arch' is not covered"):
        load_native(other)
    q4_k = write_tiny_gguf(tmp_path / "q4_k.gguf", dtype="q4_k", **K_QUANT)

    def no_compiler():
        raise KernelBuildError("could not compile arborspec's kernels (g++: not found)")
    monkeypatch.setattr(build, "library", no_compiler)
    loaded = load_model(str(q4_k), backend="native", dtype="fp32", progress=False)
    assert not is_native(loaded.model) and "g++: not found" in capsys.readouterr().err


def test_bad_specs_are_one_line_errors(tmp_path, ggufs):
    assert resolve_backend(str(ggufs["q4_k"]), "native") == "native"
    assert resolve_backend(str(ggufs["q4_k"]), "auto") in ("llamacpp", "torch")  # auto is unchanged
    with pytest.raises(ModelLoadError, match="the native backend runs GGUF files"):
        resolve_backend(str(tmp_path), "native")
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "missing.gguf"), backend="native", progress=False)
    whole = ggufs["q4_k"].read_bytes()
    cases = {"data-cut": (whole[:-1000], "is a truncated"), "header-cut": (whole[:200], "is a truncated or corrupt"),
             "text": (b"not a model\n" * 10, "is not a GGUF file"), "empty": (b"", "is a truncated or corrupt")}
    for name, (data, message) in cases.items():  # the messages llama.cpp's backend gives for these files
        (tmp_path / f"{name}.gguf").write_bytes(data)
        with pytest.raises(ModelLoadError, match=message):
            load_model(str(tmp_path / f"{name}.gguf"), backend="native", progress=False)


def test_the_command_line_runs_native_and_prints_what_plain_decoding_prints(ggufs, capsys):
    from arborspec.cli import main

    def generate(*extra: str) -> tuple[str, str]:
        code = main(["generate", "--backend", "native", "--target", str(ggufs["q4_k"]), "--draft",
                     str(ggufs["draft"]), "--prompt", "def fib(n):", "--max-new-tokens", "24", "--ignore-eos",
                     "--json", *extra])
        out = capsys.readouterr()
        assert code == 0, out.err
        return json.loads(out.out), out.err

    spec, err = generate()  # the default method (auto) and draft variant (auto: the GGUF as it is)
    plain, _ = generate("--method", "ar")
    assert spec["text"] == plain["text"] and spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["method"] == "auto" and "draft: int" not in err
    assert main(["profile", "--pair", "--backend", "native", "--target", str(ggufs["q4_k"]), "--draft",
                 str(ggufs["draft"]), "--sizes", "1,2", "--repeats", "1", "--no-variants"]) == 0
    out = capsys.readouterr().out  # the file's types, not --dtype's default (it said "bf16")
    assert "(native, GGUF" in out and "(bf16)" not in out


# ------------------------------------------------------------------------------------ the lean forward


@pytest.mark.parametrize("name", ["q4_k", "mixed", "llama", "tied"])
def test_fast_forward_equals_transformers_forward(native, name):
    """backends/native_forward.py replaces transformers' forward for tree-session calls: the same arithmetic, except
    that each row attends on its own (so rounding differs slightly from transformers' masked batch); the cache it
    leaves is the same and the logits agree to float rounding, on a prefix and then a tree."""
    from transformers import DynamicCache

    model = native(name).model
    fast, slow = model.forward, model.forward.fallback
    assert fast is not slow
    rng = random.Random(9)
    context = [rng.randrange(VOCAB) for _ in range(9)]
    tree = random_tree(rng, context[-1], 7)
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    results = []
    for forward, cache in zip((fast, slow), caches):
        outputs = []
        for ids, positions, allowed in _prefix_then_tree(context, tree):
            mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
            out = forward(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), attention_mask=mask,
                          past_key_values=cache, use_cache=True, logits_to_keep=torch.arange(len(ids)))
            outputs.append(out.logits)
        results.append(outputs)
    for a, b in zip(*results):
        assert row_errors(a[0], b[0]).max() < EXACT and torch.equal(a.argmax(-1), b.argmax(-1))
    for la, lb in zip(caches[0].layers, caches[1].layers):
        assert torch.allclose(la.keys, lb.keys, atol=1e-4) and torch.allclose(la.values, lb.values, atol=1e-4)


def test_calls_that_are_not_a_tree_sessions_go_to_transformers_forward(native):
    """The fast forward runs only a tree session's call (native_forward.fits: one sequence, positions, a 4-D mask, a
    cache, the kept rows as a tensor, no other argument); any other call reaches transformers' forward with just the
    arguments it was given (a None logits_to_keep would add an axis), also inside `many`, next to a session's call."""
    from transformers import DynamicCache

    model = native("q4_k").model
    fast, slow = model.forward, model.forward.fallback
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    n = ids.shape[1]
    positions = torch.arange(n)[None]
    causal = torch.zeros(n, n).masked_fill_(~torch.ones(n, n, dtype=torch.bool).tril(),
                                            torch.finfo(torch.float32).min)[None, None]
    session = dict(input_ids=ids, position_ids=positions, attention_mask=causal, use_cache=True,
                   logits_to_keep=torch.arange(n))
    others = {
        "no cache": dict(input_ids=ids),
        "two sequences": dict(session, input_ids=ids.repeat(2, 1), position_ids=positions.repeat(2, 1),
                              attention_mask=causal.repeat(2, 1, 1, 1)),
        "a 2-D mask": dict(session, attention_mask=torch.ones(1, n, dtype=torch.long)),
        "an int of rows to keep": dict(session, logits_to_keep=2),
        "another argument": dict(session, output_hidden_states=True),
    }

    def cached(call: dict) -> dict:  # the call with a fresh cache, where it has one
        return call if "use_cache" not in call else dict(call, past_key_values=DynamicCache(config=model.config))

    for name, call in others.items():
        got, want = fast(**cached(call)), slow(**cached(call))
        assert got.logits.shape == want.logits.shape and torch.equal(got.logits, want.logits), name
    assert torch.equal(fast(**cached(others["another argument"])).hidden_states[-1],
                       slow(**cached(others["another argument"])).hidden_states[-1])
    together = fast.many([cached(session), cached(others["no cache"])])
    assert torch.equal(together[0].logits, fast(**cached(session)).logits)
    assert torch.equal(together[1].logits, slow(input_ids=ids).logits) and together[1].logits.shape == (1, n, VOCAB)


def _prefix_then_tree(context: list[int], tree):
    """(ids, positions, allowed (q, kv)) of a causal prefix forward and then of a tree forward over its nodes."""
    n = len(context) - 1
    yield context[:-1], list(range(n)), torch.ones(n, n, dtype=torch.bool).tril()
    nodes = list(range(len(tree)))
    allowed = torch.zeros(len(nodes), n + len(nodes), dtype=torch.bool)
    allowed[:, :n] = True
    for node in nodes:
        for anc in tree.path(node):
            allowed[node, n + anc] = True
    yield [tree.tokens[i] for i in nodes], [n + tree.depths[i] for i in nodes], allowed


def test_merged_products_share_the_blocks_of_their_modules(native):
    """q/k/v (one block type) and gate/up run as one kernel call each over one matrix, whose rows are the modules'
    own blocks (views): the weights are not held twice."""
    model = native("q4_k").model
    layer = model.model.layers[0]
    merged = model.forward.layers[0]
    assert len(merged.qkv) == 1 and len(merged.gate_up) == 1  # one kernel call each
    qkv, gate_up = merged.qkv[0].matrix, merged.gate_up[0].matrix
    for module, merged_matrix in ((layer.self_attn.q_proj, qkv), (layer.self_attn.v_proj, qkv),
                                  (layer.mlp.up_proj, gate_up)):
        assert module.matrix.data.untyped_storage().data_ptr() == merged_matrix.data.untyped_storage().data_ptr()
        assert module.blocks.data_ptr() == module.matrix.data.data_ptr()
    x = torch.randn(3, model.config.hidden_size)
    q, k, v = qkv(x).split([layer.self_attn.q_proj.out_features, layer.self_attn.k_proj.out_features,
                                  layer.self_attn.v_proj.out_features], dim=-1)
    assert torch.equal(q, layer.self_attn.q_proj.matrix(x)) and torch.equal(v, layer.self_attn.v_proj.matrix(x))


def test_merged_products_keep_every_modules_bias():
    """Merging q/k/v or gate/up into one call keeps each module's bias in its own columns, also where only some of
    the merged modules have one (a llama file with mlp or attention biases); types that differ stay separate calls."""
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    from arborspec.backends.native_forward import merge, run
    from arborspec.kernels import QuantMatrix
    from tests.kernels.blocks import random_blocks

    rng = np.random.default_rng(0)

    def linear(qtype, n, bias):
        matrix = QuantMatrix(random_blocks(qtype, n, 256, rng), qtype, n, 256)
        return QuantLinear(matrix, torch.randn(n) if bias else None)

    x = torch.randn(3, 256)
    for kinds in ([(QT.Q4_K, True), (QT.Q4_K, False), (QT.Q4_K, True)], [(QT.Q4_K, False), (QT.Q6_K, True)]):
        linears = [linear(qtype, 16, bias) for qtype, bias in kinds]
        want = torch.cat([lin(x) for lin in linears], dim=-1)
        products = merge(linears)
        assert len(products) == len({qtype for qtype, _ in kinds})
        assert torch.equal(run(products, x), want)
    # one type in two layouts (16 rows packed for the build's code, 12 rows not: not a whole group) stays two calls
    linears = [linear(QT.Q4_K, 16, True), linear(QT.Q4_K, 12, False)]
    assert linears[0].matrix.layout != linears[1].matrix.layout  # the case is reached (a build with AVX2 or more)
    products = merge(linears)
    assert len(products) == 2 and torch.equal(run(products, x), torch.cat([lin(x) for lin in linears], dim=-1))


def test_a_config_transformers_refuses_is_a_one_line_error(tmp_path, monkeypatch):
    """transformers' own checks of a config (a padding id past the vocabulary: "Padding_idx must be within
    num_embeddings") raised an AssertionError traceback out of load_native; the header check now refuses that one
    first, and any other such refusal is a ValueError naming the file."""
    from arborspec.backends import native

    def refuses(*args, **kwargs):
        raise AssertionError("Padding_idx must be within num_embeddings")
    monkeypatch.setattr(native.AutoModelForCausalLM, "from_config", refuses)
    path = write_tiny_gguf(tmp_path / "m.gguf", dtype="mixed")
    with pytest.raises(ValueError, match="m.gguf: transformers cannot build the model its header describes "
                                         r"\(Padding_idx must be within num_embeddings\)"):
        load_native(path)


def test_a_file_that_leaves_a_module_empty_or_says_no_rope_scaling(tmp_path):
    """A missing norm weight is refused when loading (it would stay on the meta device until the first forward);
    a rope scaling type of "none" is no scaling and loads."""
    holed = write_tiny_gguf(tmp_path / "holed.gguf", dtype="q4_k", skip=("blk.1.ffn_norm.weight",), **K_QUANT)
    with pytest.raises(NotNative, match="the file leaves model.layers.1.post_attention_layernorm.weight"):
        load_native(holed)
    plain = {"qwen2.rope.scaling.type": ("none", GGUFValueType.STRING)}
    assert is_native(load_native(write_tiny_gguf(tmp_path / "none.gguf", dtype="q4_k", extra=plain, **K_QUANT)))


def test_a_pruned_head_takes_ids_of_the_vocabulary_once(native):
    from arborspec.backends.native import with_pruned_head
    model = native("q4_k").model
    with pytest.raises(ValueError, match=f"keeps token ids in \\[0, {VOCAB}\\)"):
        with_pruned_head(model, [0, VOCAB])  # VOCAB itself is one past the last id
    with pytest.raises(ValueError, match="pruned already"):
        with_pruned_head(with_pruned_head(model, [1, 2]), [1])
