"""The native backend's C++ step (kernels/forward.cpp, backends/native_step.py) on tiny random GGUFs of every covered
block type: its logits equal the Python forward's (backends/native_forward.py) up to float rounding, several sessions'
rows in one call equal each session alone bit for bit, the cache operations (commit, truncate, fork) leave the state
a fresh session reaches by prefilling the same tokens, and bad input is refused before the operator runs.

Why "up to float rounding" against the Python forward, and not bit for bit: the two compute norms, rotary and
attention in different float orders (~1e-7 relative), and the kernels round activations to 8 bits per block, so
where an activation lands within that rounding of a step boundary the row moves by one 8-bit step (~1e-2 of the
logit scale; tests/backends/test_native.py's module docstring has the measured figures). Within the C++ step, a row
is computed alone through one code path, so exactness holds bit for bit (test_native.py (d) and (e)).
"""
from __future__ import annotations

import random

import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.backends import make_session, native_step
from arborspec.backends.hf import TreeSession
from arborspec.backends.native_step import ContextOverflow, NativeSession
from arborspec.core.tree import TokenTree
from arborspec.drafting import POLICIES

from ..kernels.test_kernels import emulated
from .test_llamacpp import chain_logits, random_tree
from .test_native import EXACT, K_QUANT, STEP, row_errors
from .tiny_gguf import VOCAB, native_models

FILES = {
    "q4_k": {"dtype": "q4_k", **K_QUANT},
    "q6_k": {"dtype": "q6_k", **K_QUANT},
    "q5_0": {"dtype": "q5_0", **K_QUANT},
    "mixed": {"dtype": "mixed", **K_QUANT, "ffn": 288},
    "llama": {"dtype": "mixed", **K_QUANT, "ffn": 288, "arch": "llama"},
    "tied": {"dtype": "q4_k", **K_QUANT, "tied": True},
    "short": {"dtype": "q5_0", "context": 24},  # a 24-token context window
    "draft": {"dtype": "q4_k", **K_QUANT, "noise": 0.2},  # a noisy copy of q4_k
    # the attention tiles' other cases: 6 and 7 query heads per kv head (the 1.5B target's and the 0.5B draft's
    # groups), head sizes 24 (a last 8-float block) and 32
    "g6": {"dtype": "q8_0", "hidden": 288, "ffn": 128, "heads": 12, "kv_heads": 2},
    "g7": {"dtype": "q5_0", "hidden": 224, "ffn": 128, "heads": 7, "kv_heads": 1},
}

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/conftest.py


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return native_models(tmp_path_factory.mktemp("native-step"), FILES)


