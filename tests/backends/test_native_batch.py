"""Batching across requests on the native backend (backends/native_forward.py `many`, backends/batching.py, engine/many_prompts.py,
the server's scheduler), on tiny random GGUFs: several sequences' calls as one forward give each call the bits it
gets alone, so batched decoding is token for token what each request decodes alone (greedy and seeded sampling,
plain and speculative, requests joining and leaving between rounds), and a request that fails mid-round fails alone.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch
from transformers import DynamicCache

from arborspec.backends import batching
from arborspec.backends.hf import TreeSession
from arborspec.engine import SpeculativeDecoder
from arborspec.server.metrics import Metrics
from arborspec.server.scheduler import Job, Scheduler

from .test_llamacpp import random_tree
from .tiny_gguf import VOCAB, native_models

TIMEOUT = 120
K_QUANT = {"hidden": 256, "ffn": 512}
FILES = {"q4_k": {"dtype": "q4_k"}, "llama": {"dtype": "mixed", "ffn": 288, "arch": "llama"},
         "draft": {"dtype": "q4_k", "noise": 0.2}}
PROMPTS = ["def fib(n):\n    return", "x = ", "import os\nprint(os.path.join('a', 'b'))\n# now"]


pytestmark = pytest.mark.usefixtures("private_cache")  # tests/conftest.py


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    files = {name: {**K_QUANT, **spec} for name, spec in FILES.items()}
    return native_models(tmp_path_factory.mktemp("native-batch"), files)


@pytest.fixture
def shared_forwards(native, monkeypatch):
    """The target's `many` calls, recorded: how many calls each shared forward held."""
    forward = native("q4_k").model.forward
    sizes, real = [], forward.many

    def many(calls):
        sizes.append(len(calls))
        return real(calls)
    monkeypatch.setattr(forward, "many", many)
    return sizes


def causal(n_past: int, n: int) -> torch.Tensor:
    return torch.ones(n, n_past + n, dtype=torch.bool).tril(diagonal=n_past)


def call(ids, positions, allowed, cache, keep) -> dict:
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
    return dict(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), attention_mask=mask,
                past_key_values=cache, use_cache=True, logits_to_keep=torch.arange(len(ids) - keep, len(ids)))


def three_sequences(model, rng):
    """Per sequence: the calls it makes, in order, each as a function of its cache (a prefill, then a tree or a
    chain), over contexts of different lengths."""
    seqs = []
    for n_ctx, n_tree in ((12, 9), (3, 1), (7, 5)):
        context = [rng.randrange(VOCAB) for _ in range(n_ctx)]
        tree = random_tree(rng, context[-1], n_tree)
        n = len(context) - 1
        allowed = torch.zeros(len(tree), n + len(tree), dtype=torch.bool)
        allowed[:, :n] = True
        for node in range(len(tree)):
            for anc in tree.path(node):
                allowed[node, n + anc] = True
        seqs.append([
            lambda cache, c=context, n=n: call(c[:-1], list(range(n)), causal(0, n), cache, keep=1),
            lambda cache, t=tree, n=n, a=allowed: call(t.tokens, [n + d for d in t.depths], a, cache, keep=len(t)),
        ])
    return seqs


