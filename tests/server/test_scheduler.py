"""The step-interleaving worker on fake decoder loops: round-robin rounds, joining and leaving between steps, a
bounded queue, cancellation, failures kept to their request, and draining at shutdown."""
from __future__ import annotations

import threading

import pytest

from arborspec.engine import GenerationResult, GenerationStats, StepStats
from arborspec.server.metrics import Metrics
from arborspec.server.scheduler import Job, QueueFull, Scheduler, ShuttingDown

TIMEOUT = 30


def fake_steps(name: str, n: int, log: list, gate: threading.Event | None = None, fail_at: int | None = None,
               closed: list | None = None):
    """A decoder loop of `n` one-token steps that records each step in `log` (and waits at `gate` before each)."""
    stats = GenerationStats("fake", "greedy", False, prompt_tokens=3)
    try:
        for i in range(n):
            if gate is not None:
                gate.wait(TIMEOUT)
            if i == fail_at:
                raise FloatingPointError("non-finite logits")
            log.append(name)
            stats.steps.append(StepStats(tree_size=2, depth=1, widths=[1, 2], accepted=1, committed=1, draft_calls=1,
                                         t_draft=0.0, t_verify=0.0, t_other=0.0))
            stats.new_tokens = i + 1
            stats.finish_reason = "length" if i == n - 1 else ""
            yield GenerationResult("x" * (i + 1), [7] * (i + 1), stats)
    finally:
        if closed is not None:
            closed.append(name)


class Client:
    """What a request handler would hear."""

    def __init__(self):
        self.updates, self.done = [], threading.Event()

    def deliver(self, update):
        self.updates.append(update)
        if update.done:
            self.done.set()


def job(steps, stream=False) -> tuple[Job, Client]:
    client = Client()
    return Job(steps, client.deliver, stream), client


@pytest.mark.parametrize("batch", [False, True])
def test_active_requests_take_turns_one_step_each(batch):
    log, sched = [], Scheduler(max_batch=3, max_queue=0, metrics=Metrics(), batch=batch)
    clients = []
    for name in "abc":
        j, c = job(fake_steps(name, 3, log))
        sched.submit(j)
        clients.append(c)
    sched.start()
    assert all(c.done.wait(TIMEOUT) for c in clients)
    sched.stop()
    assert "".join(log) == "abcabcabc"
    assert [c.updates[-1].result.token_ids for c in clients] == [[7, 7, 7]] * 3


@pytest.mark.parametrize("batch", [False, True])
def test_requests_join_when_a_slot_frees_between_steps(batch):
    log, sched = [], Scheduler(max_batch=2, max_queue=5, metrics=Metrics(), batch=batch)
    clients = []
    for name, n in (("a", 2), ("b", 4), ("c", 2)):
        j, c = job(fake_steps(name, n, log))
        sched.submit(j)
        clients.append(c)
    sched.start()
    assert all(c.done.wait(TIMEOUT) for c in clients)
    sched.stop()
    assert "".join(log) == "ab" "ab" "bc" "bc"  # rounds: c joins in the round after a leaves


def test_a_full_scheduler_refuses_at_once():
    sched = Scheduler(max_batch=1, max_queue=1, metrics=Metrics())
    sched.submit(job(fake_steps("a", 1, []))[0])
    sched.submit(job(fake_steps("b", 1, []))[0])
    with pytest.raises(QueueFull):
        sched.submit(job(fake_steps("c", 1, []))[0])
    assert sched.load() == (0, 2)


