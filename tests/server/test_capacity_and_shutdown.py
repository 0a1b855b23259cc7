"""A full server answers 429 at once; a client that disconnects mid-stream frees its slot; SIGTERM ends in-flight
streams cleanly (finished, or told the server is shutting down) and the process exits; the server binds 127.0.0.1
unless told otherwise. Live subprocess servers from tests/server/conftest.py."""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time

import httpx
import pytest

from arborspec.server import add_serve_arguments, main
from tests.server.conftest import MODEL, server_args

LONG_STREAM = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 480, "stream": True, "ignore_eos": True}
SHORT = {"model": MODEL, "prompt": "def g(y):", "max_tokens": 2}


def data_lines(lines):
    return (line[len("data: "):] for line in lines if line.startswith("data: "))


def generations(url: str, reason: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    key = f'arborspec_generations_total{{reason="{reason}"}} '
    return sum(float(line[len(key):]) for line in text.splitlines() if line.startswith(key))


def test_a_full_server_answers_429_at_once_and_a_client_that_leaves_frees_its_slot(servers):
    url = servers["tight"].url()  # one slot, no queue
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json=LONG_STREAM) as stream:
            events = data_lines(stream.iter_lines())  # (dropping this iterator would close the connection)
            next(events)  # generating: the only slot is taken
            full = httpx.post(url + "/v1/completions", json=SHORT, timeout=10)  # a hang would time out
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        # leaving the block closes the connection mid-stream
    for _ in range(300):
        after = httpx.post(url + "/v1/completions", json=SHORT, timeout=30)
        if after.status_code != 429:
            break
        time.sleep(0.1)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] >= 1
    assert generations(url, "cancelled") == 1  # the stream was cancelled, not run to its end


def test_the_server_binds_127_0_0_1_unless_told_otherwise(servers):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args([]).host == "127.0.0.1"
    assert parser.parse_args(["--host", "0.0.0.0"]).host == "0.0.0.0"
    servers["tight"].url()
    assert "on http://127.0.0.1:" in servers["tight"].log.read_text()  # started without --host


@pytest.mark.parametrize("extra, message", [
    (["--max-batch", "0"], "--max-batch must be at least 1"),
    (["--max-tokens-limit", "0"], "--max-tokens-limit"),
    (["--method", "wetap-lossy"], "lossy"),
    (["--method", "hf-assisted"], "is a baseline"),
    (["--method", "nope"], "unknown method"),
])
def test_bad_server_settings_fail_before_loading_with_one_line(model_dirs, capsys, extra, message):
    assert main(server_args(model_dirs, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("arborspec: error:") and message in err[0]


def test_a_taken_port_is_an_error_not_a_traceback(model_dirs, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = server_args(model_dirs)
        args[args.index("--port") + 1] = str(taken.getsockname()[1])
        assert main(args) == 2
    assert "arborspec: error: cannot listen on 127.0.0.1:" in capsys.readouterr().err


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
