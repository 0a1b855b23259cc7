"""The llama.cpp backend (backends/llamacpp.py) on tiny random Qwen2 GGUFs written by tests/backends/tiny_gguf.py.

What is proved, and against what:
 (a) a tree forwarded in one batch == each root-to-node path forwarded as a plain chain on a fresh session;
 (b) forwarding layer by layer, in odd orders, or split into several llama_decode calls == one batch;
 (c) commit keeps exactly the accepted path: continuing == a fresh session prefilled with the committed tokens, and
     no KV cell or sequence survives a step (the cache's state size equals the fresh session's);
 (d) the same GGUF in transformers through hf.TreeSession gives close logits;
 (e) greedy speculative decoding on llama.cpp target + draft == plain `ar` decoding on llama.cpp, token for token;
 (f) bad files and options give one-line ValueErrors.
llama.cpp computes a token's logits with kernels that depend on the batch size, so "==" is within a tolerance,
never bitwise. Most tests use an f32 KV cache, where logits of magnitude ~10 agree to ~5e-6 (ATOL); with the default
f16 cache tree and chain agree to ~2e-3, with flash attention to ~4e-6: checked once each.
"""
from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import pytest
import torch

from arborspec.backends import make_session
from arborspec.backends.hf import TreeSession
from arborspec.backends.llamacpp import LlamaCppSession, load_llamacpp, load_llamacpp_pair, read_gguf_info
from arborspec.backends.session import Session
from arborspec.core.tree import TokenTree, dfs_order

from .tiny_gguf import EOS, VOCAB, write_tiny_gguf

ATOL = 3e-5  # F32 weights, f32 KV cache: same cells, kernels chosen by batch size (measured worst: 4.3e-6)
LOOSER = {"default": 5e-3, "flash": 1e-4}  # f16 KV cache, flash off (measured 2.0e-3) / on (measured 3.8e-6)

try:
    import llama_cpp  # noqa: F401

    HAVE_LLAMA = True
except ImportError:
    HAVE_LLAMA = False
needs_llama = pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(d / "target.gguf")
    write_tiny_gguf(d / "draft.gguf", noise=0.3)
    write_tiny_gguf(d / "q8.gguf", dtype="q8_0")
    return d


@pytest.fixture(scope="module")
def target(gguf_dir):
    model = load_llamacpp(gguf_dir / "target.gguf", n_threads=1, kv_type="f32")
    yield model
    model.close()


def random_tree(rng: random.Random, root: int, n: int, max_children: int = 3) -> TokenTree:
    """A random tree of `n` nodes stored parents-first, with random tokens."""
    tree = TokenTree.root(root)
    while len(tree) < n:
        parent = rng.randrange(len(tree))
        if len(tree.children(parent)) < max_children:
            tree.add(parent, rng.randrange(VOCAB))
    return tree


def chain_logits(model, context: list[int], tokens: list[int], new_session=make_session) -> torch.Tensor:
    """Logits after `tokens` (tokens[0] == context[-1]) forwarded as a plain sequence on a fresh session (of any
    backend: test_native reuses it; `new_session(model)` makes it)."""
    session = new_session(model)
    session.prefill(context[:-1])
    chain = TokenTree.from_parents(tokens, [-1] + list(range(len(tokens) - 1)))
    return session.forward(context, chain, list(range(len(chain))))[-1]


def assert_paths_match_chains(model, context: list[int], tree: TokenTree, logits: torch.Tensor, atol: float) -> None:
    """Every node's row of a tree forward equals the last logits of its root-to-node path run as a plain chain."""
    for node in range(len(tree)):
        ref = chain_logits(model, context, [tree.tokens[n] for n in tree.path(node)])
        torch.testing.assert_close(logits[node], ref, atol=atol, rtol=0)


def cells_state_size(session: LlamaCppSession) -> int:
    """Bytes llama.cpp would save for every non-empty KV cell: equal sizes <=> equal cell contents' shapes."""
    return session.lib.llama_state_seq_get_size(session.ctx, -1)


# ------------------------------------------------------------------------------------- (a) tree == path chains


@needs_llama
@pytest.mark.parametrize("order", ["bfs", "dfs"])
@pytest.mark.parametrize("prefilled", [9, 5])  # 5: four committed tokens ride along as pending in the tree batch
def test_tree_forward_equals_each_path_as_a_chain(target, order, prefilled):
    rng = random.Random(1)
    context = [rng.randrange(VOCAB) for _ in range(10)]
    tree = random_tree(rng, context[-1], 24)
    if order == "dfs":
        tree = tree.permute(dfs_order(tree))
    session = target.new_session()
    session.prefill(context[:prefilled])
    logits = session.forward(context, tree, list(range(len(tree))))
    assert logits.shape == (len(tree), VOCAB) and logits.dtype == torch.float32
    assert session.cached == context[:-1]
    assert_paths_match_chains(target, context, tree, logits, ATOL)
    # the tree is not trivially flat: siblings with different parents' paths get different logits
    assert (logits[1:] - logits[0]).abs().amax() > 1.0


@needs_llama
@pytest.mark.parametrize("setting", ["default", "flash"])
def test_tree_forward_equals_path_chains_under_default_and_flash_settings(gguf_dir, setting):
    model = load_llamacpp(gguf_dir / "target.gguf", n_threads=1, flash_attn=setting == "flash")
    rng = random.Random(10)
    context = [rng.randrange(VOCAB) for _ in range(12)]
    tree = random_tree(rng, context[-1], 16)
    session = model.new_session()
    session.prefill(context[:-1])
    assert_paths_match_chains(model, context, tree, session.forward(context, tree, list(range(len(tree)))),
                              LOOSER[setting])


@needs_llama
def test_quantized_tree_forward_equals_path_chains(gguf_dir):
    model = load_llamacpp(gguf_dir / "q8.gguf", n_threads=1, kv_type="f32")
    assert model.dtype == "gguf-q8_0"
    rng = random.Random(2)
    context = [rng.randrange(VOCAB) for _ in range(8)]
    tree = random_tree(rng, context[-1], 16)
    session = model.new_session()
    session.prefill(context[:-1])
    logits = session.forward(context, tree, list(range(len(tree))))
    assert_paths_match_chains(model, context, tree, logits, ATOL)  # Q8_0 dots are integer: measured 0.0


# ---------------------------------------------------------------------------- (b) layers / odd orders / chunks


def parents_first_shuffle(tree: TokenTree, rng: random.Random) -> list[int]:
    """A random order of all nodes in which every parent precedes its children (later siblings often first)."""
    ready, order = [0], []
    while ready:
        node = ready.pop(rng.randrange(len(ready)))
        order.append(node)
        ready += tree.children(node)
    return order


@needs_llama
@pytest.mark.parametrize("how", ["layers", "shuffled", "singles"])
def test_forwarding_in_pieces_equals_one_batch(target, how):
    rng = random.Random(3)
    context = [rng.randrange(VOCAB) for _ in range(12)]
    tree = random_tree(rng, context[-1], 20)
    whole = target.new_session()
    whole.prefill(context[:6])  # pending tokens ride in front of the first piece too
    ref = whole.forward(context, tree, list(range(len(tree))))
    if how == "layers":  # a drafting policy: one call per depth
        pieces = [[n for n in range(len(tree)) if tree.depths[n] == d] for d in range(tree.depth + 1)]
    else:
        order = parents_first_shuffle(tree, rng)
        if how == "singles":
            pieces = [[n] for n in order]
        else:
            cuts = sorted(rng.sample(range(1, len(order)), 4))
            pieces = [order[a:b] for a, b in zip([0] + cuts, cuts + [len(order)])]
    session = target.new_session()
    session.prefill(context[:6])
    for piece in pieces:
        # a piece may list a node before its parent within the piece only if parents-first: sort by storage index
        piece = sorted(piece)
        logits = session.forward(context, tree, piece)
        torch.testing.assert_close(logits, ref[piece], atol=ATOL, rtol=0)
        assert all(session.has(n) for n in piece)
    assert session.forwards == len(pieces) + 1  # + the prefill


@needs_llama
def test_forward_longer_than_n_batch_is_split(gguf_dir, target):
    small = load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_batch=7, kv_type="f32")
    rng = random.Random(4)
    context = [rng.randrange(VOCAB) for _ in range(30)]
    tree = random_tree(rng, context[-1], 25)
    ref_session = target.new_session()
    ref_session.prefill(context[:-1])
    ref = ref_session.forward(context, tree, list(range(len(tree))))
    session = small.new_session()
    session.prefill(context[:3])  # 26 pending tokens + 25 nodes: 8 decodes of <= 7 tokens
    logits = session.forward(context, tree, list(range(len(tree))))
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert session.forwards == 1 + 8


# ------------------------------------------------------------------------------------------------- (c) commit


def assert_clean(session: LlamaCppSession, reference: LlamaCppSession) -> None:
    """Only the committed tokens are in the cache: sequence 0 holds positions 0..n-1, no other sequence has a cell,
    and the cache would save exactly as much as a fresh session prefilled with the same tokens."""
    lib, mem, n = session.lib, session.mem, len(session.cached)
    assert session.cached == reference.cached
    assert lib.llama_memory_seq_pos_min(mem, 0) == 0 and lib.llama_memory_seq_pos_max(mem, 0) == n - 1
    assert all(lib.llama_memory_seq_pos_max(mem, s) == -1 for s in range(1, session.model.n_seq_max))
    assert cells_state_size(session) == cells_state_size(reference)


@needs_llama
def test_commit_keeps_exactly_the_accepted_path(target):
    rng = random.Random(5)
    context = [rng.randrange(VOCAB) for _ in range(6)]
    session = target.new_session()
    session.prefill(context[:-1])
    for step in range(8):
        tree = random_tree(rng, context[-1], rng.randrange(1, 30))
        pieces = [list(range(len(tree)))] if step % 2 else \
            [[n for n in range(len(tree)) if tree.depths[n] == d] for d in range(tree.depth + 1)]
        for piece in pieces:
            session.forward(context, tree, piece)
        accepted = tree.path(rng.randrange(len(tree)))
        session.commit(accepted)
        context += [tree.tokens[n] for n in accepted[1:]] + [rng.randrange(VOCAB)]  # + a bonus token
        reference = target.new_session()
        reference.prefill(session.cached)
        assert_clean(session, reference)
        probe = random_tree(rng, context[-1], 6)  # continuing == the fresh session (pending bonus rides along)
        torch.testing.assert_close(session.forward(context, probe, list(range(6))),
                                   reference.forward(context, probe, list(range(6))), atol=ATOL, rtol=0)
        session.commit([0])
        reference.commit([0])
        context.append(rng.randrange(VOCAB))
        assert_clean(session, reference)