def test_a_request_finished_mid_round_frees_its_room_at_once():
    """A job that finished stayed in the round's list until the round ended: its client's next request, sent at once,
    was refused as "the server is full" while the rest of the round ran (8 clients on a server of 4 + 4)."""
    gate = threading.Event()
    sched = Scheduler(max_batch=2, max_queue=0, metrics=Metrics())
    first, f = job(fake_steps("a", 1, []))
    slow, s = job(fake_steps("b", 2, [], gate=gate))
    sched.submit(first)
    sched.submit(slow)
    sched.start()
    assert f.done.wait(TIMEOUT)  # b's step now waits at the gate, in the same round
    assert sched.load() == (1, 0)
    again, a = job(fake_steps("c", 1, []))
    sched.submit(again)
    slow.cancel()
    assert sched.load() == (0, 1)  # a client that left frees its room too
    gate.set()
    assert a.done.wait(TIMEOUT)
    sched.stop()


def test_streaming_jobs_hear_every_step_others_only_the_last():
    sched = Scheduler(max_batch=2, max_queue=0, metrics=Metrics())
    streaming, s = job(fake_steps("s", 3, []), stream=True)
    whole, w = job(fake_steps("w", 3, []))
    sched.submit(streaming)
    sched.submit(whole)
    sched.start()
    assert s.done.wait(TIMEOUT) and w.done.wait(TIMEOUT)
    sched.stop()
    assert [u.done for u in s.updates] == [False, False, True] and len(w.updates) == 1


@pytest.mark.parametrize("batch", [False, True])
def test_a_cancelled_request_frees_its_slot_and_its_loop_is_closed(batch):
    log, closed, gate = [], [], threading.Event()
    metrics = Metrics()
    sched = Scheduler(max_batch=1, max_queue=1, metrics=metrics, batch=batch)
    long, lc = job(fake_steps("long", 1000, log, gate=gate, closed=closed))
    short, sc = job(fake_steps("short", 2, log))
    sched.submit(long)
    sched.submit(short)
    sched.start()
    long.cancel()  # the client left while its first step waits at the gate
    gate.set()
    assert sc.done.wait(TIMEOUT)
    sched.stop()
    assert log.count("long") <= 1 and closed == ["long"] and lc.updates == []
    assert metrics.finished.labels(reason="cancelled")._value.get() == 1


@pytest.mark.parametrize("batch", [False, True])
def test_a_failing_request_fails_alone(batch):
    log, sched = [], Scheduler(max_batch=2, max_queue=0, metrics=Metrics(), batch=batch)
    bad, b = job(fake_steps("bad", 5, log, fail_at=1))
    good, g = job(fake_steps("good", 3, log))
    sched.submit(bad)
    sched.submit(good)
    sched.start()
    assert b.done.wait(TIMEOUT) and g.done.wait(TIMEOUT)
    sched.stop()
    assert b.updates[-1].code == "internal_error" and "non-finite" in b.updates[-1].error
    assert g.updates[-1].error == "" and g.updates[-1].result.stats.new_tokens == 3


def test_draining_refuses_new_requests_and_cancels_what_is_left_after_the_grace_period():
    gate = threading.Event()
    sched = Scheduler(max_batch=1, max_queue=1, metrics=Metrics())
    running, r = job(fake_steps("running", 1000, [], gate=gate))
    queued, q = job(fake_steps("queued", 3, []))
    sched.submit(running)
    sched.submit(queued)
    sched.start()
    sched.drain(grace=0.0)
    with pytest.raises(ShuttingDown):
        sched.submit(job(fake_steps("late", 1, []))[0])
    gate.set()
    assert r.done.wait(TIMEOUT) and q.done.wait(TIMEOUT)
    sched.stop()
    assert r.updates[-1].code == "shutdown" and q.updates[-1].code == "shutdown"
    assert sched.load() == (0, 0)


class SharedForward:
    """A batch-capable fake target: records how many calls each shared forward held."""

    def __init__(self):
        self.sizes = []

    def many(self, calls):
        self.sizes.append(len(calls))
        return [c["x"] + 1 for c in calls]


class FakeTarget:
    def __init__(self):
        self.forward = SharedForward()

    def __call__(self, x):  # a forward alone (a round of one request)
        return x + 1


