"""server/replicas.py's parts that run without a Ray cluster: the replica's threads, its response header, its drain
and metrics gathering (on fakes of the scheduler and of Serve's handle), the deployment's sizing and the checks before
Ray starts, and the driver's start-up and shutdown order with Ray and Serve faked. tests/server/test_ray.py runs
the real deployment."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="the `ray` extra is not installed")

from arborspec.server import replicas  # noqa: E402
from arborspec.server.run import check_ray_flags  # noqa: E402
from tests.server.test_ray import flags  # noqa: E402

TEXT = b"# HELP jobs_total jobs\n# TYPE jobs_total counter\njobs_total 3.0\n"


def test_a_replicas_threads_are_its_cpus_rounded_at_least_one_unless_llama_threads_says(monkeypatch):
    import torch
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    for cpus, llama, want in ((0.4, None, 1), (2.6, None, 3), (2.0, 5, 5)):
        args = SimpleNamespace(replica_cpus=cpus, llama_threads=llama)
        replicas.use_threads(args)
        assert args.llama_threads == want
    assert set_to == [1, 3, 2]


def test_every_http_response_names_its_replica_and_keeps_its_own_headers():
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message):
        sent.append(message)
    asyncio.run(replicas.ReplicaHeader(app, "r1")({"type": "http"}, None, send))
    assert sent[0]["headers"] == [(b"content-type", b"text/plain"), (replicas.REPLICA_HEADER, b"r1")]
    assert sent[1] == {"type": "http.response.body", "body": b"ok"}
    lifespan = []

    async def other(scope, receive, send):
        lifespan.append(send)
    asyncio.run(replicas.ReplicaHeader(other, "r1")({"type": "lifespan"}, None, send))
    assert lifespan == [send]  # not http: passed through untouched


class FakeScheduler:
    """Busy (one request running) until `busy_s` after the drain began."""

    def __init__(self, busy_s: float):
        self.busy_s, self.grace, self.since = busy_s, None, None

    def drain(self, grace):
        self.grace, self.since = grace, time.monotonic()

    def load(self):
        return (0, 0) if self.since is not None and time.monotonic() - self.since >= self.busy_s else (1, 0)


def test_a_replicas_drain_starts_the_schedulers_and_waits_for_its_requests_through_the_grace(monkeypatch):
    monkeypatch.setattr(replicas, "DRAIN_SLACK_S", 0.2)
    scheduler = FakeScheduler(busy_s=0.8)
    asyncio.run(replicas.ArborspecReplica.drain(SimpleNamespace(server=SimpleNamespace(scheduler=scheduler)), 1.5))
    assert scheduler.grace == 1.5 and scheduler.load() == (0, 0)
    stuck = FakeScheduler(busy_s=60)
    t0 = time.monotonic()
    asyncio.run(replicas.ArborspecReplica.drain(SimpleNamespace(server=SimpleNamespace(scheduler=stuck)), 0.3))
    assert time.monotonic() - t0 < 3  # the grace and its slack, not the request's own end


def test_a_replica_that_fails_a_metrics_scrape_is_left_out_of_it():
    class Handle:
        def broadcast(self, method):
            assert method == "metrics_text"
            return SimpleNamespace(results_async=self.results)

        async def results(self, timeout_s, return_exceptions):
            return [("r1", TEXT), RuntimeError("replica r2 died")]
    replica = SimpleNamespace(_handle=Handle())
    merged = asyncio.run(replicas.ArborspecReplica.all_metrics(replica)).decode()
    assert 'jobs_total{replica="r1"} 3.0' in merged and "r2" not in merged


def test_a_fixed_deployment_has_one_replica_by_default_and_the_shutdown_grace_of_the_flag():
    args = flags("--ray", "--shutdown-timeout", "7")
    check_ray_flags(args)
    d = replicas.deployment(args)
    assert d.num_replicas == 1 and d._deployment_config.graceful_shutdown_timeout_s == 7
    assert replicas.replica_count(args).startswith("1 ")
    scaled = flags("--ray", "--autoscale", "2,5")
    check_ray_flags(scaled)
    assert replicas.replica_count(scaled) == "2-5 replicas"


@pytest.mark.parametrize("argv, cpus, room", [
    (["--replicas", "2", "--replica-cpus", "2"], 4, True),  # exactly the cluster's CPUs
    (["--replicas", "2", "--replica-cpus", "2"], 3, False),
    (["--autoscale", "3,8"], 2, False),  # autoscaling starts with MIN replicas
    (["--autoscale", "0,8"], 1, True),
])
def test_the_cluster_must_hold_the_replicas_that_start(monkeypatch, argv, cpus, room):
    monkeypatch.setattr(replicas.ray, "cluster_resources", lambda: {"CPU": cpus})
    args = flags("--ray", *argv)
    check_ray_flags(args)
    if room:
        replicas.check_room(args)
    else:
        with pytest.raises(ValueError, match="the Ray cluster has"):
            replicas.check_room(args)


def test_a_ray_address_where_something_listens_passes_with_ray_scheme_or_ipv6_brackets():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        replicas.check_address(f"ray://127.0.0.1:{sock.getsockname()[1]}")
    with socket.socket(socket.AF_INET6) as sock:
        try:
            sock.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        sock.listen()
        port = sock.getsockname()[1]
        replicas.check_address(f"[::1]:{port}")
    with pytest.raises(ValueError, match="no Ray cluster answers there"):
        replicas.check_address(f"[::1]:{port}")
    replicas.check_address(f":{port}")  # no host: left to Ray


def test_the_driver_waits_for_the_replicas_drain_past_its_grace_and_slack(monkeypatch):
    """Each replica's drain takes up to grace + DRAIN_SLACK_S and a tenth more; the driver must not give up first."""
    waited = []

    class Handle:
        def broadcast(self, method, grace):
            assert (method, grace) == ("drain", 2.0)
            return SimpleNamespace(results=lambda timeout_s, return_exceptions: waited.append(timeout_s))
    monkeypatch.setattr(replicas.serve, "get_deployment_handle", lambda name, app: Handle())
    replicas.drain(2.0)
    assert waited[0] > 2.0 + replicas.DRAIN_SLACK_S * 1.1