@needs_llama
def test_commit_of_nothing_and_of_the_root_only(target):
    context = [3, 1, 4, 1, 5]
    session = target.new_session()
    session.prefill(context[:-1])
    session.commit([])  # a draft that forwarded nothing this step
    assert session.cached == context[:-1]
    tree = random_tree(random.Random(6), context[-1], 10)
    session.forward(context, tree, list(range(10)))
    session.commit([0])
    reference = target.new_session()
    reference.prefill(context)
    assert_clean(session, reference)


@needs_llama
def test_steps_do_not_leak_cells_up_to_a_full_window(gguf_dir):
    """The context gets 96 + 1024 cells (a whole tree's room), rounded up to 256 by llama.cpp. Steps of 16-node trees
    forward more nodes in all than that, and the committed tokens still grow to fill it: no cell of a dropped branch
    survives a step (a leak of one cell per step would overflow the cache: llama_decode returns 1, a RuntimeError)."""
    model = load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_ctx=96, n_batch=16)
    rng = random.Random(7)
    context = [rng.randrange(VOCAB)]
    session = model.new_session()
    cells = session.lib.llama_n_ctx(session.ctx)  # what llama.cpp allocated (n_ctx + region, rounded up to 256)
    steps = 0
    while len(context) < cells - 20:
        tree = random_tree(rng, context[-1], 16)
        session.forward(context, tree, list(range(16)))
        path = tree.path(rng.choice([n for n in range(16) if tree.depths[n] <= 1]))
        session.commit(path)
        context += [tree.tokens[n] for n in path[1:]] + [rng.randrange(VOCAB)]
        steps += 1
    assert steps * 16 > cells  # without the cleanup the cells would have run out long ago
    assert session.lib.llama_memory_seq_pos_max(session.mem, 0) == len(context) - 2


@needs_llama
def test_renumber_follows_a_pruned_tree(target):
    rng = random.Random(8)
    context = [rng.randrange(VOCAB) for _ in range(7)]
    tree = random_tree(rng, context[-1], 15)
    session = target.new_session()
    session.prefill(context[:-1])
    session.forward(context, tree, list(range(len(tree))))
    keep = sorted(rng.sample(range(1, len(tree)), 9))
    kept = [0] + [n for n in keep if all(a in [0] + keep for a in tree.path(n))]
    pruned = tree.select(kept)
    session.renumber(kept)
    assert all(session.has(i) for i in range(len(pruned))) and not session.has(len(pruned))
    assert session.tree.tokens == pruned.tokens and session.tree.parents == pruned.parents
    path = pruned.path(len(pruned) - 1)
    session.commit(path)
    reference = target.new_session()
    reference.prefill(context[:-1] + [pruned.tokens[n] for n in path])
    assert_clean(session, reference)


@needs_llama
@pytest.mark.parametrize("n_seq_max", [4, 9, 17])  # 1, 2 and 4 sequences evicted per scan
def test_scarce_sequences_evict_dead_branches_and_restore_them(gguf_dir, target, n_seq_max):
    """n_seq_max - 1 branch sequences; drafting a wide tree node by node evicts branches (moving nodes that a later
    branch also holds, dropping dead ends), and a later forward under a dropped node forwards it again first.
    Logits and the committed cache stay exact."""
    small = load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_seq_max=n_seq_max, kv_type="f32")
    rng = random.Random(11)
    context = [rng.randrange(VOCAB) for _ in range(9)]
    tree = random_tree(rng, context[-1], 80, max_children=4)
    full = target.new_session()
    full.prefill(context[:-1])
    ref = full.forward(context, tree, list(range(len(tree))))
    session = small.new_session()
    session.prefill(context[:-1])
    for node in parents_first_shuffle(tree, rng):  # one node per call: at most one new branch each
        torch.testing.assert_close(session.forward(context, tree, [node]), ref[[node]], atol=ATOL, rtol=0)
    assert len(session.slot) < len(tree)  # some branches were evicted...
    evicted = max(n for n in range(len(tree)) if not session.has(n))
    child = tree.add(evicted, 9)  # ...and growing under one restores its path
    logits = session.forward(context, tree, [child])
    torch.testing.assert_close(logits[0], chain_logits(target, context, [tree.tokens[n] for n in tree.path(child)]),
                               atol=ATOL, rtol=0)
    assert all(session.has(n) for n in tree.path(child))
    session.commit(tree.path(child))
    reference = small.new_session()
    reference.prefill(session.cached)
    assert_clean(session, reference)


@needs_llama
def test_one_branch_sequence_refuses_a_fork_below_a_branch_clearly(gguf_dir):
    """At n_seq_max 2 a fork under a node that the only branch sequence holds has nowhere to go: a clear error."""
    small = load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_seq_max=2, kv_type="f32")
    fork = TokenTree.from_parents([4, 1, 2, 3, 5], [-1, 0, 0, 2, 2])  # root -> a, root -> c -> (e, f)
    with pytest.raises(ValueError, match="one forward needs more than 1 branches.*--llama-seq"):
        small.new_session().forward([4], fork, list(range(5)))


# --------------------------------------------------------------------------------------- (d) numerics vs torch


@needs_llama
@pytest.mark.parametrize("n_seq_max", [3, 4, 9])
def test_a_forward_wider_than_the_sequences_runs_in_pieces(gguf_dir, target, n_seq_max):
    """One forward of a tree with more leaves than branch sequences (a target verifying dyspec's 64 tokens at
    --llama-seq 8) stopped the generation; it now runs in pieces with exact logits, an accepted path that a later
    piece evicted is committed up to the cut, and the next forward carries the rest: the cache stays exact."""
    small = load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_seq_max=n_seq_max, kv_type="f32")
    rng = random.Random(7)
    context = [rng.randrange(VOCAB) for _ in range(9)]
    session = small.new_session()
    session.prefill(context[:-1])
    cut = 0
    for _ in range(4):
        tree = random_tree(rng, context[-1], 60, max_children=4)
        torch.testing.assert_close(session.forward(context, tree, list(range(len(tree)))),
                                   full_forward(target, context, tree), atol=ATOL, rtol=0)
        path = tree.path(max(range(len(tree)), key=lambda n: (tree.depths[n], n)))  # forwarded early, evicted
        cut += not all(session.has(n) for n in path)
        session.commit(path)
        context += [tree.tokens[n] for n in path[1:]] + [rng.randrange(VOCAB)]
        probe = random_tree(rng, context[-1], 6)
        torch.testing.assert_close(session.forward(context, probe, list(range(6))),
                                   full_forward(target, context, probe), atol=ATOL, rtol=0)
        session.commit([0])
        context.append(rng.randrange(VOCAB))
    assert cut  # some accepted path was cut by an eviction


def full_forward(model, context: list[int], tree: TokenTree) -> torch.Tensor:
    session = model.new_session()
    session.prefill(context[:-1])
    return session.forward(context, tree, list(range(len(tree))))


@needs_llama
def test_logits_agree_with_transformers_on_the_same_gguf(gguf_dir, target):
    from arborspec.loading import load_model

    hf = load_model(str(gguf_dir / "target.gguf"), dtype="fp32", progress=False).model
    rng = random.Random(9)
    context = [rng.randrange(VOCAB) for _ in range(20)]
    tree = random_tree(rng, context[-1], 16)
    ours, theirs = target.new_session(), TreeSession(hf)
    ours.prefill(context[:10])
    theirs.prefill(context[:10])
    a = ours.forward(context, tree, list(range(len(tree))))
    b = theirs.forward(context, tree, list(range(len(tree))))
    # f32 weights and KV cache on both sides: measured 8.6e-6 on logits up to ~20
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


# ------------------------------------------------------------------------------------------ (e) end to end


@needs_llama
@pytest.mark.parametrize("method,options", [("chain", {"k": 4}), ("static", {"depth": 3, "branch": 2}),
                                            ("dyspec", {"budget": 12}), ("wetap", {"budget": 16})])
def test_greedy_speculative_output_equals_plain_decoding(gguf_dir, method, options):
    from arborspec.engine import SpeculativeDecoder

    target = load_llamacpp_pair(gguf_dir / "target.gguf", n_threads=1)
    draft = load_llamacpp_pair(gguf_dir / "draft.gguf", n_threads=1)
    prompt = "def fib(n):\n    return"
    ar = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=48, ignore_eos=True)
    again = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=48, ignore_eos=True)
    assert again.token_ids == ar.token_ids  # greedy llama.cpp decoding is deterministic
    spec = SpeculativeDecoder(target, draft, method=method, **options).generate(prompt, max_new_tokens=48,
                                                                                 ignore_eos=True)
    assert spec.token_ids == ar.token_ids and spec.text == ar.text
    assert spec.stats.n_steps < ar.stats.n_steps  # the noisy draft is accepted sometimes
    assert len(set(ar.token_ids)) > 3  # not a degenerate repeat of one token


@needs_llama
@pytest.mark.parametrize("method", ["dyspec", "wetap"])
def test_wide_trees_on_few_sequences_equal_plain_decoding(gguf_dir, method):
    """dyspec's 64 tokens (and WETAP's wider unpruned layers) at n_seq_max 4: stopped at the first step before;
    now token-identical to plain greedy decoding."""
    from arborspec.engine import SpeculativeDecoder

    target = load_llamacpp_pair(gguf_dir / "target.gguf", n_threads=1, n_seq_max=4)
    draft = load_llamacpp_pair(gguf_dir / "draft.gguf", n_threads=1, n_seq_max=4)
    ar = SpeculativeDecoder(target, method="ar").generate("def fib(n):", max_new_tokens=40, ignore_eos=True)
    spec = SpeculativeDecoder(target, draft, method=method).generate("def fib(n):", max_new_tokens=40,
                                                                     ignore_eos=True)
    assert spec.token_ids == ar.token_ids and max(s.tree_size for s in spec.stats.steps) > 3


