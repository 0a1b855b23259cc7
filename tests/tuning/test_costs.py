"""The forward-cost measurements (tuning/costs.py) name the model they measured when it fails."""
import pytest
import torch

from arborspec.tuning import agreement, costs
from tests.conftest import tiny_model


def test_a_broken_model_is_named_by_what_was_profiled_not_called_the_target():
    """`--backend auto` profiles the draft too; a draft whose logits are NaN was reported as "the target model
    produced non-finite logits"."""
    draft = tiny_model("llama", seed=1)
    draft.config._name_or_path = "/models/broken-draft.gguf"
    with torch.no_grad():
        draft.get_output_embeddings().weight[:, 0] = float("nan")
    for measure in (lambda: costs.measure_forward_cost(draft, sizes=(1, 2), prefix=4, repeats=1),
                    lambda: agreement.next_token_logits(draft, [3, 4, 5])):
        with pytest.raises(FloatingPointError, match="the profiled broken-draft.gguf model produced non-finite"):
            measure()


def test_a_cache_that_cannot_be_written_costs_a_note_not_the_run(tmp_path, monkeypatch, capsys):
    """A read-only cache failed the default generate after its measurements, on the cost profile's record."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ARBORSPEC_CACHE", str(blocker / "cache"))  # no directory can be made under a file
    model = tiny_model("llama")
    curve, source = costs.profile_model(model, sizes=(1, 2), measure=lambda m, sizes, **kw: [0.01, 0.012])
    assert source == "measured" and curve(2) == pytest.approx(0.012)
    costs.profile_model(model, sizes=(1, 2), measure=lambda m, sizes, **kw: [0.01, 0.012])
    assert capsys.readouterr().err.count("cannot write to the cache") == 1  # said once


def test_a_profile_of_small_sizes_is_not_read_for_larger_ones(tmp_path, monkeypatch):
    """`arborspec profile --pair --sizes 1,2` cached a curve that auto, asking for trees up to 128, read flat past 2."""
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    model = tiny_model("llama")
    small, source = costs.profile_model(model, sizes=(1, 2), measure=lambda m, sizes, **kw: [0.023, 0.018])
    assert source == "measured"
    _, source = costs.profile_model(model, sizes=(1, 2), measure=lambda m, sizes, **kw: pytest.fail("measured"))
    assert source == "cache"
    full, source = costs.profile_model(model, sizes=(1, 2, 4, 128),
                                       measure=lambda m, sizes, **kw: [0.023, 0.018, 0.02, 0.3])
    assert source == "measured" and full(128) == pytest.approx(0.3)


def test_a_profile_without_one_row_is_not_read_for_one(tmp_path, monkeypatch):
    """A profile of `--sizes 2,...,128` was reused for auto's sizes, its t(1) read as t(2)."""
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    model = tiny_model("llama")
    costs.profile_model(model, sizes=(2, 128), measure=lambda m, sizes, **kw: [0.012, 0.3])
    full, source = costs.profile_model(model, sizes=(1, 2, 128), measure=lambda m, sizes, **kw: [0.011, 0.012, 0.3])
    assert source == "measured" and full(1) == pytest.approx(0.011)


def test_a_cached_profile_holding_nan_is_measured_again(tmp_path, monkeypatch):
    """A NaN time passed the record's check (`t <= 0` is False for NaN): auto sized its trees from NaN costs and
    `profile --pair` printed nan fits."""
    import json
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    model = tiny_model("llama")
    costs.profile_model(model, sizes=(1, 2, 4), measure=lambda m, sizes, **kw: [0.01, 0.012, 0.015])
    (record,) = tmp_path.rglob("cost-*.json")
    for field, bad in (("raw_times", float("nan")), ("raw_times", float("inf")), ("sizes", float("inf")),
                       ("sizes", 0), ("sizes", 1.5)):  # an infinite size was an OverflowError traceback
        data = json.loads(record.read_text())
        data[field][1] = bad
        record.write_text(json.dumps(data))
        curve, source = costs.profile_model(model, sizes=(1, 2, 4), measure=lambda m, sizes, **kw: [0.01, 0.02, 0.03])
        assert source == "measured" and curve(2) == pytest.approx(0.02), (field, bad)
    with pytest.raises(ValueError, match="positive, finite times"):
        costs.CostCurve.from_measurements([1, 2], [0.01, float("nan")])
    with pytest.raises(ValueError, match="one time a size, got 2 sizes and 1 times"):  # zip dropped the unpaired
        costs.CostCurve.from_measurements([1, 2], [0.01])


def test_a_profile_measured_while_others_ran_is_measured_again_on_a_quiet_machine(tmp_path, monkeypatch,
                                                                                  other_load):
    """A profile taken while other processes kept the CPUs busy (a first start during the test suite read llama.cpp's
    t(1) 1.74x slow, inside what live forwards catch) is measured again when live forwards find the machine quiet,
    and kept while it is still busy; comparisons made with it are not cached (`costs.busy`)."""
    from arborspec.core.disk_cache import read_record

    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    shares = other_load  # others' share of the CPUs during each measurement (tests/conftest.py)
    model = tiny_model("llama")
    key = costs.profile_key(model)
    busy_before, shares[:] = costs.busy, [0.45]
    curve, source = costs.profile_model(model, sizes=(1, 4), measure=lambda m, sizes, **kw: [0.030, 0.040])
    assert source == "measured" and read_record("cost", key)["others"] == 0.45 and costs.busy == busy_before + 1
    live = lambda *a, **k: [0.029, 0.041]  # noqa: E731  (close to the cached figures: only the load tells)
    for now, agrees in ((0.40, True), (None, True), (0.05, False)):  # busy still, unknown, quiet
        shares[:] = [now]
        assert costs.live_agrees(model, curve, key, measure=live, force=True) == agrees
    shares[:] = [0.05]
    costs.profile_model(model, sizes=(1, 4), refresh=True, measure=lambda m, sizes, **kw: [0.020, 0.026])
    assert read_record("cost", key)["others"] == 0.05 and costs.busy == busy_before + 1  # a quiet record: not busy
    shares[:] = [0.05]
    assert costs.live_agrees(model, costs.profile_model(model, sizes=(1, 4))[0], key, measure=live, force=True)
