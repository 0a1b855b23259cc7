"""The step-interleaving worker on fake decoder loops: round-robin rounds, joining and leaving between steps, a
bounded queue, cancellation, failures kept to their request, and draining at shutdown."""
from __future__ import annotations

import threading

import pytest

from arborspec.engine import GenerationResult, GenerationStats, StepStats
from arborspec.server.metrics import Metrics
from arborspec.server.scheduler import Job, QueueFull, Scheduler, ShuttingDown, step_round

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


def scripted_steps(results: list):
    """A decoder loop that yields `results` as given (None: a piece of the prompt read, --prefill-chunk)."""
    yield from results


def a_result(n_tokens: int, n_steps: int, finish: str = "") -> GenerationResult:
    stats = GenerationStats("fake", "greedy", False, prompt_tokens=3)
    stats.steps = [StepStats(tree_size=2, depth=1, widths=[1, 2], accepted=1, committed=1, draft_calls=1,
                             t_draft=0.0, t_verify=0.0, t_other=0.0) for _ in range(n_steps)]
    stats.new_tokens, stats.finish_reason = n_tokens, finish
    return GenerationResult("x" * n_tokens, [7] * n_tokens, stats)


def test_a_prompt_only_scored_finishes_with_no_step_and_no_first_token():
    """echo with max_tokens 0: the loop's one result has no step and no token. The request ends cleanly, and it
    has no time to its first token."""
    metrics = Metrics()
    j, client = job(scripted_steps([a_result(0, 0, "length")]))
    j.advance(metrics)
    assert j.finished and [(u.done, u.error) for u in client.updates] == [(True, "")]
    assert metrics.registry.get_sample_value("arborspec_time_to_first_token_seconds_count") == 0
    assert metrics.registry.get_sample_value("arborspec_generated_tokens_total") in (None, 0)


