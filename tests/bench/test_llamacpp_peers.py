"""The llama.cpp peer rows of `arborspec bench` (llama.cpp's own decoding loop and its prompt-lookup speculation),
the backend choice, and the report's speed-up column over plain llama.cpp; on a tiny GGUF the test writes itself."""
import pytest

from arborspec.bench.llamacpp_peers import llamacpp_generate
from arborspec.bench.report import render
from arborspec.engine import SpeculativeDecoder
from arborspec.models import llamacpp
from arborspec.models.loading import ModelLoadError, load_model, resolve_backend
from tests.models.tiny_gguf import EOS, write_tiny_gguf

pytestmark = pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("peers") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


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
def test_peer_greedy_output_equals_arborspec_plain_decoding_on_llamacpp(tiny, lookup):
    """llama.cpp's own greedy loop (with or without prompt lookup) and arborspec's `ar` on the llama.cpp backend
    decode the same GGUF to the same tokens, so their speeds compare like for like."""
    loaded = load_model(str(tiny), backend="llamacpp", progress=False)
    ids = loaded.tokenizer("def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib")["input_ids"]
    ours = SpeculativeDecoder(loaded, method="ar").generate(ids, max_new_tokens=24, ignore_eos=True)
    out = llamacpp_generate(str(tiny), ids, 24, 0.0, 0, 1.0, [], 0, 1, lookup=lookup)
    assert out["token_ids"] == ours.token_ids
    assert sum(out["committed_per_step"]) == 24
    if lookup:
        assert len(out["committed_per_step"]) == len(out["drafted_per_step"])
    else:
        assert out["committed_per_step"] == [1] * 24 and not any(out["drafted_per_step"])
    assert EOS not in out["token_ids"]


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
