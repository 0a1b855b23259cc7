"""A full server answers 429 at once; a client that disconnects mid-stream frees its slot and is counted 499; SIGTERM
ends in-flight streams cleanly (finished, or told the server is shutting down) and the process exits. Live
subprocess servers from tests/server/conftest.py."""
from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx

from tests.server.conftest import API_KEY, MODEL, data_lines, metric_samples

LONG_STREAM = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 480, "stream": True, "ignore_eos": True}
SHORT = {"model": MODEL, "prompt": "def g(y):", "max_tokens": 2}


def metric(url: str, key: str) -> float:
    """The sample named `key` (with its labels) in the server's /metrics, 0 when absent."""
    return metric_samples(httpx.get(url + "/metrics", timeout=30).text).get(key, 0.0)


def generations(url: str, reason: str) -> float:
    return metric(url, f'arborspec_generations_total{{reason="{reason}"}}')


def test_a_full_server_answers_429_at_once_and_a_client_that_leaves_frees_its_slot(servers):
    url = servers["tight"].url()  # one slot, no queue
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json=LONG_STREAM) as stream:
            events = data_lines(stream.iter_lines())  # (dropping this iterator would close the connection)
            next(events)  # generating: the only slot is taken
            full = httpx.post(url + "/v1/completions", json=SHORT, timeout=10)  # a hang would time out
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
            assert full.headers["Retry-After"] == "1"
        # leaving the block closes the connection mid-stream
    for _ in range(300):
        after = httpx.post(url + "/v1/completions", json=SHORT, timeout=30)
        if after.status_code != 429:
            break
        time.sleep(0.1)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] >= 1
    assert generations(url, "cancelled") == 1  # the stream was cancelled, not run to its end
    left = 'arborspec_requests_total{endpoint="/v1/completions",status="499"}'
    for _ in range(100):  # counted as the response ends, which may be just after the slot freed
        if metric(url, left) == 1:
            break
        time.sleep(0.05)
    assert metric(url, left) == 1  # as a non-streamed request whose client leaves is


def test_a_client_that_leaves_before_its_body_is_sent_is_counted_499_without_a_traceback(servers):
    server = servers["main"]
    url = server.url()
    left = 'arborspec_requests_total{endpoint="/v1/chat/completions",status="499"}'
    before = metric(url, left)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:  # promises 1000 bytes, sends 10, leaves
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    for _ in range(100):
        if metric(url, left) == before + 1:
            break
        time.sleep(0.05)
    assert metric(url, left) == before + 1
    assert "ClientDisconnect" not in server.log.read_text()
    still = httpx.post(url + "/v1/completions", json=SHORT, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert still.status_code == 200


def test_sigterm_ends_in_flight_streams_cleanly_and_the_server_exits(servers):
    """Last in this file: it stops the `tight` server (--shutdown-timeout 1)."""
    server = servers["tight"]
    url = server.url()
    with httpx.stream("POST", url + "/v1/completions", json=LONG_STREAM, timeout=60) as stream:
        events = data_lines(stream.iter_lines())
        next(events)
        os.kill(server.proc.pid, signal.SIGTERM)
        rest = list(events)
    assert rest[-1] == "[DONE]"
    last = json.loads(rest[-2])
    assert last.get("error", {}).get("code") == "shutdown" or last["choices"][0]["finish_reason"] == "length"
    server.proc.wait(timeout=60)
    assert server.proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    assert "Traceback" not in server.log.read_text()
