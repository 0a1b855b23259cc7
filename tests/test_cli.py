"""The command line on tiny local models: --json is consistent, and bad input exits non-zero with one clear line."""
import io
import json
import subprocess
import sys
import warnings

import pytest

from arborspec import cli
from arborspec.cli import main
from tests.conftest import noisy_copy, save_models, tiny_model

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny_model("llama", seed=0)
    paths = save_models(root, {"target": target, "draft": noisy_copy(target, 0.2)})
    other = tiny_model("gpt2", seed=1)
    other.save_pretrained(root / "other")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({"<unk>": 0, "x": 1, "y": 2}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>").save_pretrained(root / "other")
    paths["other"] = str(root / "other")
    return paths


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_output_is_consistent(model_dirs, capsys):
    code, out, _ = run_cli(capsys, "generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                           "--dtype", "fp32", "--method", "static", "--depth", "3", "--branch", "2",
                           "--prompt", "def f(x):", "--max-new-tokens", "24", "--ignore-eos", "--json", "--compare-ar")
    assert code == 0
    data = json.loads(out)
    stats = data["stats"]
    assert len(data["token_ids"]) == stats["new_tokens"] == 24
    # per decoding step: the first token came from the prompt's forward, no step
    assert stats["steps"] >= 1 and stats["tokens_per_step"] == pytest.approx(23 / stats["steps"])
    assert stats["method"] == "static" and stats["verifier"] == "greedy" and stats["lossy"] is False
    assert stats["t_total"] >= stats["t_draft"] + stats["t_verify"]
    assert data["baseline_ar"]["identical"] is True and data["baseline_ar"]["token_ids"] == data["token_ids"]


def test_plain_output_prints_text_and_summary(model_dirs, capsys):
    code, out, _ = run_cli(capsys, "generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                           "--method", "chain", "--k", "3", "--prompt", "x = ", "--max-new-tokens", "10",
                           "--ignore-eos")
    assert code == 0
    assert "tokens/step" in out and "chain/greedy" in out


def test_top_k_and_top_p_at_temperature_0_are_named_as_unused(model_dirs, capsys):
    """--top-k / --top-p at the default temperature 0 changed nothing without a word: a user who set them expected
    sampling. Given --temperature, or left at their defaults, there is no note."""
    base = ["generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--method", "chain",
            "--prompt", "x = ", "--max-new-tokens", "2"]
    note = "--top-k and --top-p shape sampling; at --temperature 0 (greedy, the default) they change nothing"
    code, _, err = run_cli(capsys, *base, "--top-p", "0.9")
    assert code == 0 and note in err
    code, _, err = run_cli(capsys, *base, "--top-k", "5", "--temperature", "0.7")
    assert code == 0 and "shape sampling" not in err


def test_trees_draws_the_drafted_steps_not_the_prompts(model_dirs, capsys, monkeypatch, tmp_path):
    drawn = {}

    def draw(trees, tokenizer, path, title=""):
        drawn.update(trees=trees, title=title)
        return path

    monkeypatch.setattr(cli, "draw_trees", draw)
    code, out, _ = run_cli(capsys, "trees", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                           "--dtype", "fp32", "--method", "static", "--depth", "2", "--branch", "2",
                           "--max-new-tokens", "12", "--num-trees", "2", "--out", str(tmp_path / "t.png"))
    assert code == 0 and out.strip() == str(tmp_path / "t.png")
    assert len(drawn["trees"]) == 2 and all(len(t["tokens"]) > 1 for t in drawn["trees"])  # each drafted something


def test_the_prompt_comes_as_an_argument_a_flag_or_standard_input(model_dirs, capsys, monkeypatch):

    base = ["generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "fp32",
            "--method", "chain", "--max-new-tokens", "8", "--ignore-eos", "--json"]
    outputs = []
    for how in (["--prompt", "def g(y):"], ["def g(y):"], ["--prompt-file", "-"], ["-"]):  # "-" was the prompt
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"def g(y):")))
        code, out, _ = run_cli(capsys, *base, *how)
        assert code == 0
        outputs.append(json.loads(out)["token_ids"])
    default = json.loads(run_cli(capsys, *base)[1])["token_ids"]
    assert outputs[0] == outputs[1] == outputs[2] == outputs[3] != default  # the same prompt each way
    with pytest.raises(SystemExit) as exc:  # two prompts at once: argparse's usage error
        main([*base, "def g(y):", "--prompt", "x"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # `trees` too: it drew the file's prompt, the text dropped unsaid
        main(["trees", "--prompt", "x", "--prompt-file", "-"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--method", "nope"], "unknown method"),
        (["--method", "chain", "--depth", "3"], "takes no option --depth"),
        (["--method", "chain", "--k", "0"], "k must be an integer >= 1"),
        (["--prompt", ""], "empty"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--prompt", "a" * 600], "context window"),
        (["--temperature", "-1"], "temperature"),
        (["--stop", "x", "--stop", ""], "non-empty string"),
    ],
)
def test_bad_input_exits_nonzero_with_a_message(model_dirs, capsys, args, message):
    code, _, err = run_cli(capsys, "generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                           "--dtype", "fp32", *args)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()[-1]) > 0


def test_missing_model_and_mismatched_tokenizers(model_dirs, capsys):
    code, _, err = run_cli(capsys, "generate", "--target", "/nonexistent/model", "--draft", model_dirs["draft"])
    assert code == 2 and "not found" in err
    code, _, err = run_cli(capsys, "generate", "--target", model_dirs["target"], "--draft", model_dirs["other"])
    assert code == 2 and "tokenizer" in err


def test_subprocess_error_has_no_traceback(model_dirs):
    proc = subprocess.run([sys.executable, "-m", "arborspec.cli", "generate", "--target", model_dirs["target"],
                           "--draft", model_dirs["draft"], "--method", "bogus"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown method 'bogus'" in proc.stderr and "Traceback" not in proc.stderr


def test_methods_lists_every_policy_and_named_variant(capsys):
    from arborspec.drafting import POLICIES
    from arborspec.runspec import METHODS

    code, out, _ = run_cli(capsys, "methods")
    assert code == 0
    lines = out.splitlines()
    for name in POLICIES:
        assert f"{name}:" in out
    for name in set(METHODS) - set(POLICIES):  # sps, wetap-lossy, the baselines: each with its line
        assert any(line.startswith(f"  {name}: ") and len(line) > len(name) + 12 for line in lines), name


def test_draft_levers_on_the_command_line(model_dirs, capsys, monkeypatch):
    from arborspec.tuning import draft_levers

    monkeypatch.setattr(draft_levers, "corpus_counts", lambda tok, n, **kw: __import__("torch").arange(n).flip(0))
    code, out, _ = run_cli(capsys, "generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                           "--dtype", "fp32", "--method", "chain", "--k", "3", "--draft-quant", "int8",
                           "--draft-vocab", "30", "--ngram", "2", "--prompt", "abcabcabc", "--max-new-tokens", "16",
                           "--ignore-eos", "--json", "--compare-ar")
    assert code == 0
    data = json.loads(out)
    assert data["baseline_ar"]["identical"] is True
    assert data["stats"]["verifier"] == "greedy"


def test_method_options_are_typed_from_the_registry():
    from arborspec.cli import build_parser

    args = build_parser().parse_args(["generate", "--method", "dyspec", "--batch", "false", "--budget", "8",
                                      "--widths", "2,2"])
    assert args.opt_batch is False and args.opt_budget == 8 and args.opt_widths == "2,2"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--batch", "maybe"])


def test_default_method_is_auto_and_the_name_grammar_works_in_generate(model_dirs, capsys):
    base = ["generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "fp32",
            "--prompt", "abcabc", "--max-new-tokens", "8", "--ignore-eos", "--json"]
    code, out, _ = run_cli(capsys, *base, "--compare-ar")
    data = json.loads(out)
    assert code == 0 and data["stats"]["method"] == "auto" and data["baseline_ar"]["identical"]
    code, out, _ = run_cli(capsys, *base, "--method", "dynatree(adapt=false)@6+noquant+ngram2", "--compare-ar")
    data = json.loads(out)
    assert code == 0 and data["stats"]["method"] == "dynatree" and data["baseline_ar"]["identical"]
    one = [*base[:-4], "--max-new-tokens", "1", "--json", "--compare-ar", "--method", "chain"]
    code, out, _ = run_cli(capsys, *one)  # one token: no rate to compare; it printed "speedup": NaN, not JSON
    assert code == 0 and json.loads(out, parse_constant=lambda c: pytest.fail(c))["baseline_ar"]["speedup"] is None


@pytest.mark.parametrize("method,extra,message", [
    ("hf-assisted", [], "is a baseline"),
    ("wetap-lossy", [], "--allow-lossy"),
    ("wetap", ["--verifier", "wetap"], "--allow-lossy"),
    ("chain(k=3)+fp8", [], "unknown lever"),
    ("chain(k=3)", ["--depth", "2"], "takes no option --depth"),
    ("static(depth=0)", [], "depth must be an integer >= 1"),
    ("static", ["--branch", "0"], "branch must be an integer >= 1"),
    # a flag for what the name sets already: the flag won in silence (chain(k=3) --k 4 ran k = 4)
    ("chain(k=3)", ["--k", "4"], "'chain(k=3)' sets k already; drop --k"),
    ("chain(verifier=asps)", ["--verifier", "mss"], "sets verifier already"),
    ("sps", ["--verifier", "mss"], "sets verifier already"),
    ("chain+vocab40", ["--draft-vocab", "30"], "sets draft_vocab already; drop --draft-vocab"),
    ("chain+ngram2", ["--ngram", "3"], "sets ngram already"),
    ("chain+suffix4", ["--suffix", "2"], "sets suffix already"),
    ("chain+lookahead2x2", ["--lookahead", "3"], "sets lookahead already"),
])
def test_bad_method_names_exit_before_loading(capsys, method, extra, message):
    code, _, err = run_cli(capsys, "generate", "--target", "/nonexistent/model", "--method", method, *extra)
    assert code == 2 and message in err and "not found" not in err


@pytest.mark.parametrize("command,args,message", [
    ("generate", ["--temperature", "nan"], "temperature must be 0 (greedy) or a finite number"),
    ("generate", ["--top-p", "2"], "top_p must be in (0, 1]"),
    ("trees", ["--top-k", "-1"], "top_k must be an integer"),
    ("trees", ["--out", "/etc/passwd/trees.png"], "/etc/passwd is not a writable directory"),
    # os.access says yes to root on /proc: the picture failed after the whole generation, in the system's words
    ("trees", ["--out", "/proc/trees.png"], "'/proc/trees.png' cannot be written"),
    ("calibrate", ["--temperature", "-0.5"], "temperature must be 0 (greedy) or a finite number"),
    ("calibrate", ["--out", "/etc"], "'/etc' is a directory"),
    ("calibrate", ["--max-new-tokens", "0"], "--max-new-tokens and --ranks must be at least 1"),
    ("calibrate", ["--ranks", "1000000000"], "--ranks must be at most 1024"),
    ("profile", ["--sizes", "1,100000"], "--sizes must each be between 1 and 1024"),
    ("profile", ["--pair", "--model", "x"], "--pair profiles --target and --draft"),
    # these were refused after the measuring
    ("profile", ["--pair", "--sizes", "1,1,4"], "--sizes lists a size twice"),
    ("profile", ["--pair", "--out", "/tmp/pair.xyz"], "a picture is written as one of"),
    ("profile", ["--model", "/nonexistent/model", "--sizes", "4"], "a linear fit needs at least 2 distinct sizes"),
    # these ran as if not given: the default prompt, the default verifier
    ("generate", ["--prompt-file", ""], "--prompt-file is empty"),
    ("generate", ["--verifier", ""], "--verifier is empty"),
    ("calibrate", ["--out", ""], "--out is empty"),
    ("generate", ["--method", "static", "--widths", ""], "--widths is empty"),  # ran the method's default widths
    # argparse read a list starting with a negative number as a flag: "expected one argument"
    ("generate", ["--method", "sequoia", "--acceptance", "-0.1,0.5"], "numbers in [0, 1], got [-0.1, 0.5]"),
    ("generate", ["--method", "sequoia", "--acceptance-file", ""], "--acceptance-file is empty"),
    ("profile", ["--model", "/nonexistent/model", "--sizes", "1,4", "--kind", "quadratic"],
     "a quadratic fit needs at least 3"),
    ("trees", ["--out", "/tmp/trees.xyz"], "not .xyz"),
    ("generate", ["--draft-vocab", "-5"], "the draft vocabulary must be 0 (off) or more"),
    ("generate", ["--ngram", "3", "--ngram-len", "0"], "an n-gram branch needs at least 1 token"),
    ("bench", ["--dataset", "humaneval,nonexistent"], "unknown dataset 'nonexistent'"),
    ("bench", ["--temperatures", "0,inf"], "temperature must be 0 (greedy) or a finite number"),
    ("generate", ["--llama-threads", "0"], "--llama-threads must be in [1, 1024], got 0"),  # native ignored it
    ("generate", ["--llama-threads", "2000"], "--llama-threads must be in [1, 1024], got 2000"),  # named n_threads
    ("bench", ["--llama-batch", "0"], "--llama-batch must be in [1, 65536]"),
    ("generate", ["--llama-seq", "300"], "--llama-seq must be in [1, 256], got 300"),
    ("generate", ["--llama-ctx", "1"], "--llama-ctx must be at least 2, got 1"),
    ("generate", ["--per-step"], "--per-step adds every step's statistics to --json's output"),
    ("bench", ["--methods", ""], "--methods names no method"),
    ("bench", ["--prompt-file", "/nonexistent/p.jsonl"], "cannot read prompt file '/nonexistent/p.jsonl'"),
    # these ran: the bad draft temperature skipped every method but hf-assisted, exit 0; -5 tokens cut texts' ends
    ("bench", ["--draft-temperature", "-1"], "--draft-temperature must be 0 (greedy) or a finite number"),
    ("bench", ["--text-tokens", "-5"], "--text-tokens must be at least 1"),
    ("bench", ["--max-prompt-tokens", "0"], "--max-prompt-tokens must be at least 1"),
    # each run failed in turn after the models loaded, exit 0; prompt i runs with seed + i, 32-bit on llama.cpp
    ("bench", ["--seed", str(2**64)], "--seed must be an integer in [0, 4294967275]"),  # 20 prompts of 1 dataset
    ("bench", ["--seed", str(2**32 - 20)], "--seed must be an integer in [0, 4294967275]"),
    ("bench", ["--seed", "-1"], "--seed must be an integer in"),
    ("trees", ["--seed", str(2**70)], "seed must be an integer in"),  # refused after both models loaded
    ("calibrate", ["--seed", str(2**70)], "seed must be an integer in"),
])
def test_bad_values_exit_before_the_models_load(capsys, command, args, message):
    # the target does not exist: an error about it would mean the models were being loaded first
    code, _, err = run_cli(capsys, command, "--target", "/nonexistent/model", *args)
    assert code == 2 and message in err and "not found" not in err and "Traceback" not in err


def test_a_prompt_file_named_like_a_dataset_beside_it_is_refused(capsys, tmp_path):
    """A prompt named humaneval/HumanEval/0 in both: the runs of two prompts were paired (speed-ups, a false
    MISMATCH in --check-equal)."""
    (tmp_path / "humaneval.jsonl").write_text('{"id": "HumanEval/0", "prompt": "x"}\n')
    code, _, err = run_cli(capsys, "bench", "--target", "/nonexistent/model", "--dataset", "humaneval",
                           "--prompt-file", str(tmp_path / "humaneval.jsonl"))
    assert code == 2 and "names its prompts humaneval/<id>, as --dataset humaneval does" in err


def test_standard_input_that_is_not_utf8_is_refused_before_loading(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait")))
    code, _, err = run_cli(capsys, "generate", "--target", "/nonexistent/model", "--prompt-file", "-")
    assert code == 2 and "standard input is not UTF-8 text (invalid continuation byte at byte 3)" in err


def test_a_prompt_file_keeps_its_line_endings_as_standard_input_does(tmp_path):
    """Text mode turned "\r\n" into "\n": the same file as --prompt-file FILE and on standard input gave the model
    two prompts."""
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"x\r\ny\rz\n")
    assert cli._read_prompt_file(str(path)) == "x\r\ny\rz\n"


def test_torch_deprecation_noise_is_hidden_in_the_cli_only(monkeypatch):
    def noisy(args):
        warnings.warn("TypedStorage is deprecated. It will be removed in the future", UserWarning)
        warnings.warn("torch.quantize_per_tensor, torch.quantize_per_channel and other quantized tensor creation "
                      "functions ... are deprecated", UserWarning)
        warnings.warn("a warning the user can act on", UserWarning)
        return 0

    monkeypatch.setitem(cli.COMMANDS, "methods", noisy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["methods"]) == 0
        inside = [str(w.message) for w in seen]
        noisy(None)  # outside the command line the same warnings show
        outside = [str(w.message) for w in seen][len(inside):]
    assert inside == ["a warning the user can act on"]
    assert len(outside) == 3


def test_a_system_error_is_one_line_not_a_traceback(capsys):
    """An --out under a file, a directory given for a file, a full disk: what the system said, exit status 2."""
    from arborspec.console import run_command

    def writes_under_a_file(args):
        open("/etc/passwd/results.json", "w")

    assert run_command(writes_under_a_file, None) == 2
    err = capsys.readouterr().err
    assert err.startswith("arborspec: error: ") and "Not a directory" in err and "Traceback" not in err


def test_kernels_info_compiles_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path))
    code, out, _ = run_cli(capsys, "kernels", "info")
    assert code == 0 and "not built for this CPU" in out and not (tmp_path / "kernels").exists()


def test_a_method_option_shows_a_default_only_where_every_method_shares_it():
    """`--budget` said "default 64" for every method (suffix's is 16; `arborspec methods` shows each one's)."""
    from arborspec.cli import build_parser
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    helps = {a.dest: a.help for a in generate._actions}
    assert helps["opt_budget"].endswith("(default: each method's own, `arborspec methods`)")
    assert helps["opt_k"].endswith("(default 5)")


def test_calibrate_refuses_to_write_an_acceptance_vector_of_zeros(model_dirs, capsys, monkeypatch, tmp_path):
    """A vector of zeros was written with exit 0; its one reader, sequoia --acceptance-file, then refused it."""
    monkeypatch.setattr(cli, "calibrate", lambda *a, **kw: {"acceptance": [0.0, 0.0], "positions": 4})
    out_file = tmp_path / "acc.json"
    code, _, err = run_cli(capsys, "calibrate", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                           "--dtype", "fp32", "--ranks", "2", "--out", str(out_file))
    assert code == 2 and "never among the draft's first 2 on these 4 positions" in err and not out_file.exists()
