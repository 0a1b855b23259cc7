"""How much of the CPUs other processes took while something was timed.

A cost profile is measured once and cached for good (tuning/costs.py), so one taken while something else ran stays
wrong: a first start of the default pair while the test suite ran timed llama.cpp's t(1) at 101.6 ms against 58.4
quiet (Intel Xeon host, 2026-11-29), 1.74x, inside the 2x that live forwards catch. So each profile records the
share of the CPUs that other processes kept busy while it was measured (`OtherLoad`), and one taken on a busy
machine is measured again at the first start that finds the machine quiet.

Read from Linux's /proc/stat (the busy time of each CPU this process may run on) less this process's own CPU time
(`os.times`, all its threads); elsewhere nothing is known (`share` None) and nothing is measured again.
"""
from __future__ import annotations

import os
import time

BUSY = 0.1  # others' share of this process's CPUs from which a timing counts as taken on a busy machine. Even a
# spinning process at the lowest priority (nice 19) took 0.13-0.15 of the 2-core Intel host, and the 1.5B target's
# t(1) read 110 ms against ~50 quiet (its threads wait for each other); quiet, the share reads ~0.01.


MIN_SECONDS = 0.1  # a shorter window has too few clock ticks (100 a second a CPU) to tell: its share is None


def is_busy(share) -> bool:
    """Whether others' `share` of the CPUs (None: unknown; anything but a number, e.g. from a damaged record: the
    same) makes a timing one taken on a busy machine."""
    return isinstance(share, (int, float)) and share >= BUSY


def busy_seconds(stat: str, cpus: set[int]) -> float:
    """CPU seconds the CPUs `cpus` spent busy since boot (user, nice, system, irq, softirq; not idle, iowait or the
    time a hypervisor gave other machines), from the text of /proc/stat."""
    ticks = 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
            ticks += user + nice + system + irq + softirq
    return ticks / os.sysconf("SC_CLK_TCK")


def _snapshot(cpus: set[int]) -> tuple[float, float, float] | None:
    """(now, the CPUs' busy seconds, this process's CPU seconds), or None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            busy = busy_seconds(f.read(), cpus)
    except (OSError, ValueError):  # no /proc, or lines of another shape (a kernel older than 2.6.11)
        return None
    own = os.times()
    return time.monotonic(), busy, own.user + own.system


class OtherLoad:
    """`with OtherLoad() as load: <timed work>`; then `load.share`: the mean share of this process's CPUs that other
    processes kept busy meanwhile (0: none, 1: all of them all the time; None where it cannot be read, or the work
    took less than `MIN_SECONDS`)."""

    def __enter__(self) -> "OtherLoad":
        self.share: float | None = None
        try:
            self.cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            self.cpus, self._start = set(), None
            return self
        self._start = _snapshot(self.cpus)
        return self

    def __exit__(self, *exc) -> None:
        end = _snapshot(self.cpus) if self._start is not None else None
        if end is None:
            return
        (t0, busy0, own0), (t1, busy1, own1) = self._start, end
        if t1 - t0 >= MIN_SECONDS and self.cpus:
            others = max((busy1 - busy0) - (own1 - own0), 0.0)
            self.share = min(others / ((t1 - t0) * len(self.cpus)), 1.0)