@pytest.mark.parametrize("name", ["q4_k", "llama"])
def test_calls_of_several_sequences_as_one_forward_equal_each_call_alone(native, name):
    """Prefills of different lengths side by side, then trees of 9, 1 and 5 nodes side by side: every call's logits
    and every cache equal those of the call run alone, bit for bit."""
    model = native(name).model
    seqs = three_sequences(model, random.Random(3))
    alone = [DynamicCache(config=model.config) for _ in seqs]
    together = [DynamicCache(config=model.config) for _ in seqs]
    for step in range(2):
        want = [model(**calls[step](cache)).logits for calls, cache in zip(seqs, alone)]
        got = [out.logits for out in model.forward.many([calls[step](cache) for calls, cache in zip(seqs, together)])]
        for w, g in zip(want, got):
            assert w.shape == g.shape and torch.equal(w, g), (w - g).abs().max()
    for a, b in zip(alone, together):
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    assert not torch.equal(got[0][0, -1], got[2][0, -1])  # the sequences really differ


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rounds_sessions_share_forwards_drafts_first(native, monkeypatch, threads):
    """Two requests in a round, each with a target and a draft session: request 0 drafts two layers, request 1 one.
    The targets' prefills share a forward, the drafts' prefills and first layers share one each, and the targets'
    trees wait for request 0's second layer and share one forward; every session's logits are its logits alone. On 2
    threads too: the step's parallel region splits attention by kv head over every sequence's rows."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_round_shares_forwards(native, monkeypatch)
    finally:
        torch.set_num_threads(before)


def check_round_shares_forwards(native, monkeypatch):
    target, draft = native("q4_k").model, native("draft").model
    sizes = {}
    for name, model in (("target", target), ("draft", draft)):
        real = model.forward.many
        monkeypatch.setattr(model.forward, "many", lambda calls, real=real, name=name: (
            sizes.setdefault(name, []).append(len(calls)) or real(calls)))
    rng = random.Random(4)
    contexts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (6, 11)]
    trees = [random_tree(rng, c[-1], n) for c, n in zip(contexts, (7, 4))]
    layers = [[[0], [1, 2]], [[0, 1]]]  # per request, the nodes each draft forward adds

    def request(i):
        t, d = TreeSession(target, "target"), TreeSession(draft, "draft")
        t.prefill(contexts[i][:-1])
        d.prefill(contexts[i][:-2])  # context[-2] rides in front of the first draft layer
        drafted = [d.forward(contexts[i], trees[i], nodes) for nodes in layers[i]]
        return drafted + [t.forward(contexts[i], trees[i], list(range(len(trees[i]))))]

    want = [request(i) for i in range(2)]
    sizes.clear()
    got = [None, None]

    def task(i):
        def run():
            got[i] = request(i)
        return run

    assert batching.run_round([task(0), task(1)], batch=True) == [None, None]
    assert sizes == {"target": [2, 2], "draft": [2, 2, 1]}
    for w, g in zip(want, got):
        assert len(w) == len(g) and all(torch.equal(a, b) for a, b in zip(w, g))


@pytest.mark.parametrize("method,options", [("ar", {}), ("ar", {"ngram": 2}), ("static", {"depth": 3, "branch": 2}),
                                            ("chain", {"k": 3})])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_k": 5}])
def test_generate_batch_equals_each_prompt_alone(native, shared_forwards, method, options, sampling):
    """Three prompts of different lengths, at most two at once (the third joins when one leaves), greedy and seeded
    sampling: each result is token for token the prompt decoded alone, and the target's forwards were shared."""
    target, draft = native("q4_k"), native("draft")
    dec = SpeculativeDecoder(target, draft if method != "ar" else None, method=method, **options, **sampling)
    seeds = [11, 12, 13]
    alone = [dec.fork().generate(p, max_new_tokens=20, seed=s, ignore_eos=True) for p, s in zip(PROMPTS, seeds)]
    shared_forwards.clear()
    batched = dec.generate_batch(PROMPTS, max_new_tokens=20, seeds=seeds, ignore_eos=True, concurrency=2)
    assert [b.token_ids for b in batched] == [a.token_ids for a in alone]
    assert [b.text for b in batched] == [a.text for a in alone]
    assert max(shared_forwards) == 2 and len(shared_forwards) < sum(b.stats.n_steps for b in batched)
    if method != "ar":
        assert sum(b.stats.n_steps for b in batched) < 60  # the draft was accepted sometimes


