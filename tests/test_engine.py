"""Greedy speculative decoding is token-identical to plain greedy decoding of the target."""
import random
import time

import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.engine.stats import GenerationStats
from tests.conftest import noisy_copy, tiny_model

SHAPES = [
    ("chain", {"k": 1}),
    ("chain", {"k": 4}),
    ("static", {"depth": 3, "branch": 2}),
    ("static", {"depth": 5, "branch": 1}),
    ("static", {"widths": "4,3,3,2"}),
]


def hf_greedy(model, ids, n):
    """Reference: plain greedy decoding without any cache (a full forward per token)."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(tok)
            out.append(tok)
    return out


@pytest.fixture(scope="module", params=["llama", "gpt_neox", "gpt2", "qwen2"])
def pair(request):
    target = tiny_model(request.param, seed=0)
    return target, noisy_copy(target, noise=0.3)


def test_ar_matches_plain_greedy(pair):
    target, _ = pair
    rng = random.Random(0)
    for _ in range(3):
        prompt = [rng.randrange(2, 56) for _ in range(rng.randrange(1, 10))]
        res = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=20, ignore_eos=True)
        assert res.token_ids == hf_greedy(target, prompt, 20)
        assert res.stats.n_steps == 19  # decoding steps: the first token came from the prompt's forward
        assert res.stats.steps[0].prefill and not any(s.prefill for s in res.stats.steps[1:])


def test_sample_one_draws_the_distribution():
    """sampling.sample_one (every verifier's bonus draw, the plain loop's pick): inverse CDF, so frequencies follow the
    (unnormalised) weights and a zero-weight token is never drawn, not even at the ends of the vocabulary."""
    from arborspec.core.sampling import make_generator, sample_one

    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 0.5, 0.0, 0.5, 0.0], dtype=torch.float64)
    gen = make_generator(0)
    n = 20000
    counts = torch.bincount(torch.tensor([sample_one(weights, gen) for _ in range(n)]), minlength=len(weights))
    expected = n * weights / weights.sum()
    assert counts[weights == 0].sum() == 0
    chi2 = float(((counts - expected)[weights > 0] ** 2 / expected[weights > 0]).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001
    assert sample_one(torch.tensor([0.0, 1e-300, 0.0], dtype=torch.float64), gen) == 1


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_plain_loop_equals_the_general_loop(pair, temperature, top_p):
    """`ar` (and `auto` when no tree can pay) runs the engine's plain loop: one forward and one pick a step, the whole
    prompt in the first forward, no verifier. It commits what the general loop commits with root-only trees: the
    argmax at T = 0, the same seeded draws at T > 0."""
    target, _ = pair
    rng = random.Random(2)
    for seed in range(3):
        prompt = [rng.randrange(2, 56) for _ in range(rng.randrange(1, 10))]
        plain = SpeculativeDecoder(target, method="ar", temperature=temperature, top_p=top_p)
        plain.verifier.verify = lambda *args: pytest.fail("the plain loop runs no verifier")
        general = SpeculativeDecoder(target, method="ar", temperature=temperature, top_p=top_p)
        general.policy.plain = False  # the same policy, stepped through draft -> verify -> commit
        a = plain.generate(prompt, max_new_tokens=20, seed=seed, ignore_eos=True)
        b = general.generate(prompt, max_new_tokens=20, seed=seed, ignore_eos=True)
        assert a.token_ids == b.token_ids and a.stats.n_steps == b.stats.n_steps == 19
        assert 0 < a.stats.t_prefill <= a.stats.t_first_token <= a.stats.t_total


@pytest.mark.parametrize("method,options", SHAPES)
def test_speculative_matches_ar(pair, method, options):
    target, draft = pair
    rng = random.Random(1)
    accepted = 0
    for _ in range(4):
        prompt = [rng.randrange(2, 56) for _ in range(rng.randrange(1, 10))]
        n = rng.randrange(5, 30)
        ref = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=n, ignore_eos=True)
        res = SpeculativeDecoder(target, draft, method=method, **options).generate(prompt, max_new_tokens=n, ignore_eos=True)
        assert res.token_ids == ref.token_ids
        assert len(res.token_ids) == n  # max_new_tokens is met exactly, even when reached mid-path
        accepted += sum(s.accepted for s in res.stats.steps)
    assert accepted > 0  # the noisy draft agrees sometimes, so accepted paths were exercised


def test_eos_inside_an_accepted_path_stops_there():
    target = tiny_model("llama", seed=0)
    prompt = [5, 9, 14, 3]
    free = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
    eos = free[6]  # pretend the 7th generated token is EOS
    target.generation_config.eos_token_id = eos
    draft = noisy_copy(target, noise=0.0)  # a perfect draft: EOS arrives in the middle of an accepted chain
    res = SpeculativeDecoder(target, draft, method="chain", k=8).generate(prompt, max_new_tokens=30)
    assert res.token_ids == free[: free.index(eos) + 1]
    assert res.stats.finish_reason == "eos"
    first, chain = res.stats.steps[:2]  # the prompt's forward gives the first token, then the chain follows it
    assert (first.accepted, first.committed) == (0, 1)
    assert chain.accepted > free.index(eos)  # the path ran past EOS and was cut


def test_logprobs_of_a_step_cut_at_eos_come_from_their_own_rows():
    """EOS in the middle of an accepted path cuts the step's tokens: each kept token's logprob is still read from the
    row that predicts it (plain decoding's), not from the end of the path."""
    target = tiny_model("llama", seed=0)
    prompt = [5, 9, 14, 3]
    free = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
    target.generation_config.eos_token_id = free[6]
    plain = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=30, logprobs=1)
    spec = SpeculativeDecoder(target, noisy_copy(target, noise=0.0), method="chain", k=8).generate(
        prompt, max_new_tokens=30, logprobs=1)
    assert spec.token_ids == plain.token_ids and spec.stats.finish_reason == "eos"
    assert spec.stats.steps[1].accepted > spec.stats.steps[1].committed - 1  # the path ran past EOS and was cut
    for got, want in zip(spec.logprobs, plain.logprobs, strict=True):
        assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_a_step_drafts_no_deeper_than_its_bonus_can_use():
    """A tree's nodes below depth (tokens left - 1) could never be kept: the step's bonus token would not fit."""
    target = tiny_model("llama", seed=0)
    res = SpeculativeDecoder(target, noisy_copy(target, noise=0.0), method="chain", k=6).generate(
        [5, 9, 14], max_new_tokens=5, ignore_eos=True)
    left = 5
    for step in res.stats.steps:
        assert step.depth <= max(left - 1, 0)
        left -= step.committed
    assert left == 0 and res.stats.steps[1].depth == 3  # the perfect draft fills the room it has