def test_after_the_first_signal_a_second_ctrl_c_interrupts_again():
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        replicas.wait_for_signal()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])


def test_a_replicas_error_is_the_last_line_of_its_traceback_else_rays_own(monkeypatch):
    message = "Traceback (most recent call last):\n  ...\nOSError: no model\n"
    status = SimpleNamespace(applications={replicas.APP_NAME: SimpleNamespace(deployments={
        "ArborspecReplica": SimpleNamespace(message=message)})})
    monkeypatch.setattr(replicas.serve, "status", lambda: status)
    assert replicas.replica_error(RuntimeError("deploy failed")) == "OSError: no model"

    def down():
        raise ConnectionError("no controller")
    monkeypatch.setattr(replicas.serve, "status", down)
    assert replicas.replica_error(RuntimeError("first\ndeploy failed\n")) == "deploy failed"


@pytest.fixture
def fake_ray(monkeypatch):
    """Ray and Serve as the driver calls them, recording the calls; the signal wait returns at once."""
    calls = []
    monkeypatch.setattr(replicas.ray, "init", lambda **kw: calls.append(("init", kw["address"])))
    monkeypatch.setattr(replicas.ray, "shutdown", lambda: calls.append(("ray.shutdown",)))
    monkeypatch.setattr(replicas.ray, "cluster_resources", lambda: {"CPU": 64})
    monkeypatch.setattr(replicas.serve, "start", lambda **kw: calls.append(("serve.start",)))
    monkeypatch.setattr(replicas.serve, "run", lambda *a, **kw: calls.append(("serve.run",)))
    monkeypatch.setattr(replicas.serve, "shutdown", lambda: calls.append(("serve.shutdown",)))
    monkeypatch.setattr(replicas, "wait_for_signal", lambda: calls.append(("signal",)))
    monkeypatch.setattr(replicas, "drain", lambda grace: calls.append(("drain", grace)))
    monkeypatch.setattr(replicas, "check_address", lambda address: calls.append(("check_address", address)))
    monkeypatch.setattr(replicas, "deployment", lambda args: SimpleNamespace(bind=lambda *a: None))
    monkeypatch.setattr(replicas, "describe", lambda args, spec: "fake")
    old = signal.getsignal(signal.SIGTERM)
    yield calls
    signal.signal(signal.SIGTERM, old)


def test_a_local_ray_is_started_drained_and_shut_down_and_a_joined_cluster_is_left_running(fake_ray):
    args = flags("--ray", "--port", "0", "--shutdown-timeout", "3")
    check_ray_flags(args)
    assert replicas.run_on_ray(args, None) == 0
    assert fake_ray == [("init", "local"), ("serve.start",), ("serve.run",), ("signal",), ("drain", 3.0),
                        ("serve.shutdown",), ("ray.shutdown",)]
    fake_ray.clear()
    joined = flags("--ray", "--port", "0", "--ray-address", "10.0.0.1:6379")
    check_ray_flags(joined)
    assert replicas.run_on_ray(joined, None) == 0
    assert fake_ray[:2] == [("check_address", "10.0.0.1:6379"), ("init", "10.0.0.1:6379")]
    assert ("ray.shutdown",) not in fake_ray