@needs_llama
@pytest.mark.usefixtures("private_cache")
def test_auto_runs_on_models_loaded_with_few_sequences(gguf_dir):
    """auto profiled complete binary trees of up to 128 tokens (64 leaves), so on models loaded with n_seq_max <= 48
    it stopped before its first step ("one forward needs more than 7 branches"); its profile's trees now keep to the
    models' leaves, and so do the trees it drafts."""
    from arborspec.drafting.auto.objective import CostModel
    from arborspec.engine import SpeculativeDecoder
    from arborspec.tuning.costs import CostCurve

    target = load_llamacpp_pair(gguf_dir / "target.gguf", n_threads=1, n_seq_max=8)
    draft = load_llamacpp_pair(gguf_dir / "draft.gguf", n_threads=1, n_seq_max=8)
    prompt = "def fib(n):\n    return"
    ar = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=32, ignore_eos=True)
    dec = SpeculativeDecoder(target, draft, method="auto", suffix=0, guard=False)
    assert dec.policy.options.max_nodes == 7
    flat = CostCurve.from_measurements((1, 128), (0.1, 0.1))  # any tree pays: wide ones
    dec.policy.use_costs(CostModel(flat, CostCurve.from_measurements((1, 128), (0.001, 0.001))))
    spec = dec.generate(prompt, max_new_tokens=32, ignore_eos=True)
    assert spec.token_ids == ar.token_ids
    assert max(s.tree_size for s in spec.stats.steps) == 7


@needs_llama
def test_trees_larger_than_n_batch_fit_up_to_the_end_of_the_window(gguf_dir):
    """240 + 16 cells (a multiple of 256: llama.cpp adds none) held 48-node trees until ~16 cells before the end of
    the window, then llama_decode found the cache full: the room after n_ctx is a whole tree's now."""
    from arborspec.engine import SpeculativeDecoder

    target = load_llamacpp_pair(gguf_dir / "target.gguf", n_threads=1, n_ctx=240, n_batch=16)
    draft = load_llamacpp_pair(gguf_dir / "draft.gguf", n_threads=1, n_ctx=240, n_batch=16)
    ar = SpeculativeDecoder(target, method="ar").generate("def fib(n):", max_new_tokens=300, ignore_eos=True)
    spec = SpeculativeDecoder(target, draft, method="static", widths="16,16,16").generate(
        "def fib(n):", max_new_tokens=300, ignore_eos=True)
    assert spec.token_ids == ar.token_ids and spec.stats.finish_reason == "context"


@needs_llama
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_loop_equals_the_general_loop(gguf_dir, temperature):
    """The engine's plain loop (`ar`, `auto` when no tree pays: one llama_decode and one pick a step, the prompt in
    the first decode) commits what draft -> verify -> commit does with root-only trees, greedy and seeded."""
    from arborspec.engine import SpeculativeDecoder

    target = load_llamacpp_pair(gguf_dir / "target.gguf", n_threads=1, kv_type="f32")
    prompt = "def fib(n):\n    return"
    for seed in range(2):
        plain = SpeculativeDecoder(target, method="ar", temperature=temperature)
        plain.verifier.verify = lambda *args: pytest.fail("the plain loop runs no verifier")
        general = SpeculativeDecoder(target, method="ar", temperature=temperature)
        general.policy.plain = False  # the same policy, stepped through draft -> verify -> commit
        a = plain.generate(prompt, max_new_tokens=32, seed=seed, ignore_eos=True)
        b = general.generate(prompt, max_new_tokens=32, seed=seed, ignore_eos=True)
        assert a.token_ids == b.token_ids and a.text == b.text
        assert len(set(a.token_ids)) > 3  # not a degenerate repeat of one token


@needs_llama
def test_a_llama_cpp_python_model_is_refused_with_the_way_to_load_it(gguf_dir):
    """A llama_cpp.Llama has .model (a pointer, an int) and .tokenizer: it was taken for a loaded pair, and the error
    said "got int"."""
    import llama_cpp

    from arborspec.engine import SpeculativeDecoder

    theirs = llama_cpp.Llama(model_path=str(gguf_dir / "target.gguf"), n_ctx=64, verbose=False)
    with pytest.raises(TypeError, match="llama-cpp-python's Llama; load the GGUF file with arborspec.load_model"):
        SpeculativeDecoder(theirs, method="ar")
    theirs.close()


@needs_llama
def test_pair_tokenizer_and_model_attributes(gguf_dir):
    pair = load_llamacpp_pair(gguf_dir / "target.gguf", n_threads=1, n_ctx=128)
    model = pair.model
    assert model.config.vocab_size == VOCAB == len(pair.tokenizer)
    assert model.config.max_position_embeddings == 128 and model.config.model_type == "qwen2"
    assert model.generation_config.eos_token_id == EOS == pair.tokenizer.eos_token_id
    assert model.n_threads == 1 and isinstance(model.dtype, str)
    assert isinstance(model.new_session("draft"), Session) and make_session(model, "draft").role == "draft"
    assert model.fingerprint() == load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_ctx=128).fingerprint()
    assert model.fingerprint() != load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_ctx=64).fingerprint()
    assert model.fingerprint() != load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_ctx=128,
                                                flash_attn=True).fingerprint()
    assert model.fingerprint() != load_llamacpp(gguf_dir / "draft.gguf", n_threads=1, n_ctx=128).fingerprint()


# ------------------------------------------------------------------------------------------- (f) bad inputs


