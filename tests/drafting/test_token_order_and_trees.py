"""Engine-level token order (DySpec App. C), per-step tree records, the tree pictures and the CLI subcommands."""
import json

import pytest

from arborspec import SpeculativeDecoder
from arborspec.cli import main
from arborspec.core.tree import TokenTree, block_count, packed
from tests.conftest import char_tokenizer, noisy_copy, save_models, tiny_model
from tests.drafting.equivalence import make_pair


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama")


@pytest.mark.parametrize("method,options,temperature", [
    ("dyspec", dict(budget=12), 1.0), ("sequoia", dict(budget=10), 0.8), ("wetap", dict(budget=8, w_min=2, w_max=5, length=4), 1.0),
    ("static", dict(depth=3, branch=3), 1.0), ("dynatree", dict(budget=10), 0.0),
])
def test_token_order_changes_only_the_layout(pair, method, options, temperature):
    """Same seed, any packing: the same draws and the same output (the verifier always sees the drafted tree; only
    the target forward's layout changes). Heavy-path order reorders siblings, which multi-branch rejection must not
    see, so this also guards that."""
    target, draft = pair
    outs = {}
    for order in ("bfs", "dfs", "heavy"):
        dec = SpeculativeDecoder(target, draft, method=method, temperature=temperature, token_order=order, **options)
        outs[order] = dec.generate([4, 8, 15, 16], max_new_tokens=24, ignore_eos=True, seed=11).token_ids
    assert outs["bfs"] == outs["dfs"] == outs["heavy"]


def test_unknown_token_order_is_refused(pair):
    with pytest.raises(ValueError, match="token order"):
        SpeculativeDecoder(pair[0], pair[1], method="dyspec", token_order="random")


def test_trees_are_recorded_with_the_accepted_path(pair):
    target, draft = pair
    res = SpeculativeDecoder(target, draft, method="dyspec", budget=10, record_trees=True, token_order="heavy").generate(
        [4, 8, 15, 16], max_new_tokens=20, ignore_eos=True)
    out = []
    for step in res.stats.steps:
        t = step.tree
        assert t is not None and len(t["tokens"]) == step.tree_size + 1
        tree = TokenTree.from_parents(t["tokens"], t["parents"])
        assert tree.widths() == step.widths and tree.depth == step.depth
        if t["path"]:  # the path is a chain from the root
            assert tree.path(t["path"][-1])[1:] == t["path"]
        assert len(t["path"]) == step.accepted
        out += [t["tokens"][n] for n in t["path"]] + [t["bonus"]]
    assert out[: len(res.token_ids)] == res.token_ids
    assert SpeculativeDecoder(target, draft, method="dyspec").generate([4], max_new_tokens=3).stats.steps[0].tree is None
    per_step = res.stats.to_dict(per_step=True)["per_step"]
    assert per_step[0]["tree"]["path"] == res.stats.steps[0].tree["path"]


def test_reordering_reduces_blocks_of_dyspec_trees():
    from arborspec.drafting import POLICIES
    from tests.drafting.fake_session import FakeSession, fake_context

    counts = {o: 0 for o in ("bfs", "dfs", "heavy")}
    for seed in range(3):
        tree = POLICIES["dyspec"](budget=255).draft(fake_context(FakeSession(vocab=30, seed=seed, sharpness=2.5)))
        for o in counts:
            counts[o] += block_count(packed(tree, o), prefix_len=0, block=32)
    assert counts["dfs"] < counts["bfs"] and counts["heavy"] <= counts["dfs"] * 1.1


def test_tree_picture(tmp_path, pair):
    from arborspec.viz.trees import draw_trees, token_label, tree_layout

    tok = char_tokenizer()
    target, draft = pair
    res = SpeculativeDecoder(target, draft, method="dynatree", budget=12, record_trees=True, tokenizer=tok).generate(
        "def f(x):", max_new_tokens=12, ignore_eos=True)
    path = draw_trees([s.tree for s in res.stats.steps[1:4]], tok, str(tmp_path / "t.png"), title="dynatree")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    y, leaves = tree_layout([-1, 0, 0, 1, 1, 2])
    assert leaves == 3 and y[3] == 0 and y[4] == 1 and y[5] == 2 and y[1] == 0.5 and y[0] == pytest.approx(1.25)
    assert token_label(tok, tok.convert_tokens_to_ids(" ")) == "·"
    assert token_label(tok, tok.convert_tokens_to_ids("\n")) == "\\n"
    dollars = type("Dollars", (), {"decode": lambda self, ids: "$$" if ids[0] % 2 else "$x$"})()
    path = draw_trees([s.tree for s in res.stats.steps[1:4]], dollars, str(tmp_path / "d.png"))  # Qwen has "$$"
    assert open(path, "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"  # it failed: two dollars read as math
    assert token_label(dollars, 2) == "\\$x\\$"  # drawn as typed, not as math


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny_model("llama", seed=0)
    return save_models(root, {"target": target, "draft": noisy_copy(target, 0.3)})


@pytest.mark.usefixtures("private_cache")  # its draft variants, profiles and calibration: not in ~/.cache
def test_cli_trees_and_calibrate(model_dirs, tmp_path, capsys):
    png = tmp_path / "trees.png"
    code = main(["trees", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "fp32",
                 "--method", "dyspec", "--budget", "8", "--prompt", "def f(x):", "--num-trees", "2",
                 "--max-new-tokens", "10", "--out", str(png), "--token-order", "dfs"])
    assert code == 0 and png.exists() and str(png) in capsys.readouterr().out
    acc = tmp_path / "acc.json"
    code = main(["calibrate", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "fp32",
                 "--prompt", "def f(x):", "--prompt", "x = 1", "--max-new-tokens", "8", "--ranks", "4",
                 "--out", str(acc)])
    assert code == 0 and "acceptance over 16 positions" in capsys.readouterr().out
    data = json.loads(acc.read_text())
    assert len(data["acceptance"]) == 4 and data["positions"] == 16
    code = main(["generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "fp32",
                 "--method", "sequoia", "--budget", "8", "--acceptance-file", str(acc), "--prompt", "x = ",
                 "--max-new-tokens", "6", "--ignore-eos", "--json", "--per-step", "--token-order", "heavy",
                 "--compare-ar"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["baseline_ar"]["identical"]
    assert all("path" in s["tree"] for s in out["stats"]["per_step"])
    code = main(["generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "fp32",
                 "--method", "dyspec", "--batch", "false", "--budget", "5", "--prompt", "x", "--max-new-tokens", "3"])
    assert code == 0
