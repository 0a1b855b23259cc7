"""The run spec (arborspec/runspec.py) and the pair loader (loading/pair.py): one grammar and one set of defaults
for `generate`, `bench` and the Python API."""
import inspect
from dataclasses import replace

import pytest
import torch

from arborspec import DecoderConfig, SpeculativeDecoder, runspec
from arborspec.bench import runner
from arborspec.cli import build_parser, run_spec
from arborspec.drafting.grafts.suffix import AUTO_SUFFIX
from arborspec.loading import pair as pair_loader
from arborspec.loading.model import LoadedModel
from tests.conftest import char_tokenizer, noisy_copy, save_models, tiny_model


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=0)
    tok = char_tokenizer()
    return (LoadedModel(target, tok, "target", "memory"), LoadedModel(noisy_copy(target, 0.2), tok, "draft", "memory"))


# ---- the grammar ---------------------------------------------------------------------------------------------------
def test_a_name_carries_options_budget_and_levers():
    s = runspec.parse("dynatree(adapt=false, window=4)@16+int8+vocab2k+ngram")
    assert s.name == "dynatree(adapt=false, window=4)@16+int8+vocab2k+ngram" and s.policy == "dynatree"
    assert s.options == (("adapt", False), ("window", 4))
    assert (s.budget, s.quant, s.vocab, s.ngram, s.ngram_len) == (16, "int8", 2048, runspec.NGRAM_DEFAULT, runspec.NGRAM_LEN)
    assert runspec.options_for(s) == ({"budget": 16, "adapt": False, "window": 4}, None)
    assert runspec.options_for(s, 64) == ({"budget": 16, "adapt": False, "window": 4}, None)  # the pinned budget wins
    assert runspec.parse("static(widths=3,3,3,3,depth=2)").options == (("widths", "3,3,3,3"), ("depth", 2))
    assert runspec.parse("chain(verifier=asps)").verifier == "asps" == runspec.parse("asps").verifier
    s = runspec.parse("hf-assisted+int4")
    assert s.hf and s.policy is None and s.quant == "int4" and s.needs_draft
    assert runspec.split_methods("ar, wetap(gamma=0.8,alpha=0.3)@16,chain@5+int8") == \
        ["ar", "wetap(gamma=0.8,alpha=0.3)@16", "chain@5+int8"]
    assert runspec.split_label("dyspec(batch=false)@16+int8") == ("dyspec(batch=false)+int8", 16)


@pytest.mark.parametrize("name,words", [
    ("no-such-method", "unknown method 'no-such-method'"), ("Chain", "does not read"), ("chain@", "does not read"),
    ("dynatree(nope=1)", "not option=value"), ("dynatree(window=x)", "window takes an integer"),
    ("chain(verifier=nope)", "unknown verifier"), ("ar@4", "no size option"), ("auto@16", "no size option"),
    ("chain+fp8", "unknown lever"), ("hf-assisted+ngram", "baselines"), ("hf-ar(k=1)", "no (option"),
    ("ar+int8", "without a draft"), ("hf-ar+noquant", "without a draft"), ("ar+vocab100", "without a draft"),
    ("wetap-lossy@64", "--allow-lossy"), ("wetap(verifier=wetap)", "--allow-lossy"),
    ("hf-ar+lookahead", "baselines"), ("ar+lookahead4x1", "at least 2 tokens"), ("ar+lookahead0", "at least 1 guess"),
    ("static(depth=0)", "depth must be an integer >= 1"), ("chain(k=5,k=6)", "k is given twice"),
    ("chain@0", "N >= 1"), ("static@0", "N >= 1"),
    ("dyspec(budget=-2)", "budget must be an integer >= 1"), ("chain(k=2.5)", "k takes an integer, got '2.5'"),
    # each of these ran with one of the two settings silently dropped
    ("static(depth=3,branch=2)@16", "does not combine with branch, depth"),
    ("static(draw=iid)@16", "does not combine with draw"), ("chain(k=3)@8", "does not combine with k"),
    ("static(verifier=greedy,verifier=naive)", "verifier is given twice"),
    ("static+int8+int4", "+int8 and +int4 set the same thing"), ("chain+ngram3+ngram5", "set the same thing"),
    ("chain+suffix4+suffix8", "set the same thing"), ("static(widths=3,,3)", "comma-separated list of integers"),
    ("static(widths=3,3,)", "comma-separated list of integers"),
    ("chain\n", "does not read"), ("chain@\u0663", "does not read"),  # "$" took a final newline, "\d" any digit
])
def test_bad_names_say_what_is_wrong(name, words):
    with pytest.raises(ValueError) as err:
        runspec.parse(name)
    assert words in str(err.value), str(err.value)


