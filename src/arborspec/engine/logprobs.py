"""The target's log-probabilities of the tokens a generation commits, with the most likely alternatives: what the
server's `logprobs` / `top_logprobs` return.

They are the target model's own distribution at each position, log_softmax of its raw logits, before temperature,
top-k or top-p (as vLLM reports them by default): the same figures whether a token came from a drafted tree or a
plain step, since a verified row is the target's forward at that position. Computed only when asked for, on the
committed rows alone (one (vocab,) log_softmax a token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # log p(token) under the target at its position (None: a prompt's first token)
    top: list[tuple[int, float]]  # the `top` most likely (token, logprob) there, most likely first


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """rows (n, vocab): the target's logits at each of `tokens`' positions -> one TokenLogprob per token."""
    logp = torch.log_softmax(rows.float(), dim=-1)  # (n, vocab)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if top:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)  # (n, top), descending
        best = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        best = [[] for _ in tokens]
    return [TokenLogprob(t, lp, b) for t, lp, b in zip(tokens, chosen, best)]