def test_generate_batch_checks_its_arguments(native):
    dec = SpeculativeDecoder(native("q4_k"), method="ar")
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        dec.generate_batch(PROMPTS, seeds=[1, 2])
    with pytest.raises(ValueError, match="concurrency must be an integer >= 1"):
        dec.generate_batch(PROMPTS, concurrency=0)
    with pytest.raises(ValueError, match="the prompt is empty"):
        dec.generate_batch(["x", []])
    assert dec.generate_batch([]) == []


def test_the_scheduler_batches_requests_that_join_and_leave_and_a_failing_one_fails_alone(native, shared_forwards):
    """A batching scheduler with requests of different lengths and methods, one joining later, and one whose decoder
    raises in the middle of a round: every other request's tokens are what it decodes alone."""
    target, draft = native("q4_k"), native("draft")
    plain = SpeculativeDecoder(target, method="ar")
    spec = SpeculativeDecoder(target, draft, method="static", depth=3, branch=2)
    requests = [(plain, PROMPTS[0], 9), (spec, PROMPTS[1], 14), (spec, PROMPTS[2], 5), (plain, PROMPTS[1], 7)]
    want = [dec.fork().generate(p, max_new_tokens=n, ignore_eos=True).token_ids for dec, p, n in requests]

    def failing():
        for i, result in enumerate(spec.fork().steps(PROMPTS[0], 10, ignore_eos=True)):
            if i == 2:  # its third step has run its share of the round's forward; then it breaks
                raise FloatingPointError("non-finite logits")
            yield result

    done = [threading.Event() for _ in range(5)]
    last = [None] * 5

    def deliver(i):
        def on(update):
            last[i] = update
            if update.done:
                done[i].set()
        return on

    sched = Scheduler(max_batch=3, max_queue=5, metrics=Metrics(), batch=True)
    jobs = [Job(dec.fork().steps(p, n, ignore_eos=True), deliver(i), stream=False)
            for i, (dec, p, n) in enumerate(requests)]
    jobs.append(Job(failing(), deliver(4), stream=False))
    for job in (jobs[0], jobs[4], jobs[1]):
        sched.submit(job)
    shared_forwards.clear()
    sched.start()
    for job in jobs[2:4]:  # join later, as slots free
        sched.submit(job)
    try:
        assert all(event.wait(TIMEOUT) for event in done)
    finally:
        sched.stop()
    assert last[4].code == "internal_error" and "non-finite" in last[4].error
    assert [u.result.token_ids for u in last[:4]] == want and all(not u.error for u in last[:4])
    assert max(shared_forwards) >= 2


def test_a_policy_drafts_knowing_how_many_requests_share_the_round(native, monkeypatch):
    """The engine tells a policy how many requests its step's forwards serve (DraftContext.sharing): the round's size
    in a batch, 1 alone. auto's costs count a round's rows for every request it delays (auto/objective.py)."""
    dec = SpeculativeDecoder(native("q4_k"), native("draft"), method="chain", k=2)
    seen, real = [], type(dec.policy).draft
    monkeypatch.setattr(type(dec.policy), "draft", lambda self, ctx: seen.append(ctx.sharing) or real(self, ctx))
    dec.generate_batch(PROMPTS[:2], max_new_tokens=6, concurrency=2, ignore_eos=True)
    assert 2 in seen and set(seen) <= {1, 2}
    seen.clear()
    dec.fork().generate(PROMPTS[0], max_new_tokens=6, ignore_eos=True)
    assert seen and set(seen) == {1}


LONG = PROMPTS[2] + "\nfor name in os.listdir('.'):\n    print(name, os.path.getsize(name))\n"


@pytest.mark.parametrize("method,options,temperature", [("ar", {}, 0.0), ("static", {"depth": 3, "branch": 2}, 0.0),
                                                        ("static", {"depth": 3, "branch": 2}, 0.9),
                                                        ("auto", {}, 0.0)])