def test_the_first_result_is_the_first_token_and_prefill_counts_both_models():
    """The first result of `steps` carries the time to its token (t_first_token = t_total then); a speculative
    run's t_prefill holds the target's prompt forward and the draft's prefill after it."""
    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, noise=0.1)
    dec = SpeculativeDecoder(target, draft, method="chain", k=3)
    first = next(dec.steps([5, 9, 14], 8, ignore_eos=True))
    assert first.stats.t_first_token == first.stats.t_total > 0
    for model in (target, draft):  # both are this test's own: nothing to restore
        model.forward = lambda *a, forward=model.forward, **k: (time.sleep(0.2), forward(*a, **k))[1]
    res = dec.generate([5, 9, 14], 2, ignore_eos=True)  # the target's first forward, then the draft's prefill
    assert res.stats.t_prefill >= 0.4


def test_perfect_draft_accepts_everything():
    target = tiny_model("qwen2", seed=2)
    res = SpeculativeDecoder(target, noisy_copy(target, 0.0), method="chain", k=4).generate(
        [7, 8, 9], max_new_tokens=25, ignore_eos=True)
    first, *drafted = res.stats.steps  # the first token comes from the prompt's forward
    assert (first.tree_size, first.committed) == (0, 1)
    assert [s.accepted for s in drafted[:-1]] == [4] * (len(drafted) - 1)
    assert res.stats.tokens_per_step > 4


def test_stop_strings_and_text(tokenizer):
    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, 0.2)
    dec = SpeculativeDecoder(target, draft, method="static", tokenizer=tokenizer, depth=3, branch=2)
    full = dec.generate("def f(x):", max_new_tokens=40, ignore_eos=True)
    stop = full.text[10:12]
    cut = dec.generate("def f(x):", max_new_tokens=40, ignore_eos=True, stop=[stop])
    assert cut.stats.finish_reason == "stop"
    assert stop in cut.text and full.text.startswith(cut.text)
    assert cut.text.index(stop) + len(stop) == len(cut.text)  # stopped right after the stop string
    assert "".join(dec.stream("def f(x):", max_new_tokens=40, ignore_eos=True)) == full.text
    assert dec.generate("def f(x):", max_new_tokens=40, ignore_eos=True, stop=stop).text == cut.text  # one string
    longer = dec.generate("def f(x):", max_new_tokens=60, ignore_eos=True).text
    long = longer[3:40]  # 37 characters, a token each: past the 32 tokens whose text the check once read
    cut = dec.generate("def f(x):", max_new_tokens=60, ignore_eos=True, stop=long)
    assert cut.stats.finish_reason == "stop" and cut.text == longer[:40]
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):  # a bare model: they never matched
        SpeculativeDecoder(dec.target, dec.draft, method="chain").generate([5, 6], max_new_tokens=4, stop=["a"])
    with pytest.raises(ValueError, match="stop must be a string or a list of strings, got int"):
        dec.generate("def f(x):", max_new_tokens=4, stop=5)
    with pytest.raises(ValueError, match="ignore_eos must be true or false, got 'no'"):
        dec.generate("def f(x):", max_new_tokens=4, ignore_eos="no")
    for bad in ([""], [stop, ""], [None]):
        with pytest.raises(ValueError, match="non-empty strings"):
            dec.generate("def f(x):", max_new_tokens=4, stop=bad)
    with pytest.raises(ValueError, match="a stop string is not valid Unicode text"):  # it could never match
        dec.generate("def f(x):", max_new_tokens=4, stop=["x\ud800"])
    at_budget = full.text.index(stop) + len(stop)  # the stop string completed by the budget's last token
    last = dec.generate("def f(x):", max_new_tokens=at_budget, ignore_eos=True, stop=[stop])
    assert last.text.endswith(stop) and last.stats.finish_reason == "stop"  # it read "length"


def cut(tokens: list[int], stop: list[str] | None = None, eos=(), budget: int = 500,
        window: int = 1000) -> tuple[list[int], str]:
    """What a generation after a one-token prompt keeps of a step's `tokens` under the stopping rules, and why it
    stops (Generation._cut); its text is the tokens read as UTF-8 bytes."""
    from arborspec.engine.generation import Generation

    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    stats = GenerationStats("ar", "greedy", False, 1)
    return Generation([65], budget, stop, set(eos), window, decode, stats, None, 0.0)._cut(tokens)


def test_a_stop_string_holding_u_fffd_waits_for_a_split_character():
    """Tokens here are bytes; U+008F is two, c2 8f. After the first the text ended in the U+FFFD of half a character,
    and a stop string holding U+FFFD ended the generation there. A tail decoded from the middle of a character
    begins with one too. A byte that stays invalid (ff) still matches, a token later."""
    stop = ["\ufffd"]
    assert cut([103, 0xC2, 0x8F, 104], stop) == ([103, 0xC2, 0x8F, 104], "")
    assert cut([65] * 2 + [0xC2, 0x8F] * 40, stop) == ([65] * 2 + [0xC2, 0x8F] * 40, "")  # tails that start at 8f
    assert cut([103, 0xFF, 104, 105], stop) == ([103, 0xFF, 104], "stop")


