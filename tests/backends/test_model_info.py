"""What the engine reads off any model object, and the seam for backends that are not torch modules: a model that
brings its own sessions (`new_session`) and offers only `config`, `generation_config`, `dtype` and `fingerprint()`."""
from types import SimpleNamespace

import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.backends import check_session_support, make_session
from arborspec.backends.model_info import branch_limit, check_pair, context_window, eos_ids, vocab_size
from arborspec.core.tree import TokenTree
from arborspec.tuning import costs
from tests.conftest import tiny_model

VOCAB = 40


class EchoSession:
    """A session whose next token is always (last token + 1) % VOCAB; the Session protocol, no torch model."""

    def __init__(self, role):
        self.role, self.cached, self.forwards = role, [], 0
        self.tree, self.slot = None, {}

    def prefill(self, ids):
        self.cached.extend(ids)

    def forward(self, context, tree: TokenTree, nodes):
        if self.tree is not tree:
            self.tree, self.slot = tree, {}
        self.forwards += 1
        logits = torch.zeros(len(nodes), VOCAB)
        for i, n in enumerate(nodes):
            self.slot[n] = len(self.slot)
            logits[i, (tree.tokens[n] + 1) % VOCAB] = 10.0
        return logits

    def has(self, node):
        return node in self.slot

    def renumber(self, kept):
        self.slot = {new: self.slot[old] for new, old in enumerate(kept) if old in self.slot}
        self.tree = self.tree.select(kept)

    def commit(self, path):
        self.cached = self.cached + [self.tree.tokens[n] for n in path] if self.tree else self.cached
        self.tree, self.slot = None, {}


class NotTorchModel:
    """What a llama.cpp model offers the engine."""

    def __init__(self, window=64):
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=window, model_type="fake",
                                      _name_or_path="fake-model")
        self.generation_config = SimpleNamespace(eos_token_id=[7, 8])
        self.dtype = "q4_k_m"
        self.n_threads = 3

    def fingerprint(self):
        return "fake-fingerprint"

    def new_session(self, role="target"):
        return EchoSession(role)


def test_context_window_and_eos_ids_read_any_config():
    assert context_window(NotTorchModel(window=50)) == 50
    gpt2 = SimpleNamespace(config=SimpleNamespace(n_positions=1024))
    assert context_window(gpt2) == 1024 and context_window(SimpleNamespace(config=SimpleNamespace())) == 2**31
    assert context_window(SimpleNamespace(config=SimpleNamespace()), default=0) == 0
    assert eos_ids(NotTorchModel(), SimpleNamespace(eos_token_id=2)) == {7, 8}  # the config's, as generate's
    assert eos_ids(SimpleNamespace(), SimpleNamespace(eos_token_id=2)) == {2}  # no config: the tokenizer's
    assert eos_ids(SimpleNamespace(), None) == set()


def test_a_rescaling_rope_holds_the_context_window_to_its_original_length():
    """longrope and dynamic RoPE change every key's frequencies past the original length (model_info.context_window);
    another rope type, or one that names no original length, keeps max_position_embeddings."""
    def window(rope: dict, **config) -> int:
        return context_window(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096, rope_scaling=rope,
                                                                     **config)))

    assert window({"rope_type": "dynamic", "original_max_position_embeddings": 1024}) == 1024
    assert window({"type": "longrope"}, original_max_position_embeddings=2048) == 2048  # the config's own field
    assert window({"rope_type": "linear", "original_max_position_embeddings": 1024}) == 4096
    assert window({"rope_type": "dynamic"}) == 4096


def test_branch_limit_and_vocab_size():
    """llama.cpp keeps one of its n_seq_max sequence ids for the committed prefix, and a tree has at least its one
    branch; the ids every model reads are below the fewest output rows."""
    assert [branch_limit(SimpleNamespace(n_seq_max=n)) for n in (1, 2, 8)] == [1, 1, 7]
    assert branch_limit(SimpleNamespace()) is None
    rows = [SimpleNamespace(config=SimpleNamespace(vocab_size=n)) for n in (10, 6)]
    assert vocab_size(rows[0], None, rows[1]) == 6 and vocab_size(None) is None


class SizedTokenizer:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def test_check_pair_refuses_outputs_that_do_not_cover_the_tokenizer():
    target = tiny_model("llama")
    n = target.config.vocab_size
    short = SimpleNamespace(config=SimpleNamespace(vocab_size=n - 1))
    check_pair(target, target, SizedTokenizer(n))
    check_pair(target, short, None)  # no tokenizer: the common rows are all there is
    with pytest.raises(ValueError, match=rf"draft vocabulary \({n - 1}\) and target vocabulary \({n}\) do not cover"):
        check_pair(target, short, SizedTokenizer(n))


def test_a_model_that_brings_its_own_sessions_runs_through_the_engine_and_the_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    model = NotTorchModel()
    check_session_support(model)  # accepted without looking for torch caches
    assert isinstance(make_session(model, "draft"), EchoSession)
    dec = SpeculativeDecoder(model, model, method="chain", k=3)
    out = dec.generate([1, 2, 3], max_new_tokens=6)
    assert out.token_ids == [4, 5, 6, 7]  # the echo chain, cut at the model's EOS (7)
    assert out.stats.finish_reason == "eos" and out.stats.tokens_per_step > 1
    curve, source = costs.profile_model(model, sizes=(1, 2, 4), repeats=1, prefix=8)
    assert source == "measured" and len(curve.times) == 3
    key = costs.profile_key(model)
    assert key["threads"] == 3 and key["model"] == "fake-fingerprint" and key["dtype"] == "q4_k_m"
    assert costs.profile_model(model, sizes=(1, 2, 4), repeats=1, prefix=8)[1] == "cache"


def test_a_generation_configs_logits_processors_are_named_once_not_applied_in_silence():
    """transformers' generate applies a saved repetition_penalty (or min_new_tokens, suppress_tokens, ...) to greedy
    decoding too: its output parted from arborspec's without a word."""
    import warnings

    from arborspec import SpeculativeDecoder
    from tests.conftest import tiny_model
    model = tiny_model("llama")
    model.generation_config.repetition_penalty = 1.1
    model.generation_config.suppress_tokens = [3]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        SpeculativeDecoder(model, method="ar")
        SpeculativeDecoder(model, method="ar")
    said = [str(w.message) for w in seen if "generation config" in str(w.message)]
    assert len(said) == 1 and "repetition_penalty=1.1" in said[0] and "suppress_tokens=[3]" in said[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeculativeDecoder(tiny_model("llama"), method="ar")  # neutral settings: nothing to say


def test_a_new_model_is_warned_about_though_it_reuses_a_freed_ones_id():
    """Models were remembered by id(); CPython hands a freed object's id to the next one of its size, which then went
    unwarned."""
    import gc
    import types
    import warnings

    from arborspec.backends.model_info import warn_unapplied

    class Model:
        generation_config = types.SimpleNamespace(repetition_penalty=1.3)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(10):
            model = Model()
            warn_unapplied(model)
            warn_unapplied(model)
            del model
            gc.collect()
    assert sum("repetition_penalty=1.3" in str(w.message) for w in seen) == 10
