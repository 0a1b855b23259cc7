"""The llama.cpp peer rows of `arborspec bench` (llama.cpp's own decoding loop and its prompt-lookup speculation),
the backend choice, and the report's speed-up column over plain llama.cpp; on a tiny GGUF the test writes itself."""
import pytest

from arborspec.backends import llamacpp
from arborspec.bench import llamacpp_peers
from arborspec.bench.llamacpp_peers import llamacpp_generate
from arborspec.bench.report import render
from arborspec.engine import SpeculativeDecoder
from arborspec.loading import ModelLoadError, load_model
from arborspec.loading.model import resolve_backend
from tests.backends.tiny_gguf import EOS, write_tiny_gguf

pytestmark = pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GGUF; the llama-cpp-python `Llama`s the peers load on it (kept in llamacpp_peers._LOADED) are closed
    at teardown: left to `Llama.__del__` at interpreter exit they print "TypeError: 'NoneType' object is not
    callable", as llama-cpp-python's module is torn down first."""
    path = tmp_path_factory.mktemp("peers") / "tiny.gguf"
    write_tiny_gguf(path)
    yield path
    for llm in llamacpp_peers._LOADED.values():
        llm.close()
    llamacpp_peers._LOADED.clear()


def test_backend_auto_picks_llamacpp_for_gguf_files_only(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))  # auto's choice is cached: not in ~/.cache
    assert resolve_backend(str(tiny), "auto") == "llamacpp"
    assert resolve_backend(str(tmp_path), "auto") == "torch"  # a checkpoint directory
    with pytest.raises(ModelLoadError, match="runs GGUF files"):
        resolve_backend(str(tmp_path), "llamacpp")
    with pytest.raises(ModelLoadError, match="unknown backend"):
        resolve_backend(str(tiny), "cuda")
    loaded = load_model(str(tiny), backend="auto", progress=False)
    assert isinstance(loaded.model, llamacpp.LlamaCppModel) and loaded.tokenizer is not None


@pytest.mark.parametrize("lookup", [0, 4])
@pytest.mark.usefixtures("private_cache")  # the GGUF's tokenizer it saves: not in ~/.cache
def test_peer_greedy_output_equals_arborspec_plain_decoding_on_llamacpp(tiny, lookup):
    """llama.cpp's own greedy loop (with or without prompt lookup) and arborspec's `ar` on the llama.cpp backend
    decode the same GGUF to the same tokens, so their speeds compare like for like."""
    loaded = load_model(str(tiny), backend="llamacpp", progress=False)
    ids = loaded.tokenizer("def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib")["input_ids"]
    ours = SpeculativeDecoder(loaded, method="ar").generate(ids, max_new_tokens=24, ignore_eos=True)
    out = llamacpp_generate(str(tiny), ids, 24, 0.0, 0, 1.0, [], 0, 1, lookup=lookup)
    assert out["token_ids"] == ours.token_ids
    assert sum(out["committed_per_step"]) == 23  # the first token came from the prompt's eval, no decoding step
    if lookup:
        assert len(out["committed_per_step"]) == len(out["drafted_per_step"])
    else:
        assert out["committed_per_step"] == [1] * 23 and not any(out["drafted_per_step"])
    assert EOS not in out["token_ids"]


def test_peers_load_without_extra_buffers_on_a_build_with_amx_kernels(tiny, monkeypatch):
    """On a build with AMX kernels Llama() loads as the backend does (backends.llamacpp.model_params: the pinned
    version's AMX product faults on a multi-token forward, the prompt's); elsewhere with llama.cpp's defaults."""
    import llama_cpp.llama_cpp as low

    for info, extra in ((b"CPU : AVX512_VNNI = 1 | AMX_INT8 = 1 | REPACK = 1 | ", False),
                        (b"CPU : AVX512_VNNI = 1 | REPACK = 1 | ", True)):
        monkeypatch.setattr(low, "llama_print_system_info", lambda info=info: info)
        out = llamacpp_generate(str(tiny), [1, 2, 3, 4, 5], 3, 0.0, 0, 1.0, [], 0, 1, n_ctx=64 + extra)
        llm = llamacpp_peers._LOADED[(str(tiny), 0, 1, 64 + extra)]
        assert llm.model_params.use_extra_bufts is extra and len(out["token_ids"]) == 3
    assert low.llama_model_default_params().use_extra_bufts  # the patch ends with the load


def _run(label, tps, prompt):
    return dict(label=label, method=label, dataset="humaneval", temperature=0.0, prompt_key=prompt, error=None,
                committed_per_step=[1], accepted_per_step=[0], drafted_per_step=[0], tokens_per_s=tps, wall=1.0,
                new_tokens=int(tps), verifier="x", lossy=False)


