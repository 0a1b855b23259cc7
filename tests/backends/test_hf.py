"""The tree-masked forward equals per-path causal forwards, and compaction leaves an exact cache."""
import random

import pytest
import torch

from arborspec.backends.hf import TreeSession, check_cache_support
from arborspec.core.tree import TokenTree
from tests.conftest import tiny_model


def random_tree(rng, root, n, vocab=56):
    tree = TokenTree.root(root)
    for _ in range(n - 1):
        tree.add(rng.randrange(len(tree)), rng.randrange(2, vocab))
    return tree


def reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_forward_equals_path_forwards(arch, attn):
    model = tiny_model(arch, attn=attn)
    rng = random.Random(hash((arch, attn)) % 1000)
    for trial in range(3):
        context = [rng.randrange(2, 56) for _ in range(rng.randrange(1, 12))]
        tree = random_tree(rng, context[-1], rng.randrange(1, 24))
        session = TreeSession(model)
        if trial == 1 and len(context) > 2:
            session.prefill(context[:2])  # some of the prompt cached, the rest pending
        logits = session.forward(context, tree, list(range(len(tree))))
        for node in range(len(tree)):
            path = context[:-1] + [tree.tokens[i] for i in tree.path(node)]
            torch.testing.assert_close(logits[node], reference_logits(model, path), atol=2e-5, rtol=1e-4)


def test_layer_by_layer_forward_equals_one_pass(arch):
    """The draft grows its tree over several calls; that must give the same logits as one pass."""
    model = tiny_model(arch)
    rng = random.Random(7)
    context = [rng.randrange(2, 56) for _ in range(5)]
    tree = random_tree(rng, context[-1], 20)
    whole = TreeSession(model).forward(context, tree, list(range(len(tree))))
    session, parts = TreeSession(model), []
    for depth in range(tree.depth + 1):
        layer = [i for i in range(len(tree)) if tree.depths[i] == depth]
        parts.append((layer, session.forward(context, tree, layer)))
    for layer, logits in parts:
        torch.testing.assert_close(logits, whole[layer], atol=2e-5, rtol=1e-4)


def test_commit_compacts_to_the_accepted_path(arch):
    model = tiny_model(arch)
    rng = random.Random(3)
    context = [rng.randrange(2, 56) for _ in range(6)]
    session = TreeSession(model)
    for _ in range(4):  # several steps, each accepting a random path
        tree = random_tree(rng, context[-1], 15)
        session.forward(context, tree, list(range(len(tree))))
        path = tree.path(rng.randrange(len(tree)))
        session.commit(path)
        context = context + [tree.tokens[i] for i in path[1:]] + [rng.randrange(2, 56)]
        assert session.cached == context[:-1]
        assert session.cache.get_seq_length() == len(context) - 1
        nxt = session.forward(context, TokenTree.root(context[-1]), [0])[0]
        torch.testing.assert_close(nxt, reference_logits(model, context), atol=2e-5, rtol=1e-4)
        session.commit([0])
        context.append(rng.randrange(2, 56))


def test_prefilling_nothing_changes_nothing():
    """Session.prefill([]) failed here (the ids of no rows made a float tensor); native and the others did nothing."""
    model = tiny_model("llama")
    session = TreeSession(model)
    session.prefill([])
    session.prefill([5, 6])
    session.prefill([])
    assert session.cached == [5, 6] and session.cache.get_seq_length() == 2
    logits = session.forward([5, 6, 7], TokenTree.root(7), [0])[0]
    torch.testing.assert_close(logits, reference_logits(model, [5, 6, 7]), atol=2e-5, rtol=1e-4)


def test_renumber_then_commit_keeps_exactly_the_path(arch):
    """A policy that prunes after drafting (WETAP) renumbers the region; commit must still drop every other row,
    including the pruned nodes' KV and when the kept path happens to sit in the region's first rows."""
    model = tiny_model(arch)
    context = [5, 9, 13, 2]
    tree = TokenTree.from_parents([2, 7, 8, 11, 12], [-1, 0, 1, 0, 3])  # 0 -> 1 -> 2 and 0 -> 3 -> 4
    session = TreeSession(model)
    session.forward(context, tree, list(range(len(tree))))  # five rows in the region
    session.renumber([0, 1, 2])  # the policy kept the chain 0 -> 1 -> 2 (the region's first three rows)
    assert session.has(2) and not session.has(3) and session.tree.tokens == [2, 7, 8]
    session.commit([0, 1, 2])
    context = context + [7, 8, 30]
    assert session.cached == context[:-1] and session.cache.get_seq_length() == len(context) - 1
    nxt = session.forward(context, TokenTree.root(context[-1]), [0])[0]
    torch.testing.assert_close(nxt, reference_logits(model, context), atol=2e-5, rtol=1e-4)