@pytest.mark.parametrize("method", ["dynatree", "wetap", "sequoia", "dyspec-threshold", "suffix", "dyspec"])
def test_a_budget_of_auto_is_read_for_every_policy_with_a_budget(method):
    """As `--budget auto` and `serve --method` pass it: refused for all but dyspec before the name check learnt
    that make_policy wraps a size knob in the budget tuner."""
    spec = runspec.parse(f"{method}(budget=auto)")
    assert runspec.options_for(spec)[0]["budget"] == "auto"
    with pytest.raises(ValueError, match="budget must be"):
        runspec.parse(f"{method}(budget=often)")


def test_budgets_map_to_each_policys_size_option():
    assert runspec.options_for(runspec.parse("chain"), 8) == ({"k": 8}, None)
    assert runspec.options_for(runspec.parse("dyspec"), 32) == ({"budget": 32}, None)
    assert runspec.options_for(runspec.parse("beam"), 16) == ({"beams": 4, "steps": 4}, None)
    assert runspec.options_for(runspec.parse("beam@3"))[0] == {"beams": 3, "steps": 1}  # 4 nodes were drafted
    fixed, warning = runspec.options_for(runspec.parse("static(depth=3,branch=2)"), 16)  # a bench --budgets sweep
    assert fixed == {"depth": 3, "branch": 2} and "sets branch, depth itself; budget 16 not applied" in warning
    assert runspec.options_for(runspec.parse("ar"), 32) == ({}, None)
    assert runspec.options_for(runspec.parse("auto"), 16) == ({}, None)  # auto sizes its trees itself
    assert runspec.options_for(runspec.parse("static"), None) == ({}, None)
    for b in (1, 2, 5, 16, 32, 64):
        widths = [int(w) for w in runspec.static_widths(b)["widths"].split(",")]
        assert sum(widths) == b and widths == sorted(widths, reverse=True)
    assert runspec.static_widths(16) == {"widths": "4,4,4,4"}


def test_wetap_is_exact_and_its_lossy_rule_needs_consent():
    exact = runspec.parse("wetap")
    assert exact.policy == "wetap" and exact.verifier is None and not exact.lossy
    old = runspec.parse("wetap-exact")  # the bench's former name for the exact one still runs it
    assert (old.policy, old.verifier, old.size) == (exact.policy, exact.verifier, exact.size)
    lossy = runspec.parse("wetap-lossy@64", allow_lossy=True)
    assert lossy.policy == "wetap" and lossy.verifier == "wetap" and lossy.lossy
    assert runspec.parse("wetap(verifier=wetap)@64", allow_lossy=True).verifier == "wetap"


def test_a_method_without_a_quant_lever_takes_the_runs_draft_quant():
    assert runspec.parse("chain").quant == "auto" == runspec.DEFAULT_DRAFT_QUANT
    assert runspec.parse("chain", draft_quant="int4").quant == "int4"
    assert runspec.parse("chain+int8", draft_quant="none").quant == "int8"
    assert runspec.parse("chain+noquant").quant == "none"
    assert runspec.parse("ar").quant == "none"  # nothing to quantize
    with pytest.raises(ValueError, match="unknown draft quantization"):
        runspec.parse("chain", draft_quant="fp8")


# ---- one set of defaults -------------------------------------------------------------------------------------------
def test_generate_bench_and_the_python_api_run_the_same_default():
    generate = run_spec(build_parser().parse_args(["generate"]))
    settings = runner.settings_from_args(build_parser().parse_args(["bench"]))
    bench = {c.method: c.spec for c in runner._configs(settings, [])}
    assert runspec.DEFAULT_METHOD in bench and bench[runspec.DEFAULT_METHOD] == generate
    assert generate == runspec.parse("auto") and (generate.policy, generate.quant) == ("auto", "auto")
    assert DecoderConfig.of().method == generate.policy  # SpeculativeDecoder(target, draft)'s method
    assert inspect.signature(pair_loader.load_pair).parameters["draft_quant"].default == generate.quant
    trees = run_spec(build_parser().parse_args(["trees"]))
    assert trees == generate


