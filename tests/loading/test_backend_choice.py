"""`--backend auto` for GGUF files (loading/backend_choice.py): the backend measured fastest, cached; the draft follows.

The rule is tested on given costs (timings are never asserted); the wiring on tiny GGUFs the tests write."""
from __future__ import annotations

import pytest

from arborspec.backends import llamacpp
from arborspec.backends.native import is_native
from arborspec.core.disk_cache import read_record
from arborspec.drafting.auto.policy import predicted_rates
from arborspec.kernels.build import library
from arborspec.loading import backend_choice, load_model
from arborspec.loading.backend_choice import choice_key, choose, pick
from arborspec.loading.pair import load_pair
from arborspec.tuning.costs import CostCurve
from tests.backends.tiny_gguf import write_tiny_gguf


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test its own cache: a choice cached by one test must not decide another's. The kernels are loaded first,
    from the real cache (compiled once per CPU)."""
    library()
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))


def figures(t1: float, t4: float, rate: float | None = None) -> dict:
    """A candidate's figures as backend_choice.measure makes them: a target curve and a predicted rate."""
    return {"rate": 1 / t1 if rate is None else rate, "plain": 1 / t1, "speculative": None,
            "target": {"sizes": [1, 4], "times": [t1, t4]}, "draft": None}


def curve(t1: float, t4: float, t16: float | None = None) -> CostCurve:
    sizes, times = [1, 4], [t1, t4]
    if t16 is not None:
        sizes, times = [1, 4, 16], [t1, t4, t16]
    return CostCurve.from_measurements(sizes, times)


def test_the_fastest_predicted_rate_wins_and_near_ties_go_to_the_cheaper_tree():
    assert pick({"native": figures(0.050, 0.083), "llamacpp": figures(0.040, 0.100)}) == "llamacpp"  # 25% faster
    assert pick({"native": figures(0.041, 0.068), "llamacpp": figures(0.040, 0.100)}) == "native"  # within 5%: t(4)
    assert pick({"native": figures(0.043, 0.068), "llamacpp": figures(0.040, 0.100)}) == "llamacpp"  # 7.5%: not a tie
    assert pick({"native": figures(0.040, 0.068)}) == "native"
    # slower plain decoding, but speculation predicted faster: the rate decides, not t(1)
    assert pick({"native": figures(0.050, 0.060, rate=30.0), "llamacpp": figures(0.040, 0.100)}) == "native"


def test_the_rate_is_auto_policys_own_prediction_from_both_curves():
    """t(1) alone would pick the first backend; its trees cost 3x a token to verify against 1.2x on the other, and
    with a cheap draft the second predicts the faster speculation (objective.expected_ceiling)."""
    draft = curve(0.004, 0.005, 0.008)
    fast_plain = predicted_rates(curve(0.040, 0.120, 0.400), draft)
    cheap_trees = predicted_rates(curve(0.044, 0.050, 0.070), draft)
    assert fast_plain["plain"] > cheap_trees["plain"]
    assert cheap_trees["speculative"] > fast_plain["speculative"] and cheap_trees["rate"] > fast_plain["rate"]
    assert cheap_trees["rate"] == cheap_trees["speculative"] > 1.1 * cheap_trees["plain"]
    assert predicted_rates(curve(0.040, 0.120), None)["rate"] == 1 / 0.040  # no draft: plain decoding
    dear_draft = predicted_rates(curve(0.040, 0.050), curve(0.040, 0.050))  # a draft as dear as the target
    assert dear_draft["rate"] == dear_draft["plain"]  # speculation cannot pay: auto would decode plainly