@needs_llama
def test_truncated_and_foreign_files_are_refused(tmp_path):
    good = write_tiny_gguf(tmp_path / "good.gguf").read_bytes()
    cases = {"data-cut": (good[: len(good) - 1000], "is a truncated or corrupt GGUF file"),
             "header-cut": (good[:200], "is a truncated or corrupt GGUF file"),
             "text": (b"this is not a model\n" * 10, "is not a GGUF file \\(GGUF magic invalid\\)"),
             "empty": (b"", "is a truncated or corrupt GGUF file")}
    for name, (data, message) in cases.items():
        (tmp_path / f"{name}.gguf").write_bytes(data)
        with pytest.raises(ValueError, match=message):
            load_llamacpp(tmp_path / f"{name}.gguf")
    with pytest.raises(ValueError, match="GGUF file .* not found"):
        load_llamacpp(tmp_path / "missing.gguf")


@needs_llama
def test_gguf_that_is_not_a_causal_lm_is_refused(tmp_path):
    broken = write_tiny_gguf(tmp_path / "broken.gguf", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match="llama.cpp could not load .*tensor 'blk.1.ffn_up.weight' not found"):
        load_llamacpp(broken)
    embedder = write_tiny_gguf(tmp_path / "embed.gguf", pooling=1)
    assert read_gguf_info(embedder).embedding_model
    with pytest.raises(ValueError, match="is an embedding model .*not a causal LM"):
        load_llamacpp(embedder)
    unknown = write_tiny_gguf(tmp_path / "unknown.gguf", arch="no-such-arch")
    with pytest.raises(ValueError, match="llama.cpp could not load .*unknown model architecture: 'no-such-arch'"):
        load_llamacpp(unknown)


@needs_llama
def test_bad_options_are_refused(gguf_dir):
    path = gguf_dir / "target.gguf"
    with pytest.raises(ValueError, match="larger than target.gguf's trained context \\(256"):
        load_llamacpp(path, n_ctx=257)
    for option, value in (("n_seq_max", 257), ("n_seq_max", 0), ("n_batch", 0), ("n_threads", 0),
                          ("n_threads", 1.5), ("n_ctx", 1), ("kv_type", "q4_0")):
        with pytest.raises(ValueError, match=option):
            load_llamacpp(path, **{option: value})
    assert load_llamacpp(path, n_threads=1).n_ctx == 256  # default: min(4096, trained)


@needs_llama
def test_a_build_with_amx_kernels_loads_its_weights_without_extra_buffers(gguf_dir, monkeypatch):
    """The pinned llama.cpp's AMX product faults on a multi-token forward (llamacpp.model_params): where the build has
    AMX kernels the weights stay out of the extra buffers that reach them; elsewhere llama.cpp's defaults stand."""
    from arborspec.backends import llamacpp

    lib, seen = llamacpp.bindings(), []
    load = lib.llama_model_load_from_file
    monkeypatch.setattr(lib, "llama_model_load_from_file",
                        lambda path, params: seen.append(params.use_extra_bufts) or load(path, params))
    for info, extra in ((b"CPU : AVX2 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | REPACK = 1 | ", False),
                        (b"CPU : AVX2 = 1 | AVX512_VNNI = 1 | REPACK = 1 | ", True)):
        monkeypatch.setattr(lib, "llama_print_system_info", lambda info=info: info)
        model = load_llamacpp(gguf_dir / "target.gguf", n_threads=1)
        assert seen[-1] is extra
        tree = TokenTree.from_parents([3, 6, 7, 8], [-1, 0, 0, 1])
        assert torch.isfinite(full_forward(model, [1, 2, 3], tree)).all()  # a multi-token forward runs
        model.close()


def test_missing_llama_cpp_module_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    path = write_tiny_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"needs llama-cpp-python==0.3.36 .*pip install .arborspec\[llamacpp\]"):
        load_llamacpp(path)


@needs_llama
def test_close_frees_the_model_and_closes_its_sessions(gguf_dir):
    from arborspec.backends import llamacpp

    model = load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_ctx=64)
    live, done = model.new_session(), model.new_session()
    live.prefill([5, 6, 7])
    done.close()  # its context goes back to the model, to be freed with it
    assert model in llamacpp._OPEN and len(model._idle) == 1 and not model.closed
    model.close()
    assert model.closed and model not in llamacpp._OPEN and not model._idle and live.ctx is None
    tree = TokenTree.from_parents([7], [-1])
    with pytest.raises(RuntimeError, match="target session is closed"):
        live.forward([5, 6, 7], tree, [0])  # a clear error, not a call into freed memory
    with pytest.raises(RuntimeError, match="session is closed"):
        live.commit([0])
    with pytest.raises(ValueError, match="target.gguf is closed"):
        model.new_session()
    model.close()  # idempotent


@needs_llama
def test_models_left_open_are_closed_at_exit(gguf_dir, monkeypatch):
    """close_all (registered with atexit) closes what is still open: at interpreter exit it runs before
    llama-cpp-python's module is torn down, after which freeing would fail."""
    import weakref

    from arborspec.backends import llamacpp

    model = load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_ctx=64)
    session = model.new_session()
    monkeypatch.setattr(llamacpp, "_OPEN", weakref.WeakSet([model]))  # not the other tests' open models
    llamacpp.close_all()
    assert model.closed and session.ctx is None and not llamacpp._OPEN


