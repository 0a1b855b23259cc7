"""The lock that keeps two processes from fetching one alias at once (core/downloads.py)."""
from __future__ import annotations

import threading

from arborspec.core.downloads import file_lock


def test_a_run_that_waits_for_the_lock_says_so(tmp_path, capsys):
    """It sat silent for as long as the other process's download took."""
    path, held, release = tmp_path / "locks" / "some-alias.lock", threading.Event(), threading.Event()

    def holder():
        with file_lock(path):
            held.set()
            release.wait(30)
    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(30)
    threading.Timer(0.5, release.set).start()
    with file_lock(path):  # another open file: flock blocks it as it would another process
        pass
    thread.join(30)
    assert "waiting for another arborspec process to finish with some-alias" in capsys.readouterr().err
    with file_lock(path):
        pass
    assert "waiting" not in capsys.readouterr().err  # a free lock is taken without a word
