"""`arborspec serve` against real clients: the official openai client and raw HTTP, on live subprocess servers
(tests/server/conftest.py). Outputs over HTTP must be exactly what `SpeculativeDecoder.generate` gives in-process."""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from arborspec.loading import load_model
from arborspec.runspec import build_decoder, parse
from tests.server.conftest import API_KEY, METHOD, MODEL, metric_samples

PROMPT = "def f(x):\n    return"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def pair(model_dirs):
    return load_model(model_dirs["target"], dtype="fp32"), load_model(model_dirs["draft"], dtype="fp32")


def reference(pair, method=METHOD, **sampling):
    target, draft = pair
    return build_decoder(parse(method, draft_quant="none"), target, draft, **sampling)


@pytest.fixture(scope="module")
def client(main_url):
    return openai.OpenAI(base_url=main_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def ext(**options):
    return {"extra_body": {"ignore_eos": True, "arborspec": {"return_token_ids": True, **options}}}


def stream_text(chunks) -> tuple[str, dict]:
    """The concatenated text of a completion stream and its last chunk (as a dict)."""
    text, last = "", None
    for chunk in chunks:
        last = chunk.model_dump()
        if chunk.choices:
            choice = chunk.choices[0]
            text += getattr(choice, "text", None) or (choice.delta.content if hasattr(choice, "delta") else "") or ""
    return text, last


# ---- exactness ---------------------------------------------------------------------------------------------------
def test_greedy_completion_over_http_equals_generate(client, pair):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, **ext())
    want = reference(pair).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    spec = reply.model_extra["arborspec"]
    assert spec["token_ids"] == want.token_ids
    assert reply.choices[0].text == want.text and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 40 and reply.usage.prompt_tokens == len(PROMPT)
    assert spec["method"] == "static" and spec["verifier"] == "greedy" and spec["lossy"] is False
    assert spec["steps"] == want.stats.n_steps and spec["accepted_tokens"] == sum(s.accepted for s in want.stats.steps)


def test_streamed_completion_is_the_same_text_with_usage_in_the_last_chunk(client, pair):
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, stream=True, **ext())
    text, last = stream_text(chunks)
    want = reference(pair).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert text == want.text
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 40
    assert last["arborspec"]["token_ids"] == want.token_ids and last["arborspec"]["tokens_per_step"] > 1


def test_chat_uses_the_targets_chat_template_streaming_or_not(client, pair):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a list"}]
    target = pair[0]
    prompt = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = reference(pair).generate(prompt, max_new_tokens=24, ignore_eos=True)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **ext())
    assert whole.choices[0].message.content == want.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(target.tokenizer(prompt)["input_ids"])
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True, **ext())
    text, last = stream_text(streamed)
    assert text == want.text and last["usage"]["completion_tokens"] == 24


def test_seeded_sampling_is_per_request_even_when_requests_interleave(client, pair):
    """Six sampled requests at once, two seeds: each equals its own seeded generate() at batch size 1."""
    def one(seed):
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0.9, top_p=0.95,
                                          seed=seed, **ext())
        return seed, reply.model_extra["arborspec"]["token_ids"]

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, [1, 2, 1, 2, 1, 2]))
    for seed, ids in got:
        want = reference(pair, temperature=0.9, top_p=0.95).generate(PROMPT, 32, seed=seed, ignore_eos=True)
        assert ids == want.token_ids
    assert got[0][1] != got[1][1]  # the seeds really differ (a failure here would make the test above vacuous)


def test_stop_strings_end_the_text_before_the_stop_string(client, pair):
    want = reference(pair).generate(PROMPT, max_new_tokens=40, ignore_eos=True).text
    stop = want[10:12]
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, stop=[stop], **ext())
    text = reply.choices[0].text
    assert text == want[:want.index(stop)] and reply.choices[0].finish_reason == "stop"
    streamed, _ = stream_text(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, stop=stop,
                                                        stream=True, **ext()))
    assert streamed == text


