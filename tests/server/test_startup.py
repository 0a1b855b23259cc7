"""`arborspec serve` loads its pair through the loader `arborspec generate` uses (spec.load_pair): the same flags give
the same backends, and the start-up line says what runs and why."""
from __future__ import annotations

import argparse

import pytest

from arborspec import cli
from arborspec.backends import llamacpp
from arborspec.backends.native import is_native
from arborspec.loading.pair import LoadedPair, load_pair_for
from arborspec.server import build, run
from arborspec.server.scheduler import Scheduler
from tests.backends.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, private_cache):
    """A tiny GGUF target and a noisy copy as its draft, in native's and llama.cpp's block types."""
    folder = tmp_path_factory.mktemp("gguf")
    target, draft = folder / "t.gguf", folder / "d.gguf"
    write_tiny_gguf(target, dtype="q4_k")
    write_tiny_gguf(draft, dtype="q4_k", noise=0.2)
    return str(target), str(draft)


def both_front_ends(flags: list[str]) -> tuple[LoadedPair, LoadedPair]:
    """The pair `generate` loads and the pair `serve` loads for the same flags."""
    gen = cli.build_parser().parse_args(["generate", "--prompt", "x", *flags])
    parser = argparse.ArgumentParser()
    run.add_serve_arguments(parser)
    serve = parser.parse_args(flags)
    run.check_flags(serve)
    generated = load_pair_for(gen, cli.run_spec(gen))
    decoders, served = build.load_decoders(serve, run.server_spec(serve))
    assert decoders.target is served.target and decoders.quant == served.quant
    return generated, served


CASES = [["--backend", "auto"], ["--backend", "native"]]
if llamacpp.available():
    CASES += [["--backend", "llamacpp"], ["--backend", "native", "--draft-backend", "llamacpp"]]


@pytest.mark.parametrize("backends", CASES, ids=lambda c: "-".join(c[1::2]))
def test_serve_and_generate_resolve_the_same_backends_for_the_same_flags(ggufs, backends):
    target, draft = ggufs
    generated, served = both_front_ends(["--target", target, "--draft", draft, "--method", "chain",
                                         "--dtype", "fp32", *backends])
    assert generated.backends == served.backends
    assert is_native(generated.draft.model) == is_native(served.draft.model)
    if "--draft-backend" not in backends:  # the draft follows the target: one thread pool for both
        assert served.backends[0] == served.backends[1]
        assert is_native(served.target.model) == is_native(served.draft.model)
    else:
        assert served.backends == ("native", "llamacpp")
    assert (served.choice != "") == (backends[1] == "auto")  # the figures behind an auto choice, for the start line


def test_the_start_up_line_says_what_runs_and_why():
    pair = LoadedPair(None, None, "none", ("llamacpp", "llamacpp"),
                      "native 30.0 tok/s (t(1) 30.0 ms, t(4) 40.0 ms), llamacpp 31.0 tok/s (t(1) 25.0 ms, ...)")
    line = build.backend_line(pair, Scheduler(8, 8, None, batch=False))
    assert line.startswith("target on llamacpp, draft on llamacpp (--backend auto, predicted: native 30.0 tok/s")
    assert line.endswith("native would batch concurrent requests (--backend native)")
    given = build.backend_line(LoadedPair(None, None, "none", ("native", None), ""), Scheduler(8, 8, None, batch=True))
    assert given == "target on native"


def test_requests_run_the_servers_draft_as_auto_prepared_it(monkeypatch):
    """A server whose `auto` draft came with a pruned head (pair.vocab): a request's method that names no head size
    runs that draft; one that names another head, or another quantization, is refused (the draft is prepared once)."""
    from arborspec.drafting import sequoia
    from arborspec.engine import DecoderConfig
    from arborspec.runspec import parse
    from arborspec.server.decoders import Decoders

    decoders = Decoders(parse("auto", draft_quant="q4_0"), None, object(), "q4_0", 32768, DecoderConfig())
    spec = decoders.spec_for(method="chain")
    assert (spec.quant, spec.vocab) == ("q4_0", 32768)
    for method in ("chain+vocab1024", "chain+iq4_nl"):
        with pytest.raises(ValueError, match="this server's draft has q4_0 and 32768"):
            decoders.spec_for(method=method)
    # a request naming only a verifier or a budget runs the server's method on its draft (was refused: its spec
    # still said quantization "auto", which was compared with the resolved q4_0)
    decoders = Decoders(parse("chain"), None, object(), "iq4_nl", 65536, DecoderConfig())
    assert decoders.spec.quant == "auto"
    for request in ({"verifier": "mss"}, {"budget": 4}):
        spec = decoders.spec_for(**request)
        assert (spec.name, spec.quant, spec.vocab) == ("chain", "iq4_nl", 65536)
    read = []
    monkeypatch.setattr(sequoia, "load_acceptance_file", lambda path: read.append(path) or [0.5])
    for method in ("sequoia(acceptance_file=/etc/passwd)", "auto(reprofile=true)",  # a client's probe, or a stall
                   "sequoia(acceptance-file=/etc/passwd)", "sequoia( acceptance-file = /x.json )", "auto(reprofile=1)"):
        with pytest.raises(ValueError, match="a request may not set (acceptance_file|reprofile)"):
            decoders.spec_for(method=method)
    assert read == []  # the hyphenated spelling read the file, and the error told the client whether it exists
    with pytest.raises(ValueError, match="names its verifier .sps. already"):  # the field won in silence
        decoders.spec_for(method="sps", verifier="mss")


def test_serve_refuses_a_verifier_flag_for_a_method_that_names_one():
    """`serve --method sps --verifier mss` ran mss in silence; generate and a request's fields refuse it."""
    parser = argparse.ArgumentParser()
    run.add_serve_arguments(parser)
    for method in ("sps", "chain(verifier=asps)"):
        with pytest.raises(ValueError, match="sets verifier already"):
            run.server_spec(parser.parse_args(["--method", method, "--verifier", "mss"]))
    assert run.server_spec(parser.parse_args(["--method", "chain", "--verifier", "mss"])).verifier == "mss"
