"""Child processes that stop with this one: a kernel build's ninja and compilers, a fetch's pip."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time


class _Stopped(BaseException):  # not an Exception: no `except Exception` in the block swallows it
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def children_stop_with_us(wait_s: float = 5.0):
    """SIGTERM or SIGHUP during the block goes to this process's children too (ninja, which passes it on to its
    compilers; pip) before this process dies by it. The default action killed the process alone: `timeout`, `kill
    PID` or a closed terminal during a first kernel build left ninja and two compilers running, orphaned, on both
    cores, and during a fetch left pip downloading into a partial file nothing removed (Ctrl-C reaches the whole
    process group and was fine). The signal arrives in the block as an exception (so cleanups in it run) and is
    raised again once the block is left, so the exit status still says which signal ended the process."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def forward(signum, frame):
        children = _children()
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)
        deadline = time.monotonic() + wait_s
        while any(_running(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise _Stopped(signum)

    before = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    except _Stopped as stop:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        signal.raise_signal(stop.signum)
        raise  # a handler of the caller's own that returned
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _children() -> list[int]:
    """This process's child processes (from /proc: ninja is started deep inside torch's builder)."""
    me, found = str(os.getpid()), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                with open(f"/proc/{entry.name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:  # the field after the state: the parent
                        found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Whether `pid` is alive and not a zombie (a child that has exited but is not yet waited for)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