def test_a_finished_sessions_context_is_reused_cleared(target):
    """A new session takes the previous one's context (no 150 ms re-creation) with its KV cache emptied: what it
    computes equals a first session's result, whatever the previous session left in the cells."""
    first = chain_logits(target, [1, 2, 3, 4, 5], [5, 6, 7])
    session = make_session(target, "target")
    session.prefill([9, 9, 9, 9, 9, 9, 9, 9])  # leave unrelated cells behind
    ctx = session.ctx
    del session
    reused = make_session(target, "target")
    assert reused.ctx == ctx and len(reused.cached) == 0
    assert cells_state_size(reused) == cells_state_size(make_session(target, "target"))
    del reused
    assert torch.allclose(chain_logits(target, [1, 2, 3, 4, 5], [5, 6, 7]), first, atol=1e-6)


def exact_first_two(model, prompt: list[int], sampling) -> torch.Tensor:
    """P(first two generated tokens) under the warped target, read from the model itself (llama.cpp here, any
    backend's session): one forward after the prompt, and one after each first token the warp allows (top-k keeps
    this to a handful)."""
    def next_probs(context: list[int]) -> torch.Tensor:
        session = make_session(model)
        session.prefill(context[:-1])
        root = TokenTree.from_parents([context[-1]], [-1])
        return sampling.probs(session.forward(context, root, [0]))[0].double()

    vocab = model.config.vocab_size
    first = next_probs(prompt)
    dist = torch.zeros(vocab * vocab, dtype=torch.float64)
    for t1 in torch.nonzero(first).flatten().tolist():
        dist[t1 * vocab : (t1 + 1) * vocab] = first[t1] * next_probs(prompt + [t1])
    return dist


@pytest.mark.slow
@needs_llama
@pytest.mark.parametrize("method,options,verifier", [("chain", {"k": 2}, "sps"), ("dyspec", {"budget": 6}, "mbr"),
                                                     ("static", {"depth": 2, "branch": 2}, "naive")])
def test_sampled_speculative_output_follows_the_target_distribution(gguf_dir, method, options, verifier):
    """At T = 1 (top-k 3, so the exact distribution of the first two tokens has few cells), the exact verifiers on
    llama.cpp sessions emit the target's distribution: a chi-square test with enough samples to catch any error of
    total variation 0.05 with probability 0.95 (3.6k samples, ~12 s each; the draft's own distribution is 0.79
    away). What is tested here is the backend's sessions under sampled trees; the verifiers themselves are proven to
    0.02 on exact tables (tests/verify/test_equivalence.py), which here took 25k samples and ~85 s a case."""
    from arborspec.core.sampling import SamplingConfig
    from arborspec.engine import SpeculativeDecoder
    from tests.verify.harness import assert_same_distribution, plan_samples, sample_outputs

    target = load_llamacpp_pair(gguf_dir / "target.gguf", n_threads=1, kv_type="f32")
    draft = load_llamacpp_pair(gguf_dir / "draft.gguf", n_threads=1, kv_type="f32")
    prompt = target.tokenizer("def fib(n):")["input_ids"]
    sampling = SamplingConfig(1.0, 3, 1.0)
    probs = exact_first_two(target.model, prompt, sampling)
    dec = SpeculativeDecoder(target, draft, method=method, temperature=1.0, top_k=3, verifier=verifier, **options)
    assert dec.verifier.name == verifier
    counts = sample_outputs(dec, prompt, 2, plan_samples(probs, tv=0.05), seed=11, max_new_tokens=3)
    assert_same_distribution(counts, probs, tv=0.05)


@needs_llama
def test_calibration_ranks_a_llamacpp_draft(gguf_dir):
    """`arborspec calibrate` on llama.cpp models ranked the draft by calling it as a torch module (a TypeError)."""
    from arborspec.bench.calibrate import calibrate

    target = load_llamacpp_pair(gguf_dir / "target.gguf", n_threads=1, n_ctx=128)
    draft = load_llamacpp_pair(gguf_dir / "draft.gguf", n_threads=1, n_ctx=128)
    same = calibrate(target.model, target.model, [[5, 6, 7], [9, 3]], max_new_tokens=8, ranks=4)
    assert same["acceptance"][0] == pytest.approx(1.0) and same["positions"] == 16  # the target as its own draft
    other = calibrate(target.model, draft.model, [[5, 6, 7], [9, 3]], max_new_tokens=8, ranks=4)
    assert other["positions"] == 16 and 0 < sum(other["acceptance"]) <= 1


def test_a_tokenizer_field_the_file_lacks_is_named(tmp_path, monkeypatch):
    """A GGUF without merges failed with "could not build a tokenizer from ...: 'scores'" (transformers' KeyError)."""
    from arborspec.backends import llamacpp

    def lacks(*args, **kwargs):
        raise KeyError("scores")
    monkeypatch.setattr(llamacpp.AutoTokenizer, "from_pretrained", lacks)
    with pytest.raises(ValueError, match=r"m.gguf: its tokenizer metadata is incomplete \(transformers looked for "
                                         r"tokenizer.ggml.scores\)"):
        llamacpp.gguf_tokenizer(tmp_path / "m.gguf")


