"""STree: the packed tree scan over Mamba2 models and Mamba2/attention hybrids is exact.

Every node's output equals the plain recurrence (and transformers' own model) run along that node's path; activation
replay leaves exactly the states transformers' cache holds after the committed sequence; greedy speculative decoding
with SSM targets and drafts is token-identical to plain decoding. Tiny random fp32 models; no real weights.
"""
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache

from arborspec import SpeculativeDecoder
from arborspec.backends import check_session_support, make_session
from arborspec.backends.hf import TreeSession
from arborspec.backends.ssm import RowActs, SSMTreeSession, TreeInfo, tree_mixer_forward
from arborspec.backends.ssm_scan import (
    conv_taps,
    discretize,
    new_conv_tail,
    replay_state,
    sequential_ssm,
    tree_conv,
    tree_ssd,
)
from arborspec.core.tree import TokenTree
from tests.backends.test_hf import random_tree, reference_logits
from tests.backends.tiny_ssm import ssm_model
from tests.conftest import noisy_copy, tiny_model

KINDS = ["mamba2", "bamba", "nemotron_h"]
SHAPES = [dict(heads=4, head_dim=8, state=8, groups=1), dict(heads=4, head_dim=8, state=8, groups=2),
          dict(heads=2, head_dim=16, state=4, groups=2), dict(heads=8, head_dim=4, state=16, groups=4)]


# ---- the pure math -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{heads}P{head_dim}N{state}G{groups}".format(**s))
def test_tree_scan_equals_the_recurrence_along_every_path(shape):
    H, P, N, G = shape["heads"], shape["head_dim"], shape["state"], shape["groups"]
    rng = random.Random(H * 100 + G)
    torch.manual_seed(H + P + N + G)
    for _ in range(4):
        tree = random_tree(rng, 0, rng.randrange(1, 30))
        T = len(tree)
        x, B, C = torch.randn(T, H, P), torch.randn(T, G, N), torch.randn(T, G, N)
        dt, dA = discretize(torch.randn(T, H), torch.randn(H), torch.randn(H))
        D, state0 = torch.randn(H), torch.randn(H, P, N)
        mask = tree.ancestor_mask()
        cum = mask.float() @ dA  # A_tree = L @ log A
        y = tree_ssd(C[None], cum[None], B[None], x[None], dt[None], cum[None], mask[None], state0[None])[0]
        y = y + D[:, None] * x
        for node in range(T):
            path = torch.tensor(tree.path(node))
            ref, final = sequential_ssm(state0, x[path], dt[path], dA[path], B[path], C[path], D)
            torch.testing.assert_close(y[node], ref[-1], atol=1e-4, rtol=1e-4)
            replayed = replay_state(state0, x[path], dt[path], dA[path], B[path])
            torch.testing.assert_close(replayed, final, atol=1e-4, rtol=1e-4)


def test_conv_taps_follow_ancestors_then_the_committed_tail():
    # rows: 0 root (follows the committed tail), 1 and 2 children of 0, 3 child of 2, 4 child of 3
    parents = [-1, 0, 0, 2, 3]
    taps = conv_taps(parents, 4, list(range(5)))
    k1 = 3  # buffer = [tail0, tail1, tail2 | row0 .. row4]
    assert taps[0].tolist() == [0, 1, 2, k1 + 0]
    assert taps[1].tolist() == [1, 2, k1 + 0, k1 + 1]
    assert taps[2].tolist() == [1, 2, k1 + 0, k1 + 2]  # not row 1: the previous *packed* position is a sibling
    assert taps[3].tolist() == [2, k1 + 0, k1 + 2, k1 + 3]
    assert taps[4].tolist() == [k1 + 0, k1 + 2, k1 + 3, k1 + 4]