def test_logprobs_are_the_targets_and_a_stream_carries_them_with_its_text(client, pair):
    """completions' `logprobs` k: each token's logprob under the target (those of generate(logprobs=k) in-process)
    and its k best alternatives, streamed or not; chat's `logprobs` / `top_logprobs` in chat's shape."""
    want = reference(pair).generate(PROMPT, max_new_tokens=16, ignore_eos=True, logprobs=3)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3, **ext())
    lp = reply.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
    assert "".join(lp.tokens) == reply.choices[0].text == want.text and lp.text_offset[0] == 0
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy: the best one
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3,
                                            stream=True, **ext()))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(streamed) > 1 and sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "sort"}], max_tokens=8,
                                          logprobs=True, top_logprobs=2, **ext())
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(c.top_logprobs) == 2 for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode() == chat.choices[0].message.content
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **ext())
    assert plain.choices[0].logprobs is None  # not asked for


def test_echo_puts_the_prompt_and_its_logprobs_in_front(client, pair):
    """completions' echo (what lm-evaluation-harness sends for log-likelihoods): the prompt's text before the
    completion's, its tokens' logprobs before theirs (null for the first), streamed or not."""
    want = reference(pair).generate(PROMPT, max_new_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=True)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True,
                                      **ext())
    text, lp = reply.choices[0].text, reply.choices[0].logprobs
    assert text == PROMPT + want.text and "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        [t.logprob for t in want.prompt_logprobs[1:] + want.logprobs], abs=1e-5)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                            echo=True, stream=True, **ext()))
    assert chunks[0].choices[0].text.startswith(PROMPT) and stream_text(chunks)[0] == text
    assert sum((c.choices[0].logprobs.tokens for c in chunks if c.choices[0].logprobs), []) == lp.tokens
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, **ext())
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True, **ext())
    assert scored.choices[0].text == PROMPT and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(PROMPT)]  # the prompt's, scored alone
    assert scored.usage.completion_tokens == 0
    assert stream_text(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True,
                                                 stream=True, **ext()))[0] == PROMPT
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)  # scoring needs logprobs
    # a prompt as long as the window (512 tokens: LONG below) scored alone, as rolling perplexity sends it (was a 400)
    filled = client.completions.create(model=MODEL, prompt=[5] * 512, max_tokens=0, logprobs=1, echo=True, **ext())
    assert len(filled.choices[0].logprobs.token_logprobs) == 512 and filled.usage.prompt_tokens == 512
    with pytest.raises(openai.BadRequestError, match="context window is 512"):
        client.completions.create(model=MODEL, prompt=[5] * 513, max_tokens=0, logprobs=1, echo=True)
    with pytest.raises(openai.BadRequestError):  # chat has no echo
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                       extra_body={"echo": True})


def test_stream_options_include_usage_puts_usage_in_a_last_chunk_with_no_choices(client, pair):
    """As OpenAI streams it when asked: every chunk has `usage: null`, the finish chunk too, then one more chunk
    with empty `choices` and the usage (and the `arborspec` statistics)."""
    want = reference(pair).generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    chunks = [c.model_dump() for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, stream=True, stream_options={"include_usage": True}, **ext())]
    *text_chunks, finish, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    assert last["usage"]["prompt_tokens"] == len(PROMPT) and last["arborspec"]["token_ids"] == want.token_ids
    assert finish["choices"][0]["finish_reason"] == "length" and finish["usage"] is None
    assert all(c["usage"] is None for c in text_chunks)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == want.text
    messages = [{"role": "user", "content": "sort a list"}]
    chat = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                               stream_options={"include_usage": True}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 6
    assert chat[-2].choices[0].finish_reason is not None and chat[-2].usage is None


def test_stream_options_need_a_stream(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, stream_options={"include_usage": True})
    assert info.value.param == "stream_options"