def test_generate_flags_compose_on_the_name():
    args = build_parser().parse_args(["generate", "--method", "dynatree(adapt=false)@32+int8", "--window", "4",
                                      "--verifier", "naive", "--ngram", "2", "--draft-quant", "none"])
    s = run_spec(args)
    assert (s.policy, s.budget, s.quant, s.ngram, s.verifier) == ("dynatree", 32, "int8", 2, "naive")
    assert runspec.options_for(s) == ({"budget": 32, "adapt": False, "window": 4}, None)
    s = run_spec(build_parser().parse_args(["generate", "--method", "chain", "--k", "3", "--draft-quant", "none"]))
    assert replace(s, name="chain(k=3)") == runspec.parse("chain(k=3)", draft_quant="none")
    lossy = build_parser().parse_args(["generate", "--method", "wetap", "--verifier", "wetap"])
    with pytest.raises(ValueError, match="--allow-lossy"):
        run_spec(lossy)
    assert run_spec(build_parser().parse_args(["generate", "--method", "wetap", "--verifier", "wetap",
                                               "--allow-lossy"])).lossy


def test_lookahead_levers_name_the_window_and_ngram():
    s = runspec.parse("ar+lookahead")
    assert (s.policy, s.needs_draft, s.quant, s.lookahead, s.lookahead_ngram) == ("ar", False, "none", 4, 3)
    assert (runspec.parse("auto+int8+lookahead5x4").lookahead, runspec.parse("auto+lookahead5x4").lookahead_ngram) == (5, 4)
    args = build_parser().parse_args(["generate", "--method", "ar", "--lookahead", "6"])
    assert run_spec(args).lookahead == 6


def test_auto_grafts_suffix_branches_by_default():
    """`auto` without a number: the spec leaves the number to the method (None), the engine grafts AUTO_SUFFIX nodes;
    `+suffixN` and --suffix say otherwise, 0 turns them off; other methods graft none unless asked."""
    from arborspec.drafting.grafts.suffix import default_suffix_nodes

    assert runspec.parse("auto").suffix is None and default_suffix_nodes("auto") == AUTO_SUFFIX > 0
    assert runspec.parse("chain").suffix is None and default_suffix_nodes("chain") == 0
    assert runspec.parse("auto+suffix0").suffix == 0 and runspec.parse("chain+suffix4").suffix == 4
    assert [runspec.parse(m).suffix_nodes for m in ("auto", "chain", "auto+suffix0", "chain+suffix4")] == [AUTO_SUFFIX, 0, 0, 4]
    assert run_spec(build_parser().parse_args(["generate", "--suffix", "0"])).suffix == 0
    assert run_spec(build_parser().parse_args(["generate"])).suffix is None


# ---- models and decoders -------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("private_cache")  # auto's profiles, agreement and logit table: not in ~/.cache
def test_build_decoder_runs_the_spec_exactly(models):
    target, draft = models
    prompt = list(range(3, 12))
    ar = runspec.build_decoder(runspec.parse("ar"), target).generate(prompt, max_new_tokens=12, ignore_eos=True)
    dec = runspec.build_decoder(runspec.parse("chain@3", draft_quant="none"), target, draft)
    assert dec.policy.options.k == 3 and dec.draft is draft.model
    assert dec.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids == ar.token_ids
    dec = runspec.build_decoder(runspec.parse("dyspec(batch=false)"), target, draft, budget=6, draft_temperature=0.5)
    assert (dec.policy.options.budget, dec.policy.options.batch) == (6, False)
    with pytest.raises(ValueError, match="is a baseline"):
        runspec.build_decoder(runspec.parse("hf-assisted"), target, draft)
    dec = runspec.build_decoder(runspec.parse("ar+lookahead3x2+suffix4"), target)
    assert (dec.free.lookahead, dec.free.suffix, dec.draft) == ((3, 2, 3), 4, None)
    assert dec.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids == ar.token_ids
    # auto's default branches: on every tree at T = 0; at T > 0 only on bare trees, those verified by naive
    for temperature, bare, verifier in ((0.0, False, "greedy"), (1.0, True, "traversal+naive")):
        for dec in (runspec.build_decoder(runspec.parse("auto"), target, draft, temperature=temperature),
                    SpeculativeDecoder(target, draft, temperature=temperature)):  # the API's default too
            assert (dec.free.suffix, dec.bare_grafts, dec.verifier_name) == (AUTO_SUFFIX, bare, verifier)
    asked = runspec.build_decoder(runspec.parse("auto+suffix4"), target, draft, temperature=1.0)  # asked for: every tree
    assert (asked.free.suffix, asked.bare_grafts, asked.verifier_name) == (4, False, "naive")
    assert runspec.build_decoder(runspec.parse("auto+suffix0"), target, draft).free.suffix == 0


