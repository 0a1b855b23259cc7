"""Many prompts decoded at once: `SpeculativeDecoder.generate_batch`, and what `arborspec bench --concurrency` runs.

Up to `concurrency` requests are active; every round advances each of them by one speculative step (its own draft,
verification and commit), and a request that finishes leaves at the end of its round while the next waiting prompt
joins, as in the server's scheduler. Where the target batches (backends/batching.py: the native backend), the
round's target forwards run as one forward over every request's tree, so the target's weights are read once per
round instead of once per request; elsewhere the steps run one after another.

Each prompt gets its own fork of the decoder (the same models and settings, a fresh policy) and its own seed, so its
output is bit for bit what `decoder.fork().generate(prompt, seed=seed)` gives alone: greedy and seeded sampled
outputs do not depend on the batch (sampled ones from policies whose trees do not follow the clock: `auto` only with
repeatable=true, drafting/auto/options.py).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import partial

from ..backends.batching import can_batch, run_round
from ..core.options import check_int
from ..core.sampling import check_seed


def generate_batch(decoder, prompts: list, max_new_tokens: int = 128, stop: list[str] | None = None,
                   seeds: list[int | None] | None = None, ignore_eos: bool = False,
                   concurrency: int | None = None) -> list:
    """One GenerationResult per prompt, in order (see the module docstring); `seeds`: one per prompt (None: the
    decoder's own seed, sampling.seed; unseeded only where that is None); `concurrency`: the most requests active at
    once (None: all of them)."""
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):  # a string was read as one-letter prompts
        raise ValueError(f"prompts must be a list of prompts (texts, token-id lists or conversations), not "
                         f"{type(prompts).__name__}; one prompt: generate()")
    n = len(prompts)
    if seeds is not None and not isinstance(seeds, (list, tuple)):
        raise ValueError(f"seeds must be a list of one seed (or None) per prompt, got {seeds!r}")
    seeds = [None] * n if seeds is None else list(seeds)
    if len(seeds) != n:
        raise ValueError(f"got {len(seeds)} seeds for {n} prompts")
    limit = n if concurrency is None else concurrency
    if n:
        check_int(limit, "concurrency", 1)
    for prompt in prompts:  # an empty or too long prompt fails here, before any request has started
        decoder.encode(prompt)
    for seed in seeds:  # and a bad seed (it failed when its prompt's turn came, the results before it thrown away)
        check_seed(seed)
    batch = can_batch(decoder.target)
    results: list = [None] * n
    waiting, active = deque(range(n)), {}  # active: prompt index -> its decoder loop
    try:
        while waiting or active:
            while waiting and len(active) < limit:  # join between rounds
                i = waiting.popleft()
                active[i] = decoder.fork().steps(prompts[i], max_new_tokens, stop, seeds[i], ignore_eos,
                                                 partial=False)
            order = list(active)
            errors = run_round([partial(_advance, active[i], results, i) for i in order], batch)
            for err in errors:
                if err is not None:
                    raise err
            for i in order:  # leave between rounds (a loop yields its result once, when it finishes)
                if results[i] is not None:
                    active.pop(i).close()
    finally:
        for steps in active.values():
            try:
                steps.close()  # (an interrupted round has ended its threads: backends/batching.py, Round._abort)
            except ValueError:  # still running on a step's thread: "generator already executing"
                pass
    return results


def _advance(steps: Iterator, results: list, i: int) -> None:
    results[i] = next(steps)