def forward_tree(session, context: list[int], tree: TokenTree, prefilled: int, layers: int = 1) -> torch.Tensor:
    """Prefill context[:prefilled], then forward the tree in `layers` calls (a drafting policy's level-by-level
    calls), the pending context riding in front of the first: every node's logits (len(tree), vocab)."""
    if prefilled:
        session.prefill(context[:prefilled])
    nodes = list(range(len(tree)))
    cut = sorted({0, len(nodes), *random.Random(len(tree)).sample(range(1, max(2, len(nodes))), layers - 1)})
    return torch.cat([session.forward(context, tree, nodes[a:b]) for a, b in zip(cut, cut[1:]) if b > a])


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q5_0", "mixed", "llama", "tied"])
def test_the_step_equals_the_python_forward(native, name):
    """Trees of 1..33 nodes with branching (in one call and over several), after prefixes of several lengths."""
    model = native(name).model
    rng = random.Random(11)
    assert isinstance(make_session(model), NativeSession)
    errors, same_top = [], []
    for size in (1, 2, 5, 17, 33):
        context = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 20))]
        tree = random_tree(rng, context[-1], size)
        prefilled = rng.randrange(0, len(context) - 1)
        a = forward_tree(make_session(model), context, tree, prefilled, layers=1 + size // 8)
        b = forward_tree(TreeSession(model), context, tree, prefilled)
        errors.append(row_errors(a, b))
        same_top.append(a.argmax(-1) == b.argmax(-1))
    errors, same_top = torch.cat(errors), torch.cat(same_top)
    assert errors.max() < STEP  # at most one activation step apart (see the module docstring)
    assert (errors < EXACT).float().mean() >= 0.8
    assert same_top.float().mean() >= 0.95


@pytest.mark.parametrize("name", ["g6", "g7", "mixed"])
def test_16_lanes_give_the_bits_of_the_8_lane_code(native, name, monkeypatch):
    """forward.cpp's AVX-512 attention, exp and SiLU against its AVX2 code, in one build: the native one where the
    CPU has AVX-512, else the emulated one (SIMDe), so hosts without AVX-512 still prove the 16-lane code."""
    model = native(name).model
    step = model.forward.step
    if step.cpp.lanes() != 16:
        emulated()  # or a skip where this host cannot build it
        step = native_step.Step(model.forward, ops="arborspec_kernels_emulated")
        monkeypatch.setattr(model.forward, "step", step)
    rng = random.Random(5)
    context = [rng.randrange(VOCAB) for _ in range(23)]
    tree = random_tree(rng, context[-1], 11)
    logits = {}
    try:
        for lanes in (16, 8):
            step.cpp.set_lanes(lanes)
            logits[lanes] = forward_tree(make_session(model), context, tree, prefilled=17, layers=2)
    finally:
        step.cpp.set_lanes(16)
    assert torch.equal(logits[16], logits[8]), (logits[16] - logits[8]).abs().max()
    assert (logits[16][1:] - logits[16][0]).abs().amax() > 1.0  # the rows really differ
    with pytest.raises(RuntimeError, match="8 or 16 lanes"):
        step.cpp.set_lanes(4)


@pytest.mark.parametrize("name", ["g6", "g7"])
def test_a_tree_row_has_the_bits_of_its_token_decoded_after_its_path(native, name):
    """Exactness for the head layouts the default files lack (test_native.py (d) has the rest): a node's logits
    equal those of its token decoded as a chain, bit for bit."""
    model = native(name).model
    rng = random.Random(8)
    context = [rng.randrange(VOCAB) for _ in range(19)]
    tree = random_tree(rng, context[-1], 14)
    logits = forward_tree(make_session(model), context, tree, prefilled=12, layers=3)
    chains = torch.stack([chain_logits(model, context, [tree.tokens[n] for n in tree.path(node)])
                          for node in range(len(tree))])
    assert torch.equal(logits, chains), row_errors(logits, chains).max()


def test_the_step_runs_the_8_row_layouts_an_avx2_cpu_gets(tmp_path, monkeypatch):
    """Every matrix in the layouts an AVX2-only build picks (q4_K x8, q6_K x8, the 32-blocks' x8; on a VNNI host the
    step otherwise runs x16): the step equals the Python forward, and a tree row has the bits of its chain."""
    from arborspec.kernels import QuantMatrix
    from arborspec.loading import load_model

    from .tiny_gguf import write_tiny_gguf
    chosen = QuantMatrix._layout
    monkeypatch.setattr(QuantMatrix, "_layout", lambda self, pack, isa: chosen(self, pack, "avx2"))
    path = write_tiny_gguf(tmp_path / "mixed.gguf", **FILES["mixed"])
    model = load_model(str(path), backend="native", progress=False).model
    fast = model.forward
    layouts = {lin.matrix.qtype.name: lin.matrix.layout for layer in fast.layers
               for lin in (*layer.qkv, layer.o, *layer.gate_up, layer.down)}
    assert set(layouts) >= {"Q4_K", "Q6_K", "Q5_0"} and all(1000 < v < 2000 for v in layouts.values()), layouts
    rng = random.Random(12)
    context = [rng.randrange(VOCAB) for _ in range(15)]
    tree = random_tree(rng, context[-1], 9)
    logits = forward_tree(make_session(model), context, tree, prefilled=10, layers=2)
    python = forward_tree(TreeSession(model), context, tree, prefilled=10)
    assert row_errors(logits, python).max() < STEP
    chains = torch.stack([chain_logits(model, context, [tree.tokens[n] for n in tree.path(node)])
                          for node in range(len(tree))])
    assert torch.equal(logits, chains), row_errors(logits, chains).max()


@pytest.mark.parametrize("name", ["g6", "g7", "mixed"])
def test_the_logits_do_not_depend_on_the_number_of_threads(native, name):
    """forward.cpp runs a forward in one parallel region, its steps split between the threads (the other tests run
    one thread): 2 and 3 threads give the bits of 1. g6 has 2 kv heads (2 threads: each attends with its own heads'
    keys, no barrier in between; 3: one), g7 one; mixed holds products of several matrices and block formats."""
    model = native(name).model
    rng = random.Random(9)
    context = [rng.randrange(VOCAB) for _ in range(21)]
    tree = random_tree(rng, context[-1], 9)
    before, logits = torch.get_num_threads(), {}
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            logits[threads] = forward_tree(make_session(model), context, tree, prefilled=5, layers=2)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(logits[2], logits[1]) and torch.equal(logits[3], logits[1])
    assert (logits[1][1:] - logits[1][0]).abs().amax() > 1.0  # the rows really differ


@pytest.mark.parametrize("method", [name for name in POLICIES if name != "ar"])
def test_every_policy_decodes_greedily_as_plain_decoding_does(native, method):
    """Token for token, with each policy's defaults, on the C++ step (target and draft)."""
    target, draft = native("q4_k"), native("draft")
    assert isinstance(make_session(target.model), NativeSession) and isinstance(make_session(draft.model), NativeSession)
    prompt = [5, 71, 33, 9, 120, 4]
    ar = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=32, ignore_eos=True)
    spec = SpeculativeDecoder(target, draft, method=method).generate(prompt, max_new_tokens=32, ignore_eos=True)
    assert spec.token_ids == ar.token_ids and len(set(ar.token_ids)) > 3
    if method not in ("auto", "suffix"):  # auto may decode plainly on models this small; suffix needs repeats
        assert spec.stats.n_steps < ar.stats.n_steps


