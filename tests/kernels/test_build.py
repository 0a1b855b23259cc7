"""The kernels' build (kernels/build.py): a build a killed process left half done does not hang the next start."""
import subprocess
import sys

from arborspec.core.downloads import file_lock
from arborspec.kernels.build import build_dir, library


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