def test_a_stop_string_of_multi_byte_characters_is_found_past_32_tokens():
    """Tokens here are bytes, and the characters three each. The stop check decodes a tail of tokens; 32 of them end
    in the 10 whole characters before them and begin with 2 bytes of a cut one (2 U+FFFD, dropped): an 11-character
    stop string needs the tail to reach past that, which the margin for a cut character gives."""
    text = "".join(chr(0x4E00 + i) for i in range(40))  # 40 CJK characters, 120 bytes
    tokens = list(text.encode())
    assert cut(tokens, [text[20:31]]) == (tokens[:93], "stop")  # the stop string ends at byte 93


def test_eos_is_the_reason_even_on_the_budgets_or_the_windows_last_token():
    """A model that ends on its own at the last token it had room for finished with "eos", not "length" or
    "context" (the server sends that on: OpenAI's "stop", not "length")."""
    assert cut([5, 7, 9], eos={7}, budget=2) == ([5, 7], "eos")
    assert cut([5, 7, 9], eos={7}, window=3) == ([5, 7], "eos")
    assert cut([5, 7, 9], eos={7}, budget=1) == ([5], "length")


def test_a_stream_joins_up_to_the_text_when_the_tokenizer_cleans_up_spaces(tokenizer):
    """With clean_up_tokenization_spaces, decoding " ," gave "," once the comma came, rewriting a space the stream
    had sent: the joined stream kept the space and lost the comma."""
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.clean_up_tokenization_spaces = True
    dec = SpeculativeDecoder(tiny_model("llama", seed=3), method="ar", tokenizer=tok, temperature=3.0)
    whole = dec.generate("a , b . c", 40, ignore_eos=True, seed=81).text
    assert " ," in whole  # the case: a space, then a comma in a later step
    assert "".join(dec.stream("a , b . c", 40, ignore_eos=True, seed=81)) == whole