class Loader:
    """A stand-in backend: returns (model, None) (None: cannot run the file) and counts its calls."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self):
        self.calls += 1
        return None if self.model is None else (self.model, None)


def test_choose_measures_every_candidate_once_keeps_the_winner_and_caches_the_choice(tmp_path, monkeypatch):
    monkeypatch.setattr(backend_choice, "remeasured", lambda models, progress=True: False)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x" * 10)
    measured = {"fast": figures(0.030, 0.050), "slow": figures(0.060, 0.090)}
    monkeypatch.setattr(backend_choice, "measure", lambda model, draft=None: measured[model])
    loaders = {"slow": Loader("slow"), "fast": Loader("fast")}
    got = choose(path, loaders, threads=2, progress=False)
    assert (got.backend, got.loaded) == ("fast", ("fast", None)) and "fast 33.3 tok/s" in got.why
    assert [ld.calls for ld in loaders.values()] == [1, 1]
    record = read_record("backend-choice", choice_key(path, ["slow", "fast"], 2))
    assert record["backend"] == "fast" and record["figures"]["slow"]["target"]["times"] == [0.06, 0.09]
    again = choose(path, loaders, threads=2, progress=False)
    assert (again.backend, again.loaded) == ("fast", None)  # cached: nothing loaded
    assert [ld.calls for ld in loaders.values()] == [1, 1]
    from arborspec.core.disk_cache import write_record
    for damage in ({"rate": None}, {"target": {"sizes": [1, 4], "times": [0.0, 0.0]}}):  # a KeyError, a ValueError
        record["figures"]["slow"] = {k: v for k, v in record["figures"]["slow"].items() if k != "rate"} \
            if damage.get("rate", 0) is None else {**record["figures"]["slow"], **damage}
        write_record("backend-choice", choice_key(path, ["slow", "fast"], 2), record)
        assert choose(path, loaders, threads=2, progress=False).loaded == ("fast", None)  # measured again
    assert [ld.calls for ld in loaders.values()] == [3, 3]
    whole = read_record("backend-choice", choice_key(path, ["slow", "fast"], 2))
    for damaged in ({**whole, "figures": {**whole["figures"], "slow": None}}, {**whole, "backend": ["fast"]},
                    {**whole, "figures": {**whole["figures"], "slow": [1, 2]}}):  # were tracebacks
        write_record("backend-choice", choice_key(path, ["slow", "fast"], 2), damaged)
        assert choose(path, loaders, threads=2, progress=False).loaded == ("fast", None)  # measured again
    assert [ld.calls for ld in loaders.values()] == [6, 6]
    assert choose(path, loaders, threads=1, progress=False).loaded == ("fast", None)  # another thread count
    draft = tmp_path / "d.gguf"
    draft.write_bytes(b"d")
    assert choose(path, loaders, draft, threads=2, progress=False).loaded == ("fast", None)  # with a draft: again
    path.write_bytes(b"y" * 11)  # another file at the same path: measured again
    assert choose(path, loaders, threads=2, progress=False).loaded == ("fast", None)
    assert loaders["fast"].calls == 9


def test_a_backend_that_cannot_run_the_file_drops_out_unmeasured(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    measured = []
    monkeypatch.setattr(backend_choice, "measure", lambda m, d=None: measured.append(m) or figures(1.0, 1.0))
    monkeypatch.setattr(backend_choice, "remeasured", lambda models, progress=True: False)
    got = choose(path, {"native": Loader(None), "llamacpp": Loader("l")}, progress=False)
    assert (got.backend, got.loaded) == ("llamacpp", ("l", None))
    assert measured == []  # one candidate left: nothing to compare
    with pytest.raises(ValueError, match="no backend can run"):
        choose(tmp_path / "m.gguf", {"native": Loader(None)}, threads=3, progress=False)


def test_a_candidate_profiled_while_the_machine_was_busy_is_measured_again_before_the_comparison(tmp_path,
                                                                                                 monkeypatch):
    """The 1064 ms case: the first profile of "a" ran during a stall and loses on its figures; checked against live
    forwards once every candidate is profiled, it is measured again, and the true figures decide."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    measured = {"a": [figures(0.300, 0.500), figures(0.030, 0.050)], "b": [figures(0.040, 0.060)]}
    monkeypatch.setattr(backend_choice, "measure", lambda m, d=None: measured[m].pop(0))
    monkeypatch.setattr(backend_choice, "remeasured", lambda models, progress=True: models[0] == "a")
    got = choose(path, {"a": Loader("a"), "b": Loader("b")}, threads=2, progress=False)
    assert got.backend == "a" and got.record["figures"]["a"]["plain"] == pytest.approx(1 / 0.030)
    assert measured == {"a": [], "b": []}


def test_a_comparison_made_while_the_machine_was_busy_is_used_but_not_cached(tmp_path, monkeypatch):
    """One candidate's profile came from the cache (live forwards found the machine busy: the cached figure kept),
    the other's was measured live under the same load, and the cached choice then stood for good."""
    from arborspec.tuning import costs

    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    measured = {"a": figures(0.100, 0.150), "b": figures(0.032, 0.090)}
    monkeypatch.setattr(backend_choice, "measure", lambda m, d=None: measured[m])

    def remeasured(models, progress=True):
        costs.busy += models[0] == "b"  # "b"'s live check: busy, its cached figure kept
        return False

    monkeypatch.setattr(backend_choice, "remeasured", remeasured)
    loaders = {"a": Loader("a"), "b": Loader("b")}
    assert choose(path, loaders, threads=2, progress=False).backend == "b"
    assert read_record("backend-choice", choice_key(path, ["a", "b"], 2)) is None
    monkeypatch.setattr(backend_choice, "remeasured", lambda models, progress=True: False)
    choose(path, loaders, threads=2, progress=False)  # compared again at the next start: a quiet one is kept
    assert [ld.calls for ld in loaders.values()] == [2, 2]
    assert read_record("backend-choice", choice_key(path, ["a", "b"], 2))["backend"] == "b"