def test_prompt_pieces_say_nothing_and_the_first_token_is_timed_once(monkeypatch):
    """A loop reading its prompt in pieces yields None (nothing to tell, not even to a stream); the time to the first
    token runs from the queueing to the first step that made one, not to a later step."""
    from types import SimpleNamespace

    from arborspec.server import scheduler

    now = [0.0]
    monkeypatch.setattr(scheduler, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    metrics = Metrics()
    j, client = job(scripted_steps([None, a_result(1, 1), a_result(2, 2), a_result(3, 3, "length")]), stream=True)
    for t in (10.0, 20.0, 30.0, 40.0):
        now[0] = t
        j.advance(metrics)
    assert [(u.done, len(u.result.token_ids)) for u in client.updates] == [(False, 1), (False, 2), (True, 3)]
    assert metrics.registry.get_sample_value("arborspec_time_to_first_token_seconds_sum") == 20.0
    assert metrics.registry.get_sample_value("arborspec_request_latency_seconds_sum") == 40.0


def test_a_request_cancelled_before_its_turn_in_a_round_takes_no_step():
    """A client that left while the round ran the requests before its own: its step is not run."""
    log, metrics = [], Metrics()
    left, lc = job(fake_steps("left", 3, log))
    stays, sc = job(fake_steps("stays", 3, log))
    left.cancel()
    step_round([left, stays], metrics)
    assert log == ["stays"] and lc.updates == [] and not left.finished


def test_a_round_does_not_end_a_request_twice_when_its_handler_fails_after_its_end():
    """A failure outside the request's own loop (here its last delivery) after the request ended: it is logged, and
    the request is not ended again (a second 'done' update, an 'error' counted for a request that finished)."""
    metrics, heard = Metrics(), []

    def deliver(update):
        heard.append(update)
        if len(heard) == 1:
            raise RuntimeError("the handler broke")

    j = Job(fake_steps("a", 1, []), deliver, stream=False)
    step_round([j], metrics)
    assert j.finished and [(u.done, u.error) for u in heard] == [(True, "")]
    assert metrics.finished.labels(reason="error")._value.get() == 0


@pytest.mark.parametrize("max_batch,max_queue", [(0, 0), (0, 4), (1, -1)])
def test_a_scheduler_needs_a_slot_and_a_queue_of_no_negative_size(max_batch, max_queue):
    with pytest.raises(ValueError, match="max_batch must be >= 1 and max_queue >= 0"):
        Scheduler(max_batch=max_batch, max_queue=max_queue, metrics=Metrics())


def test_a_queued_request_whose_client_left_frees_its_place_in_the_queue():
    sched = Scheduler(max_batch=1, max_queue=1, metrics=Metrics())
    sched.submit(job(fake_steps("a", 1, []))[0])
    left = job(fake_steps("b", 1, []))[0]
    sched.submit(left)
    left.cancel()
    assert sched.load() == (0, 1)
    sched.submit(job(fake_steps("c", 1, []))[0])  # not "the server is full"
    assert sched.load() == (0, 2)


def test_a_drain_with_no_grace_is_overdue_at_once(monkeypatch):
    """drain(0) (a second Ctrl-C): the grace is over at its deadline itself, even on a clock that has not moved."""
    from types import SimpleNamespace

    from arborspec.server import scheduler

    monkeypatch.setattr(scheduler, "time", SimpleNamespace(monotonic=lambda: 100.0, perf_counter=lambda: 0.0))
    sched = Scheduler(max_batch=1, max_queue=0, metrics=Metrics())
    sched.drain(grace=0.0)
    assert sched.overdue


def test_a_stopped_scheduler_refuses_new_requests():
    sched = Scheduler(max_batch=1, max_queue=1, metrics=Metrics())
    sched.stop()
    with pytest.raises(ShuttingDown):
        sched.submit(job(fake_steps("late", 1, []))[0])
    assert sched.load() == (0, 0)


def test_the_queue_depth_counts_each_submitted_request_at_once():
    metrics = Metrics()
    sched = Scheduler(max_batch=1, max_queue=2, metrics=metrics)
    for depth, name in enumerate("ab", 1):
        sched.submit(job(fake_steps(name, 1, []))[0])
        assert metrics.registry.get_sample_value("arborspec_queue_depth") == depth


def test_an_idle_worker_sleeps_until_the_drain_deadline_and_not_again_after_it(monkeypatch):
    """Idle, the worker wakes at the deadline (just past it, so that it is over when it checks); once it is over,
    it sleeps until notified (a timeout of zero or less would have it spin)."""
    from types import SimpleNamespace

    from arborspec.server import scheduler

    now = [100.0]
    monkeypatch.setattr(scheduler, "time", SimpleNamespace(monotonic=lambda: now[0], perf_counter=lambda: 0.0))
    sched = Scheduler(max_batch=1, max_queue=0, metrics=Metrics())
    assert sched._wait_time() is None
    sched.drain(grace=5.0)
    assert sched._wait_time() == pytest.approx(5.01)
    now[0] = 105.0
    assert sched._wait_time() is None
    now[0] = 200.0
    assert sched._wait_time() is None


def test_a_round_reports_its_batch_size_while_it_runs():
    metrics, sizes = Metrics(), []

    def steps(name):
        for result in fake_steps(name, 2, []):
            sizes.append(metrics.registry.get_sample_value("arborspec_batch_size"))
            yield result

    sched = Scheduler(max_batch=2, max_queue=0, metrics=metrics)
    clients = []
    for name in "ab":
        j, c = job(steps(name))
        sched.submit(j)
        clients.append(c)
    sched.start()
    assert all(c.done.wait(TIMEOUT) for c in clients)
    sched.stop()
    assert sizes == [2, 2, 2, 2]


def test_stopping_ends_the_running_and_the_queued_requests_and_zeroes_the_gauges():
    metrics, entered = Metrics(), threading.Event()

    def endless():
        for result in fake_steps("running", 10**6, []):
            entered.set()
            yield result

    sched = Scheduler(max_batch=1, max_queue=1, metrics=metrics)
    running, r = job(endless())
    queued, q = job(fake_steps("queued", 3, []))
    sched.submit(running)
    sched.submit(queued)
    sched.start()
    assert entered.wait(TIMEOUT)
    sched.stop()
    assert r.updates[-1].code == "shutdown" and q.updates[-1].code == "shutdown"
    assert metrics.registry.get_sample_value("arborspec_queue_depth") == 0
    assert metrics.registry.get_sample_value("arborspec_batch_size") == 0
    assert metrics.finished.labels(reason="shutdown")._value.get() == 2


def test_a_queued_request_whose_client_left_leaves_the_queue_before_the_next_round():
    metrics, depths = Metrics(), []

    def first():
        for result in fake_steps("a", 1, []):
            depths.append(metrics.registry.get_sample_value("arborspec_queue_depth"))
            yield result

    sched = Scheduler(max_batch=1, max_queue=2, metrics=metrics)
    a, ac = job(first())
    left, lc = job(fake_steps("left", 3, []))
    last, c = job(fake_steps("c", 1, []))
    for j in (a, left, last):
        sched.submit(j)
    left.cancel()
    sched.start()
    assert ac.done.wait(TIMEOUT) and c.done.wait(TIMEOUT)
    sched.stop()
    assert depths == [1] and left.finished and lc.updates == []
