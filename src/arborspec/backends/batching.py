"""Rounds: several requests' decoder steps advanced together, their forwards on one model run as ONE forward.

Why a rendezvous and not a rewritten engine: a request's step (`SpeculativeDecoder.steps`) drafts, runs the target
once over its tree, verifies and commits, all in one screen of code that knows nothing of other requests. Here each
step of a round runs in its own thread, and the threads take turns (a baton, handed on in request order): a step
runs until it asks for a forward of a batch-capable model, or ends; then the next step runs. When every step of the
round is either waiting for a forward or done, the round runs the waiting forwards together (one `forward.many` call
per model), hands each step its own output, and resumes the steps in order.

Draft forwards go first: while any step waits on a draft forward, only draft forwards run (the drafts' layers of
every request side by side), and the target's wait until every request has finished drafting. So one target forward
per round verifies every request's tree, however many layers each request drafts.

Only one thread runs at a time, so nothing races: not the models' kernels (which split their work over torch's own
thread pool), not a policy, not a cache. A step that raises or finishes releases the others (it is done), and a
shared forward that fails is reported to every step that waited on it, as its own error.

A model batches when its `forward` has a `many(calls)` method: the native backend's (backends/native_forward.py),
whose forward computes every row alone, so a request's logits in a shared forward are the bits it gets alone.
transformers' own forward (a masked batch over padded sequences would round differently), llama.cpp and the
state-space backend do not: their forwards run at once, unshared, and a scheduler whose target does not batch runs
its rounds' steps one after another (`run_round(..., batch=False)`).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

_READY, _WAITING, _DONE = "ready", "waiting", "done"
_local = threading.local()  # .round, .index: the round (and which of its steps) this thread runs, if any


def can_batch(model) -> bool:
    """Whether `model`'s forwards from several requests can run as one (its forward has `many`)."""
    return callable(getattr(getattr(model, "forward", None), "many", None))


def forward(model, kwargs: dict, role: str = "target"):
    """`model(**kwargs)`, or, on a step of a batching round with a batch-capable model, the same call's output from
    the round's shared forward (`role`: the session's, "draft" or "target"; drafts go first)."""
    round_ = getattr(_local, "round", None)
    if round_ is not None and can_batch(model):
        return round_.submit(model, kwargs, role)
    return model(**kwargs)


def sharing() -> int:
    """How many requests' steps share this thread's forwards: the size of the batching round it runs in, else 1.
    A row added to one request's tree then delays every request of the round (drafting/grafts/budget.py)."""
    round_ = getattr(_local, "round", None)
    return round_.size if round_ is not None else 1


def run_round(tasks: list[Callable[[], None]], batch: bool) -> list[BaseException | None]:
    """Run every task once (one request's step each); each task's exception, or None. With `batch`, as a `Round`
    (forwards shared); without, one after another in this thread, as they would run alone."""
    if batch and len(tasks) > 1:
        return Round(len(tasks)).run(tasks)
    errors: list[BaseException | None] = []
    for task in tasks:
        try:
            task()
            errors.append(None)
        except Exception as err:
            errors.append(err)
    return errors


class RoundAborted(RuntimeError):
    """Raised in a step's thread when the round it waits in was interrupted (the caller's Ctrl-C)."""


