"""Continuous batching: one worker advances every active request by one speculative step per round.

Requests join (from a bounded queue, up to `max_batch` at once) and leave (finished, client gone, server stopping)
between rounds. Each request owns its own decoder loop (`SpeculativeDecoder.steps`, a generator that yields after
every step), and with it its own policy state, sampling settings, seed, stopping rules and KV caches, so its
output is exactly what it would be alone. Only the loaded models are shared: sessions never share state, and one
thread at a time runs a forward (`Scheduler.models`: a round, or a request's decoder being made), so no two forwards
race.

A round (`step_round`) is `backends.batching.run_round` over the requests' steps: with a target that batches (the
native backend) every request drafts its tree and ONE target forward verifies all of them; otherwise the steps run
one after another. `SpeculativeDecoder.generate_batch` (and `arborspec bench --concurrency`) runs the same rounds.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

from ..backends.batching import run_round
from ..engine import GenerationResult
from .metrics import Metrics

log = logging.getLogger("arborspec.server")


@dataclass(frozen=True)
class Update:
    """What a request's handler hears from the worker: the generation so far, or why it ended early."""

    result: GenerationResult | None
    done: bool
    error: str = ""  # set when the generation ended without finishing
    code: str = ""  # "shutdown" or "internal_error", with `error`


class QueueFull(Exception):
    """Every slot and every queue place is taken: answer 429 now rather than make the client wait unboundedly."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


class Job:
    """One request inside the scheduler: its decoder loop, where its updates go, and whether its client left."""

    def __init__(self, steps: Iterator[GenerationResult], deliver: Callable[[Update], None], stream: bool):
        self.steps = steps  # the request's own decoder loop; advanced only by the worker (a round's thread)
        self.deliver = deliver  # called on the worker's threads (one at a time); must neither block nor raise
        self.stream = stream  # deliver every step, or only the last
        self.queued = time.perf_counter()
        self.first_token: float | None = None
        self.result: GenerationResult | None = None
        self.cancelled = False  # set from any thread; the worker drops the job before its next step
        self.finished = False

    def cancel(self) -> None:
        self.cancelled = True

    def advance(self, metrics: Metrics) -> None:
        """One step of this request's decoder."""
        try:
            result = next(self.steps)
        except Exception as err:  # a failing request must not take the others down with it
            log.exception("generation failed")
            self.end(metrics, "error", Update(None, True, f"generation failed: {err}", "internal_error"))
            return
        if result is None:  # a piece of its prompt read (--prefill-chunk): nothing to tell yet
            return
        self.result = result
        if result.stats.steps:  # none when a prompt was only scored (echo, max_tokens 0)
            metrics.step(result.stats.steps[-1], result.stats.method)
        if self.first_token is None and result.token_ids:
            self.first_token = time.perf_counter()
        if result.stats.finish_reason:
            metrics.generation(result, self.queued, self.first_token, time.perf_counter())
            self.end(metrics, None, Update(result, True))
        elif self.stream:
            self.deliver(Update(result, False))

    def end(self, metrics: Metrics, reason: str | None, update: Update | None) -> None:
        """Leave the scheduler: close the decoder loop (its KV caches go with it) and tell the handler, if any."""
        self.finished = True
        self.steps.close()
        if reason is not None:
            metrics.finished.labels(reason=reason).inc()
        if update is not None:
            self.deliver(update)


def step_round(jobs: list[Job], metrics: Metrics, batch: bool = False) -> None:
    """Advance every job in `jobs` by one speculative step.

    Without `batch` each job runs its own step in turn (its draft forwards, then one target forward over its own
    tree), so a round costs the sum of the jobs' steps. With `batch` (a target that batches, backends/batching.py),
    each job's step runs in a thread of its own, taking turns: every job drafts its tree; ONE target forward runs all
    trees together, each attending only to its own KV cache; each job verifies and commits its own tree with its own
    sampling settings and random generator. Every output stays what it is at batch size 1; the gain is that the
    target's weights are read once per round instead of once per job, which is what a memory-bound target pays for.
    """
    errors = run_round([partial(_advance, job, metrics) for job in jobs], batch)
    for job, err in zip(jobs, errors):
        if err is not None:  # Job.advance keeps a request's own failures to it; this is anything else
            log.error("a step failed outside its request: %r", err)
            if not job.finished:
                job.end(metrics, "error", Update(job.result, True, f"generation failed: {err}", "internal_error"))


def _advance(job: Job, metrics: Metrics) -> None:
    if not job.cancelled:  # a client that left during this round frees its slot now
        job.advance(metrics)