def test_out_of_sync_context_is_refused():
    model = tiny_model("llama")
    session = TreeSession(model)
    session.prefill([3, 4, 5])
    with pytest.raises(RuntimeError, match="out of sync"):
        session.forward([9, 9, 9, 9], TokenTree.root(9), [0])
    with pytest.raises(RuntimeError, match="out of sync"):  # the root is already in the cache: it would run twice
        session.forward([3, 4, 5], TokenTree.root(5), [0])
    assert session.cached == [3, 4, 5] and session.region_len == 0


def test_a_forward_the_region_cannot_take_is_refused_before_it_runs():
    """No nodes; a root that is not the last committed token; a second tree while the region holds the first one's
    nodes (its slots would be read as the new tree's)."""
    session = TreeSession(tiny_model("llama"))
    session.prefill([3, 4])
    tree = TokenTree.from_parents([5, 6], [-1, 0])
    with pytest.raises(ValueError, match="at least one node"):
        session.forward([3, 4, 5], tree, [])
    with pytest.raises(ValueError, match="root must be the last committed token"):
        session.forward([3, 4, 7], tree, [0])
    session.forward([3, 4, 5], tree, [0])
    with pytest.raises(RuntimeError, match="another tree's nodes"):
        session.forward([3, 4, 5], TokenTree.from_parents([5, 6], [-1, 0]), [1])
    assert session.cached == [3, 4] and session.region_len == 1 and session.forwards == 2


def test_nodes_outside_the_tree_and_cyclic_trees_are_refused_before_a_forward():
    """Every backend's forward starts with begin_forward: node -1 ran as a node with no tree path (native), and a
    tree built by hand with a cycle in its parents looped for ever."""
    session = TreeSession(tiny_model("llama"))
    session.prefill([3, 4])
    tree = TokenTree.from_parents([5, 6], [-1, 0])
    for nodes in ([0, -1], [2], [0, 1, 5]):
        with pytest.raises(ValueError, match="nodes must be nodes of the tree \\(0 to 1\\)"):
            session.forward([3, 4, 5], tree, nodes)
    wide = TokenTree.from_parents([5, 6, 7, 8], [-1, 0, 0, 1])
    session.forward([3, 4, 5], wide, [0, 1, 2])
    for path, what in (([2, 1], "not a chain"), ([0, 1, 2], "not a chain"), ([0, 0], "not a chain"),
                       ([1], "from its root"), ([0, 1, 3], "not in the region")):
        with pytest.raises(ValueError, match=what):  # commit would have kept keys at the wrong positions
            session.commit(path)
    session.commit([0, 1])
    assert session.cached == [3, 4, 5, 6]
    cyclic = TokenTree(tokens=[5, 6], parents=[-1, 1], depths=[0, 1], probs=[1.0, 1.0], sources=["", "d"])
    with pytest.raises(ValueError, match="cycle through node 1"):
        cyclic.path(1)


def test_sliding_window_models_are_refused():
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="sliding"):
        check_cache_support(model)