class Round:
    """One round of `n` steps (see the module docstring). `run` is called once, from the thread that owns it."""

    def __init__(self, n: int):
        self._cond = threading.Condition()
        self._state = [_READY] * n
        self._turn: int | None = None  # the step whose thread may run now; None: the coordinator's turn
        self._calls: dict[int, tuple] = {}  # step -> (model, kwargs, role) it waits on
        self._outputs: dict[int, object] = {}  # step -> its forward's output, or the exception to raise
        self._errors: list[BaseException | None] = [None] * n
        self._aborted = False  # the coordinator was interrupted: every step ends at its next wait (`_abort`)

    @property
    def size(self) -> int:
        """The number of steps in the round (backends/batching.sharing)."""
        return len(self._state)

    def run(self, tasks: list[Callable[[], None]]) -> list[BaseException | None]:
        threads = [threading.Thread(target=self._step, args=(i, task), name=f"arborspec-step-{i}", daemon=True)
                   for i, task in enumerate(tasks)]
        try:
            for thread in threads:
                thread.start()
            while self._next():
                pass
        except BaseException:  # Ctrl-C in the caller's thread
            self._abort(threads)
            raise
        for thread in threads:
            thread.join()
        return self._errors

    def _abort(self, threads: list[threading.Thread]) -> None:
        """End every step that is not done, one at a time as ever: each raises RoundAborted at its next wait (one
        that has not started its task ends without running it), so it closes its request's caches. Before, an
        interrupted round left its threads waiting for a turn forever, each holding its request's KV caches (32
        threads after 10 Ctrl-C on a 4-prompt generate_batch)."""
        with self._cond:
            self._aborted = True
            for i, thread in enumerate(threads):
                if thread.ident is None:  # never started (the Ctrl-C came while the threads started); one
                    self._state[i] = _DONE  # that starts yet finds itself done (`_step`)
            self._cond.notify_all()
            self._settle(lambda: self._turn is None)  # a running step gets to its next wait first
            for i, state in enumerate(self._state):
                if state != _DONE:
                    self._turn = i
                    self._cond.notify_all()
                    self._settle(lambda: self._turn is None)

    def _settle(self, predicate) -> None:
        """wait_for(predicate) through further Ctrl-Cs: an abort cut short left the steps after it waiting forever."""
        while True:
            try:
                self._cond.wait_for(predicate)
                return
            except KeyboardInterrupt:
                continue

    def submit(self, model, kwargs: dict, role: str):
        """On a step's thread: wait for the round's shared forward, return this call's output (or raise its error)."""
        i = _local.index
        with self._cond:
            self._calls[i] = (model, kwargs, role)
            self._pass(i, _WAITING)
            self._cond.wait_for(lambda: self._turn == i)
            if self._aborted:
                raise RoundAborted("the round was interrupted")
            out = self._outputs.pop(i)
        if isinstance(out, BaseException):
            raise out
        return out

    # ---- the coordinator ----------------------------------------------------------------------------------------
    def _next(self) -> bool:
        """Give the baton to the first ready step and wait for it back; when none is ready, run the waiting forwards
        (the drafts' first). False once every step is done."""
        with self._cond:
            ready = [i for i, s in enumerate(self._state) if s == _READY]
            if ready:
                self._turn = ready[0]
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._turn is None)
                return True
            waiting = [i for i, s in enumerate(self._state) if s == _WAITING]
            if not waiting:
                return False
            drafting = [i for i in waiting if self._calls[i][2] != "target"]
            chosen = drafting or waiting
            calls = [self._calls.pop(i)[:2] for i in chosen]
        outputs = forward_together(calls)
        with self._cond:
            for i, out in zip(chosen, outputs):
                self._outputs[i] = out
                self._state[i] = _READY
        return True

    # ---- a step's thread ----------------------------------------------------------------------------------------
    def _step(self, i: int, task: Callable[[], None]) -> None:
        _local.round, _local.index = self, i
        with self._cond:
            self._cond.wait_for(lambda: self._turn == i or self._state[i] == _DONE)
            if self._state[i] == _DONE:  # counted as never started by an abort
                _local.round = None
                return
        try:
            if not self._aborted:
                task()
        except BaseException as err:  # kept for the caller; the round goes on without this step
            self._errors[i] = err
        finally:
            _local.round = None
            with self._cond:
                self._pass(i, _DONE)

    def _pass(self, i: int, state: str) -> None:
        """Step i stops running (waiting for a forward, or done): the baton goes back to the coordinator."""
        self._state[i] = state
        self._turn = None
        self._cond.notify_all()


def forward_together(calls: list[tuple]) -> list[object]:
    """[(model, kwargs)] -> each call's output, in order: the calls on one model as one `forward.many` call. A
    failing shared forward is each of its calls' error (its caches may be half updated: no retry alone)."""
    outputs: list[object] = [None] * len(calls)
    by_model: dict[int, list[int]] = {}
    for j, (model, _) in enumerate(calls):
        by_model.setdefault(id(model), []).append(j)
    for members in by_model.values():
        model = calls[members[0]][0]
        try:
            results = model.forward.many([calls[j][1] for j in members])
        except Exception as err:
            results = [_failed(err) for _ in members]
        for j, out in zip(members, results):
            outputs[j] = out
    return outputs


def _failed(err: Exception) -> RuntimeError:
    """A fresh exception per waiting step (one exception object raised in several threads would share a traceback)."""
    out = RuntimeError(f"the batched forward failed: {type(err).__name__}: {err}")
    out.__cause__ = err
    return out