def test_a_cached_choice_takes_the_winners_figures_measured_again(tmp_path, monkeypatch):
    """At a later start the winner's curves are checked (profile_model); one measured again replaces its figures in
    the record and the start-up line; figures that hold leave the record alone."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    monkeypatch.setattr(backend_choice, "remeasured", lambda models, progress=True: False)
    monkeypatch.setattr(backend_choice, "measure",
                        lambda m, d=None: {"a": figures(0.060, 0.100), "b": figures(0.080, 0.120)}[m])
    choose(path, {"a": Loader("a"), "b": Loader("b")}, threads=2, progress=False)
    cached = choose(path, {"a": Loader("a"), "b": Loader("b")}, threads=2, progress=False)
    assert cached.backend == "a" and cached.loaded is None and "a 16.7 tok/s" in cached.why
    profiles = {"a": (curve(0.060, 0.100), "cache")}
    monkeypatch.setattr(backend_choice, "profile_model", lambda model, progress=False: profiles[model])
    backend_choice.recheck(cached, "a", progress=False)
    assert read_record("backend-choice", cached.key)["figures"]["a"]["plain"] == pytest.approx(1 / 0.060)
    profiles["a"] = (curve(0.025, 0.040), "measured")  # its cached figure was a busy machine's
    backend_choice.recheck(cached, "a", progress=False)
    record = read_record("backend-choice", cached.key)
    assert record["backend"] == "a" and record["figures"]["a"]["plain"] == 40.0 and "a 40.0 tok/s" in cached.why
    assert record["figures"]["b"]["plain"] == pytest.approx(1 / 0.080)  # the other's, as recorded


def test_live_forwards_replace_a_cached_curve_only_when_it_is_too_slow(monkeypatch):
    """Load only ever slows a forward: a cached curve 3x slower than live forwards was taken on a busy machine and is
    measured again, and so is one whose t(4) grows from t(1) far faster than the live pair's (the load fell on its
    larger trees); live forwards 3x slower than the cache mean the machine is busy now, and the cache stands."""
    from types import SimpleNamespace

    from arborspec.tuning import costs
    model, cached = SimpleNamespace(config=SimpleNamespace()), curve(0.030, 0.060)
    for live, agrees in (((0.010, 0.020), False), ((0.090, 0.180), True), ((0.035, 0.065), True),
                         ((0.030, 0.036), False),  # t(1) right, but t(4) = 2 t(1) cached against 1.2 t(1) live
                         ((0.028, 0.045), True),  # cached t(4)/t(1) 2.0 against 1.6 live: within LIVE_SHAPE
                         ((0.045, 0.036), True)):  # a stalled live t(1) says nothing of the curve's growth
        key = {"name": f"m{live}"}
        assert costs.live_agrees(model, cached, key, measure=lambda *a, live=live, **k: list(live)) == agrees
        assert costs.live_agrees(model, cached, key, measure=lambda *a, **k: [1e-4, 1e-4])  # once per process


def test_auto_runs_a_gguf_on_a_measured_backend_and_the_draft_follows_it(tmp_path, capsys):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    write_tiny_gguf(target, dtype="q4_k")
    write_tiny_gguf(draft, dtype="q4_k", noise=0.2)
    t, d = load_pair(str(target), str(draft), backend="auto", progress=True)
    err = capsys.readouterr().err
    chosen = "native" if is_native(t.model) else "llamacpp"
    assert f"{chosen} runs t.gguf fastest here" in err or not llamacpp.available()
    assert "with its draft" in err or not llamacpp.available()  # the pair was measured, not the target alone
    assert is_native(d.model) == is_native(t.model)  # one thread pool for both
    again = load_model(str(target), backend="auto", progress=False)  # the cached choice
    assert is_native(again.model) == is_native(t.model)
    t, d = load_pair(str(target), str(draft), backend="auto", progress=False)  # both tokenizers saved: one object
    assert d.tokenizer is t.tokenizer


def test_auto_on_a_gguf_native_cannot_run_says_so_only_as_progress(tmp_path, capsys):
    path = tmp_path / "f32.gguf"
    write_tiny_gguf(path, dtype="f32")  # float weights: no native kernel
    loaded = load_model(str(path), backend="auto", progress=False)
    assert not is_native(loaded.model) and capsys.readouterr().err == ""
