"""Rounds (backends/batching.py) on fake models and fake steps: the forwards of a round's steps run as one `many` call
per model, drafts first, each step gets its own output, steps take turns in order, and a step that raises, finishes
early or waits on a failing forward never leaves the others hanging."""
from __future__ import annotations

import threading

from arborspec.backends import batching

TIMEOUT = 30


class FakeForward:
    """A batch-capable forward: output = 10 x the call's x; records each `many` call's xs."""

    def __init__(self, fail: bool = False):
        self.batches: list[list[int]] = []
        self.fail = fail

    def __call__(self, x):
        return self.many([dict(x=x)])[0]

    def many(self, calls):
        self.batches.append([c["x"] for c in calls])
        if self.fail:
            raise MemoryError("out of memory")
        return [10 * c["x"] for c in calls]


class FakeModel:
    def __init__(self, fail: bool = False):
        self.forward = FakeForward(fail)

    def __call__(self, **kwargs):
        return self.forward(**kwargs)


def run(tasks, batch=True):
    """run_round in a thread of its own, so that a hang fails the test instead of freezing it."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("errors", batching.run_round(tasks, batch)), daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "the round hung"
    return out["errors"]


def test_a_rounds_forwards_run_as_one_call_and_each_step_gets_its_own_output():
    model, got = FakeModel(), {}

    def step(name, xs):
        def task():
            got[name] = [batching.forward(model, dict(x=x)) for x in xs]
        return task

    errors = run([step("a", [1, 2]), step("b", [3]), step("c", [4, 5, 6])])
    assert errors == [None, None, None]
    assert got == {"a": [10, 20], "b": [30], "c": [40, 50, 60]}
    # each batch holds the next forward of every step still running, in step order
    assert model.forward.batches == [[1, 3, 4], [2, 5], [6]]


def test_steps_take_turns_in_order_and_never_run_at_once():
    model, log, running = FakeModel(), [], []

    def step(name):
        def task():
            running.append(name)
            assert len(running) == 1, f"{running} run at once"
            log.append(f"{name}-draft")
            running.pop()
            batching.forward(model, dict(x=1))
            running.append(name)
            assert len(running) == 1, f"{running} run at once"
            log.append(f"{name}-verify")
            running.pop()
        return task

    assert run([step("a"), step("b")]) == [None, None]
    assert log == ["a-draft", "b-draft", "a-verify", "b-verify"]


def test_a_step_that_raises_or_ends_early_releases_the_others():
    model, got = FakeModel(), {}

    def failing():
        batching.forward(model, dict(x=1))
        raise FloatingPointError("non-finite logits")

    def short():
        got["short"] = "done without a forward"

    def long():
        got["long"] = [batching.forward(model, dict(x=x)) for x in (2, 3, 4)]

    errors = run([failing, short, long])
    assert isinstance(errors[0], FloatingPointError) and errors[1:] == [None, None]
    assert got == {"short": "done without a forward", "long": [20, 30, 40]}
    assert model.forward.batches == [[1, 2], [3], [4]]


def test_a_failing_shared_forward_is_each_waiting_steps_own_error():
    model, seen = FakeModel(fail=True), []

    def step():
        try:
            batching.forward(model, dict(x=1))
        except RuntimeError as err:
            seen.append(err)
            raise

    errors = run([step, step, step])
    assert len(model.forward.batches) == 1  # no retry: the caches may be half updated
    assert all(isinstance(e, RuntimeError) and "the batched forward failed: MemoryError" in str(e) for e in errors)
    assert len({id(e) for e in seen}) == 3 and isinstance(seen[0].__cause__, MemoryError)


def test_each_model_gets_one_many_call_with_only_its_own_calls():
    """Steps waiting on two models at once (two targets' requests in one round): a `many` call per model, each over
    the calls made on it, and every step gets its own model's output."""
    first, second, got = FakeModel(), FakeModel(), {}

    def step(name, model, x):
        def task():
            got[name] = batching.forward(model, dict(x=x))
        return task

    assert run([step("a", first, 1), step("b", second, 2), step("c", first, 3)]) == [None] * 3
    assert first.forward.batches == [[1, 3]] and second.forward.batches == [[2]]
    assert got == {"a": 10, "b": 20, "c": 30}


def test_draft_forwards_run_first_so_one_target_forward_holds_every_request():
    """Request a drafts two layers, b one, c none: the drafts' layers run side by side, and the target's forwards
    wait for the last draft layer, so the round has ONE target forward over all three."""
    target, draft, got = FakeModel(), FakeModel(), {}

    def step(name, layers):
        def task():
            drafted = [batching.forward(draft, dict(x=layer), role="draft") for layer in range(layers)]
            got[name] = (drafted, batching.forward(target, dict(x=len(name) + layers)))
        return task

    assert run([step("a", 2), step("b", 1), step("c", 0)]) == [None] * 3
    assert draft.forward.batches == [[0, 0], [1]] and target.forward.batches == [[3, 2, 1]]
    assert got == {"a": ([0, 10], 30), "b": ([0], 20), "c": ([], 10)}


def test_calls_on_models_that_do_not_batch_run_at_once_on_the_steps_own_thread():
    """A model without `many` (transformers' forward, llama.cpp), a call outside a round: plain calls."""
    target, threads = FakeModel(), []

    class Plain:
        def __call__(self, x):
            threads.append(threading.current_thread().name)
            return -x

    def step():
        assert batching.forward(Plain(), dict(x=3), role="draft") == -3
        assert batching.forward(target, dict(x=2)) == 20

    assert run([step, step]) == [None, None]
    assert target.forward.batches == [[2, 2]]
    assert threads == ["arborspec-step-0", "arborspec-step-1"]
    assert batching.forward(target, dict(x=5)) == 50  # no round on this thread: a call of its own


def test_without_batching_the_steps_run_one_after_another_on_the_callers_thread():
    model, log = FakeModel(), []

    def step(name):
        def task():
            log.append((name, threading.current_thread() is threading.main_thread()))
            batching.forward(model, dict(x=1))
            if name == "b":
                raise ValueError("bad")
            log.append((name, "after"))
        return task

    errors = batching.run_round([step("a"), step("b"), step("c")], batch=False)
    assert [type(e).__name__ if e else None for e in errors] == [None, "ValueError", None]
    assert log == [("a", True), ("a", "after"), ("b", True), ("c", True), ("c", "after")]
    assert model.forward.batches == [[1], [1], [1]]


def test_can_batch_is_whether_the_forward_has_many():
    class Bare:
        def forward(self, x):
            return x

    assert batching.can_batch(FakeModel()) and not batching.can_batch(Bare()) and not batching.can_batch(object())


def test_a_step_knows_how_many_requests_share_its_forwards():
    seen = []

    def task():
        seen.append(batching.sharing())

    assert run([task, task, task]) == [None] * 3 and seen == [3, 3, 3]
    seen.clear()
    assert run([task, task], batch=False) == [None] * 2 and seen == [1, 1]  # one after another: nothing shared
    assert batching.sharing() == 1


def _step_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("arborspec-step")]


