"""Cost profiles and STree's runtime model (eqs. 7-8): measuring t(N), least-squares fits, the tree-size rule, the
profile cache, and `arborspec profile` (arborspec.tuning.costs, arborspec.runtime_model)."""
import json

import numpy as np
import pytest
import torch

from arborspec.cli import main
from arborspec.core import disk_cache as cache
from arborspec.tuning import costs
from arborspec.tuning.costs import full_tree, measure_forward_cost
from arborspec.tuning.runtime_model import RuntimeModel, default_kind, fit_runtime, larger_tree_pays, required_tau_ratio
from tests.backends.tiny_ssm import ssm_model
from tests.conftest import noisy_copy, save_models, tiny_model

SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


def test_linear_fit_recovers_a_noiseless_line():
    times = [0.002 * n + 0.030 for n in SIZES]
    fit = fit_runtime(SIZES, times, "linear")
    assert fit.kind == "linear"
    assert fit.coeffs == pytest.approx((0.002, 0.030), rel=1e-9)
    assert fit(10) == pytest.approx(0.050)
    assert "N + " in fit.describe()


def test_quadratic_fit_recovers_a_noisy_parabola():
    rng = np.random.default_rng(0)
    a, b, c = 1e-5, 5e-4, 0.040
    times = [(a * n * n + b * n + c) * (1 + 0.01 * rng.standard_normal()) for n in SIZES for _ in range(5)]
    fit = fit_runtime([n for n in SIZES for _ in range(5)], times, "quadratic")
    assert fit.coeffs == pytest.approx((a, b, c), rel=0.1)
    assert "N^2" in fit.describe()


def test_fits_refuse_bad_input():
    with pytest.raises(ValueError, match="at least 2 distinct"):
        fit_runtime([4, 4, 4], [1.0, 1.1, 0.9], "linear")
    with pytest.raises(ValueError, match="at least 3 distinct"):
        fit_runtime([1, 2], [1.0, 2.0], "quadratic")
    with pytest.raises(ValueError, match="unknown runtime model"):
        fit_runtime(SIZES, SIZES, "cubic")


def test_the_decision_rule_is_eq_7():
    model = RuntimeModel("linear", (1.0, 10.0))  # t(5) = 15, t(20) = 30: the bigger tree must double tau
    assert required_tau_ratio(model, 5, 20) == pytest.approx(2.0)
    assert larger_tree_pays(2.0, 5, 4.0, 20, model)  # exactly break-even counts as paying
    assert not larger_tree_pays(2.0, 5, 3.9, 20, model)
    assert larger_tree_pays(2.0, 20, 1.1, 5, model)  # and the rule works downwards
    quad = RuntimeModel("quadratic", (0.01, 0.0, 1.0))  # t(10) = 2, t(30) = 10
    assert required_tau_ratio(quad, 10, 30) == pytest.approx(5.0)
    assert not larger_tree_pays(2.0, 10, 9.0, 30, quad) and larger_tree_pays(2.0, 10, 10.0, 30, quad)
    # the rule is wall time per token t / tau: it agrees with comparing t(N1)/tau1 and t(N2)/tau2 directly
    for tau2 in np.linspace(1.0, 6.0, 11):
        assert larger_tree_pays(2.0, 10, tau2, 30, quad) == (quad(30) / tau2 <= quad(10) / 2.0 + 1e-12)
    with pytest.raises(ValueError, match="positive"):
        larger_tree_pays(0.0, 5, 1.0, 10, model)