# ---- the model: listed, retrieved, or left out --------------------------------------------------------------------
def test_the_model_is_retrieved_by_name_and_served_when_a_request_names_none(client, main_url, pair):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.created > 1.7e9  # when the server started
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert httpx.get(main_url + f"/v1/models/{MODEL}", timeout=30).status_code == 401  # the key is needed here too
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}  # no "model", as llama-server and vLLM take it
    reply = httpx.post(main_url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert reply.status_code == 200 and reply.json()["model"] == MODEL
    assert reply.json()["choices"][0]["text"] == reference(pair).generate(PROMPT, 6, ignore_eos=True).text
    chat = httpx.post(main_url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == MODEL


# ---- the arborspec extension: per-request method and sizing ----------------------------------------------------
def test_a_request_may_pick_its_method_and_budget(client, pair):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **ext(method="chain", budget=3))
    spec = reply.model_extra["arborspec"]
    want = reference(pair, method="chain@3").generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert spec["method"] == "chain" and spec["token_ids"] == want.token_ids
    assert spec["drafted_tokens"] == sum(s.tree_size for s in want.stats.steps) and max(
        s.tree_size for s in want.stats.steps) == 3


def test_a_lossy_override_needs_the_requests_consent(client, main_url):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.8,
            "arborspec": {"method": "wetap-lossy"}}
    refused = httpx.post(main_url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert refused.status_code == 400 and "allow_lossy" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "arborspec"  # the field at fault (was null)
    body["arborspec"]["allow_lossy"] = True
    allowed = httpx.post(main_url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert allowed.status_code == 200 and allowed.json()["arborspec"]["lossy"] is True


# ---- robustness --------------------------------------------------------------------------------------------------
def test_api_key_is_required_on_v1_routes_only(main_url, servers):
    """The `main` server took its key from $ARBORSPEC_API_KEY (tests/server/conftest.py), not from a flag."""
    assert "API key required" in servers["main"].log.read_text()
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(main_url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["WWW-Authenticate"] == "Bearer"  # RFC 6750: which scheme the client should use
    assert httpx.get(main_url + "/v1/models", timeout=30).status_code == 401
    models = httpx.get(main_url + "/v1/models", headers=AUTH, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(main_url + "/health", timeout=30).status_code == 200
    assert httpx.head(main_url + "/health", timeout=30).status_code == 200  # as load balancers' probes ask


def test_openai_client_reports_an_unknown_model_and_bad_values(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)


@pytest.mark.parametrize("param, value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -1)])
def test_bad_sampling_values_name_their_param(client, param, value):
    with pytest.raises(openai.BadRequestError, match=param) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={param: value})
    assert info.value.param == param and info.value.code is None


def test_a_nan_temperature_names_its_param(main_url):  # Python's json writes NaN; the openai client refuses to
    body = b'{"prompt": "x", "max_tokens": 1, "temperature": NaN}'
    r = httpx.post(main_url + "/v1/completions", content=body, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize("message", [{"role": "user", "content": None}, {"role": "system", "content": None},
                                     {"role": "user"}])
def test_a_message_without_content_is_a_400_unless_the_assistants(client, message):
    with pytest.raises(openai.BadRequestError, match="needs 'content'") as info:
        client.chat.completions.create(model=MODEL, messages=[message], max_tokens=1)
    assert info.value.param == "messages"


LONG = "x" * 600  # over the tiny models' 512-token context window
BAD_BODIES = [
    ("not json", b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, "JSON object"),
    ("wrong type", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("bool for int", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("wrong type in a message", None, 400, "messages"),
    ("max_tokens 0", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens over the limit", {"prompt": "x", "max_tokens": 481}, 400, "480"),
    ("prompt over the context window", {"prompt": LONG, "max_tokens": 4}, 400, "context window"),
    ("empty prompt", {"prompt": "", "max_tokens": 4}, 400, "empty"),
    ("several prompts", {"prompt": ["a", "b"], "max_tokens": 4}, 400, "one prompt"),
    ("token id out of range", {"prompt": [3, 99999], "max_tokens": 4}, 400, "outside the vocabulary"),
    ("missing prompt", {"max_tokens": 4}, 400, "prompt"),
    ("n = 2", {"prompt": "x", "n": 2}, 400, "'n'"),
    ("logprobs over 5", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("temperature NaN", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("top_p 0", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("unknown method", {"prompt": "x", "arborspec": {"method": "nope"}}, 400, "unknown method"),
    ("unknown extension field", {"prompt": "x", "arborspec": {"depth": 3}}, 400, "arborspec"),
    ("unknown model", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ("body too large", {"prompt": "x" * 5000}, 413, "4096"),
    ("nested too deeply", b"[" * 2000 + b"]" * 2000, 400, "too deeply"),  # was a 500 (RecursionError)
    ("a lone surrogate", b'{"prompt": "\\ud800", "max_tokens": 4}', 400, "not valid Unicode"),  # was a 500
    ("a tree past the node bound", {"prompt": "x", "arborspec": {"method": "dyspec@100000"}}, 400, "at most 1024"),
    ("a file on the server", {"prompt": "x", "arborspec": {"method": "sequoia(acceptance_file=/etc/passwd)"}}, 400,
     "may not set acceptance_file"),
    ("a file, spelled with -", {"prompt": "x", "arborspec": {"method": "sequoia(acceptance-file=/etc/passwd)"}}, 400,
     "may not set acceptance_file"),  # it read the file: "is not JSON" or "No such file" told whether it exists
]


@pytest.mark.parametrize("name, body, status, message", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_requests_get_an_openai_error_object_never_a_500(main_url, name, body, status, message):
    path = "/v1/completions"
    if body is None:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}
    if isinstance(body, dict):
        body = json.dumps({"model": MODEL, **body}).encode()
    r = httpx.post(main_url + path, content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": [3, 99999], "max_tokens": 4}, "prompt"),
    ({"prompt": "x", "arborspec": {"method": "chain", "budget": 100000}}, "arborspec"),
    ({"prompt": "x", "temperature": 1.0, "arborspec": {"verifier": "greedy"}}, "arborspec"),
])
def test_errors_found_while_the_request_is_built_name_its_field(main_url, body, param):
    """These 400s came with "param": null: they are raised while the request's decoder is built, not parsed."""
    r = httpx.post(main_url + "/v1/completions", json={"model": MODEL, **body}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_metrics_are_prometheus_text_with_latencies_and_speculation(client, main_url):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **ext())
    httpx.post(main_url + "/v1/completions", json={"model": MODEL, "prompt": ""}, headers=AUTH, timeout=30)
    text = httpx.get(main_url + "/metrics", timeout=30).text
    values = metric_samples(text)
    assert values['arborspec_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values["arborspec_time_to_first_token_seconds_count"] >= 1
    assert values["arborspec_time_per_output_token_seconds_count"] >= 1
    assert values["arborspec_generated_tokens_total"] >= 8
    assert values["arborspec_tokens_per_step_count"] >= 1 and values["arborspec_accepted_tokens_per_step_sum"] >= 0
    assert "arborspec_queue_depth" in values and "arborspec_batch_size" in values
    assert values['arborspec_requests_total{endpoint="/v1/completions",status="400"}'] >= 1


def test_metrics_count_drafted_accepted_and_emitted_tokens_per_method(client, main_url):
    """One request's counts, read as differences of the counters around it (the server is shared), are its own
    `arborspec` statistics: acceptance rate and tokens per step are one division of two counters."""
    def counts():
        values = metric_samples(httpx.get(main_url + "/metrics", timeout=30).text)
        return {name: values.get(f'arborspec_{name}_total{{method="chain"}}', 0.0)
                for name in ("speculative_steps", "drafted_tokens", "accepted_tokens", "emitted_tokens")}

    before = counts()
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, **ext(method="chain", budget=4))
    after = counts()
    got = {name: after[name] - before[name] for name in after}
    spec = reply.model_extra["arborspec"]
    assert got["speculative_steps"] == spec["steps"] > 0
    assert got["drafted_tokens"] == spec["drafted_tokens"] and got["accepted_tokens"] == spec["accepted_tokens"]
    assert got["emitted_tokens"] == reply.usage.completion_tokens - 1 == 29  # the first came from the prompt's forward
    assert got["accepted_tokens"] / got["drafted_tokens"] == pytest.approx(spec["acceptance_rate"])
    assert got["emitted_tokens"] / got["speculative_steps"] == pytest.approx(spec["tokens_per_step"])
    info = re.search(r"^arborspec_server_info\{(.*)\} 1\.0$", httpx.get(main_url + "/metrics", timeout=30).text, re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info[1]))
    assert labels["method"] == METHOD and labels["backend"] == "torch" and labels["draft_backend"] == "torch"
    assert labels["batching"] == "false" and labels["draft_quant"] == "none"


def test_fifty_concurrent_streams_all_complete(client, main_url):
    def one(i):
        chunks = client.completions.create(model=MODEL, prompt=f"def f{i}(x):", max_tokens=16, stream=True,
                                           extra_body={"ignore_eos": True})
        text, last = stream_text(chunks)
        return last["usage"]["completion_tokens"], last["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(50) as pool:
        futures = [pool.submit(one, i) for i in range(50)]
        results = [f.result(timeout=180) for f in futures]
    assert results == [(16, "length")] * 50
    health = httpx.get(main_url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    for _ in range(100):  # every slot frees (the worker retires a job just after its last update)
        if httpx.get(main_url + "/health", timeout=30).json()["active"] == 0:
            break
        time.sleep(0.1)
    assert httpx.get(main_url + "/health", timeout=30).json() == {"status": "ok", "active": 0, "queued": 0}
