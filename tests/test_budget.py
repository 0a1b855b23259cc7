"""STree's runtime model (eqs. 7-8): least-squares fits of t(N), the tree-size rule, and `arborspec profile`."""
import json

import numpy as np
import pytest
import torch

from arborspec.budget import (
    RuntimeModel,
    default_kind,
    fit_runtime,
    full_tree,
    larger_tree_pays,
    measure_forward_cost,
    required_tau_ratio,
)
from arborspec.cli import main
from tests.conftest import char_tokenizer, noisy_copy, tiny_model
from tests.models.tiny_ssm import ssm_model

SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors run far faster on one intra-op thread than with thread hand-offs on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    tok = char_tokenizer()
    paths = {}
    for name, model in [("target", target), ("draft", noisy_copy(target, 0.2)), ("hybrid", ssm_model("bamba"))]:
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


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


@pytest.mark.parametrize("mode", ["packed", "unrolled"])
def test_cli_generate_with_ssm_models_matches_ar(ssm_dirs, capsys, mode):
    code = main(["generate", "--target", ssm_dirs["target"], "--draft", ssm_dirs["draft"], "--dtype", "fp32",
                 "--method", "static", "--depth", "3", "--branch", "2", "--ssm-tree", mode, "--prompt", "def f(x):",
                 "--max-new-tokens", "16", "--ignore-eos", "--json", "--compare-ar"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["baseline_ar"]["identical"] is True and len(data["token_ids"]) == 16
