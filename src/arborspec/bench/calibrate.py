"""Measure a draft/target pair's positional acceptance rates: Sequoia's acceptance vector.

For each calibration prompt the target generates a continuation (greedy at temperature 0, sampled above it); one
forward of the draft over prompt + continuation (through its own backend's session: transformers, llama.cpp or
native) then ranks, at every generated position, the draft's candidates.
`acceptance[i]` is the fraction of positions where the target's token was the draft's (i+1)-th most likely token:
the probability that the (i+1)-th ranked child of an accepted node is the one the target takes (the events are
disjoint, so the vector sums to at most 1). `arborspec calibrate` writes it as JSON for `sequoia --acceptance-file`.
"""
from __future__ import annotations

import torch

from ..backends.model_info import context_window, model_and_tokenizer, vocab_size
from ..core.disk_cache import write_json
from ..core.sampling import SEED_RANGE
from ..engine import SpeculativeDecoder
from ..tuning.agreement import next_token_logits
from ..tuning.corpus import DEFAULT_PROMPTS


@torch.inference_mode()
def calibrate(target, draft, prompts, tokenizer=None, max_new_tokens: int = 64, temperature: float = 0.0,
              ranks: int = 16, seed: int | None = 0, top_k: int = 0, top_p: float = 1.0) -> dict:
    """The acceptance vector of `draft` against `target` on `prompts` (text or token-id lists), the target sampling
    at `temperature`, `top_k`, `top_p`."""
    target_model, tokenizer = model_and_tokenizer(target, tokenizer)
    draft_model, _ = model_and_tokenizer(draft)
    if ranks < 1 or max_new_tokens < 1:
        raise ValueError(f"ranks and max_new_tokens must be >= 1, got {ranks!r} and {max_new_tokens!r}")
    dec = SpeculativeDecoder(target_model, method="ar", temperature=temperature, top_k=top_k, top_p=top_p,
                             tokenizer=tokenizer)
    counts = torch.zeros(ranks, dtype=torch.float64)
    draft_vocab = vocab_size(draft_model) or float("inf")
    draft_window = context_window(draft_model)
    positions = 0
    for i, prompt in enumerate(prompts):
        ids = dec.encode(prompt)
        out = dec.generate(ids, max_new_tokens=max_new_tokens, seed=_nth_seed(seed, i)).token_ids
        # the target's table may be wider than the draft's (padding rows): an id the draft lacks ends what it reads
        # (it was an IndexError inside the draft's embedding); the engine never drafts such ids either
        out = out[:next((j for j, t in enumerate(out) if t >= draft_vocab), len(out))]
        out = out[:max(0, draft_window - len(ids))]  # and a draft's shorter window ends it (an IndexError too)
        if not out:
            continue
        logits = next_token_logits(draft_model, ids + out)[len(ids) - 1 : len(ids) - 1 + len(out)].float()
        chosen = logits.gather(1, torch.tensor(out)[:, None])  # (len(out), 1)
        rank = (logits > chosen).sum(dim=1)  # 0 = the draft's top token
        for r in rank.tolist():
            if r < ranks:
                counts[r] += 1
        positions += len(out)
    if positions == 0:
        raise ValueError("calibration produced no tokens the draft could read (the target ended at once, or the "
                         f"prompts fill the draft's {draft_window}-token window)")
    acceptance = (counts / positions).tolist()
    return {"acceptance": acceptance, "positions": positions, "prompts": len(prompts), "temperature": temperature,
            "ranks": ranks, "max_new_tokens": max_new_tokens}


def write_acceptance_file(path: str, result: dict) -> None:
    write_json(path, result)


def _nth_seed(seed: int | None, i: int) -> int | None:
    """Prompt i's seed: `seed + i`, wrapped into the range torch takes (the largest seed failed on the second
    prompt, a seed never given)."""
    if seed is None:
        return None
    low, high = SEED_RANGE
    return low + (seed - low + i) % (high - low + 1)
