"""Live servers for the server tests: tiny random models saved to a temp dir, `python -m arborspec.server` started as
subprocesses on free 127.0.0.1 ports (the server binds port 0 and prints the address it got), stopped by their PIDs.

The servers start together, once per session, because most of their start-up is importing torch: on a busy 2-core
machine that is the bulk of these tests' time.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import char_tokenizer, noisy_copy, save_models, tiny_model

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
METHOD = "static(depth=3,branch=2)"
MODEL = "tiny"
API_KEY = "test-key"
START_TIMEOUT_S = 240  # importing torch on a loaded machine is slow; a server not up by then is broken


def data_lines(lines):
    """The payloads of a server-sent event stream's `data: ` lines ("[DONE]" last)."""
    return (line[len("data: "):] for line in lines if line.startswith("data: "))


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value}, a sample a line (the comments left out)."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^([^#\s]\S*) (\S+)$", text, re.M)}


@dataclass
class LiveServer:
    proc: subprocess.Popen
    log: Path  # the server's stderr

    def url(self) -> str:
        """Waits until the server says where it listens and answers /health; its base URL."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            m = re.search(r"serving .* on (http://[\d.]+:\d+)", self.log.read_text())
            if m:
                try:
                    if httpx.get(m[1] + "/health", timeout=5).status_code == 200:
                        return m[1]
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise AssertionError(f"the server did not start in {START_TIMEOUT_S} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server-models")
    target = tiny_model("llama", seed=0)
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return save_models(root, {"target": target, "draft": noisy_copy(target, 0.2)}, tok)


def server_args(model_dirs, *extra: str) -> list[str]:
    return ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "fp32",
            "--draft-quant", "none", "--method", METHOD, "--port", "0", "--model-name", MODEL, *extra]


def launch(model_dirs, log: Path, *extra: str, api_key: str | None = None) -> LiveServer:
    """A server started with `extra` flags; `api_key`: the key it requires, given as $ARBORSPEC_API_KEY."""
    env = dict(os.environ, OMP_NUM_THREADS="1", ARBORSPEC_CACHE=str(log.parent / "cache"), PYTHONUNBUFFERED="1")
    env.pop("ARBORSPEC_API_KEY", None)
    if api_key is not None:
        env["ARBORSPEC_API_KEY"] = api_key
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "arborspec.server", *server_args(model_dirs, *extra)],
                                stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=Path(__file__).parents[2])
    return LiveServer(proc, log)


@pytest.fixture(scope="session")
def servers(model_dirs, tmp_path_factory):
    """Two servers, started at once: `main` (an API key from the environment, room for 50 concurrent streams) and
    `tight` (one slot, no queue: for 429 and disconnects; stopped by SIGTERM in the last test of
    test_capacity_and_shutdown.py)."""
    root = tmp_path_factory.mktemp("servers")
    live = {
        "main": launch(model_dirs, root / "main.log", "--max-batch", "8", "--max-queue", "64",
                       "--max-tokens-limit", "480", "--max-body-bytes", "4096", api_key=API_KEY),
        "tight": launch(model_dirs, root / "tight.log", "--max-batch", "1", "--max-queue", "0",
                        "--shutdown-timeout", "1"),
    }
    yield live
    for server in live.values():
        server.stop()


@pytest.fixture(scope="session")
def main_url(servers) -> str:
    return servers["main"].url()