def test_sessions_share_one_forward_and_get_the_bits_they_get_alone(native):
    """Three sequences' prefills, then their trees (9, 1 and 5 nodes), each time as ONE operator call: every
    session's logits and cache equal those of the same session run alone."""
    model = native("mixed").model
    rng = random.Random(3)
    plans = []
    for n_ctx, n_tree in ((12, 9), (3, 1), (7, 5)):
        context = [rng.randrange(VOCAB) for _ in range(n_ctx)]
        plans.append((context, random_tree(rng, context[-1], n_tree)))
    alone = [make_session(model) for _ in plans]
    together = [make_session(model) for _ in plans]
    want = [s.forward(c, t, list(range(len(t)))) for s, (c, t) in zip(alone, plans)]
    calls = []
    for session, (context, tree) in zip(together, plans):  # record each session's call instead of running it
        session._reserve(len(context) + len(tree))
        calls.append(_step_call(session, context, tree))
    got = model.forward.many([{"step": call} for call in calls])
    for w, g in zip(want, got):
        assert torch.equal(w, g), (w - g).abs().max()
    for a, b in zip(alone, together):
        used = len(a.cached) + a.region_len
        assert torch.equal(a.keys[:, :, :used], b.keys[:, :, :used])
    assert not torch.equal(got[0][0], got[2][0])  # the sequences really differ


def _step_call(session: NativeSession, context, tree):
    """The StepCall `session.forward` would make for the whole tree on an empty session (no state changed)."""
    recorded = []
    real = session.model.forward.step.run
    session.model.forward.step.run = lambda calls: recorded.extend(calls) or [torch.zeros(len(c.keep), VOCAB) for c in calls]
    try:
        session.forward(context, tree, list(range(len(tree))))
    finally:
        session.model.forward.step.run = real
    session.cached, session.slot, session.region_len, session.tree = [], {}, 0, None
    return recorded[0]


