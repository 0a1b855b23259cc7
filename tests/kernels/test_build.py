"""The kernels' build (kernels/build.py): a build a killed process left half done does not hang the next start; old
builds do not pile up in the cache."""
import fcntl
import os
import subprocess
import sys
import time

from arborspec.core.downloads import file_lock
from arborspec.kernels.build import build_dir, library, prune_builds


def test_a_lock_file_left_by_a_killed_build_is_cleared():
    """torch's builder waits forever for its `lock` file to go; one left by a killed process (Ctrl-C in a first
    compile) hung every later start. A new process clears it and loads the kernels."""
    library()  # built (the setup script builds it; a first run here compiles it)
    directory = build_dir()
    with file_lock(directory / "build.lock"):  # no builder is inside torch's load while the stale file is made
        (directory / "lock").touch()
    code = "from arborspec.kernels.build import library; print(library().isa)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    finally:
        (directory / "lock").unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == library().isa


def test_old_builds_are_removed_but_the_recent_the_current_and_the_busy_ones(tmp_path):
    """Builds 0..5, build i last used i hours ago; the current one is build 3, build 5 is locked by another user."""
    kernels = tmp_path / "kernels"
    names = [f"{i:016x}" for i in range(6)]
    for hours, name in enumerate(names):
        (kernels / name).mkdir(parents=True)
        (kernels / name / "arborspec_kernels.so").write_bytes(b"0")
        (kernels / name / "build.lock").touch()
        os.utime(kernels / name / "build.lock", (time.time() - 3600 * hours,) * 2)
    (kernels / "notes").mkdir()  # not a build
    with open(kernels / names[5] / "build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = prune_builds(kernels / names[3], keep=3)
    assert sorted(p.name for p in removed) == [names[2], names[4]]
    assert sorted(p.name for p in kernels.iterdir()) == sorted([names[0], names[1], names[3], names[5], "notes"])
    assert prune_builds(kernels / names[3], keep=3) == [kernels / names[5]]  # free now: the oldest goes
