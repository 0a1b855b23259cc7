"""The share of the CPUs other processes take while something is timed (core/cpu_load.py)."""
import subprocess
import sys
import time

import pytest

from arborspec.core import cpu_load

STAT = """cpu  900 10 300 5000 20 5 5 40 0 0
cpu0 400 0 100 2500 10 2 3 20 0 0
cpu1 500 10 200 2500 10 3 2 20 0 0
intr 12345
"""


def test_busy_seconds_count_the_cpus_this_process_runs_on_and_not_idle_or_stolen_time(monkeypatch):
    monkeypatch.setattr(cpu_load.os, "sysconf", lambda name: 100)
    assert cpu_load.busy_seconds(STAT, {0}) == pytest.approx((400 + 100 + 2 + 3) / 100)
    assert cpu_load.busy_seconds(STAT, {0, 1}) == pytest.approx((505 + 715) / 100)  # not the summary line twice
    assert cpu_load.busy_seconds(STAT, {7}) == 0


def test_the_share_is_others_busy_time_over_the_cpus_time(monkeypatch):
    """Two CPUs for 2 s: 4 CPU-seconds, of which the CPUs were busy 3 and this process used 1: others 2 of 4."""
    snapshots = iter([(10.0, 100.0, 5.0), (12.0, 103.0, 6.0), (20.0, 0.0, 0.0), (20.05, 1.0, 0.0),
                      (30.0, 50.0, 9.0), (31.0, 50.5, 10.0)])
    monkeypatch.setattr(cpu_load, "_snapshot", lambda cpus: next(snapshots))
    monkeypatch.setattr(cpu_load.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with cpu_load.OtherLoad() as load:
        pass
    assert load.share == pytest.approx(0.5)
    with cpu_load.OtherLoad() as load:
        pass
    assert load.share is None  # 50 ms: too few clock ticks to tell
    with cpu_load.OtherLoad() as load:
        pass
    assert load.share == 0  # this process alone (accounting skew below zero is none)


def test_a_process_that_cannot_read_the_cpus_knows_nothing(monkeypatch, busy_rule):
    monkeypatch.setattr(cpu_load, "_snapshot", lambda cpus: None)
    with cpu_load.OtherLoad() as load:
        pass
    assert load.share is None and not cpu_load.is_busy(load.share)
    assert [cpu_load.is_busy(x) for x in (0.05, 0.1, 0.9, "0.9", float("nan"))] == [False, True, True, False, False]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat")
def test_another_process_spinning_is_seen():
    """A child that spins for 1 s holds a whole CPU (of the 2 here, however busy the suite keeps the others)."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.2: pass"])
    try:
        time.sleep(0.1)
        with cpu_load.OtherLoad() as load:
            time.sleep(0.8)
    finally:
        child.wait()
    cpus = len(cpu_load.os.sched_getaffinity(0))
    assert load.share is not None and load.share >= 0.5 / cpus


def test_a_stat_file_of_another_shape_means_unknown(monkeypatch):
    """Lines with fewer fields than user..softirq (kernels before 2.6.11) raised a ValueError from every profile."""
    old = "cpu  1 2 3 4\ncpu0 1 2 3 4\n"
    with pytest.raises(ValueError):
        cpu_load.busy_seconds(old, {0})
    monkeypatch.setattr(cpu_load, "busy_seconds", lambda stat, cpus, real=cpu_load.busy_seconds: real(old, cpus))
    assert cpu_load._snapshot({0}) is None
    with cpu_load.OtherLoad() as load:
        pass
    assert load.share is None
