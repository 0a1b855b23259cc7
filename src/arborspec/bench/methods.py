"""The bench's transformers baselines: `hf-ar` (plain `generate`), `hf-assisted` (`assistant_model=draft`) and
`hf-lookup` (`prompt_lookup_num_tokens=10`), timed like an arborspec run.

What every method name means, baselines included, is arborspec/runspec.py. The baselines run on the same loaded models
with the same prompt ids, `do_sample = T > 0`, the same temperature / top-k / top-p and the engine's EOS ids, and
nothing else from the model's generation config. A streamer timestamps every round (TTFT, committed tokens per
round); for assisted generation and prompt lookup the drafted tokens per round come from wrapping the candidate
generators' `update_candidate_strategy` while `generate` runs.
"""
from __future__ import annotations

import copy
import time

import torch
from transformers import GenerationConfig
from transformers.generation import candidate_generator as cg

from ..runspec import RunSpec


class _Clock:
    """A transformers streamer that timestamps every put(): the first is the prompt, each later one a decoding round
    (one token for plain decoding, the accepted tokens + 1 for assisted generation)."""

    def __init__(self):
        self.rounds: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.rounds.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


class _CountDrafts:
    """Patch the candidate generators' update_candidate_strategy to record each round's drafted/accepted counts."""

    def __init__(self):
        self.classes = [c for c in vars(cg).values()
                        if isinstance(c, type) and issubclass(c, cg.CandidateGenerator)
                        and "update_candidate_strategy" in vars(c)]
        self.rounds: list[tuple[int, int]] = []  # (drafted, accepted)
        self.inside = 0

    def __enter__(self):
        self.saved = {c: vars(c)["update_candidate_strategy"] for c in self.classes}
        for cls, orig in self.saved.items():
            def wrapped(gen, input_ids, scores, num_matches, _orig=orig):
                if not self.inside:  # count a round once, even if one override calls another
                    self.rounds.append((int(scores.shape[1]) - 1, int(num_matches)))  # scores: (1, drafted + 1, V)
                self.inside += 1
                try:
                    return _orig(gen, input_ids, scores, num_matches)
                finally:
                    self.inside -= 1
            cls.update_candidate_strategy = wrapped
        return self

    def __exit__(self, *exc):
        for cls, orig in self.saved.items():
            cls.update_candidate_strategy = orig


def hf_generate(spec: RunSpec, target, draft, ids: list[int], max_new_tokens: int, temperature: float,
                top_k: int, top_p: float, eos: list[int], seed: int | None) -> dict:
    """Run transformers' own generate (plain, assisted, or prompt lookup) and time it like an arborspec run."""
    # sampling: every setting explicit (a None would be filled from the model's generation config or transformers'
    # global defaults, top_k=50, which the arborspec runs do not use); greedy: none (any value, neutral or not, made
    # transformers warn "may be ignored" on every run)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p) if temperature > 0 else {}
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0, eos_token_id=list(eos),
                           pad_token_id=(eos[0] if eos else 0), repetition_penalty=1.0, **sampling)
    kwargs = dict(spec.hf)
    if kwargs.pop("assistant_model", False):
        kwargs["assistant_model"] = draft
    for key in ("prompt_lookup_num_tokens",):
        if key in kwargs:
            setattr(cfg, key, kwargs.pop(key))
    if seed is not None:
        torch.manual_seed(seed)
    clock, inputs = _Clock(), torch.tensor([ids])
    with torch.no_grad(), _CountDrafts() as counts:
        start = time.perf_counter()
        out = target.generate(inputs, generation_config=copy.deepcopy(cfg), streamer=clock,
                              attention_mask=torch.ones_like(inputs), **kwargs)
        wall = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    committed = [n for _, n in clock.rounds]
    if not counts.rounds and len(committed) > 1:  # plain generate: the prompt's forward is no decoding step
        committed = committed[1:]  # (assisted generation and lookup read the prompt in their first verification)
    drafted = [d for d, _ in counts.rounds] if counts.rounds else [0] * len(committed)
    return dict(
        token_ids=new, wall=wall, ttft=(clock.rounds[0][0] - start) if clock.rounds else None,
        committed_per_step=committed, accepted_per_step=[max(n - 1, 0) for n in committed],
        drafted_per_step=drafted if len(drafted) == len(committed) else None,
        finish_reason="eos" if new and new[-1] in eos else "length",
    )