def test_commit_truncate_and_fork_leave_the_state_a_fresh_session_reaches(native):
    """After committing a path that is not the region's first slots (a gather), the next forward equals that of a
    fresh session that prefilled the same tokens; so after truncating, and on a fork, bit for bit."""
    model = native("q4_k").model
    rng = random.Random(7)
    context = [rng.randrange(VOCAB) for _ in range(9)]
    tree = random_tree(rng, context[-1], 12, max_children=2)
    leaf = max(range(len(tree)), key=lambda n: (tree.depths[n], n))  # a deep node, late in the region
    path = tree.path(leaf)
    assert path != list(range(len(path)))  # its slots are not the region's first: commit must gather

    session = make_session(model)
    forward_tree(session, context, tree, 4, layers=3)
    session.commit(path)
    committed = context[:-1] + [tree.tokens[n] for n in path]
    assert session.cached == committed

    def next_logits(s, tokens: list[int], token: int) -> torch.Tensor:
        return s.forward(tokens + [token], TokenTree.root(token), [0])

    def fresh(tokens: list[int]) -> NativeSession:
        s = make_session(model)
        s.prefill(tokens)
        return s

    twin = session.fork()
    token = rng.randrange(VOCAB)
    want = next_logits(fresh(committed), committed, token)
    assert torch.equal(next_logits(session, committed, token), want)
    assert torch.equal(next_logits(twin, committed, token), want)  # the fork kept the state, and is its own
    assert twin.keys.data_ptr() != session.keys.data_ptr()

    session.commit([0])
    session.truncate(6)
    assert session.cached == committed[:6]
    assert torch.equal(next_logits(session, committed[:6], token), next_logits(fresh(committed[:6]), committed[:6], token))


def test_the_cache_grows_as_needed_and_positions_stop_at_the_context_window(native, monkeypatch):
    monkeypatch.setattr(native_step, "FIRST_CAPACITY", 8)
    model = native("short").model  # context window of 24 tokens
    session = make_session(model)
    rng = random.Random(0)
    ids = [rng.randrange(VOCAB) for _ in range(24)]
    session.prefill(ids[:20])
    assert session.keys.shape[2] == 32  # 8, doubled twice
    wide = TokenTree.from_parents([ids[20]] + ids[:19], [-1] + [0] * 19)  # 20 more entries, at positions 20..21
    session.forward(ids[:21], wide, list(range(len(wide))))
    assert session.keys.shape[2] == 64 and session.region_len == 20
    session.commit([0])
    deep = TokenTree.from_parents([ids[21]] + ids[:3], [-1, 0, 1, 2])  # positions 21..24: one too many
    with pytest.raises(ContextOverflow, match="position 24 is past the model's context window of 24"):
        session.forward(ids[:22], deep, list(range(len(deep))))
    assert session.cached == ids[:21] and session.region_len == 0  # nothing ran


def test_an_open_region_refuses_prefill_truncate_and_fork(native):
    """Each of these acts on the committed prefix only: with tree nodes in the region, the prefix's new entries
    would land on the region's slots (prefill), or the copy or cut would carry half a step."""
    session = make_session(native("q4_k").model)
    session.prefill([3, 1, 4])
    session.forward([3, 1, 4, 1], TokenTree.root(1), [0])
    with pytest.raises(RuntimeError, match="prefill with a non-empty region"):
        session.prefill([5])
    with pytest.raises(ValueError, match="needs an empty region"):
        session.truncate(2)
    with pytest.raises(RuntimeError, match="fork with a non-empty region"):
        session.fork()
    assert session.cached == [3, 1, 4] and session.region_len == 1  # nothing changed


def test_truncate_takes_any_length_from_0_to_the_committed_prefix(native):
    """The whole prefix is a valid length: the prefix cache (engine/prefix_cache.py) cuts a kept session to the
    part a new prompt shares, which is all of it when the new prompt extends the old one."""
    session = make_session(native("q4_k").model)
    session.prefill([3, 1, 4, 1])
    session.truncate(4)
    assert session.cached == [3, 1, 4, 1]
    for bad in (5, -1):
        with pytest.raises(ValueError, match=r"0 <= length <= 4"):
            session.truncate(bad)
    session.truncate(0)
    assert session.cached == []


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_a_token_id_just_outside_the_vocabulary_is_refused_before_the_operator(native, bad):
    session = make_session(native("q4_k").model)
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {VOCAB}\)"):
        session.prefill([1, bad])
    assert session.cached == [] and session.forwards == 0


def test_the_cache_grows_only_when_full(native, monkeypatch):
    monkeypatch.setattr(native_step, "FIRST_CAPACITY", 8)
    session = make_session(native("q4_k").model)
    session.prefill([1, 2, 3, 4, 5])
    session.prefill([6, 7, 8])  # exactly the 8 entries the cache has
    assert session.keys.shape[2] == session.values.shape[2] == 8
    session.prefill(list(range(8)))  # 16 entries: doubled once, to exactly what they need
    assert session.keys.shape[2] == session.values.shape[2] == 16
    session.prefill([9])
    assert session.keys.shape[2] == session.values.shape[2] == 32


def test_the_rotary_table_grows_when_a_position_reaches_its_end(native, monkeypatch):
    """Step.cos_sin's table of rotary rows: a position equal to its length (here 8 rows, and the empty table of a
    model's first forward at position 0) is a row it lacks; the table is then rebuilt up to the context window
    (256 positions in the tiny files), each row the rotary module's own."""
    step = native("q4_k").model.forward.step
    want_cos, want_sin = (t[0] for t in step.rotary(torch.empty(1, dtype=torch.float32), torch.arange(256)[None]))
    for rows, position in ((8, 8), (0, 0)):
        monkeypatch.setattr(step, "angles", (want_cos[:rows], want_sin[:rows]))
        cos, sin = step.cos_sin(torch.tensor([position, 1]), position)
        assert torch.equal(cos, want_cos[[position, 1]]) and torch.equal(sin, want_sin[[position, 1]])
        assert len(step.angles[0]) == 256


def test_bad_input_is_refused_before_the_operator_and_by_it(native):
    model = native("q4_k").model
    session = make_session(model)
    with pytest.raises(ValueError, match="token ids must lie in"):
        session.prefill([1, VOCAB + 3])
    assert session.cached == []
    step = model.forward.step
    session._reserve(4)
    ids = torch.tensor([1, 2], dtype=torch.long)
    cos = torch.zeros(2, step.head_dim)
    long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    cases = {  # the operator itself: an error, never a crash
        "writes past its cache": dict(at=long([0, 9999])),
        "sees no key": dict(prefix=long([0, 0])),
        "outside the vocabulary": dict(ids=long([1, 10**6])),
        "must be ascending": dict(extra=long([3, 2]), offsets=long([0, 0, 2]), prefix=long([1, 1])),
        # a row's offsets past the extra table (a later row's set right): read past its end before
        "bad visible range": dict(extra=long([2, 3]), offsets=long([0, 600, 2]), prefix=long([1, 1])),
        "kept row out of range": dict(keep=long([2])),
    }
    before = session.keys.clone()
    for message, change in cases.items():
        args = dict(ids=ids, cos=cos, sin=cos, keys=[session.keys], values=[session.values], seq=long([0, 0]),
                    at=long([0, 1]), prefix=long([1, 2]), offsets=long([0, 0, 0]), extra=long([]), keep=long([1]))
        args.update(change)
        with pytest.raises(RuntimeError, match=message):
            step.cpp.forward(*args.values())
    assert torch.equal(session.keys.view(torch.int32), before.view(torch.int32))  # refused before any write (bits:
    # the cache's unwritten slots may hold NaN)


# ------------------------------------------------------------------------------------------ a pruned draft head


