"""A live server on the native backend (tiny random GGUFs): it says its rounds share one target forward, and
concurrent requests over HTTP, greedy and seeded sampled, of different lengths, get exactly what each gets from
`SpeculativeDecoder.generate` alone."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from arborspec.core.disk_cache import cache_dir
from arborspec.kernels.build import library
from arborspec.loading import load_model
from arborspec.runspec import build_decoder, parse
from tests.backends.tiny_gguf import write_tiny_gguf
from tests.server.conftest import LiveServer

METHOD = "static(depth=3,branch=2)"
K_QUANT = {"hidden": 256, "ffn": 512, "dtype": "q4_k"}
# (prompt, max_tokens, sampling): four requests at once, of different lengths, one of them sampled with a seed
REQUESTS = [("def fib(n):\n    return", 24, {}), ("x = ", 9, {}), ("import os\n", 17, {"temperature": 1.0, "seed": 5}),
            ("for i in range(3):", 12, {})]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("native-server")
    return {"target": write_tiny_gguf(root / "target.gguf", **K_QUANT),
            "draft": write_tiny_gguf(root / "draft.gguf", noise=0.2, **K_QUANT)}


@pytest.fixture(scope="module")
def server(ggufs, tmp_path_factory):
    library()  # compiled once per CPU, in the real cache; the server's private cache links to it
    root = tmp_path_factory.mktemp("native-server-run")
    (root / "cache").mkdir()
    (root / "cache" / "kernels").symlink_to(cache_dir() / "kernels")
    env = dict(os.environ, OMP_NUM_THREADS="1", ARBORSPEC_CACHE=str(root / "cache"), PYTHONUNBUFFERED="1")
    log = root / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "arborspec.server", "--target", str(ggufs["target"]),
                                 "--draft", str(ggufs["draft"]), "--backend", "native", "--draft-quant", "none",
                                 "--method", METHOD, "--port", "0", "--model-name", "tiny", "--max-batch", "4"],
                                stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=Path(__file__).parents[2])
    live = LiveServer(proc, log)
    yield live
    live.stop()


def complete(url: str, prompt: str, max_tokens: int, sampling: dict) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "arborspec": {"return_token_ids": True}, **sampling}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_concurrent_requests_share_rounds_and_each_gets_its_output_alone(server, ggufs, monkeypatch, tmp_path):
    url = server.url()
    assert "one target forward per round" in server.log.read_text()
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        replies = list(pool.map(lambda r: complete(url, *r), REQUESTS))
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))  # the tokenizers it saves: not in ~/.cache
    target = load_model(str(ggufs["target"]), backend="native", progress=False)
    draft = load_model(str(ggufs["draft"]), backend="native", progress=False)
    for (prompt, n, sampling), reply in zip(REQUESTS, replies):
        decoder = build_decoder(parse(METHOD, draft_quant="none"), target, draft,
                                temperature=sampling.get("temperature", 0.0))
        want = decoder.generate(prompt, max_new_tokens=n, seed=sampling.get("seed"), ignore_eos=True)
        assert reply["arborspec"]["token_ids"] == want.token_ids and reply["choices"][0]["text"] == want.text
        assert reply["usage"]["completion_tokens"] == n
    assert httpx.get(url + "/health", timeout=30).status_code == 200