def byte_tokenizer():
    """A tokenizer whose tokens are bytes (byte-level BPE without merges) and an EOS: texts can end in the middle of
    a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0} | {c: i + 1 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_a_stream_sends_the_whole_text_in_pieces_that_are_never_empty():
    """A stream holds back a text ending in U+FFFD (half a character) until the rest comes, but not at the end: a
    generation whose budget ends mid-character still sends its last piece. A last step that adds no text (EOS)
    sends no empty piece. Random bytes at T = 3 end both ways within a few seeds (2 and 17 on the hosts here)."""
    model = tiny_model("llama", vocab=257)
    model.generation_config.eos_token_id = 0
    dec = SpeculativeDecoder(model, method="ar", tokenizer=byte_tokenizer(), temperature=3.0)
    cases = {"mid-character": None, "eos": None}
    for seed in range(100):
        whole = dec.generate("ab", 12, seed=seed)
        case = "eos" if whole.stats.finish_reason == "eos" else "mid-character" if whole.text.endswith("\ufffd") else ""
        if case and cases[case] is None:
            cases[case] = seed
            pieces = list(dec.stream("ab", 12, seed=seed))
            assert "".join(pieces) == whole.text and "" not in pieces, (case, seed)
    assert None not in cases.values(), cases


def test_a_bad_seed_in_a_batch_is_refused_before_any_prompt_runs(tokenizer, monkeypatch):
    dec = SpeculativeDecoder(tiny_model("llama", seed=0), method="ar", tokenizer=tokenizer)
    monkeypatch.setattr(type(dec), "fork", lambda self: pytest.fail("a prompt started"))
    with pytest.raises(ValueError, match="seed must be an integer"):
        dec.generate_batch(["ab", "cd", "ef"], 8, seeds=[1, 2, "oops"], concurrency=1)


def test_context_window_is_respected():
    target = tiny_model("llama", seed=0, context=32)
    draft = noisy_copy(target, 0.2)
    dec = SpeculativeDecoder(target, draft, method="chain", k=6)
    res = dec.generate(list(range(2, 27)), max_new_tokens=50, ignore_eos=True)
    assert res.stats.finish_reason == "context" and 25 + len(res.token_ids) == 32
    with pytest.raises(ValueError, match="context window"):
        dec.generate(list(range(2, 34)) + [2] * 5, max_new_tokens=5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="nope"), "unknown method"),
        (dict(method="chain", k=0), "k must be an integer >= 1"),
        (dict(method="chain", depth=3), "takes no option 'depth'"),
        (dict(method="static", widths="3,x"), "comma-separated"),
        (dict(method="static", verifier="nope"), "unknown verifier"),
        (dict(method="static", temperature=-1), "temperature"),
        (dict(method="static", temperature=0.7, verifier="greedy"), "temperature 0"),
        (dict(method="static", temperature=1e-40), "temperature must be 0"),  # logits / T would overflow float32
        (dict(method="static", top_k=2.0), "top_k"),
        (dict(method="static", seed="1"), "seed"),
        (dict(method="static", max_new_tokens=8), "argument of generate"),
        (dict(method="static", do_sample=True), "do_sample"),
        (dict(method="chain", repetition_penalty=1.2), "repetition_penalty is not supported: arborspec verifies"),
        # transformers keywords once refused as "method 'auto' takes no option ...", as if another method took them
        (dict(suppress_tokens=[3]), "suppress_tokens is not supported: arborspec verifies against the target's own"),
        (dict(stop_strings=["x"]), r"stop_strings is not supported: give generate\(\) stop=\[...\]"),
        (dict(output_scores=True), "output_scores is not supported: generate.* returns a GenerationResult"),
        (dict(prompt_lookup_num_tokens=3), r"prompt_lookup_num_tokens is not supported: .*ngram=N"),
        (dict(method="chain", max_length=20), "max_length is not supported: give generate"),
        (dict(method="static", temperature=True), "temperature must be"),  # read as 1.0
        (dict(method="static", temperature=0.7, top_p="0.9"), "top_p must be"),  # a TypeError naming nothing
        (dict(method="static", draft_temperature=-2.0), "draft_temperature must be"),  # at T = 0 as well
        (dict(method="static", temperature=0.5, seed=2**70), "seed must be an integer in"),
        # a tree past MAX_TREE_NODES (1024): these ran until memory ran out, on a server at one client's request
        (dict(method="static", depth=100, branch=100), "has more than a billion drafted nodes; .* at most 1024$"),
        (dict(method="static", widths="600,600"), "at most 1024"),
        (dict(method="static", depth=10, branch=2), "has 2046 drafted nodes"),  # depth 9 (1022): the next test
        (dict(method="dyspec", budget=100_000), "at most 1024"),
        (dict(method="beam", beams=200_000), "at most"),
        (dict(method="chain", k=5000), "at most 1024"),
        (dict(method="auto", max_nodes=5000), "at most 1024"),
        # used by truthiness: allow_lossy="no" ran a lossy verifier
        (dict(method="static", temperature=1.0, verifier="wetap", allow_lossy="no"), "allow_lossy must be true or"),
        (dict(method="static", record_trees="yes"), "record_trees must be true or false"),
        # a float option that is no number failed inside a comparison ("'<' not supported ...") or ran as 1
        (dict(method="dynatree", tau_h="0.9"), "tau_h must be a number, got '0.9'"),
        (dict(method="wetap", alpha=None), "alpha must be a number, got None"),
        (dict(method="auto", guard_margin="0.1"), "guard_margin must be a number"),
        (dict(method="suffix", factor=True), "factor must be a number, got True"),
        (dict(method="beam", steps=1000), "steps x beams = 3000 drafted tokens a step; at most 1024"),
    ],
)
def test_bad_configuration_is_refused(kwargs, match):
    target = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target, noisy_copy(target, 0.1), **kwargs)


def test_a_tree_just_under_the_node_limit_is_allowed():
    from arborspec.drafting.static import StaticOptions

    assert StaticOptions(depth=9, branch=2).depth == 9  # 1022 drafted nodes, the limit 1024


def test_an_option_given_twice_is_refused():
    """method_options={"k": 3} with k=4 ran k = 4 in silence."""
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="k is given twice, in method_options and as a keyword"):
        SpeculativeDecoder(target, noisy_copy(target, 0.1), method="chain", method_options={"k": 3}, k=4)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sampling=0.7), "sampling must be a SamplingConfig, got float"),
    (dict(method_options=None), "method_options must be a dict"),
])
def test_config_fields_of_the_wrong_type_are_named(kwargs, match):
    target = tiny_model("llama")
    with pytest.raises(TypeError, match=match):
        SpeculativeDecoder(target, noisy_copy(target, 0.1), method="static", **kwargs)


def test_bad_prompts_are_refused():
    target = tiny_model("llama")
    dec = SpeculativeDecoder(target, method="ar")
    with pytest.raises(ValueError, match="empty"):
        dec.generate([], max_new_tokens=3)
    for budget in (0, 2.0, True):
        with pytest.raises(ValueError, match="max_new_tokens"):
            dec.generate([3], max_new_tokens=budget)
    with pytest.raises(ValueError, match="seed"):
        dec.generate([3], max_new_tokens=2, seed=1.5)
    with pytest.raises(ValueError, match="prompt_logprobs must be true or false"):  # "no" was true
        dec.generate([3, 4], max_new_tokens=0, logprobs=1, prompt_logprobs="no")
    for messages, n in (([{"role": "user", "content": "a"}, {"content": "b"}], 1), ([{"content": "hi"}], 0)):
        with pytest.raises(ValueError, match=f"chat message {n} has no 'role'"):  # was "token ids must be integers"
            dec.generate(messages, max_new_tokens=2)


@pytest.mark.parametrize("call", ["generate", "stream", "steps", "generate_batch"])
def test_settings_passed_per_call_name_the_constructor(call):
    """transformers users pass temperature (or do_sample, min_p) to each generate call: Python's bare "unexpected
    keyword argument" named neither where it goes nor why; the refusal comes at the call, before any step."""
    dec = SpeculativeDecoder(tiny_model("llama"), method="ar")
    prompt = [[3]] if call == "generate_batch" else [3]
    with pytest.raises(TypeError, match=r"temperature is a setting of SpeculativeDecoder\(\.\.\., temperature="):
        getattr(dec, call)(prompt, max_new_tokens=2, temperature=0.7)
    with pytest.raises(TypeError, match="min_p is not an argument of .*: arborspec verifies .* with temperature"):
        getattr(dec, call)(prompt, max_new_tokens=2, min_p=0.1)
    with pytest.raises(TypeError, match="do_sample is not an argument"):
        getattr(dec, call)(prompt, max_new_tokens=2, do_sample=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        getattr(dec, call)(prompt, max_new_tokens=2, bogus=1)
    # transformers' generate(**tokenizer(text, return_tensors="pt")) and its streamer
    with pytest.raises(TypeError, match="input_ids is not an argument of .*: pass the prompt .* as generate"):
        getattr(dec, call)(input_ids=prompt, max_new_tokens=2)
    with pytest.raises(TypeError, match=r"streamer is not an argument of .*: stream\(\) yields"):
        getattr(dec, call)(prompt, max_new_tokens=2, streamer=object())
    with pytest.raises(TypeError, match=r"stop_strings is not an argument of .*: give generate\(\) stop="):
        getattr(dec, call)(prompt, max_new_tokens=2, stop_strings=["x"])
    if call == "generate_batch":  # seeds=[...], one per prompt: seed= named the constructor, which has one too
        with pytest.raises(TypeError, match=r"generate_batch\(\) takes seeds=\[...\], one seed"):
            dec.generate_batch(prompt, max_new_tokens=2, seed=3)


def test_nan_logits_are_refused():
    target = tiny_model("llama")
    with torch.no_grad():
        target.get_output_embeddings().weight[5, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite"):
        SpeculativeDecoder(target, method="ar").generate([3, 4], max_new_tokens=3)


def test_api_refuses_draft_with_another_tokenizer(tokenizer):
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({"<unk>": 0, "x": 1}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")
    target = SimpleNamespace(model=tiny_model("llama"), tokenizer=tokenizer, name="t")
    draft = SimpleNamespace(model=tiny_model("llama", seed=3), tokenizer=other, name="d")
    with pytest.raises(ValueError, match="tokenizers differ"):
        SpeculativeDecoder(target, draft, method="chain")


def test_per_position_acceptance_and_zero_accept_share():
    target = tiny_model("qwen2", seed=2)
    perfect = SpeculativeDecoder(target, noisy_copy(target, 0.0), method="chain", k=4).generate(
        [7, 8, 9], max_new_tokens=25, ignore_eos=True).stats
    assert perfect.accepted_at_depth[:4] == [1.0, 1.0, 1.0, 1.0]
    assert perfect.zero_accept_share == 0.0
    noisy = SpeculativeDecoder(target, noisy_copy(target, 3.0), method="chain", k=4).generate(
        [7, 8, 9], max_new_tokens=25, ignore_eos=True).stats
    shares = noisy.accepted_at_depth
    assert shares == sorted(shares, reverse=True)  # accepting depth d needs depth d-1 accepted too
    steps = [s for s in noisy.steps if s.tree_size]
    assert 0 < noisy.zero_accept_share == sum(s.accepted == 0 for s in steps) / len(steps)
    assert noisy.to_dict()["accepted_at_depth"] == shares


# ---- which source supplied the accepted tokens -------------------------------------------------------------------
def repeating_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 56) for _ in range(8)] * 3  # repeats, so n-gram and suffix branches get drafted


def test_per_source_counts_add_up_to_the_steps_counts():
    import json

    target = tiny_model("llama", seed=0)
    dec = SpeculativeDecoder(target, noisy_copy(target, 0.5), method="static", depth=2, branch=2, ngram=3,
                             suffix=6)
    seen = set()
    for seed in range(3):
        res = dec.generate(repeating_prompt(seed), max_new_tokens=24, ignore_eos=True)
        for step in res.stats.steps:
            assert sum(c["accepted"] for c in step.sources.values()) == step.accepted
            assert sum(c["proposed"] for c in step.sources.values()) == step.tree_size
            assert all(c["accepted"] <= c["proposed"] for c in step.sources.values())
            seen |= {s for s, c in step.sources.items() if c["accepted"]}
        total = res.stats.sources
        assert sum(c["accepted"] for c in total.values()) == sum(s.accepted for s in res.stats.steps)
        assert json.loads(json.dumps(res.stats.to_dict(per_step=True)))["sources"] == total
    assert "draft" in seen and seen & {"ngram", "suffix"}  # several sources supplied tokens: the sums mean something


def test_a_suffix_only_run_credits_everything_to_suffix():
    target = tiny_model("llama", seed=0)
    dec = SpeculativeDecoder(target, method="suffix")
    res = dec.generate(repeating_prompt(1), max_new_tokens=24, ignore_eos=True)
    total = res.stats.sources
    assert set(total) == {"suffix"} and total["suffix"]["accepted"] == sum(s.accepted for s in res.stats.steps) > 0
    assert total["suffix"]["proposed"] == sum(s.tree_size for s in res.stats.steps)
    plain = SpeculativeDecoder(target, method="ar").generate(repeating_prompt(1), max_new_tokens=8, ignore_eos=True)
    assert plain.stats.sources == {} and plain.stats.to_dict()["sources"] == {}


# ---- the decoder's settings as one value ---------------------------------------------------------------------------
def test_a_config_runs_what_the_same_keywords_run():
    """DecoderConfig.of reads SpeculativeDecoder's keywords: sampling into `sampling`, its fields by name, the rest as
    the policy's options; a decoder made from that config (or forked) commits the same tokens from the same seed."""
    from dataclasses import replace

    from arborspec import DecoderConfig
    from arborspec.core.sampling import SamplingConfig

    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, 0.3)
    kw = dict(method="static", depth=2, branch=2, temperature=0.8, top_k=5, ngram=3, token_order="dfs")
    config = DecoderConfig.of(**kw)
    assert (config.sampling, config.method_options, config.ngram) == (SamplingConfig(0.8, 5),
                                                                      {"depth": 2, "branch": 2}, 3)
    assert config.draft_sampling == SamplingConfig(0.8, 5)
    assert replace(config, draft_temperature=0.0).draft_sampling.greedy
    by_keywords = SpeculativeDecoder(target, draft, **kw)
    by_config = SpeculativeDecoder(target, draft, config)
    assert by_config.config == by_keywords.config == by_keywords.fork().config
    runs = [d.generate([3, 4, 5, 3, 4, 5, 3], max_new_tokens=16, seed=2, ignore_eos=True).token_ids
            for d in (by_keywords, by_config, by_keywords.fork())]
    assert runs[0] == runs[1] == runs[2]
    # keywords on top of a config: the config's settings stay, the keyword wins
    greedy = SpeculativeDecoder(target, draft, config, temperature=0.0)
    assert greedy.sampling.greedy and greedy.policy.options.depth == 2 and greedy.verifier.name == "greedy"
    with pytest.raises(TypeError, match="DecoderConfig"):
        SpeculativeDecoder(target, draft, "chain")  # the old third positional argument, refused by name
    with pytest.raises(TypeError, match="config="):
        SpeculativeDecoder(target, config)  # a config in the draft's place
    for models in (("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"), (target, "some/dir"), (None, draft)):
        with pytest.raises(TypeError, match="expected a loaded model.*arborspec.load_model"):  # not deep inside
            SpeculativeDecoder(*models, method="chain")
    for tokenizer in ("gpt2", 5):  # accepted, then "'str' object is not callable" at the first generate
        with pytest.raises(TypeError, match="tokenizer must be a loaded tokenizer"):
            SpeculativeDecoder(target, draft, tokenizer=tokenizer, method="chain")
    with pytest.raises(ValueError, match="ngram_len must be"):  # 0 drafted no n-gram branch and said nothing
        SpeculativeDecoder(target, method="ar", ngram=3, ngram_len=0)
    with pytest.raises(ValueError, match="unknown token order"):
        DecoderConfig(token_order="random")