def _interrupted(tasks) -> None:
    """run_round, interrupted by a Ctrl-C (KeyboardInterrupt) in the caller's thread; no step thread may outlive it."""
    try:
        batching.run_round(tasks, batch=True)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interrupt did not reach the caller")
    for thread in _step_threads():
        thread.join(TIMEOUT)
    assert not _step_threads(), "a step thread waits for a turn forever"


def test_a_round_interrupted_mid_forward_ends_every_step_and_each_cleans_up():
    """Ctrl-C during a shared forward (it runs on the caller's thread) left the steps waiting for their turn forever,
    each holding its request's caches (32 threads after 10 interrupted generate_batch calls)."""
    class Interrupted(FakeForward):
        def many(self, calls):
            raise KeyboardInterrupt
    model, closed, outcome = FakeModel(), [], {}
    model.forward = Interrupted()

    def step(name):
        def task():
            try:
                batching.forward(model, dict(x=1))
                outcome[name] = "ran on"
            except batching.RoundAborted:
                outcome[name] = "aborted"
                raise
            finally:
                closed.append(name)
        return task

    _interrupted([step("a"), step("b"), step("c")])
    assert sorted(closed) == ["a", "b", "c"] and set(outcome.values()) == {"aborted"}


def test_a_round_interrupted_while_its_threads_start_leaves_none_behind(monkeypatch):
    started, ran = [], []
    start = threading.Thread.start

    def start_then_interrupt(thread):
        start(thread)
        started.append(thread.name)
        if len(started) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    _interrupted([lambda: ran.append(1)] * 3)
    monkeypatch.undo()
    assert len(started) == 2 and ran == []  # no task runs once the caller is gone


def test_a_second_ctrl_c_while_the_round_ends_its_steps_leaves_none_behind():
    """The second Ctrl-C came while the abort waited for a step's clean-up: the abort stopped there, the steps after
    it waited forever, and generate_batch's clean-up said "generator already executing" instead of the interrupt."""
    import _thread
    import time

    from arborspec.engine.many_prompts import generate_batch

    class Forward:
        def __call__(self, **kw):
            return self.many([kw])[0]

        def many(self, calls):
            _thread.interrupt_main()  # the first Ctrl-C, during the shared forward (on the caller's thread)
            time.sleep(0.2)
            return [1 for _ in calls]

    class Model:
        forward = Forward()

    class Decoder:
        target = Model()

        def encode(self, prompt):
            return [1]

        def fork(self):
            return self

        def steps(self, prompt, *args, **kwargs):
            try:
                while True:
                    batching.forward(self.target, dict(x=1))
                    yield None
            finally:
                if threading.current_thread().name.startswith("arborspec-step"):
                    _thread.interrupt_main()  # the second, while the abort waits for this clean-up
                    time.sleep(0.3)

    try:
        generate_batch(Decoder(), ["a", "b", "c"], max_new_tokens=4)
    except KeyboardInterrupt:
        pass
    time.sleep(1.0)  # a second interrupt still pending reaches this thread here, not inside the round
    for thread in _step_threads():
        thread.join(TIMEOUT)
    assert not _step_threads()