@pytest.mark.parametrize("kept", [260, 37])
def test_a_pruned_head_gives_the_whole_heads_logits_on_its_ids_and_runs_packed(native, kept):
    """A pruned head's matrix is padded to whole 16-row groups (so it runs a packed layout like the real draft's
    whole head, not the file layout's slower code), and the padding never shows: the kept ids get the whole head's
    logits, every other id the lowest finite logit."""
    from arborspec.backends.native import with_pruned_head

    draft = native("draft").model
    keep = sorted(random.Random(kept).sample(range(VOCAB), kept))
    pruned = with_pruned_head(draft, keep)
    assert draft.lm_head.matrix.qtype.name == "Q4_K"  # packed by every vector build (x8 AVX2, x16 VNNI) ...
    assert pruned.lm_head.matrix.n % 16 == 0 and pruned.lm_head.matrix.packed  # ... once its rows fill the groups
    prompt = list(range(3, 11))
    tree = TokenTree.root(prompt[-1])  # three rows: the step spreads each row's logits over the vocabulary
    tree.add(0, 40)
    tree.add(0, 41)
    full = make_session(draft).forward(prompt, tree, [0, 1, 2])
    cut = make_session(pruned).forward(prompt, tree, [0, 1, 2])
    assert cut.shape == full.shape == (3, VOCAB)
    # the same products in another layout's kernel (the tiny whole head, 261 rows, is not packed): equal up to the
    # order of the float sums
    assert torch.allclose(cut[:, keep], full[:, keep], rtol=1e-5, atol=1e-4), (cut[:, keep] - full[:, keep]).abs().max()
    others = [i for i in range(VOCAB) if i not in set(keep)]
    assert (cut[:, others] == torch.finfo(cut.dtype).min).all()


