"""The target's perplexity of an output on every backend (bench/perplexity.py): read as chains through a session on
the GGUF backends, where it came out None on every run; each row equals a one-token forward at that position."""
from __future__ import annotations

import math

import pytest
import torch

from arborspec.backends import make_session
from arborspec.bench import perplexity as ppl
from arborspec.core.tree import TokenTree
from arborspec.loading import load_model
from arborspec.loading.pair import backend_of
from tests.backends.tiny_gguf import write_tiny_gguf

PROMPT, NEW = [5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]
pytestmark = pytest.mark.usefixtures("private_cache")  # the GGUF tokenizers it builds: not in ~/.cache


def one_token_logits(model, context: list[int]) -> torch.Tensor:
    """The model's logits after `context`, from a fresh session and a lone root: no chain, no chunks."""
    session = make_session(model, "reference")
    session.prefill(context[:-1])
    return session.forward(context, TokenTree.root(context[-1]), [0])[0]


@pytest.mark.parametrize("backend", ["native", "llamacpp"])
def test_a_gguf_targets_perplexity_is_read_through_its_session_chunk_by_chunk(backend, tmp_path, monkeypatch):
    if backend == "llamacpp":
        pytest.importorskip("llama_cpp")
    gguf = write_tiny_gguf(tmp_path / "t.gguf", dtype="q4_k", hidden=256, ffn=512)  # blocks native's kernels take
    model = load_model(str(gguf), backend=backend, progress=False).model
    assert backend_of(model) == backend
    monkeypatch.setattr(ppl, "CHUNK", 3)  # 7 tokens: chunks of 3, 3 and 1
    rows = ppl.chain_logits(model, PROMPT, NEW)
    want = torch.stack([one_token_logits(model, PROMPT + NEW[:i]) for i in range(len(NEW))])
    assert rows.shape == want.shape
    # native computes each row alone: the same bits; llama.cpp's numerics depend on the batch (~6e-4 here)
    assert torch.equal(rows, want) if backend == "native" else torch.allclose(rows, want, atol=2e-3)
    nll = [-torch.log_softmax(want[i].double(), -1)[t].item() for i, t in enumerate(NEW)]
    assert ppl.target_perplexity(model, PROMPT, NEW) == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-3)
    assert ppl.target_perplexity(model, PROMPT, []) is None