class Scheduler:
    """Admission (`submit`), the worker thread's rounds, and shutdown (`drain`, then `stop`). `batch`: the rounds share
    one target forward (`step_round`); for a target that batches (`backends.batching.can_batch`)."""

    def __init__(self, max_batch: int, max_queue: int, metrics: Metrics, batch: bool = False):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self.max_batch, self.max_queue, self.metrics, self.batch = max_batch, max_queue, metrics, batch
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._deadline: float | None = None  # set by drain(): what is still running then is cancelled
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="arborspec-scheduler", daemon=True)
        # Held while a round runs, and by whoever else runs the loaded models: a request's decoder is made in a
        # thread of its own (app.py), and making it may measure the pair (auto's agreement or cost profiles, the
        # first time). Forwards from two threads at once each spread over every core and spin at their barriers
        # against each other: three requests whose decoders measured beside a round took 14.8 s, not ~5 (Zen 4).
        self.models = threading.Lock()

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def load(self) -> tuple[int, int]:
        """(requests being generated, requests waiting): neither finished nor cancelled. A job that finished mid-round
        stays in the round's list until the round ends, and one whose client left until the next begins; counted,
        they had a client that sent its next request at once refused as "the server is full" (8 clients, one request
        each at a time, on a server of 4 + 4: 3-8 of 64 requests refused, an SSM model's rounds)."""
        with self._cond:
            return (sum(not (job.finished or job.cancelled) for job in self._active),
                    sum(not job.cancelled for job in self._waiting))

    def start(self) -> None:
        self._thread.start()

    @property
    def overdue(self) -> bool:
        """The drain's grace is over. Handlers then answer their clients themselves (app.py): the worker cancels
        what is left only between rounds, and a round reading long prompts on llama.cpp ran 15 s past the grace."""
        return self._deadline is not None and time.monotonic() >= self._deadline

    def check_room(self) -> None:
        """ShuttingDown or QueueFull if a request submitted now would be refused: checked before its decoder is made
        too, which waits for the running round (`models`), so that a full server answers 429 at once."""
        with self._cond:
            if self.draining or self._stopped:
                raise ShuttingDown("the server is shutting down")
            if sum(self.load()) >= self.max_batch + self.max_queue:
                raise QueueFull(f"the server is full ({self.max_batch} requests running, {self.max_queue} queued); "
                                "retry later")

    def submit(self, job: Job) -> None:
        with self._cond:
            self.check_room()  # (the condition's lock is reentrant)
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def drain(self, grace: float) -> None:
        """Take no new requests; let the running and queued ones finish for `grace` seconds, then cancel the rest.
        A later call can only bring the deadline closer (a second Ctrl-C: `drain(0)`)."""
        with self._cond:
            deadline = time.monotonic() + grace
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel whatever is left and end the worker thread (after the step it is in, if any)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the worker thread ------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._active or self._waiting or self._stopped):
                    self._cond.wait(timeout=self._wait_time())
                    self._check_deadline()
                self._check_deadline()
                if self._stopped:
                    self._cancel_all()
                    return
                self._drop_cancelled()
                while self._waiting and len(self._active) < self.max_batch:  # join between rounds
                    self._active.append(self._waiting.popleft())
                batch = list(self._active)
                self.metrics.queue_depth.set(len(self._waiting))
                self.metrics.batch_size.set(len(batch))
            with self.models:  # outside the condition's lock: submitting never waits for a forward
                step_round(batch, self.metrics, self.batch)
            with self._cond:
                self._active = [job for job in self._active if not job.finished]
                self.metrics.batch_size.set(len(self._active))

    def _wait_time(self) -> float | None:
        """How long an idle worker may sleep: until notified, or until the drain deadline if one is ahead."""
        left = None if self._deadline is None else self._deadline - time.monotonic()
        return min(left + 0.01, threading.TIMEOUT_MAX) if left is not None and left > 0 else None

    def _check_deadline(self) -> None:
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self._cancel_all()

    def _cancel_all(self) -> None:
        for job in [*self._active, *self._waiting]:
            if not job.finished:
                job.end(self.metrics, "shutdown",
                        Update(job.result, True, "the server is shutting down", "shutdown"))
        self._active, self._waiting = [], deque()
        self.metrics.queue_depth.set(0)
        self.metrics.batch_size.set(0)

    def _drop_cancelled(self) -> None:
        """Jobs whose client left: end them without a word (nobody is listening)."""
        for job in [*self._active, *self._waiting]:
            if job.cancelled and not job.finished:
                job.end(self.metrics, "cancelled", None)
        self._active = [job for job in self._active if not job.finished]
        self._waiting = deque(job for job in self._waiting if not job.finished)