@pytest.mark.parametrize("pruned", [False, True], ids=["whole head", "pruned head"])
def test_a_nan_in_the_head_is_refused_as_non_finite_logits(native, pruned):
    """The step checks the logits itself (the session no longer does): a NaN scale in the head's first row gives
    token 0 a NaN logit, which must surface as FloatingPointError naming the session's role, never as an argmax."""
    from arborspec.backends.native import with_pruned_head

    draft = native("draft").model
    model = with_pruned_head(draft, list(range(0, VOCAB, 3))) if pruned else draft
    blocks = model.lm_head.matrix.data  # row 0's first block starts with its scale d (fp16), packed or not
    saved = blocks[0, :2].clone()
    prompt = list(range(3, 11))
    try:
        blocks[0, :2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # fp16 NaN
        with pytest.raises(FloatingPointError, match="the draft model produced non-finite logits"):
            make_session(model, "draft").forward(prompt, TokenTree.root(prompt[-1]), [0])
    finally:
        blocks[0, :2] = saved
    assert torch.isfinite(make_session(model, "draft").forward(prompt, TokenTree.root(prompt[-1]), [0])).all()


@pytest.mark.parametrize("where", ["attn_k scale", "ffn_norm"])
def test_a_nan_inside_the_layers_is_refused_as_non_finite_logits(native, where):
    """A NaN key (a NaN scale in attn_k's first row) or a NaN norm weight must reach the logits: the kernels' exp
    clamped a NaN attention score to exp(-87.3) and their activation quantizer dropped a NaN, so both gave finite
    garbage logits where transformers and llama.cpp give NaN."""
    layer = native("draft").model.model.layers[0]
    data = layer.self_attn.k_proj.matrix.data if where == "attn_k scale" else layer.post_attention_layernorm.weight
    saved = data.flatten()[:2].clone()
    prompt = list(range(3, 11))
    try:
        if where == "attn_k scale":
            data[0, :2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # fp16 NaN: row 0's first block scale
        else:
            data.data[0] = float("nan")
        with pytest.raises(FloatingPointError, match="the draft model produced non-finite logits"):
            make_session(native("draft").model, "draft").forward(prompt, TokenTree.root(prompt[-1]), [0])
    finally:
        data.data.view(-1)[:2] = saved
    assert torch.isfinite(make_session(native("draft").model, "draft").forward(prompt, TokenTree.root(prompt[-1]),
                                                                                [0])).all()


@pytest.mark.parametrize("ids, message", [([5, 3], "ascending"), ([4, 4], "ascending"), ([0, VOCAB], "inside"),
                                         ([-1, 2], "inside"), ([], "int64")])
def test_the_step_refuses_head_ids_out_of_order_or_outside_the_vocabulary(native, ids, message):
    step = native_step.Step(native("draft").model.forward)
    with pytest.raises(RuntimeError, match=message):
        step.cpp.set_head_ids(torch.tensor(ids, dtype=torch.long), VOCAB)


def test_a_draft_with_a_pruned_head_keeps_greedy_and_sampled_output_exact(native):
    """A native draft whose head leaves out the target's most likely first token (so the draft can never propose
    it): greedy output is plain greedy decoding's, and at T = 1, top-k 3, the first two tokens of dyspec trees
    verified by mbr follow the target's exact distribution (chi-square, power to catch a total variation of 0.1 with
    probability 0.95)."""
    from dataclasses import replace

    from arborspec.backends.native import PrunedQuantHead, with_pruned_head
    from arborspec.core.sampling import SamplingConfig
    from tests.verify.harness import assert_same_distribution, plan_samples, sample_outputs

    from .test_llamacpp import exact_first_two

    target, draft = native("q4_k"), native("draft")
    prompt = target.tokenizer("x = ")["input_ids"]
    sampling = SamplingConfig(1.0, 3, 1.0)
    probs = exact_first_two(target.model, prompt, sampling)  # (vocab * vocab,) over the first two tokens
    first = probs.reshape(VOCAB, VOCAB).sum(1)
    left_out = int(first.argmax())
    assert first[left_out] > 0.2  # the target often starts with the token the draft can never propose
    pruned = replace(draft, model=with_pruned_head(draft.model, [i for i in range(VOCAB) if i != left_out]))
    assert isinstance(pruned.model.lm_head, PrunedQuantHead) and not isinstance(draft.model.lm_head, PrunedQuantHead)
    session = make_session(pruned.model)
    q = session.forward(prompt, TokenTree.root(prompt[-1]), [0]).softmax(-1)[0]
    assert q[left_out] == 0 and q.sum().item() == pytest.approx(1.0)

    ar = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=24, ignore_eos=True)
    spec = SpeculativeDecoder(target, pruned, method="dyspec", budget=8).generate(prompt, max_new_tokens=24,
                                                                                 ignore_eos=True)
    assert spec.token_ids == ar.token_ids

    dec = SpeculativeDecoder(target, pruned, method="dyspec", budget=4, temperature=1.0, top_k=3, verifier="mbr")
    counts = sample_outputs(dec, prompt, 2, plan_samples(probs, tv=0.1), seed=3, max_new_tokens=2)
    assert_same_distribution(counts, probs, tv=0.1)


def test_the_vocab_lever_prunes_a_native_draft_from_corpus_frequencies(native, monkeypatch):
    """`+vocabK` on a native draft: the K most frequent tokens of the corpus (faked here: ShareGPT is a download)
    plus EOS; the draft as loaded stays as it was (the bench runs both)."""
    from arborspec.loading import pair
    from arborspec.tuning import draft_levers

    counts = torch.arange(VOCAB, 0, -1)  # token id i is the i-th most frequent
    monkeypatch.setattr(draft_levers, "corpus_counts", lambda tokenizer, size, progress=True: counts[:size])
    target, draft = native("q4_k"), native("draft")
    prepared, quant, vocab = pair.prepare_draft(target, draft, "auto", vocab=40, progress=False)
    keep = prepared.model.lm_head.keep.tolist()
    assert (quant, vocab) == ("none", 40) and keep == sorted(set(range(40)) | {draft.tokenizer.eos_token_id})
    assert prepared.model is not draft.model and draft.model.lm_head.out_features == VOCAB
    assert prepared.model.fingerprint() != draft.model.fingerprint()  # its own cost profile
