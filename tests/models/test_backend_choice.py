"""`--backend auto` for GGUF files (models/backend_choice.py): the backend measured fastest, cached; the draft follows.

The rule is tested on given costs (timings are never asserted); the wiring on tiny GGUFs the tests write."""
from __future__ import annotations

import pytest

from arborspec.cache import read_record
from arborspec.kernels.build import library
from arborspec.models import backend_choice, llamacpp
from arborspec.models.backend_choice import choice_key, choose, pick
from arborspec.models.loading import load_model
from arborspec.models.native import is_native
from arborspec.spec import load_pair

from .tiny_gguf import write_tiny_gguf


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test its own cache: a choice cached by one test must not decide another's. The kernels are loaded first,
    from the real cache (compiled once per CPU)."""
    library()
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))


def costs(t1: float, t4: float) -> dict[int, float]:
    return {1: t1, 4: t4}


def test_the_fastest_plain_step_wins_and_near_ties_go_to_the_cheaper_tree():
    assert pick({"native": costs(0.050, 0.083), "llamacpp": costs(0.040, 0.100)}) == "llamacpp"  # 25% faster t(1)
    assert pick({"native": costs(0.041, 0.068), "llamacpp": costs(0.040, 0.100)}) == "native"  # within 5%: t(4)
    assert pick({"native": costs(0.043, 0.068), "llamacpp": costs(0.040, 0.100)}) == "llamacpp"  # 7.5%: not a tie
    assert pick({"native": costs(0.040, 0.068)}) == "native"


class Loader:
    """A stand-in backend: returns `model` (None: cannot run the file) and counts its calls."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self):
        self.calls += 1
        return self.model


def test_choose_times_every_candidate_once_keeps_the_winner_and_caches_the_choice(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x" * 10)
    measured = {"fast": costs(0.030, 0.050), "slow": costs(0.060, 0.090)}
    monkeypatch.setattr(backend_choice, "time_forwards", lambda model: measured[model])
    loaders = {"slow": Loader("slow"), "fast": Loader("fast")}
    assert choose(path, loaders, threads=2, progress=False) == ("fast", "fast")
    assert [ld.calls for ld in loaders.values()] == [1, 1]
    record = read_record("backend-choice", choice_key(path, ["slow", "fast"], 2))
    assert record["backend"] == "fast" and record["costs_ms"]["slow"]["1"] == 60.0
    assert choose(path, loaders, threads=2, progress=False) == ("fast", None)  # cached: nothing loaded
    assert [ld.calls for ld in loaders.values()] == [1, 1]
    assert choose(path, loaders, threads=1, progress=False) == ("fast", "fast")  # another thread count: measured
    path.write_bytes(b"y" * 11)  # another file at the same path: measured again
    assert choose(path, loaders, threads=2, progress=False) == ("fast", "fast")
    assert loaders["fast"].calls == 3


def test_a_backend_that_cannot_run_the_file_drops_out_untimed(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    timed = []
    monkeypatch.setattr(backend_choice, "time_forwards", lambda model: timed.append(model) or costs(1.0, 1.0))
    assert choose(path, {"native": Loader(None), "llamacpp": Loader("l")}, progress=False) == ("llamacpp", "l")
    assert timed == []  # one candidate left: nothing to compare
    with pytest.raises(ValueError, match="no backend can run"):
        choose(tmp_path / "m.gguf", {"native": Loader(None)}, threads=3, progress=False)


def test_auto_runs_a_gguf_on_a_measured_backend_and_the_draft_follows_it(tmp_path, capsys):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    write_tiny_gguf(target, dtype="q4_k")
    write_tiny_gguf(draft, dtype="q4_k", noise=0.2)
    t, d = load_pair(str(target), str(draft), backend="auto", progress=True)
    err = capsys.readouterr().err
    chosen = "native" if is_native(t.model) else "llamacpp"
    assert f"{chosen} runs t.gguf fastest here" in err or not llamacpp.available()
    assert is_native(d.model) == is_native(t.model)  # one thread pool for both
    again = load_model(str(target), backend="auto", progress=False)  # the cached choice
    assert is_native(again.model) == is_native(t.model)


def test_auto_on_a_gguf_native_cannot_run_says_so_only_as_progress(tmp_path, capsys):
    path = tmp_path / "f32.gguf"
    write_tiny_gguf(path, dtype="f32")  # float weights: no native kernel
    loaded = load_model(str(path), backend="auto", progress=False)
    assert not is_native(loaded.model) and capsys.readouterr().err == ""
