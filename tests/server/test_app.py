"""The routes and helpers of server/app.py, in process (no models, no sockets): tests/server/test_admission.py's fake
decoder factory behind the real app, scheduler and metrics. What is pinned here: the app's own part of each answer
(statuses, headers, fields, the metrics it counts), not the engine's text."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import suppress
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from arborspec.server import app as app_module
from arborspec.server.app import create_app
from arborspec.server.metrics import CONTENT_TYPE, Metrics
from arborspec.server.protocol import Limits
from arborspec.server.scheduler import QueueFull, Scheduler
from tests.server.conftest import data_lines, metric_samples
from tests.server.test_admission import PROMPT, WINDOW, FakeDecoders, held_round
from tests.server.test_scheduler import fake_steps

KEY = "sekrit"


class Recorder(FakeDecoders):
    """FakeDecoders that remember what the handlers asked of them: `encode`'s room, the decoder loop's arguments."""

    def __init__(self, make_steps, prompt_ids: int = 20):
        super().__init__(make_steps)
        self.prompt_ids, self.rooms, self.steps_args = prompt_ids, [], []

    def encode(self, prompt, room=1):
        from arborspec.engine.prompts import prompt_ids
        self.rooms.append(room)
        return prompt_ids(None, [1] * self.prompt_ids, window=WINDOW, room=room)

    def spec_for(self, method, verifier, budget, allow_lossy):
        return None

    def build(self, spec, sampling):
        def steps(*args):
            self.steps_args.append(args)
            return self.make_steps()
        return SimpleNamespace(steps=steps)


def serve(make_steps=lambda: fake_steps("ok", 3, []), max_batch: int = 1, max_queue: int = 0, api_key=None,
          render_metrics=None, prompt_ids: int = 20, max_body_bytes: int = 1 << 20):
    metrics = Metrics()
    scheduler = Scheduler(max_batch, max_queue, metrics)
    decoders = Recorder(make_steps, prompt_ids)
    app = create_app(decoders, Limits("m", 64, 4, max_body_bytes, api_key), scheduler, metrics, render_metrics)
    return TestClient(app, raise_server_exceptions=False), scheduler, decoders


def counted(metrics_text: str, endpoint: str, status: int) -> float:
    key = f'arborspec_requests_total{{endpoint="{endpoint}",status="{status}"}}'
    return metric_samples(metrics_text).get(key, 0.0)


def events(text: str) -> list:
    return list(data_lines(text.splitlines()))


# ---- lifespan, health, metrics --------------------------------------------------------------------------------------
def test_the_apps_shutdown_stops_the_schedulers_worker():
    client, scheduler, _ = serve()
    with client:
        assert scheduler._thread.is_alive()
    assert not scheduler._thread.is_alive()


def test_health_counts_running_and_waiting_requests_and_says_stopping_with_503_when_draining():
    client, scheduler, _ = serve(max_batch=1, max_queue=2)
    with client:
        gate = held_round(scheduler)
        running = client.get("/health")
        scheduler.drain(600.0)
        stopping, head = client.get("/health"), client.head("/health")
        gate.set()
    assert running.status_code == 200 and running.json() == {"status": "ok", "active": 1, "queued": 0}
    assert stopping.status_code == 503 and stopping.json()["status"] == "stopping" and head.status_code == 503


def test_metrics_are_served_with_prometheus_content_type_or_by_the_given_renderer():
    client, _, _ = serve()
    with client:
        own = client.get("/metrics")
    assert own.headers["content-type"] == CONTENT_TYPE and "arborspec_requests_total" in own.text

    async def gathered():
        return b"# gathered from every replica\n"
    client, _, _ = serve(render_metrics=gathered)
    with client:
        assert client.get("/metrics").text == "# gathered from every replica\n"


# ---- models ---------------------------------------------------------------------------------------------------------
def test_the_model_routes_need_the_key_and_answer_openais_model_objects():
    client, _, _ = serve(api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    with client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models/m").status_code == 401
        listed = client.get("/v1/models", headers=auth).json()
        one = client.get("/v1/models/m", headers=auth).json()
        unknown = client.get("/v1/models/org/other", headers=auth)  # a hub id's slash is part of the name
        metrics = client.get("/metrics").text
    card = {"id": "m", "object": "model", "created": app_module.STARTED, "owned_by": "arborspec"}
    assert listed == {"object": "list", "data": [card]} and one == card
    assert unknown.status_code == 404 and "org/other" in unknown.json()["error"]["message"]
    assert counted(metrics, "/v1/models", 200) == 1 and counted(metrics, "/v1/models", 401) == 1
    assert counted(metrics, "/v1/models/{model}", 200) == 1 and counted(metrics, "/v1/models/{model}", 404) == 1


# ---- authentication -------------------------------------------------------------------------------------------------
def test_chat_completions_need_the_key_and_a_known_model_too():
    client, _, _ = serve(api_key=KEY)
    messages = [{"role": "user", "content": "hi"}]
    with client:
        anonymous = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
        unknown = client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": messages},
                              headers={"Authorization": f"Bearer {KEY}"})
    assert anonymous.status_code == 401 and anonymous.headers["WWW-Authenticate"] == "Bearer"
    assert unknown.status_code == 404


@pytest.mark.parametrize("header", [f"bearer {KEY}", f"Bearer   {KEY}"])
def test_the_bearer_scheme_is_case_insensitive_and_spaces_may_repeat_as_rfc_7235_has_it(header):
    """RFC 7235: `credentials = auth-scheme 1*SP token68`, the scheme case-insensitive; the server's own key is
    stripped too (run.api_key)."""
    client, _, _ = serve(api_key=KEY)
    with client:
        reply = client.post("/v1/completions", json=PROMPT, headers={"Authorization": header})
    assert reply.status_code == 200


# ---- errors ---------------------------------------------------------------------------------------------------------
def test_unknown_paths_and_methods_get_their_status_as_an_openai_error_object():
    client, _, _ = serve()
    with client:
        missing, wrong = client.get("/v1/nope"), client.get("/v1/completions")
        metrics = client.get("/metrics").text
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    assert wrong.status_code == 405 and "error" in wrong.json()
    assert counted(metrics, "other", 404) == 1 and counted(metrics, "/v1/completions", 405) == 1


def test_an_unexpected_error_is_a_500_server_error_object(monkeypatch):
    def broken(self, prompt, room=1):
        raise RuntimeError("boom")
    monkeypatch.setattr(Recorder, "encode", broken)
    client, _, _ = serve()
    with client:
        reply = client.post("/v1/completions", json=PROMPT)
    assert reply.status_code == 500 and reply.json()["error"]["type"] == "server_error"
    assert "boom" in reply.json()["error"]["message"]


def test_a_full_server_says_when_to_retry():
    client, scheduler, _ = serve()
    with client:
        gate = held_round(scheduler)
        reply = client.post("/v1/completions", json=PROMPT)
        gate.set()
    assert reply.status_code == 429 and reply.headers["Retry-After"] == str(app_module.RETRY_AFTER_S)


def test_a_server_that_is_stopping_refuses_new_requests_with_503():
    client, scheduler, _ = serve()
    with client:
        scheduler.drain(600.0)
        reply = client.post("/v1/completions", json=PROMPT)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutting_down"


def test_a_request_refused_after_its_decoder_was_made_closes_that_decoder(monkeypatch):
    """The server filled up between the room check and the submit: the decoder loop made for it is closed."""
    closed = []

    class Steps:
        def __iter__(self):
            return self

        def __next__(self):
            raise StopIteration

        def close(self):
            closed.append(True)
    client, scheduler, _ = serve(Steps)
    monkeypatch.setattr(scheduler, "check_room", lambda: None)

    def full(job):
        raise QueueFull("the server is full")
    monkeypatch.setattr(scheduler, "submit", full)
    with client:
        reply = client.post("/v1/completions", json=PROMPT)
    assert reply.status_code == 429 and closed == [True]


# ---- bodies ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_of_exactly_the_limit_is_taken_and_one_byte_more_is_a_413(chunked):
    body = json.dumps(PROMPT).encode()
    client, _, _ = serve(max_body_bytes=len(body))
    headers = {"Content-Type": "application/json"}

    def send(data: bytes):
        return client.post("/v1/completions", content=iter([data]) if chunked else data, headers=headers)
    with client:
        fits, over = send(body), send(body + b" ")
    assert fits.status_code == 200, fits.text
    assert over.status_code == 413 and over.json()["error"]["code"] == "body_too_large"


# ---- context window -------------------------------------------------------------------------------------------------
def test_a_prompt_and_max_tokens_that_exactly_fill_the_window_run():
    client, _, decoders = serve(prompt_ids=WINDOW - 4)
    with client:
        reply = client.post("/v1/completions", json={**PROMPT, "max_tokens": 4})
    assert reply.status_code == 200, reply.text


def test_max_completion_tokens_past_the_window_is_a_400_as_max_tokens_is():
    client, _, _ = serve()
    with client:
        reply = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_completion_tokens": WINDOW})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt"


def test_a_request_without_max_tokens_runs_to_the_windows_end_with_its_prompt_checked_for_one_token_of_room():
    """Only a named max_tokens must fit the window; a prompt that leaves fewer tokens than the default is served."""
    client, _, decoders = serve(prompt_ids=WINDOW - 2)
    with client:
        reply = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert reply.status_code == 200, reply.text
    assert decoders.rooms == [1]


# ---- what the decoder loop is asked for -----------------------------------------------------------------------------
def test_an_echo_without_logprobs_asks_for_no_prompt_logprobs():
    client, _, decoders = serve()
    with client:
        reply = client.post("/v1/completions", json={**PROMPT, "echo": True})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "x" + "xxx"
    assert [args[-2:] for args in decoders.steps_args] == [(None, False)]


def test_token_ids_are_sent_only_when_asked_for():
    client, _, _ = serve()
    with client:
        plain = client.post("/v1/completions", json=PROMPT).json()
        asked = client.post("/v1/completions", json={**PROMPT, "arborspec": {"return_token_ids": True}}).json()
        metrics = client.get("/metrics").text
    assert "token_ids" not in plain["arborspec"] and asked["arborspec"]["token_ids"] == [7, 7, 7]
    assert counted(metrics, "/v1/completions", 200) == 2


# ---- streams --------------------------------------------------------------------------------------------------------
def test_a_stream_is_uncached_event_stream_text_and_counted_once_done():
    client, _, _ = serve()
    with client:
        reply = client.post("/v1/completions", json={**PROMPT, "stream": True})
        metrics = client.get("/metrics").text
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.headers["Cache-Control"] == "no-cache" and reply.headers["X-Accel-Buffering"] == "no"
    assert events(reply.text)[-1] == "[DONE]" and counted(metrics, "/v1/completions", 200) == 1


def test_a_chat_stream_opens_with_the_assistants_role(monkeypatch):
    monkeypatch.setattr(app_module, "render_chat", lambda tokenizer, messages, name: [1] * 20)
    client, _, _ = serve()
    with client:
        reply = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                          "max_tokens": 3, "stream": True})
    first = json.loads(events(reply.text)[0])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_a_stream_held_back_at_a_possible_stop_string_sends_no_empty_text_chunks():
    """"x", "xx", "xxx" may each still grow into the stop string "xxxq": nothing is sent until the last step."""
    client, _, _ = serve(spaced_steps(3))
    with client:
        reply = client.post("/v1/completions", json={**PROMPT, "stream": True, "stop": ["xxxq"]})
    chunks = [json.loads(e) for e in events(reply.text)[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "xxx" and texts[:-1] == [t for t in texts[:-1] if t]


def test_a_handler_that_is_cancelled_cancels_its_job():
    """As when the server cuts a request off: the job stops taking a slot at once, not after its last step."""
    gate = threading.Event()
    client, scheduler, _ = serve(lambda: fake_steps("long", 1000, [], gate=gate))

    async def cut_off():
        scheduler.start()  # (no lifespan here: the app is called directly)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=client.app), base_url="http://t") as http:
            task = asyncio.create_task(http.post("/v1/completions", json=PROMPT))
            for _ in range(200):
                if scheduler.load() == (1, 0):
                    break
                await asyncio.sleep(0.05)
            running = scheduler.load()
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        return running, scheduler.load()
    try:
        assert asyncio.run(cut_off()) == ((1, 0), (0, 0))
    finally:
        gate.set()
        scheduler.stop()


def spaced_steps(n: int, pause_s: float = 0.3):
    """fake_steps's loop, its steps `pause_s` apart: a stream then hears each step on its own."""
    def steps():
        for result in fake_steps("slow", n, []):
            time.sleep(pause_s)
            yield result
    return steps