def test_a_file_whose_name_is_not_utf8_loads(gguf_dir, tmp_path):
    """A path Python holds with surrogates (bytes the file system's encoding could not decode, as every path under
    an ASCII locale with PYTHONUTF8=0) failed with "'utf-8' codec can't encode ... surrogates not allowed"."""
    import os
    import shutil
    odd = tmp_path / os.fsdecode(b"caf\xe9.gguf")
    shutil.copy(gguf_dir / "target.gguf", odd)
    model = load_llamacpp(odd, n_threads=1, n_ctx=64)
    assert model.n_vocab == VOCAB


@needs_llama
def test_a_prefill_longer_than_n_batch_keeps_counting_positions(gguf_dir, target):
    """Each llama_decode call of a long prefill continues where the last one stopped: positions 0..n-1 on sequence
    0, and the next forward's logits are those of a session that prefilled in one call."""
    small = load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_batch=7, kv_type="f32")
    rng = random.Random(12)
    context = [rng.randrange(VOCAB) for _ in range(20)]
    session = small.new_session()
    session.prefill(context[:-1])  # 19 tokens: decodes of 7, 7 and 5
    assert session.forwards == 3
    assert session.lib.llama_memory_seq_pos_max(session.mem, 0) == len(context) - 2
    tree = random_tree(rng, context[-1], 5)
    ref = target.new_session()
    ref.prefill(context[:-1])
    torch.testing.assert_close(session.forward(context, tree, list(range(5))),
                               ref.forward(context, tree, list(range(5))), atol=ATOL, rtol=0)
    small.close()


@needs_llama
def test_commit_of_nothing_after_a_forward_drops_the_root_too(target):
    """The root (the context's last token) was forwarded as a tree node: rejecting every node drops its cell as well,
    so the next step forwards it again without a second cell at its position."""
    context = [3, 1, 4, 1, 5]
    session = target.new_session()
    session.prefill(context[:-1])
    session.forward(context, random_tree(random.Random(13), context[-1], 6), list(range(6)))
    session.commit([])
    reference = target.new_session()
    reference.prefill(context[:-1])
    assert_clean(session, reference)


@needs_llama
def test_prefill_with_a_forwarded_tree_is_refused(target):
    session = target.new_session()
    session.prefill([3, 1])
    session.forward([3, 1, 4], TokenTree.root(4), [0])
    with pytest.raises(RuntimeError, match="prefill with a non-empty region"):
        session.prefill([5])


@needs_llama
def test_renumber_carries_evicted_nodes_to_their_new_numbers(gguf_dir):
    """A node an eviction dropped keeps being known as evicted under its new number: committing a path through it
    keeps the path up to it (the rest rides in front of the next forward) instead of failing in check_path."""
    small = load_llamacpp(gguf_dir / "target.gguf", n_threads=1, n_seq_max=4, kv_type="f32")
    rng = random.Random(11)
    context = [rng.randrange(VOCAB) for _ in range(9)]
    tree = random_tree(rng, context[-1], 40, max_children=4)
    session = small.new_session()
    session.prefill(context[:-1])
    for node in parents_first_shuffle(tree, rng):
        session.forward(context, tree, [node])
    gone = max(n for n in range(len(tree)) if not session.has(n))
    leaf = next(n for n in range(1, gone) if not tree.children(n) and n not in tree.path(gone))
    kept = [n for n in range(len(tree)) if n != leaf]  # every node after `leaf` moves down by one
    evicted = set(session.evicted)
    session.renumber(kept)
    assert session.evicted == {new for new, old in enumerate(kept) if old in evicted} and gone - 1 in session.evicted
    path = [kept.index(n) for n in tree.path(gone)]
    cut = next(i for i, n in enumerate(path) if not session.has(n))
    session.commit(path)
    assert session.cached == context[:-1] + [tree.tokens[kept[n]] for n in path[:cut]]
    small.close()


def test_llama_error_prefers_the_loading_reason_then_the_first_line(monkeypatch):
    from arborspec.backends import llamacpp
    monkeypatch.setattr(llamacpp._log, "errors", ["first", "llama_model_load: error loading model: bad tensor", "x"])
    assert llamacpp.llama_error("none") == "bad tensor"
    monkeypatch.setattr(llamacpp._log, "errors", ["first", "second"])
    assert llamacpp.llama_error("none") == "first"
    assert llamacpp.llama_error("none") == "none"  # the lines are consumed


@needs_llama
def test_a_full_kv_cache_is_named_as_such(target, monkeypatch):
    """llama_decode returns 1 when no cells are free for the batch (llama.h): said as a full cache, not a failure."""
    session = target.new_session()
    monkeypatch.setattr(session, "lib", SimpleNamespace(llama_decode=lambda ctx, batch: 1))
    with pytest.raises(RuntimeError, match=r"target KV cache is full \(256 \+ \d+ cells\)"):
        session.prefill([3, 1, 4])


@needs_llama
def test_default_context_and_batch_threads(gguf_dir, tmp_path):
    """n_ctx defaults to min(4096, trained); n_threads_batch to n_threads; n_seq_max past 256 is refused here."""
    long = load_llamacpp(write_tiny_gguf(tmp_path / "long.gguf", context=8192), n_threads=1, n_seq_max=2)
    assert long.n_ctx == 4096 and long.settings.n_threads_batch == 1
    long.close()
    with pytest.raises(ValueError, match=r"n_seq_max must be an integer in \[1, 256\], got 257"):
        load_llamacpp(gguf_dir / "target.gguf", n_seq_max=257)