def test_report_adds_the_llamacpp_speedup_column_only_when_that_peer_ran():
    runs = [_run("llamacpp-ar", 20.0, "p0"), _run("auto", 30.0, "p0")]
    text = render({"runs": runs, "settings": {"methods": ["llamacpp-ar", "auto"]}, "env": {}}, [])
    assert "speed-up vs llamacpp-ar" in text
    row = next(line for line in text.splitlines() if line.startswith("| auto"))
    assert "| 1.50 |" in row
    plain = render({"runs": [_run("ar", 20.0, "p0")], "settings": {"methods": ["ar"]}, "env": {}}, [])
    assert "llamacpp-ar" not in plain


FAKE_LOOKAHEAD = r'''#!/usr/bin/env python3
"""Prints what llama.cpp's llama-lookahead prints: the prompt, then the text (accepted tokens in colour) on stdout,
the totals on stderr; records its arguments next to itself."""
import pathlib, sys
args = sys.argv[1:]
pathlib.Path(__file__).with_suffix(".args").write_text("\n".join(args))
prompt, n = args[args.index("-p") + 1], int(args[args.index("-n") + 1])
sys.stdout.write("\n\n" + prompt + "ab\x1b[0;96mcd\x1b[0m\x1b[0;96mef\x1b[0mg" + "\n\n")
sys.stderr.write(f"I encoded   5 tokens in    0.250 seconds, speed:   20.0 t/s\n"
                 f"I decoded   7 tokens in    1.750 seconds, speed:    4.0 t/s\n\nI n_predict = 7\nI n_accept  = 4\n")
'''


def test_lookahead_peer_runs_the_program_and_reads_its_totals(tmp_path, monkeypatch, tokenizer):
    """llamacpp-lookahead runs a program (llama.cpp's example): the prompt goes in as text with the run's settings,
    the totals come back (7 tokens, 4 of them accepted: 3 steps; prompt + decoding seconds), the tokens are its text
    after the prompt, colour codes removed. Without the program: a clear error saying how to get it."""
    from arborspec.bench.llamacpp_peers import LOOKAHEAD_ENV, lookahead_generate

    monkeypatch.setenv(LOOKAHEAD_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="llama-lookahead.*docs/llamacpp.md"):
        lookahead_generate("m.gguf", [5, 6], 7, 0.0, 0, 1.0, False, 3, 2, tokenizer)
    program = tmp_path / "fake-lookahead"
    program.write_text(FAKE_LOOKAHEAD)
    program.chmod(0o755)
    monkeypatch.setenv(LOOKAHEAD_ENV, str(program))
    ids = tokenizer("say hi:")["input_ids"]
    out = lookahead_generate("m.gguf", ids, 7, 0.7, 20, 0.9, True, 3, 2, tokenizer)
    assert tokenizer.decode(out["token_ids"]) == "abcdefg"
    assert out["wall"] == pytest.approx(2.0) and out["ttft"] == pytest.approx(0.25)
    assert sorted(out["committed_per_step"]) == [2, 2, 3] and sum(out["accepted_per_step"]) == 4
    assert out["finish_reason"] == "length"
    args = program.with_suffix(".args").read_text().split("\n")
    for flag, value in (("-m", "m.gguf"), ("-p", tokenizer.decode(ids)), ("-n", "7"), ("--temp", "0.7"),
                        ("--top-k", "20"), ("--top-p", "0.9"), ("-s", "3"), ("-t", "2")):
        assert args[args.index(flag) + 1] == value
    assert "--ignore-eos" in args
    program.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    with pytest.raises(RuntimeError, match="exit 3.*broken"):
        lookahead_generate("m.gguf", ids, 7, 0.0, 0, 1.0, False, 3, 2, tokenizer)


def test_the_peers_run_with_the_llama_options_given(monkeypatch, tokenizer):
    """--llama-ctx and --llama-threads reach llama.cpp's own loops as they reach the llama.cpp backend; the peers
    always ran with a 4096-token context and torch's thread count."""
    from types import SimpleNamespace

    from arborspec import runspec
    from arborspec.bench import runner

    seen = []
    monkeypatch.setattr(runner, "llamacpp_generate", lambda *a, **k: seen.append(("ar", a, k)) or {})
    monkeypatch.setattr(runner, "lookahead_generate", lambda *a, **k: seen.append(("la", a, k)) or {})
    target = SimpleNamespace(tokenizer=tokenizer, model=None)
    monkeypatch.setattr(runner, "eos_ids", lambda model, tok: [])
    for llama, threads, n_ctx in (({}, runner.torch.get_num_threads(), 4096), ({"n_ctx": 512, "n_threads": 1}, 1, 512)):
        bench = runner.Bench(runner.BenchSettings(target="m.gguf", draft="d", llama=llama), target, None)
        seen.clear()
        for name in ("llamacpp-ar", "llamacpp-lookahead"):
            cfg = runner.Config(name, runspec.parse(name), None, 0.0, {})
            bench.generate(cfg, [5, 6], 4, 0)
        (_, ar_args, ar_kw), (_, la_args, la_kw) = seen
        assert ar_args[8] == threads and ar_kw["n_ctx"] == n_ctx and ar_kw["lookup"] == 0
        assert la_args[8] == threads and la_kw["n_ctx"] == n_ctx