def test_the_sampling_seed_is_the_default_seed_of_a_generation():
    """SamplingConfig carries a request's seed (the server's one sampling type): a generation that names no seed
    draws from it; one that names a seed draws from that."""
    from arborspec import DecoderConfig
    from arborspec.core.sampling import SamplingConfig

    target = tiny_model("llama", seed=0)
    prompt = [3, 4, 5]
    want = [SpeculativeDecoder(target, method="ar", temperature=1.0).generate(prompt, max_new_tokens=12, seed=s,
                                                                              ignore_eos=True).token_ids
            for s in (7, 8)]
    assert want[0] != want[1]  # the seed decides something here
    seeded = SpeculativeDecoder(target, config=DecoderConfig(method="ar", sampling=SamplingConfig(1.0, seed=7)))
    assert seeded.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids == want[0]
    keyword = SpeculativeDecoder(target, method="ar", temperature=1.0, seed=7)  # as transformers users write it
    assert keyword.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids == want[0]
    assert seeded.generate(prompt, max_new_tokens=12, seed=8, ignore_eos=True).token_ids == want[1]


def test_the_engine_reaches_free_branches_only_through_free_branches():
    """The loop calls one FreeBranches object (drafting/grafts/branches.py); no engine module imports the n-gram,
    suffix, lookahead or budget modules themselves."""
    from tests.test_structure import find_modules, import_graph

    graph = import_graph(find_modules())
    grafts = "arborspec.drafting.grafts"
    reached = {t for m, targets in graph.items() if m.startswith("arborspec.engine") for t in targets
               if t.startswith(grafts)}
    assert reached == {grafts}