def test_a_prompt_read_in_pieces_decodes_the_same_tokens(native, monkeypatch, method, options, temperature):
    """steps(prefill_chunk=8): each model reads the prompt 8 tokens a call, the loop yields None after each piece,
    and the tokens and texts are those of a prompt read at once; no call reads more than 8 new tokens."""
    dec = SpeculativeDecoder(native("q4_k"), native("draft"), method=method, temperature=temperature, **options)
    whole = list(dec.fork().steps(LONG, 10, seed=7, ignore_eos=True))
    rows = []
    real = type(dec.target.forward.step).run

    def run(self, calls):
        rows.extend(len(c.ids) for c in calls)
        return real(self, calls)
    monkeypatch.setattr(type(dec.target.forward.step), "run", run)
    pieces = list(dec.fork().steps(LONG, 10, seed=7, ignore_eos=True, prefill_chunk=8))
    prompt = len(dec.encode(LONG))
    results = [r for r in pieces if r is not None]
    assert pieces.count(None) >= prompt // 8 - 1 and pieces[0] is None
    assert [r.token_ids for r in results] == [r.token_ids for r in whole]
    assert results[-1].text == whole[-1].text and results[-1].stats.prompt_tokens == prompt
    reads = pieces.count(None) + 2  # the target's pieces, its first forward, the draft's pieces (Nones + 1)
    assert max(rows[:reads]) <= 8 and sum(rows[:reads]) >= prompt
    assert None not in whole  # the default reads the prompt at once


def test_a_long_prompt_joining_is_read_a_piece_per_round_while_the_others_stream(native):
    """A server round carries one piece of a joining request's prompt (--prefill-chunk): a request already
    streaming gets a step in every round while the long prompt is read, and both get what they get alone."""
    dec = SpeculativeDecoder(native("q4_k"), native("draft"), method="static", depth=3, branch=2)
    want = [dec.fork().generate(p, max_new_tokens=n, ignore_eos=True).token_ids for p, n in ((PROMPTS[1], 40),
                                                                                            (LONG, 6))]
    order, done, last = [], [threading.Event(), threading.Event()], [None, None]

    def deliver(i):
        def on(update):
            order.append(i)
            last[i] = update
            if update.done:
                done[i].set()
        return on

    sched = Scheduler(max_batch=2, max_queue=0, metrics=Metrics(), batch=True)
    jobs = [Job(dec.fork().steps(PROMPTS[1], 40, ignore_eos=True, prefill_chunk=8), deliver(0), stream=True),
            Job(dec.fork().steps(LONG, 6, ignore_eos=True, prefill_chunk=8), deliver(1), stream=True)]
    for job in jobs:
        sched.submit(job)
    sched.start()
    try:
        assert all(event.wait(TIMEOUT) for event in done)
    finally:
        sched.stop()
    assert [u.result.token_ids for u in last] == want
    pieces = len(dec.encode(LONG)) // 8 - 1
    assert order.index(1) >= pieces  # the short request streamed a step a round while the long one was read


def test_prompt_logprobs_read_in_pieces_are_the_same_bits(native):
    """A prompt read for its logprobs in chains of 8 (a server's --prefill-chunk) or of 64 gives the same logprobs,
    bit for bit on native, and the same tokens as a plain generate()."""
    dec = SpeculativeDecoder(native("q4_k"), native("draft"), method="static", depth=3, branch=2)
    want = dec.generate(LONG, max_new_tokens=6, ignore_eos=True)
    pieces = list(dec.steps(LONG, 6, ignore_eos=True, prefill_chunk=8, logprobs=1, prompt_logprobs=True))
    whole = dec.generate(LONG, max_new_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=True)
    assert pieces[-1].token_ids == whole.token_ids == want.token_ids
    assert pieces.count(None) >= len(dec.encode(LONG)) // 8 - 1 > 64 // 8  # LONG spans two chains of 64
    assert pieces[-1].prompt_logprobs == whole.prompt_logprobs and len(whole.prompt_logprobs) == len(dec.encode(LONG))