def test_a_config_transformers_builds_no_cache_for_is_one_clear_error():
    """A Gemma2 with sliding_window None keeps windowed layer types: DynamicCache raised a TypeError from inside
    transformers (a traceback, exit 1, in `arborspec generate`)."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8,
                       num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM: transformers cannot build a KV cache for this config "
                                         r"\(TypeError: .*sliding_window, layer_types"):
        check_cache_support(model)


def _tiny(config_class, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config_class(vocab_size=64, **kw)).eval()


def _models_that_would_run_trees_wrong():
    from transformers import BloomConfig, FalconConfig, GPTNeoConfig, MptConfig, OpenAIGPTConfig, RwkvConfig

    return [
        ("ALiBi", _tiny(BloomConfig, hidden_size=32, n_layer=2, n_head=4, pad_token_id=0)),
        ("ALiBi", _tiny(MptConfig, d_model=32, n_layers=2, n_heads=4, max_seq_len=128, pad_token_id=0)),
        ("ALiBi", _tiny(FalconConfig, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True)),
        ("local attention", _tiny(GPTNeoConfig, hidden_size=32, num_layers=2, num_heads=4, window_size=16,
                                  attention_types=[[["global", "local"], 1]], max_position_embeddings=512)),
        ("takes no past_key_values", _tiny(RwkvConfig, hidden_size=32, num_hidden_layers=2,
                                           attention_hidden_size=32, intermediate_size=64, pad_token_id=0)),
        ("takes no past_key_values", _tiny(OpenAIGPTConfig, n_embd=32, n_layer=2, n_head=4)),
    ]


def test_models_whose_attention_follows_cache_slots_are_refused_before_they_answer_wrong():
    """A sweep of transformers' architectures against their own generate found these: chains right, trees wrong
    (ALiBi, GPT-Neo's local layers), or every method wrong (RWKV, GPT-1)."""
    from arborspec.backends import check_session_support

    for reason, model in _models_that_would_run_trees_wrong():
        with pytest.raises(ValueError, match="cannot run tree attention exactly") as info:
            check_session_support(model)
        assert reason in str(info.value), (type(model).__name__, str(info.value))


def test_a_local_window_as_long_as_the_context_is_accepted():
    from transformers import GPTNeoConfig

    from arborspec.backends import check_session_support

    check_session_support(_tiny(GPTNeoConfig, hidden_size=32, num_layers=2, num_heads=4, window_size=512,
                                attention_types=[[["global", "local"], 1]], max_position_embeddings=512))
    check_session_support(tiny_model("llama"))


def test_a_model_off_the_cpu_is_refused_before_its_first_forward():
    """A model whose weights are not on the CPU (a GPU, or `meta` without hooks to bring them back) failed in its
    first forward with torch's device error and a traceback; target or draft, it is now a ValueError up front.
    `meta` stands in for a GPU here: the check is the same for any device but the CPU."""
    from arborspec import SpeculativeDecoder

    cpu, off = tiny_model("llama"), tiny_model("llama").to("meta")
    with pytest.raises(ValueError, match=r"runs torch models on the CPU, and LlamaForCausalLM has weights on meta"):
        SpeculativeDecoder(off, method="ar")
    with pytest.raises(ValueError, match=r"has weights on meta: move it with model.to\('cpu'\)"):
        SpeculativeDecoder(cpu, off, method="chain")
    off.lm_head.to_empty(device="cpu")  # one layer moved back is not enough
    with pytest.raises(ValueError, match="weights on meta"):
        SpeculativeDecoder(off, method="ar")
    cpu.hf_device_map = {"model": "cpu", "lm_head": 0}  # what from_pretrained(device_map=...) records
    with pytest.raises(ValueError, match="weights on GPU 0"):
        SpeculativeDecoder(cpu, method="ar")


def test_a_model_with_layers_offloaded_to_disk_runs_and_decodes_the_same(tmp_path):
    """accelerate leaves weights it offloaded to disk on `meta` and loads them onto the CPU for each forward: such a
    model runs (its device_map names only the CPU and disk) and decodes what the model in memory decodes."""
    from transformers import AutoModelForCausalLM

    from arborspec import SpeculativeDecoder

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    places = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
              "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=places,
                                                     offload_folder=str(tmp_path / "off"))
    assert any(p.device.type == "meta" for p in offloaded.parameters())  # the case
    want = SpeculativeDecoder(model, method="ar").generate([1, 2, 3], max_new_tokens=5, ignore_eos=True).token_ids
    got = SpeculativeDecoder(offloaded, method="ar").generate([1, 2, 3], max_new_tokens=5, ignore_eos=True).token_ids
    assert got == want


def test_longrope_runs_to_its_original_length_and_stops_there():
    """Past it longrope changes every key's frequencies: Phi-3's own generate recomputes its cache, and a tree
    forward cannot, so the generation ends there ("context") rather than differ from the model's own."""
    from transformers import Phi3Config

    from arborspec import SpeculativeDecoder

    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4, long_factor=[16.0] * 4,
                original_max_position_embeddings=32)
    torch.manual_seed(0)
    model = _tiny(Phi3Config, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=32,
                  rope_parameters=rope, sliding_window=None, pad_token_id=0)
    prompt = [5, 6, 7, 8]
    res = SpeculativeDecoder(model, model, method="static", depth=2, branch=2).generate(prompt, 60, ignore_eos=True)
    assert res.stats.finish_reason == "context" and len(prompt) + len(res.token_ids) == 32
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=len(res.token_ids), do_sample=False)
    assert res.token_ids == want[0, len(prompt):].tolist()