def test_the_first_token_comes_before_the_draft_reads_the_prompt():
    # the prompt's forward gives the first token, streamed before the draft's prefill (time to first token is the
    # target's prefill alone); a request that ends at its first token never runs the draft
    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, noise=0.3)
    calls = []
    draft.register_forward_hook(lambda module, args, out: calls.append(1))
    dec = SpeculativeDecoder(target, draft, method="chain", k=3)
    steps = dec.steps([5, 9, 14, 3], max_new_tokens=12, ignore_eos=True)
    first = next(steps)
    assert len(first.token_ids) == 1 and not calls
    assert first.token_ids == hf_greedy(target, [5, 9, 14, 3], 1)
    rest = list(steps)
    assert calls and rest[0].stats.steps[1].tree_size > 0
    assert rest[-1].token_ids == hf_greedy(target, [5, 9, 14, 3], 12)
    calls.clear()
    one = dec.generate([5, 9, 14, 3], max_new_tokens=1)
    assert len(one.token_ids) == 1 and not calls


def test_each_result_of_steps_keeps_the_counts_of_its_own_step():
    """Every result shared one stats object that later steps kept changing: a caller keeping the first result saw
    the final new_tokens, finish reason and steps beside its one token."""
    target = tiny_model("llama")
    dec = SpeculativeDecoder(target, noisy_copy(target, 0.2), method="chain", k=3)
    results = list(dec.steps([5, 9, 14, 3], max_new_tokens=12, ignore_eos=True))
    assert len(results) > 2
    for r in results:
        assert r.stats.new_tokens == len(r.token_ids) == sum(s.committed for s in r.stats.steps)
    assert [r.stats.finish_reason for r in results] == [""] * (len(results) - 1) + ["length"]
    auto = SpeculativeDecoder(target, noisy_copy(target, 0.2))  # the policy's account comes with the last result
    for n in (1, 6):  # one token: the prompt's forward alone ends the run
        assert auto.generate([5, 9, 14, 3], max_new_tokens=n, ignore_eos=True).stats.policy, n


@pytest.mark.parametrize("method,options", [("ar", {}), ("chain", {"k": 3})])
def test_generate_decodes_the_text_once_not_at_every_step(tokenizer, monkeypatch, method, options):
    """Each step's result decoded the whole text so far, which `generate` threw away: quadratic in the length (4000
    tokens of a tiny model with Qwen's tokenizer: 16.6 s, 13.4 without). `steps(partial=False)` builds the last
    alone."""
    from arborspec.engine import generation

    target = tiny_model("llama")
    dec = SpeculativeDecoder(target, noisy_copy(target, 0.2), method=method, tokenizer=tokenizer, **options)
    full = list(dec.steps("abc", max_new_tokens=40, ignore_eos=True))
    quiet = list(dec.steps("abc", max_new_tokens=40, ignore_eos=True, partial=False))
    assert len(quiet) == len(full) > 5 and quiet[:-1] == [None] * (len(quiet) - 1)
    assert (quiet[-1].text, quiet[-1].token_ids, quiet[-1].stats.n_steps) == \
        (full[-1].text, full[-1].token_ids, full[-1].stats.n_steps)
    results = []
    monkeypatch.setattr(generation.Generation, "_result",
                        lambda self, real=generation.Generation._result: results.append(1) or real(self))
    assert dec.generate("abc", max_new_tokens=40, ignore_eos=True).text == full[-1].text
    assert [r.text for r in dec.generate_batch(["abc", "ba"], max_new_tokens=40, ignore_eos=True)][0] == full[-1].text
    assert len(results) == 3  # one result each


def test_tokens_per_second_counts_the_time_after_the_first_token_draft_prefill_included():
    """The prompt's forward makes the first token, and a speculative run prefills its draft after it: throughput is
    the tokens after the first over the time after the first, the same terms for plain and speculative runs."""
    stats = GenerationStats("auto", "greedy", False, prompt_tokens=10, new_tokens=5, t_prefill=1.5,
                            t_first_token=1.0, t_total=3.0)  # the draft's 0.5 s of prefill inside t_prefill
    assert stats.tokens_per_s == pytest.approx(4 / 2.0)
    assert stats.tokens_per_s == pytest.approx(1 / stats.tpot)
    one = GenerationStats("auto", "greedy", False, prompt_tokens=10, new_tokens=1, t_prefill=0.9,
                          t_first_token=0.9, t_total=0.9002)
    assert one.tokens_per_s == 0.0  # no token after the first: no rate (it read 5000 tokens/s)