def test_full_tree_shape_and_default_kinds():
    tree = full_tree(15, 3, [7, 8])
    assert len(tree) == 15 and tree.depth == 3 and tree.widths() == [1, 2, 4, 8]
    for n, leaves in [(128, 7), (128, 63), (15, 1), (15, 8), (1, 3)]:  # a backend's forwards that take few leaves
        tree = full_tree(n, 3, [7, 8], leaves=leaves)
        parents = set(tree.parents)
        assert len(tree) == n and sum(i not in parents for i in range(n)) == min(leaves, (n + 1) // 2)
    assert full_tree(15, 3, [7, 8], leaves=4).widths() == [1, 2, 4, 4, 4]  # the complete layers, then chains
    assert default_kind(ssm_model("mamba2")) == "linear"
    assert default_kind(ssm_model("bamba")) == "quadratic"
    assert default_kind(tiny_model("llama")) == "quadratic"


@pytest.mark.parametrize("kind", ["mamba2", "bamba"])
def test_measure_forward_cost_runs_on_a_model(kind):
    model = ssm_model(kind)
    times = measure_forward_cost(model, sizes=[1, 4, 16], prefix=20, repeats=2)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert fit_runtime([1, 4, 16], times, "linear").kind == "linear"


@pytest.fixture(scope="module")
def ssm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ssm_models")
    target = ssm_model("mamba2", seed=0)
    return save_models(root, {"target": target, "draft": noisy_copy(target, 0.2), "hybrid": ssm_model("bamba")})


def test_cli_profile_prints_the_fit_and_plots(ssm_dirs, tmp_path, capsys):
    png = tmp_path / "profile.png"
    code = main(["profile", "--model", ssm_dirs["hybrid"], "--dtype", "fp32", "--sizes", "1,2,4,8", "--repeats", "1",
                 "--prefix", "12", "--out", str(png)])
    out = capsys.readouterr().out
    assert code == 0
    assert "quadratic fit: t(N) =" in out and "N2=8" in out
    assert png.exists() and png.stat().st_size > 1000
    code = main(["profile", "--model", ssm_dirs["target"], "--dtype", "fp32", "--sizes", "1,2,x"])
    assert code == 2


def test_cli_profile_with_a_fit_below_zero_still_prints_and_plots(ssm_dirs, tmp_path, capsys, monkeypatch):
    """Timings seen on a busy host (N = 1 slower than N = 2) bend the quadratic fit below 0 at N1: the command
    printed every figure, then failed with exit 2 and no plot."""
    from arborspec import cli
    monkeypatch.setattr(cli, "measure_forward_cost", lambda model, sizes, **kw: [0.11982, 0.08782, 0.19171])
    png = tmp_path / "profile.png"
    code = main(["profile", "--model", ssm_dirs["target"], "--dtype", "fp32", "--kind", "quadratic", "--sizes",
                 "1,2,128", "--out", str(png)])
    assert code == 0 and "gives no rule for larger trees" in capsys.readouterr().out and png.stat().st_size > 1000


@pytest.mark.usefixtures("private_cache")  # its draft's int8 copy and profiles: not in ~/.cache
@pytest.mark.parametrize("mode", ["packed", "unrolled"])
def test_cli_generate_with_ssm_models_matches_ar(ssm_dirs, capsys, mode):
    code = main(["generate", "--target", ssm_dirs["target"], "--draft", ssm_dirs["draft"], "--dtype", "fp32",
                 "--method", "static", "--depth", "3", "--branch", "2", "--ssm-tree", mode, "--prompt", "def f(x):",
                 "--max-new-tokens", "16", "--ignore-eos", "--json", "--compare-ar"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["baseline_ar"]["identical"] is True and len(data["token_ids"]) == 16


# ---- cached profiles and calibrations (drafting/auto/) ---------------------------------------------------------------
@pytest.fixture
def counted_measure(monkeypatch, tmp_path):
    """A private cache directory and a fake measurement that counts its calls (t(n) = 1 ms + 0.1 ms per token)."""
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake(model, sizes, prefix=200, repeats=3, ssm_tree="packed", **kw):
        calls.append((model, tuple(sizes), prefix, ssm_tree))
        return [0.001 + 1e-4 * n for n in sizes]

    monkeypatch.setattr(costs, "measure_forward_cost", fake)
    return calls


def test_profiles_are_cached_and_invalidated(counted_measure, monkeypatch, tmp_path):
    model = tiny_model("llama", seed=0)
    curve, source = costs.profile_model(model)
    assert source == "measured" and len(counted_measure) == 1 and curve(8) == pytest.approx(0.0018)
    path = costs.profile_path(model)
    assert path.parent == tmp_path / "cache" / "profiles" and path.exists()
    assert json.loads(path.read_text())["versions"] == cache.library_versions()
    assert costs.profile_model(model)[1] == "cache" and len(counted_measure) == 1
    assert costs.profile_model(tiny_model("llama", seed=0))[1] == "cache"  # the same model, loaded again

    def source_of(m):
        return costs.profile_model(m)[1]

    assert source_of(tiny_model("llama", seed=1)) == "measured"  # other weights
    assert source_of(tiny_model("llama", seed=0, layers=3)) == "measured"  # other architecture
    assert source_of(tiny_model("llama", seed=0).to(torch.bfloat16)) == "measured"  # other dtype
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert source_of(model) == "measured"  # other thread count
    finally:
        torch.set_num_threads(threads)
    assert source_of(model) == "cache"
    versions = cache.library_versions()
    monkeypatch.setattr(cache, "library_versions", lambda: dict(versions, transformers="0.0.1"))
    assert source_of(model) == "measured"  # another library version
    monkeypatch.setattr(cache, "library_versions", lambda: versions)
    assert source_of(model) == "measured"  # the file now holds the other version's record
    path.write_text("{not json")
    assert source_of(model) == "measured"  # unreadable
    assert costs.profile_model(model, refresh=True)[1] == "measured"
    monkeypatch.setattr(costs, "machine_id", lambda: "another cpu")
    assert source_of(model) == "measured"  # another machine
    assert counted_measure[-1][2] == 200  # the prefix fits the tiny model's 512-token window


def test_an_unrolled_tree_scan_is_profiled_as_itself(counted_measure):
    """auto with `ssm_tree="unrolled"` sized its trees from the packed scan's costs: the profile did not know the scan.
    A Mamba2 / hybrid model's curve is now measured and kept per scan; every other model's key stays as it was."""
    from arborspec import SpeculativeDecoder
    ssm, attention = ssm_model("mamba2", seed=0), tiny_model("llama", seed=0)
    assert costs.profile_model(ssm)[1] == "measured" and counted_measure[-1][3] == "packed"
    assert costs.profile_model(ssm, ssm_tree="unrolled")[1] == "measured" and counted_measure[-1][3] == "unrolled"
    assert costs.profile_model(ssm, ssm_tree="unrolled")[1] == "cache"
    assert costs.profile_path(ssm, "unrolled") != costs.profile_path(ssm)
    costs.profile_model(attention)
    assert costs.profile_path(attention, "unrolled") == costs.profile_path(attention)
    del counted_measure[:]
    draft = ssm_model("mamba2", seed=1)
    SpeculativeDecoder(ssm, draft, method="auto", ssm_tree="unrolled")  # auto profiles the pair as it will run
    assert [(m, scan) for m, _, _, scan in counted_measure] == [(draft, "unrolled")]  # the target's is kept already


def test_profile_measures_a_tiny_model_for_real(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    model = tiny_model("llama", seed=0, context=64)  # a short window: the prefix shrinks to fit
    curve, source = costs.profile_model(model, sizes=(1, 2, 4), repeats=1)
    assert source == "measured" and all(t > 0 for t in curve.times)
    record = json.loads(costs.profile_path(model).read_text())
    assert record["prefix"] < 64 and record["sizes"] == [1, 2, 4]


def test_models_compared_with_each_other_are_measured_in_the_same_rounds(tmp_path, monkeypatch):
    """profile_together: round by round every model once (a drifting host slows them alike), each model's fastest
    round kept and cached as its profile."""
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    calls, sessions = [], []

    class Drifting:  # a session whose forwards the host slows down call by call
        def __init__(self, model, prefix=200, seed=0, ssm_tree="packed", new_session=None):
            self.model = model
            sessions.append(model)

        def round(self, sizes):
            calls.append(self.model)
            base = 0.001 if self.model is a else 0.002
            return [base * n + 0.01 * len(calls) for n in sizes]

    monkeypatch.setattr(costs, "TreeTimer", Drifting)
    curves = costs.profile_together([a, b], sizes=(1, 4), repeats=3)
    assert sessions == [a, b]  # one session each, prefilled once
    assert calls == [a, b] + [a, b] * 3  # a warm-up round each, then the timed rounds interleaved
    assert curves[0].times == pytest.approx((0.031, 0.034)) and curves[1].times == pytest.approx((0.042, 0.048))
    assert curves[0](1) < curves[1](1)  # measured one after the other, b's first round would have beaten a's last
    for model, curve in zip((a, b), curves):
        assert costs.profile_model(model, sizes=(1, 4)) == (curve, "cache")  # (reused for the sizes it measured)


def test_calibration_is_saved_and_reloaded(counted_measure, monkeypatch):
    from arborspec import SpeculativeDecoder

    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, 0.3)
    dec = SpeculativeDecoder(target, draft, method="auto")
    assert dec.policy.source["calibration"] == "new" and len(counted_measure) == 2
    dec.policy.calibrator.observe([0.55] * 50, [1] * 20 + [0] * 30)
    dec.policy.save()
    again = SpeculativeDecoder(target, draft, method="auto")
    assert again.policy.source["calibration"] == "cache" and len(counted_measure) == 2  # profiles cached too
    assert again.policy.calibrator.trials.sum() == pytest.approx(dec.policy.calibrator.trials.sum())
    assert SpeculativeDecoder(target, noisy_copy(target, 0.3, seed=5), method="auto").policy.source["calibration"] \
        == "new"  # another draft
    assert SpeculativeDecoder(target, draft, method="auto", temperature=1.0).policy.source["calibration"] == "new"
    assert SpeculativeDecoder(target, draft, method="auto", remember=False).policy.source.get("calibration") is None
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert SpeculativeDecoder(target, draft, method="auto").policy.source["calibration"] == "new"
    finally:
        torch.set_num_threads(threads)
    versions = cache.library_versions()
    monkeypatch.setattr(cache, "library_versions", lambda: dict(versions, arborspec="9.9"))
    assert SpeculativeDecoder(target, draft, method="auto").policy.source["calibration"] == "new"


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_models")
    target = tiny_model("llama", seed=0)
    return save_models(root, {"target": target, "draft": noisy_copy(target, 0.2)})


def test_cli_profile_pair_says_which_profile_a_busy_machine_measured(llama_dirs, tmp_path, monkeypatch, capsys,
                                                                      other_load):
    """A profile measured while other processes kept the CPUs busy says so, and a later start that finds the machine
    quiet measures it again (core/cpu_load.py; tuning/costs.py live_agrees)."""
    from arborspec.tuning import costs

    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    other_load[:] = [0.5] * 2  # others' share of the CPUs while the target and the draft are measured
    args = ["profile", "--pair", "--target", llama_dirs["target"], "--draft", llama_dirs["draft"], "--dtype", "fp32",
            "--sizes", "1,2,4,8", "--repeats", "1", "--prefix", "12", "--no-variants"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("measured profile") == 2 and out.count("other processes kept 50% of the CPUs busy") == 2
    other_load[:] = [0.0] * 4  # each profile's live forwards find the machine quiet, and it is measured again
    costs._checked.clear()  # a later process: the live forwards check each cached profile again
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("measured profile") == 2 and "other processes" not in out


def test_cli_profile_pair_and_generate_auto(llama_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    png = tmp_path / "res.d" / "pair.png"  # written for --out res.d/pair: a dot in a directory's name, no suffix
    args = ["profile", "--pair", "--target", llama_dirs["target"], "--draft", llama_dirs["draft"], "--dtype", "fp32",
            "--sizes", "1,2,4,8", "--repeats", "1", "--prefix", "12"]
    assert main(args + ["--out", str(tmp_path / "res.d" / "pair")]) == 0
    out = capsys.readouterr().out
    assert "target:" in out and "(fp32): measured profile" in out and "d(n)/d(1)" in out and png.stat().st_size > 1000
    assert "draft variants (measured" in out and "<- default" in out and "int8" in out
    variants = tmp_path / "res.d" / "pair-draft-variants.png"  # it went to res-draft-variants.d/pair.png
    assert variants.stat().st_size > 1000 and str(png) in out and str(variants) in out
    out = capsys.readouterr().out if main(args) == 0 else ""
    assert "cache profile" in out and "draft variants (cache" in out
    assert main(["profile", "--dtype", "fp32"]) == 2  # neither --model nor --pair
    for extra in (["--method", "auto"], ["--method", "dyspec", "--budget", "auto"]):
        code = main(["generate", "--target", llama_dirs["target"], "--draft", llama_dirs["draft"], "--dtype", "fp32",
                     "--prompt", "def f(x):", "--max-new-tokens", "12", "--ignore-eos", "--compare-ar", *extra])
        out = capsys.readouterr().out
        assert code == 0 and "auto:" in out and "identical output" in out
    (tmp_path / "a-file").write_text("")  # a cache that cannot be written: no path named that was never written
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "a-file" / "cache"))
    assert main(args + ["--no-variants"]) == 0
    out = capsys.readouterr().out
    assert out.count("measured profile (not cached: the cache cannot be written)") == 2 and "cost-" not in out


def test_a_fit_is_written_with_each_sign_once():
    from arborspec.tuning.runtime_model import RuntimeModel

    assert RuntimeModel("quadratic", (1.568e-6, -5.423e-4, 1.096e-2)).describe() == \
        "t(N) = 0.001568*N^2 - 0.5423*N + 10.96 ms"
    assert RuntimeModel("linear", (-2e-3, 5e-3)).describe() == "t(N) = -2*N + 5 ms"


def test_cli_profile_cuts_a_prefix_past_the_context_window(llama_dirs, capsys):
    """`profile --pair` fitted its prefix into the window; `profile --model` did not, and native refused it."""
    code = main(["profile", "--model", llama_dirs["target"], "--dtype", "fp32", "--sizes", "1,2,4", "--repeats", "1",
                 "--prefix", "100000"])
    assert code == 0 and "--prefix 100000 cut to" in capsys.readouterr().err


def test_a_window_too_small_to_profile_is_refused_by_auto_and_the_draft_choice_keeps_the_draft(tmp_path, monkeypatch,
                                                                                               capsys):
    """A profile's timed calls ran past a 16- or 32-token window: GPT-2's learned positions failed with an
    IndexError inside `auto` (and in the CLI's default draft choice, a traceback). 48 positions hold them."""
    from arborspec import SpeculativeDecoder

    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    small = tiny_model("gpt2", seed=0, context=32)
    with pytest.raises(costs.WindowTooSmall, match=r"context window \(32 tokens\) is too small .*another method"):
        SpeculativeDecoder(small, noisy_copy(small, 0.2), method="auto")
    fits = tiny_model("gpt2", seed=0, context=48)
    plain = SpeculativeDecoder(fits, method="ar").generate([5, 6, 7], max_new_tokens=8, ignore_eos=True)
    auto = SpeculativeDecoder(fits, noisy_copy(fits, 0.2), method="auto").generate([5, 6, 7], max_new_tokens=8,
                                                                                   ignore_eos=True)
    assert auto.token_ids == plain.token_ids

    save_models(tmp_path, {"target": small, "draft": noisy_copy(small, 0.2)})
    args = ["generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--dtype", "fp32",
            "--prompt", "def f(x):", "--max-new-tokens", "6", "--ignore-eos", "--backend", "torch"]
    assert main(args + ["--method", "auto"]) == 2
    assert "is too small to time its tree forwards" in capsys.readouterr().err
    assert main(args + ["--method", "chain", "--compare-ar"]) == 0  # --draft-quant auto: the draft as loaded
    captured = capsys.readouterr()
    assert "identical output" in captured.out and "draft: as loaded (the context window is too small" in captured.err
    assert main(["profile", "--model", str(tmp_path / "target"), "--dtype", "fp32"]) == 2  # its own advice
    assert "profile fewer or smaller --sizes, or fewer --repeats" in capsys.readouterr().err