def forwarding_steps(name: str, n: int, target: FakeTarget, log: list):
    """A decoder loop whose every step drafts (logged), runs one target forward and commits (logged)."""
    from arborspec.backends.batching import forward

    stats = GenerationStats("fake", "greedy", False, prompt_tokens=3)
    for i in range(n):
        log.append(f"{name}{i}-draft")
        assert forward(target, {"x": i}) == i + 1
        log.append(f"{name}{i}-commit")
        stats.steps.append(StepStats(tree_size=0, depth=0, widths=[1], accepted=0, committed=1, draft_calls=0,
                                     t_draft=0.0, t_verify=0.0, t_other=0.0))
        stats.new_tokens = i + 1
        stats.finish_reason = "length" if i == n - 1 else ""
        yield GenerationResult("x" * (i + 1), [7] * (i + 1), stats)


def test_a_batching_scheduler_runs_one_target_forward_per_round_for_every_request():
    target, log = FakeTarget(), []
    sched = Scheduler(max_batch=3, max_queue=0, metrics=Metrics(), batch=True)
    clients = []
    for name, n in (("a", 2), ("b", 3), ("c", 1)):
        j, c = job(forwarding_steps(name, n, target, log))
        sched.submit(j)
        clients.append(c)
    sched.start()
    assert all(c.done.wait(TIMEOUT) for c in clients)
    sched.stop()
    assert [c.updates[-1].result.stats.new_tokens for c in clients] == [2, 3, 1]
    # a round: every request drafts, one shared forward, every request commits; requests leave when done
    assert log[:6] == ["a0-draft", "b0-draft", "c0-draft", "a0-commit", "b0-commit", "c0-commit"]
    assert target.forward.sizes == [3, 2]  # the last round has b alone: its forward runs unshared


@pytest.mark.parametrize("batch", [False, True])
def test_a_round_holds_the_models_and_a_decoder_being_made_waits_for_it(batch):
    """A round runs holding `Scheduler.models`; `start_generation` makes a request's decoder holding it too, so a
    decoder that measures the pair never runs its forwards beside a round's (nor two such decoders at once)."""
    from types import SimpleNamespace

    from arborspec.server.app import start_generation

    held, entered, gate = [], threading.Event(), threading.Event()
    sched = Scheduler(max_batch=2, max_queue=0, metrics=Metrics(), batch=batch)

    def steps():  # each step records whether its round holds the models; the first waits at the gate
        for result in fake_steps("a", 2, []):
            entered.set()
            gate.wait(TIMEOUT)
            held.append(sched.models.locked())
            yield result

    j, client = job(steps())
    sched.submit(j)
    sched.start()
    built = threading.Event()

    class Decoders:  # the parts of server/decoders.Decoders that start_generation calls
        spec, prefill_chunk, context_window = None, 0, 16

        def encode(self, prompt, room=1):
            return [1]

        def sampling(self, *_):
            return SimpleNamespace(seed=0)

        def build(self, spec, sampling):
            built.set()
            return SimpleNamespace(steps=lambda *a: iter(()))

    req = SimpleNamespace(arborspec=None, temperature=None, top_k=None, top_p=None, seed=None, ignore_eos=False,
                          max_tokens=None, max_completion_tokens=None)
    maker = threading.Thread(target=start_generation, args=(Decoders(), "m", req, "x", False, 4, [], sched.models))
    assert entered.wait(TIMEOUT)  # a round is in its step
    maker.start()
    assert not built.wait(0.3)  # the decoder waits while the round runs
    gate.set()
    assert built.wait(TIMEOUT) and client.done.wait(TIMEOUT)
    maker.join(TIMEOUT)
    sched.stop()
    assert held == [True, True]


def test_a_later_drain_only_brings_the_deadline_closer():
    sched = Scheduler(max_batch=1, max_queue=0, metrics=Metrics())
    sched.drain(grace=600.0)
    assert sched.draining and not sched.overdue
    sched.drain(grace=0.0)
    assert sched.overdue
    sched.drain(grace=600.0)
    assert sched.overdue
