"""The request handlers (server/app.py) against a round that runs long, in process: a fake decoder factory whose
decoder loops are tests/server/test_scheduler.py's fake steps, one of them held at a gate (a round reading a long
prompt on llama.cpp took 14 s). What must not wait for that round: a full server's 429, a prompt's context-length
400, and a shutdown's 503 once its grace is over. A stream that ends in an error event is counted with its status."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from fastapi.testclient import TestClient

from arborspec.server.app import create_app
from arborspec.server.metrics import Metrics
from arborspec.server.protocol import Limits
from arborspec.server.scheduler import Scheduler
from tests.server.test_scheduler import fake_steps, job

PROMPT_IDS = 20  # every prompt's length under the fake encoder
WINDOW = 32
PROMPT = {"model": "m", "prompt": "x", "max_tokens": 4}
AT_ONCE_S = 5.0  # an answer that waited for the held round (released after HOLD_S) took longer
HOLD_S = 12.0


class FakeDecoders:
    """The parts of server/decoders.Decoders that the handlers call; each decoder's loop is `make_steps()`."""

    spec, prefill_chunk, context_window = None, 0, WINDOW

    def __init__(self, make_steps):
        self.make_steps, self.target = make_steps, SimpleNamespace(tokenizer=None)

    def sampling(self, *_):
        return SimpleNamespace(seed=0)

    def encode(self, prompt, room=1):
        return [1] * PROMPT_IDS

    def build(self, spec, sampling):
        return SimpleNamespace(steps=lambda *a: self.make_steps())


def serve(make_steps, max_batch: int = 1, max_queue: int = 0):
    metrics = Metrics()
    scheduler = Scheduler(max_batch, max_queue, metrics)
    app = create_app(FakeDecoders(make_steps), Limits("m", 64, 4, 1 << 20), scheduler, metrics)
    return TestClient(app), scheduler


def held_round(scheduler: Scheduler) -> threading.Event:
    """A request already running whose step waits at a gate (opened after HOLD_S, so that a test of code that waits
    for it ends anyway): the round holds the models."""
    gate, entered = threading.Event(), threading.Event()

    def steps():
        entered.set()
        yield from fake_steps("long", 1000, [], gate=gate)
    scheduler.submit(job(steps())[0])
    threading.Timer(HOLD_S, gate.set).start()
    assert entered.wait(30)
    return gate


def timed(call):
    t0 = time.monotonic()
    return call(), time.monotonic() - t0


def test_a_full_server_answers_429_without_waiting_for_the_running_round():
    client, scheduler = serve(lambda: fake_steps("late", 1, []))
    with client:
        gate = held_round(scheduler)
        reply, took = timed(lambda: client.post("/v1/completions", json=PROMPT))
        gate.set()
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "queue_full" and took < AT_ONCE_S


def test_a_prompt_past_the_context_window_is_a_400_without_waiting_for_the_running_round():
    client, scheduler = serve(lambda: fake_steps("late", 1, []), max_batch=2)
    with client:
        gate = held_round(scheduler)
        reply, took = timed(lambda: client.post("/v1/completions", json={**PROMPT, "max_tokens": WINDOW}))
        gate.set()
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "context_length_exceeded" and took < AT_ONCE_S


def test_a_prompt_that_fills_the_window_names_the_prompt_as_the_field_at_fault(monkeypatch):
    """Without max_tokens the window check is the encoder's (engine/prompts.py); its 400 had no `param`."""
    from arborspec.engine.prompts import prompt_ids
    monkeypatch.setattr(FakeDecoders, "encode", lambda self, prompt, room=1: prompt_ids(None, [1] * WINDOW,
                                                                                         window=WINDOW, room=room))
    client, _ = serve(lambda: fake_steps("late", 1, []))
    with client:
        error = client.post("/v1/completions", json={"model": "m", "prompt": "x"}).json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"


def test_requests_in_a_round_past_the_shutdown_grace_hear_503_at_once():
    """The request's own step is the long one; the server starts to shut down (grace 0) while it runs."""
    gate, server = threading.Event(), {}

    def steps():
        server["scheduler"].drain(0.0)
        yield from fake_steps("long", 1000, [], gate=gate)
    client, server["scheduler"] = serve(steps)
    with client:
        threading.Timer(HOLD_S, gate.set).start()
        reply, took = timed(lambda: client.post("/v1/completions", json=PROMPT))
        late = client.post("/v1/completions", json=PROMPT)
        gate.set()
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutdown" and took < AT_ONCE_S
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"  # no new request is taken


def test_a_stream_that_ends_in_an_error_event_is_counted_with_its_status():
    client, scheduler = serve(lambda: fake_steps("bad", 3, [], fail_at=1))
    with client:
        reply = client.post("/v1/completions", json={**PROMPT, "stream": True})
        metrics = client.get("/metrics").text
    assert '"code":"internal_error"' in reply.text.replace(" ", "") and reply.text.rstrip().endswith("[DONE]")
    assert 'arborspec_requests_total{endpoint="/v1/completions",status="500"} 1.0' in metrics
    assert 'status="200"' not in metrics.split("arborspec_requests_total")[1].split("# HELP")[0]


def test_a_second_signal_ends_the_grace_at_once_and_a_third_forces_the_exit():
    """uvicorn's own second-signal exit cancelled the handlers mid-answer and printed their tracebacks; here the
    second signal makes the handlers answer 503 / an error event at once (the grace is over), the third forces."""
    import signal

    import uvicorn

    from arborspec.server.run import Server
    scheduler = Scheduler(max_batch=1, max_queue=1, metrics=Metrics())
    server = Server(uvicorn.Config(lambda *_: None), scheduler, grace=600.0)
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and scheduler.draining and not scheduler.overdue
    server.handle_exit(signal.SIGINT, None)
    assert scheduler.overdue and not server.force_exit
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit
