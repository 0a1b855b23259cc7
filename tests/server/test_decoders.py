"""A request's spec, sampling and decoder as server/decoders.Decoders makes them from the server's settings, without
models: what a request may override, what it keeps of the server's, and what it is refused."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from arborspec.core.sampling import SamplingConfig
from arborspec.engine import DecoderConfig
from arborspec.runspec import parse
from arborspec.server import decoders as decoders_module
from arborspec.server.decoders import Decoders


def served(method: str = "chain", draft: object | None = "draft", quant: str = "q4_0", vocab: int = 0,
           config: DecoderConfig = DecoderConfig()) -> Decoders:
    """A server running `method` (its draft prepared with `quant` and head size `vocab`), with no models loaded."""
    return Decoders(parse(method, draft_quant=quant), None, draft, quant, vocab, config)


def test_a_requests_sampling_keeps_what_it_names_zero_included():
    """temperature 0 (greedy) and seed 0 are values a request names, not fields it left out."""
    dec = served(config=DecoderConfig(sampling=SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, seed=11)))
    assert dec.sampling(0.0, None, None, 0) == SamplingConfig(temperature=0.0, top_k=5, top_p=0.9, seed=0)
    assert dec.sampling(None, None, None, None) == dec.defaults


def test_a_lossy_verifier_runs_only_with_the_requests_consent():
    dec = served()
    with pytest.raises(ValueError, match='set "allow_lossy": true'):
        dec.spec_for(method="wetap-lossy")
    spec = dec.spec_for(method="wetap-lossy", allow_lossy=True)
    assert spec.lossy and spec.allow_lossy


def test_a_baseline_is_refused():
    with pytest.raises(ValueError, match="is a baseline"):
        served().spec_for(method="hf-ar")


def test_a_requests_budget_sizes_its_method_unless_the_method_pins_one():
    assert served().spec_for(method="chain", budget=3).budget == 3
    with pytest.raises(ValueError, match="pins its budget already"):
        served().spec_for(method="chain@5", budget=3)
    pinned = served("chain@5")  # the server's own pinned budget: a request's budget replaces it, its verifier not
    assert pinned.spec_for(budget=3).budget == 3
    assert pinned.spec_for(verifier="mss").budget == 5


def test_a_request_may_choose_another_verifier_for_the_servers_method():
    """Only a method the request names itself may not name a verifier too (the field won in silence)."""
    spec = served("sps").spec_for(verifier="mss")
    assert (spec.name, spec.verifier) == ("sps", "mss")


def test_a_method_that_drafts_needs_the_servers_draft():
    with pytest.raises(ValueError, match="needs a draft model, and this server runs without one"):
        served("ar", draft=None).spec_for(method="chain")


def test_a_method_that_drafts_nothing_keeps_its_own_head_size():
    spec = served("chain", vocab=1024).spec_for(method="ar")
    assert not spec.needs_draft and spec.vocab == parse("ar").vocab


def test_a_request_decoder_gets_the_bare_draft_its_sampling_and_the_prefix_cache(monkeypatch):
    made = []
    monkeypatch.setattr(decoders_module, "build_decoder",
                        lambda spec, target, draft, config: made.append((spec, target, draft, config))
                        or SimpleNamespace())
    draft, cache = SimpleNamespace(model="the draft's model"), object()
    dec = Decoders(parse("chain"), "target", draft, "q4_0", 0, DecoderConfig(token_order="dfs"), prefix_cache=cache)
    sampling = SamplingConfig(temperature=1.0, seed=3)
    decoder = dec.build(dec.spec, sampling)
    [(spec, target, bare, config)] = made
    assert (spec, target, bare) == (dec.spec, "target", "the draft's model")
    assert config == DecoderConfig(token_order="dfs", sampling=sampling)
    assert decoder.prefix_cache is cache


def test_a_prompt_is_encoded_with_the_room_its_request_needs(monkeypatch):
    seen = []
    monkeypatch.setattr(decoders_module, "model_prompt_ids", lambda *args: seen.append(args) or [1, 2])
    target = SimpleNamespace(tokenizer="tok", model="target model")
    dec = Decoders(parse("chain"), target, SimpleNamespace(model="draft model"), "q4_0", 0, DecoderConfig())
    assert dec.encode("hi", room=7) == [1, 2]
    assert seen == [("tok", "hi", "target model", "draft model", 7)]


def test_a_requests_budget_must_size_something():
    dec = served()
    with pytest.raises(ValueError, match="has no size option for a budget"):
        dec.spec_for(method="auto", budget=4)


def test_a_requests_spec_carries_its_own_consent_to_a_lossy_verifier():
    dec = served()
    assert dec.spec_for(verifier="mss").allow_lossy is False
    assert dec.spec_for(verifier="mss", allow_lossy=True).allow_lossy is True