def test_tree_conv_equals_causal_conv_along_each_path():
    rng = random.Random(5)
    torch.manual_seed(5)
    C, K = 6, 4
    weight, bias = torch.randn(C, K), torch.randn(C)
    for _ in range(5):
        tree = random_tree(rng, 0, rng.randrange(1, 20))
        tail, rows = torch.randn(K - 1, C), torch.randn(len(tree), C)
        taps = conv_taps(tree.parents, K, list(range(len(tree))))
        out = tree_conv(torch.cat([tail, rows])[None], taps[None], weight, bias)[0]
        for node in range(len(tree)):
            seq = torch.cat([tail, rows[tree.path(node)]])  # committed tail, then the path
            ref = F.conv1d(seq.T[None], weight[:, None], bias, groups=C)[0, :, -1]
            torch.testing.assert_close(out[node], ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(new_conv_tail(tail, rows[:1]), torch.cat([tail[1:], rows[:1]]))


def test_replaying_no_rows_leaves_the_state():
    """SSMTreeSession.commit([]) after a forward (keep nothing of the step) replays a chain of no rows, which must
    leave the state as it was (cum[-1] of an empty cumsum would raise)."""
    state0 = torch.randn(4, 8, 8)
    empty = torch.empty(0, 4)
    assert replay_state(state0, torch.empty(0, 4, 8), empty, empty, torch.empty(0, 2, 8)) is state0


@pytest.mark.parametrize("groups,limited", [(1, False), (2, False), (2, True)])
def test_mixer_on_a_chain_equals_transformers_mixer(groups, limited):
    """tree_mixer_forward reuses the mixer's own projections, conv weights, discretisation, gating and norm; with
    `limited`, a time_step_limit that clamps a quarter of the steps from below and a quarter from above."""
    model = ssm_model("mamba2", groups=groups)
    mixer = model.backbone.layers[0].mixer
    torch.manual_seed(1)
    hidden = torch.randn(1, 11, 32)
    with torch.no_grad():
        if limited:  # dt_raw: the in_proj's last num_heads columns (transformers' Mamba2Mixer split)
            dt = F.softplus(mixer.in_proj(hidden)[..., -mixer.num_heads:] + mixer.dt_bias)
            low, high = dt.quantile(0.25).item(), dt.quantile(0.75).item()
            assert 0 < low < high
            mixer.time_step_limit = (low, high)
        ref = mixer(hidden)  # transformers' chunked torch path, zero initial state
        T, K = 11, mixer.conv_kernel_size
        info = TreeInfo(taps=conv_taps(list(range(-1, T - 1)), K, list(range(T)))[None],
                        mask=torch.ones(T, T, dtype=torch.bool).tril()[None])
        out, _ = tree_mixer_forward(mixer, hidden, info, torch.zeros(K - 1, mixer.conv_dim),
                                    torch.zeros(mixer.num_heads, mixer.head_dim, mixer.ssm_state_size),
                                    RowActs.empty(mixer, torch.float32))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


# ---- whole models ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["packed", "unrolled"])
@pytest.mark.parametrize("kind,shape", [("mamba2", SHAPES[0]), ("mamba2", SHAPES[3]), ("bamba", SHAPES[1]),
                                        ("nemotron_h", SHAPES[2])])
def test_tree_forward_equals_path_forwards(kind, shape, mode):
    model = ssm_model(kind, **shape)
    rng = random.Random(hash((kind, mode)) % 1000)
    for trial in range(3):
        context = [rng.randrange(2, 56) for _ in range(rng.randrange(1, 14))]
        tree = random_tree(rng, context[-1], rng.randrange(1, 24))
        session = make_session(model, "target", ssm_tree=mode)
        assert isinstance(session, SSMTreeSession)
        if trial == 1 and len(context) > 2:
            session.prefill(context[:2])  # some of the prompt in the state, the rest pending
        logits = session.forward(context, tree, list(range(len(tree))))
        for node in range(len(tree)):
            path = context[:-1] + [tree.tokens[i] for i in tree.path(node)]
            torch.testing.assert_close(logits[node], reference_logits(model, path), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_by_layer_forward_equals_one_pass(kind):
    """Drafting policies grow the tree over several calls; the later calls see earlier rows' activations."""
    model = ssm_model(kind)
    rng = random.Random(7)
    context = [rng.randrange(2, 56) for _ in range(5)]
    tree = random_tree(rng, context[-1], 20)
    for mode in ["packed", "unrolled"]:
        whole = SSMTreeSession(model, ssm_tree=mode).forward(context, tree, list(range(len(tree))))
        session, parts = SSMTreeSession(model, ssm_tree=mode), []
        for depth in range(tree.depth + 1):
            layer = [i for i in range(len(tree)) if tree.depths[i] == depth]
            parts.append((layer, session.forward(context, tree, layer)))
        for layer, logits in parts:
            torch.testing.assert_close(logits, whole[layer], atol=2e-5, rtol=1e-4)


def test_unrolled_baseline_carries_one_state_per_path():
    model = ssm_model("mamba2")
    rng = random.Random(9)
    context = [rng.randrange(2, 56) for _ in range(6)]
    tree = random_tree(rng, context[-1], 12)
    session = SSMTreeSession(model, ssm_tree="unrolled")
    session.prefill(context[:-1])
    session.forward(context, tree, list(range(len(tree))))
    leaves = [n for n in range(len(tree)) if not tree.children(n)]
    for i, states in session.path_states.items():
        assert states.shape[0] == len(leaves)
        for b, leaf in enumerate(leaves):
            ref = hf_states(model, context[:-1] + [tree.tokens[n] for n in tree.path(leaf)])
            torch.testing.assert_close(states[b], ref.layers[i].recurrent_states[0][0], atol=1e-5, rtol=1e-4)
    session.commit([0])
    assert session.path_states == {}
    lean = SSMTreeSession(model, ssm_tree="unrolled", path_states=False)  # the benchmark's third variant
    lean.prefill(context[:-1])
    logits = lean.forward(context, tree, list(range(len(tree))))
    assert lean.path_states == {}
    torch.testing.assert_close(logits[leaves[0]], reference_logits(
        model, context[:-1] + [tree.tokens[n] for n in tree.path(leaves[0])]), atol=2e-5, rtol=1e-4)


def hf_states(model, ids):
    """transformers' own cache after running `ids` in one forward (its chunked scan)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        key = "cache_params" if model.config.model_type == "mamba2" else "past_key_values"
        model(torch.tensor([ids]), use_cache=True, **{key: cache})
    return cache


@pytest.mark.parametrize("kind", KINDS)
def test_activation_replay_leaves_the_sequential_states(kind):
    model = ssm_model(kind)
    rng = random.Random(3)
    context = [rng.randrange(2, 56) for _ in range(6)]
    session = SSMTreeSession(model, max_ride=4, prefill_chunk=5)  # exercise chunked prefill and catch-up too
    session.prefill(context[:3])
    for step in range(5):
        tree = random_tree(rng, context[-1], 15)
        session.forward(context, tree, list(range(len(tree))))
        path = tree.path(rng.randrange(len(tree)))
        session.commit(path)
        context = context + [tree.tokens[i] for i in path[1:]] + [rng.randrange(2, 56)]
        if step == 2:  # a long pending catch-up (the draft fell behind): goes through the chunked prefill
            context += [rng.randrange(2, 56) for _ in range(9)]
        assert session.cached == context[:-1][: len(session.cached)]
        cache = hf_states(model, session.cached)
        for i in session.ssm_state:
            layer = cache.layers[i]
            torch.testing.assert_close(session.ssm_state[i], layer.recurrent_states[0][0], atol=1e-5, rtol=1e-4)
            K = session.conv_state[i].shape[0] + 1
            torch.testing.assert_close(session.conv_state[i], layer.conv_states[0][0, :, -(K - 1):].T,
                                       atol=1e-6, rtol=1e-5)
        for i, (k, v) in session.kv.items():
            torch.testing.assert_close(k, cache.layers[i].keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v, cache.layers[i].values, atol=1e-5, rtol=1e-4)
        nxt = session.forward(context, TokenTree.root(context[-1]), [0])[0]
        torch.testing.assert_close(nxt, reference_logits(model, context), atol=2e-5, rtol=1e-4)
        session.commit([0])
        context.append(rng.randrange(2, 56))


def test_bf16_tree_logits_stay_close():
    model = ssm_model("bamba").to(torch.bfloat16)
    rng = random.Random(11)
    context = [rng.randrange(2, 56) for _ in range(8)]
    tree = random_tree(rng, context[-1], 12)
    logits = SSMTreeSession(model).forward(context, tree, list(range(len(tree))))
    for node in range(len(tree)):
        path = context[:-1] + [tree.tokens[i] for i in tree.path(node)]
        ref = reference_logits(model, path)
        assert (logits[node] - ref).abs().max() < 0.25 * ref.abs().max()


# ---- the engine --------------------------------------------------------------------------------------------------
POLICY_CASES = [("chain", {"k": 4}), ("static", {"depth": 3, "branch": 2}), ("static", {"widths": "4,3,2"}),
                ("beam", {"steps": 3, "beams": 2}), ("dyspec", {"budget": 12}), ("dynatree", {"budget": 12}),
                ("sequoia", {"budget": 12}), ("wetap", {"budget": 12, "length": 4, "w_min": 2, "w_max": 4})]


def assert_matches_ar(target, draft, method, options, prompts=3, **kw):
    rng = random.Random(1)
    accepted = 0
    for _ in range(prompts):
        prompt = [rng.randrange(2, 56) for _ in range(rng.randrange(1, 10))]
        n = rng.randrange(8, 24)
        ref = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=n, ignore_eos=True)
        res = SpeculativeDecoder(target, draft, method=method, **kw, **options).generate(
            prompt, max_new_tokens=n, ignore_eos=True)
        assert res.token_ids == ref.token_ids
        accepted += sum(s.accepted for s in res.stats.steps)
    assert accepted > 0


@pytest.fixture(scope="module")
def mamba_pair():
    target = ssm_model("mamba2", seed=0)
    return target, noisy_copy(target, noise=0.3)


@pytest.fixture(scope="module")
def bamba_pair():
    target = ssm_model("bamba", seed=0)
    return target, noisy_copy(target, noise=0.3)


def test_ar_matches_plain_greedy(mamba_pair, bamba_pair):
    for target in (mamba_pair[0], bamba_pair[0]):
        prompt = [5, 9, 14, 3]
        res = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=12, ignore_eos=True)
        ids, ref = list(prompt), []
        for _ in range(12):
            ref.append(int(reference_logits(target, ids).argmax()))
            ids.append(ref[-1])
        assert res.token_ids == ref


@pytest.mark.parametrize("method,options", POLICY_CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(POLICY_CASES)])
def test_greedy_equivalence_mamba2_every_policy(mamba_pair, method, options):
    target, draft = mamba_pair
    kw = {"allow_lossy": True} if method == "wetap" else {}
    assert_matches_ar(target, draft, method, options, **kw)


@pytest.mark.parametrize("mode", ["packed", "unrolled"])
@pytest.mark.parametrize("method,options", [("chain", {"k": 4}), ("static", {"depth": 3, "branch": 2}),
                                            ("dyspec", {"budget": 10})])
def test_greedy_equivalence_hybrid(bamba_pair, method, options, mode):
    target, draft = bamba_pair
    assert_matches_ar(target, draft, method, options, ssm_tree=mode)


def test_greedy_equivalence_unrolled_mamba2(mamba_pair):
    target, draft = mamba_pair
    assert_matches_ar(target, draft, "static", {"depth": 3, "branch": 2}, ssm_tree="unrolled")


def test_ssm_draft_for_an_attention_target_and_back():
    attention = tiny_model("llama", seed=0)
    ssm = ssm_model("mamba2", seed=4)
    # an SSM drafting for a transformer (and the reverse): agreement is rare, the outputs must still match exactly
    for target, draft in [(attention, ssm), (ssm, attention), (attention, ssm_model("bamba", seed=5))]:
        rng = random.Random(2)
        for _ in range(2):
            prompt = [rng.randrange(2, 56) for _ in range(rng.randrange(1, 8))]
            ref = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=10, ignore_eos=True)
            res = SpeculativeDecoder(target, draft, method="static", depth=2, branch=3).generate(
                prompt, max_new_tokens=10, ignore_eos=True)
            assert res.token_ids == ref.token_ids


def test_a_perfect_ssm_draft_accepts_everything(mamba_pair):
    target, _ = mamba_pair
    res = SpeculativeDecoder(target, noisy_copy(target, 0.0), method="chain", k=4).generate(
        [7, 8, 9], max_new_tokens=21, ignore_eos=True)
    first, *drafted = res.stats.steps  # the first token comes from the prompt's forward
    assert (first.tree_size, first.committed) == (0, 1)
    assert [s.accepted for s in drafted[:-1]] == [4] * (len(drafted) - 1)


# ---- backend selection, loading ----------------------------------------------------------------------------------
def test_make_session_picks_the_backend():
    assert type(make_session(tiny_model("llama"), "target")) is TreeSession
    assert type(make_session(ssm_model("mamba2"), "draft", ssm_tree="unrolled")) is SSMTreeSession
    with pytest.raises(ValueError, match="ssm_tree"):
        make_session(ssm_model("mamba2"), "target", ssm_tree="sideways")
    with pytest.raises(ValueError, match="ssm_tree"):
        SpeculativeDecoder(ssm_model("mamba2"), method="ar", ssm_tree="sideways")


def test_unsupported_state_space_models_are_refused_with_a_hint():
    from transformers import MambaConfig

    mamba1 = AutoModelForCausalLM.from_config(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                          state_size=4))
    with pytest.raises(ValueError, match="mamba2, bamba, nemotron_h"):
        check_session_support(mamba1)
    with pytest.raises(ValueError, match="mamba2, bamba, nemotron_h"):
        SpeculativeDecoder(mamba1, method="ar")
    check_session_support(ssm_model("bamba"))


def test_a_saved_mamba2_loads_and_decodes(tmp_path, tokenizer):
    from arborspec.loading import load_model

    model = ssm_model("mamba2", seed=2)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="fp32", progress=False)
    assert type(loaded.model).__name__ == "Mamba2ForCausalLM"
    ids = tokenizer("def f(x):")["input_ids"]
    tree = random_tree(random.Random(0), ids[-1], 8)
    logits = make_session(loaded.model, "target").forward(ids, tree, list(range(len(tree))))
    for node in range(len(tree)):
        path = ids[:-1] + [tree.tokens[i] for i in tree.path(node)]
        torch.testing.assert_close(logits[node], reference_logits(model, path), atol=2e-5, rtol=1e-4)
    dec = SpeculativeDecoder(loaded, noisy_copy(loaded.model, 0.2), method="static", depth=2, branch=2)
    out = dec.generate("def f(x):", max_new_tokens=12, ignore_eos=True)
    assert out.token_ids == SpeculativeDecoder(loaded, method="ar").generate(
        "def f(x):", max_new_tokens=12, ignore_eos=True).token_ids


# ---- distribution equivalence (tests/verify/harness.py) ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind,method,options,verifier", [
    ("mamba2", "static", {"depth": 3, "branch": 2}, "mbr"),  # children drawn without replacement
    ("bamba", "static", {"widths": "3,2,2"}, "naive"),  # deterministic children, hybrid target
])
def test_sampling_with_an_ssm_target_keeps_the_target_distribution(kind, method, options, verifier):
    """The first 2 tokens over many seeded runs follow the exact target distribution (catches a 0.1 TV error with
    power 0.95), with an SSM (or hybrid) target and draft, trees reaching 3 tokens deep."""
    from tests.verify.harness import assert_same_distribution, exact_target_distribution, plan_samples, sample_outputs

    vocab, prompt, k, horizon = 8, [2, 5, 3, 7], 2, 4
    target = ssm_model(kind, seed=0, vocab=vocab, scale=1.0)
    draft = noisy_copy(target, noise=1.0)
    dec = SpeculativeDecoder(target, draft, method=method, verifier=verifier, temperature=1.0, **options)
    probs = exact_target_distribution(target, prompt, k, dec.sampling)
    counts = sample_outputs(dec, prompt, k, plan_samples(probs, tv=0.1), seed=7, max_new_tokens=horizon)
    rep = assert_same_distribution(counts, probs, tv=0.1)
    assert sum(counts) == rep.n
