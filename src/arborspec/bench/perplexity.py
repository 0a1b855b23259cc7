"""The target's perplexity of a run's output: exp of the mean negative log-likelihood of the generated tokens, given
the prompt and the tokens before each (bench/metrics.py: `perplexity`).

A model that brings tree sessions (llama.cpp, native) has no transformers forward: its perplexity came out None on
every run, with no word, so a bench on the default GGUF pair never reported it. There the output is read as chains
through a session, the way the engine verifies a drafted chain: the prompt prefilled, then the generated tokens
forwarded `CHUNK` at a time, each chunk's last token the next chunk's root. A transformers model reads prompt and
output in one forward without a cache.
"""
from __future__ import annotations

import torch

from ..backends import brings_sessions, make_session
from ..core.tree import TokenTree
from . import metrics

CHUNK = 256  # tokens a forward: well inside a tree's MAX_TREE_NODES


def target_perplexity(model, prompt: list[int], new: list[int]) -> float | None:
    """Perplexity of `new` after `prompt` under `model`; None for no tokens."""
    if not new:
        return None
    if brings_sessions(model):
        return metrics.perplexity(chain_logits(model, prompt, new), new)
    ids = torch.tensor([prompt + new])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(new)]
    return metrics.perplexity(logits, new)


def chain_logits(model, prompt: list[int], new: list[int]) -> torch.Tensor:
    """(len(new), vocab): row i the model's logits before new[i], read through one of its sessions."""
    session = make_session(model, "perplexity")
    session.prefill(prompt[:-1])
    context, rows = list(prompt), []
    for start in range(0, len(new), CHUNK):
        part = new[start:start + CHUNK]
        tree = TokenTree.root(context[-1])  # the root predicts part[0]; node i (part[i - 1]) predicts part[i]
        for i, token in enumerate(part[:-1]):
            tree.add(i, token)
        nodes = list(range(len(tree)))
        rows.append(session.forward(context, tree, nodes))
        session.commit(nodes)
        context += part
    return torch.cat(rows)