def test_logprobs_are_the_targets_whether_a_token_was_drafted_or_not(pair):
    """generate(logprobs=k): one entry per token, the target's log-probability at its position and its k best
    alternatives; a speculative run reads them from its verified rows and gets what plain decoding gets."""
    target, draft = pair
    prompt = [5, 9, 14, 3, 7]
    plain = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=12, ignore_eos=True, logprobs=4)
    spec = SpeculativeDecoder(target, draft, method="static", depth=3, branch=2).generate(
        prompt, max_new_tokens=12, ignore_eos=True, logprobs=4)
    assert spec.token_ids == plain.token_ids and len(spec.logprobs) == len(spec.token_ids) == 12
    assert sum(s.accepted for s in spec.stats.steps) > 0  # some tokens did come from drafted trees
    for got, want, token in zip(spec.logprobs, plain.logprobs, spec.token_ids):
        assert got.token == token and got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top] and got.top[0] == (token, pytest.approx(got.logprob))
        assert [v for _, v in got.top] == sorted((v for _, v in got.top), reverse=True) and got.top[0][1] <= 0
    with torch.no_grad():  # the first token's: a full forward of the prompt
        first = torch.log_softmax(target(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert spec.logprobs[0].logprob == pytest.approx(float(first[spec.token_ids[0]]), abs=1e-4)
    assert SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=3).logprobs is None
    cut = SpeculativeDecoder(target, draft, method="static", depth=3, branch=2).generate(
        prompt, max_new_tokens=5, ignore_eos=True, logprobs=0)  # the budget cuts a step's accepted path
    assert [lp.token for lp in cut.logprobs] == cut.token_ids == plain.token_ids[:5]
    assert all(lp.top == [] for lp in cut.logprobs)


def test_prompt_logprobs_are_a_full_forwards_and_the_output_stays_the_same(pair):
    """generate(logprobs=k, prompt_logprobs=True): the prompt is read in chains of forwards that keep its rows; each
    prompt token after the first gets the full forward's logprob there, and the generated tokens do not change."""
    target, draft = pair
    prompt = [5, 9, 14, 3, 7, 22, 8, 31, 2, 17]
    dec = SpeculativeDecoder(target, draft, method="static", depth=3, branch=2)
    want = dec.generate(prompt, max_new_tokens=8, ignore_eos=True)
    got = dec.generate(prompt, max_new_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=True)
    assert got.token_ids == want.token_ids and got.logprobs is not None
    with torch.no_grad():
        full = torch.log_softmax(target(torch.tensor([prompt])).logits[0].float(), -1)  # (len(prompt), vocab)
    first, *rest = got.prompt_logprobs
    assert first.token == prompt[0] and first.logprob is None and len(rest) == len(prompt) - 1
    for i, lp in enumerate(rest):
        assert lp.token == prompt[i + 1] and lp.logprob == pytest.approx(float(full[i, prompt[i + 1]]), abs=1e-4)
        assert [t for t, _ in lp.top] == full[i].topk(2).indices.tolist()
    assert want.prompt_logprobs is None
    with pytest.raises(ValueError, match="needs logprobs"):
        dec.generate(prompt, max_new_tokens=2, prompt_logprobs=True)
    scored = dec.generate(prompt, max_new_tokens=0, logprobs=2, prompt_logprobs=True)  # the prompt alone
    assert scored.token_ids == [] and scored.prompt_logprobs == got.prompt_logprobs
    assert scored.stats.finish_reason == "length" and scored.stats.n_steps == 0
    with pytest.raises(ValueError, match="0 only with prompt_logprobs"):
        dec.generate(prompt, max_new_tokens=0, logprobs=2)


@pytest.mark.usefixtures("private_cache")  # the GGUF's tokenizer is saved in the cache: not in ~/.cache
@pytest.mark.parametrize("backend", ["torch", "native", "llamacpp"])
def test_a_prompt_as_long_as_the_window_can_be_scored(backend, tmp_path):
    """Rolling perplexity (lm-eval's loglikelihood_rolling) sends prompts exactly as long as the window, to be scored
    alone: they were refused ("no room for a token"). A token more, or a token to generate, still is."""
    from arborspec.backends.model_info import context_window
    from arborspec.loading import load_model
    from tests.backends.tiny_gguf import write_tiny_gguf
    if backend == "torch":
        target = tiny_model("llama", seed=0)
    else:
        pytest.importorskip("llama_cpp")
        target = load_model(str(write_tiny_gguf(tmp_path / "t.gguf", dtype="mixed")), backend=backend,
                            progress=False).model
    window = context_window(target)
    ids = [(7 * i + 3) % 50 + 2 for i in range(window)]
    dec = SpeculativeDecoder(target, method="ar")
    whole = dec.generate(ids, max_new_tokens=0, logprobs=1, prompt_logprobs=True).prompt_logprobs
    cut = dec.generate(ids[:-1], max_new_tokens=0, logprobs=1, prompt_logprobs=True).prompt_logprobs
    assert [lp.token for lp in whole] == ids and len(whole) == len(cut) + 1
    for a, b in zip(whole, cut):  # causal: the last token changes no earlier row (to the matmuls' rounding: on an
        # Intel Xeon the prompt's length changes torch's blocking, a last-bit difference at one row in 512)
        assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert (a.logprob is None) == (b.logprob is None) and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
    if backend == "torch":
        with torch.no_grad():
            full = torch.log_softmax(target(torch.tensor([ids])).logits[0].float(), -1)
        assert whole[-1].logprob == pytest.approx(float(full[-2, ids[-1]]), abs=1e-4)
    with pytest.raises(ValueError, match=f"the prompt has {window + 1} tokens; the target's context window is"):
        dec.generate(ids + [3], max_new_tokens=0, logprobs=1, prompt_logprobs=True)
    with pytest.raises(ValueError, match=f"the prompt has {window} tokens"):
        dec.generate(ids, max_new_tokens=1)


def test_a_conversation_is_encoded_in_the_chat_template_with_its_own_special_tokens_only():
    """A list of messages is written by the chat template, which writes the BOS token itself: the tokenizer must not
    add a second one (as it does to plain text), and a tokenizer without a template is a clear error."""
    from tokenizers.processors import TemplateProcessing

    from tests.conftest import char_tokenizer

    tok = char_tokenizer()
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    dec = SpeculativeDecoder(tiny_model("llama", seed=0, vocab=64), method="ar", tokenizer=tok)
    assert dec.encode("hi")[:2] == [bos, tok.convert_tokens_to_ids("h")]  # plain text: the tokenizer's BOS
    ids = dec.encode([{"role": "user", "content": "hi"}])
    assert ids == [bos] + tok("user: hi\n", add_special_tokens=False)["input_ids"]  # one BOS: the template's
    assert dec.generate([{"role": "user", "content": "hi"}], max_new_tokens=3).token_ids == \
        dec.generate(ids, max_new_tokens=3).token_ids
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template|has none"):
        dec.encode([{"role": "user", "content": "hi"}])


def test_only_a_tree_that_got_free_branches_goes_to_the_free_branches_verifier():
    """with_free_branches: naive (the free verifier) accepts fewer of a sampled draft's tokens than traversal, so a
    tree the branches left as drafted keeps the drafted trees' verifier; with `bare_only` a drafted tree is not
    grafted at all."""
    from arborspec.core.tree import TokenTree
    from arborspec.engine.verifier_choice import with_free_branches

    drafted_verifier, free_verifier = object(), object()

    def nothing(tree):
        return tree

    def one_branch(tree):
        tree.add(0, 9, source="suffix")
        return tree

    for bare_only in (False, True):
        tree, verifier = with_free_branches(TokenTree.root(5), nothing, bare_only, drafted_verifier, free_verifier)
        assert len(tree) == 1 and verifier is drafted_verifier
        tree, verifier = with_free_branches(TokenTree.root(5), one_branch, bare_only, drafted_verifier, free_verifier)
        assert len(tree) == 2 and verifier is free_verifier
    drafted = TokenTree.root(5)
    drafted.add(0, 7)
    tree, verifier = with_free_branches(drafted, one_branch, True, drafted_verifier, free_verifier)
    assert len(tree) == 2 and verifier is drafted_verifier


class _SharedForward:
    def __init__(self, sizes):
        self.sizes = sizes

    def many(self, calls):
        self.sizes.append(len(calls))
        return [1 for _ in calls]


class _BatchingTarget:
    """A target whose forwards batch (backends/batching.can_batch); records each forward's size (1: alone)."""

    def __init__(self):
        self.sizes = []
        self.forward = _SharedForward(self.sizes)

    def __call__(self, **kwargs):
        self.sizes.append(1)
        return 1


class _FakeDecoder:
    """What generate_batch calls of a SpeculativeDecoder. A prompt of length L is L steps: L - 1 yield nothing (the
    loop's partial results held back), the last yields what its loop was asked for. `fail`: a prompt whose first step
    raises."""

    def __init__(self, target=None, fail: str | None = None):
        self.target, self.fail = target if target is not None else (lambda **kwargs: 1), fail
        self.encoded, self.started, self.closed, self.live, self.most_live = [], [], [], 0, 0

    def encode(self, prompt):
        if not prompt:
            raise ValueError("the prompt is empty")
        self.encoded.append(prompt)

    def fork(self):
        return _FakeFork(self)


class _FakeFork:
    def __init__(self, parent):
        self.parent = parent

    def steps(self, prompt, max_new_tokens, stop, seed, ignore_eos, partial=True):
        from arborspec.backends import batching

        p = self.parent
        p.started.append(prompt)
        p.live += 1
        p.most_live = max(p.most_live, p.live)
        try:
            for i in range(len(prompt)):
                if prompt == p.fail:
                    raise FloatingPointError("non-finite logits")
                batching.forward(p.target, {"x": i})
                yield (prompt, max_new_tokens, stop, seed, ignore_eos, partial) if i == len(prompt) - 1 else None
        finally:
            p.live -= 1
            p.closed.append(prompt)


def test_generate_batch_runs_each_prompt_on_its_own_fork_with_its_seed_in_order_up_to_concurrency():
    from arborspec.engine.many_prompts import generate_batch

    dec = _FakeDecoder()
    prompts, seeds = ["aaa", "b", "cc", "dddd"], [5, None, 0, 9]
    got = generate_batch(dec, prompts, max_new_tokens=7, stop=["x"], seeds=seeds, ignore_eos=True, concurrency=2)
    assert got == [(p, 7, ["x"], s, True, False) for p, s in zip(prompts, seeds)]
    assert dec.started == prompts and dec.most_live == 2  # joined in order, at most two at once
    assert sorted(dec.closed) == sorted(prompts) and dec.live == 0
    assert generate_batch(dec, []) == []


def test_generate_batch_shares_a_batching_targets_forwards_within_a_round():
    from arborspec.engine.many_prompts import generate_batch

    target = _BatchingTarget()
    generate_batch(_FakeDecoder(target), ["aa", "bb"], max_new_tokens=2)
    assert target.sizes == [2, 2]


def test_generate_batch_checks_every_prompt_seed_and_count_before_any_prompt_starts():
    from arborspec.engine.many_prompts import generate_batch

    dec = _FakeDecoder()
    for kwargs, error in (({"concurrency": 0}, "concurrency must be an integer >= 1"),
                          ({"seeds": 5}, "seeds must be a list"),
                          ({"seeds": [1, 2]}, "got 2 seeds for 3 prompts"),
                          ({"seeds": [1, 2, "oops"]}, "seed must be an integer")):
        with pytest.raises(ValueError, match=error):
            generate_batch(dec, ["ab", "cd", "ef"], **kwargs)
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate_batch(dec, ["ab", "cd", ""])
    assert dec.started == []


def test_a_failing_prompt_fails_generate_batch_and_the_others_loops_are_closed():
    from arborspec.engine.many_prompts import generate_batch

    dec = _FakeDecoder(fail="bad")
    with pytest.raises(FloatingPointError, match="non-finite"):
        generate_batch(dec, ["aaaa", "bad", "cc"], max_new_tokens=3)
    assert dec.live == 0 and sorted(dec.closed) == ["aaaa", "bad", "cc"]