def test_prepare_draft_resolves_auto_by_measurement_and_copies_on_request(models, monkeypatch, tmp_path):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))  # the int8 draft is cached on disk
    target, draft = models
    calls = []

    def measured(t, d, progress=True):
        calls.append(d)
        return "int8", {"variants": {"int8": {"quant": "int8", "vocab": 0, "agreement": 0.9, "draft_times": [0.01]}}}, "cache"

    monkeypatch.setattr(pair_loader, "choose_draft_quant", measured)
    same, quant, vocab = pair_loader.prepare_draft(target, draft, "none")
    assert same is draft and (quant, vocab) == ("none", 0) and not calls
    prepared, quant, vocab = pair_loader.prepare_draft(target, draft, "auto", copy_first=True, progress=False)
    assert (quant, vocab) == ("int8", 0) and calls == [draft] and prepared is not draft
    assert type(draft.model.model.layers[0].mlp.up_proj) is torch.nn.Linear  # the original is untouched
    assert type(prepared.model.model.layers[0].mlp.up_proj) is not torch.nn.Linear


@pytest.mark.usefixtures("private_cache")  # the int8 draft it prepares: not in ~/.cache
def test_load_pair_checks_the_pair(tmp_path):
    target = tiny_model("llama", seed=0)
    save_models(tmp_path, {"target": target, "draft": noisy_copy(target, 0.2)})
    pair = pair_loader.load_pair(str(tmp_path / "target"), str(tmp_path / "draft"), draft_quant="none", dtype="fp32",
                          progress=False)
    t, d = pair  # unpacks as (target, draft); the server also reads what was decided
    assert t.model.dtype == d.model.dtype == torch.float32 and t.tokenizer.get_vocab() == d.tokenizer.get_vocab()
    assert (pair.quant, pair.backends, pair.choice) == ("none", ("torch", "torch"), "")
    int8 = pair_loader.load_pair(str(tmp_path / "target"), str(tmp_path / "draft"), draft_quant="int8", dtype="fp32",
                          progress=False)
    assert int8.quant == "int8"  # the quantization the draft was prepared with, which requests are checked against
    t, d = pair_loader.load_pair(str(tmp_path / "target"), None, dtype="fp32", progress=False)
    assert d is None
    with pytest.raises(ValueError, match="unknown draft quantization"):
        pair_loader.load_pair(str(tmp_path / "target"), str(tmp_path / "draft"), draft_quant="int3")


def test_load_pair_refuses_what_the_engine_would_before_measuring_draft_variants(tmp_path, monkeypatch):
    """With draft_quant "auto" the variants were measured first: a draft whose table is short of the tokenizer failed
    with an IndexError inside the measurement, not the engine's clear refusal."""
    from arborspec.tuning import draft_choice
    monkeypatch.setattr(draft_choice, "choose_draft_quant", lambda *a, **k: pytest.fail("measured a refused pair"))
    tok = char_tokenizer()
    for name, vocab in (("target", None), ("short", len(tok) - 7)):
        model = tiny_model("llama", seed=0) if vocab is None else tiny_model("llama", seed=0, vocab=vocab)
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    with pytest.raises(ValueError, match="do not cover the tokenizer"):
        pair_loader.load_pair(str(tmp_path / "target"), str(tmp_path / "short"), dtype="fp32", progress=False)
