"""One generation's bookkeeping, the same for the speculative loop and the plain one (engine/decoder.py): the
committed context, the stopping rules (EOS, the token budget, the context window, stop strings), the statistics and
their clocks, and the result after every step."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import torch

from ..backends.model_info import context_window
from ..core.options import is_whole
from .logprobs import TokenLogprob, token_logprobs
from .prompts import unicode_text
from .stats import GenerationResult, GenerationStats, StepStats


def stop_strings(stop: str | list[str] | None) -> list[str] | None:
    """`stop` as a list: a single string is one stop string (as transformers' stop_strings takes it), not its
    characters. ValueError for an empty one: every text contains it, so the generation would end at its first token."""
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__} {stop!r:.80}")
    if stop is not None and not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop strings must be non-empty strings (an empty one would end every generation at its "
                         f"first token), got {list(stop)!r}")
    for s in stop or ():  # a lone surrogate ("\ud800" from JSON) can never appear in decoded text: it never stopped
        unicode_text(s, "a stop string")
    return stop


def check_budget(max_new_tokens, scoring: bool = False) -> None:
    """ValueError unless `max_new_tokens` is an integer >= 1 (>= 0 when a prompt is scored: prompt_logprobs)."""
    low = 0 if scoring else 1
    if not is_whole(max_new_tokens) or max_new_tokens < low:
        raise ValueError(f"max_new_tokens must be an integer >= 1 (0 only with prompt_logprobs: a prompt scored), "
                         f"got {max_new_tokens!r}")


def _no_text(tokens: list[int]) -> str:
    return ""


class Generation:
    """A generation of up to `max_new_tokens` after the prompt `ids`; `commit` a step's tokens, then `record` it."""

    def __init__(self, ids: list[int], max_new_tokens: int, stop: list[str] | None, eos: set[int], window: int,
                 decode: Callable[[list[int]], str] | None, stats: GenerationStats, generator, t_start: float):
        """`decode`: token ids to text; None without a tokenizer (then the result has no text, and stop strings,
        which are matched on the text, are refused)."""
        if stop and decode is None:
            raise ValueError("stop strings need a tokenizer (they are matched on the text); pass tokenizer=...")
        self.context, self.new = list(ids), []  # prompt + committed tokens; committed tokens only
        self.top_id = max(ids)  # the largest token id in the context (a draft with fewer rows cannot read it)
        self.max_new_tokens, self.stop, self.eos, self.window = max_new_tokens, stop_strings(stop), eos, window
        self.decode, self.stats, self.generator, self.t_start = decode or _no_text, stats, generator, t_start
        self.top_logprobs: int | None = None  # set: each committed token's logprob and this many alternatives
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's tokens, when asked for
        self.sessions: list = []  # the target's session, then the draft's (or None), once open
        self.partial = True  # False: `record` builds the final result only (see `record`)

    @property
    def finished(self) -> bool:
        return bool(self.stats.finish_reason)

    def room(self) -> int:
        """Tokens a step's tree may add below its root: its bonus token must still fit the budget and the window."""
        return max(min(self.max_new_tokens - len(self.new), self.window - len(self.context)) - 1, 0)

    def draft_room(self, room: int, draft) -> int:
        """`room` for the trees `draft` (a model, or None) drafts: none of their nodes past the draft's own context
        window, which may be shorter than the target's. A node at depth d sits at position len(context) - 1 + d; near
        the end of that window the trees get shallower, then are bare roots, and the target decodes on alone (the
        draft's session would overflow: native raised ContextOverflow there, llama.cpp filled its cache). Bare
        roots too once the target committed a token the draft has no row for (a padding id of a wider table: see
        backends/session.py, VocabAligned): the draft cannot read the context any more."""
        if draft is None:
            return room
        if self.top_id >= draft.config.vocab_size:
            return 0
        return max(min(room, context_window(draft) - len(self.context)), 0)

    def commit(self, proposed: list[int]) -> list[int]:
        """The tokens of `proposed` (a step's accepted tokens, then its bonus) kept under the stopping rules, added
        to the context; `stats.finish_reason` says why the generation stops, if it does."""
        kept, self.stats.finish_reason = self._cut(proposed)
        self.top_id = max([self.top_id, *kept])
        self.context += kept
        self.new += kept
        return kept

    def note_logprobs(self, logits: torch.Tensor, rows: list[int], kept: list[int]) -> None:
        """With `top_logprobs` set: the logprobs of `kept` (a step's committed tokens), each at its row of `logits`
        (the target's forward: rows[i] is the node whose row predicts kept[i])."""
        if self.top_logprobs is not None and kept:
            self.logprobs += token_logprobs(logits[rows[:len(kept)]], kept, self.top_logprobs)

    def record(self, step: StepStats) -> GenerationResult | None:
        """The result so far, with `step` counted; the clocks leave out measure_optimum's time (stats.t_measure).
        None before the last step where `partial` is off: a result decodes the whole text so far, so one a step
        made a long generation's text cost quadratic time for `generate`, which keeps only the last (Qwen's
        tokenizer decodes 4096 tokens in 0.85 ms; 4000 tokens of a tiny model took 16.6 s with a result a step,
        13.4 s without; Intel Xeon host, 2026-11-29)."""
        stats = self.stats
        stats.steps.append(step)
        stats.new_tokens = len(self.new)
        now = time.perf_counter() - self.t_start - stats.t_measure
        if len(stats.steps) == 1:
            stats.t_first_token = now
        stats.t_total = now
        return self._result() if self.partial or self.finished else None

    def scored(self) -> GenerationResult:
        """The result of a generation of no tokens (max_new_tokens 0): its prompt's logprobs alone."""
        self.stats.finish_reason = "length"
        self.stats.t_prefill = self.stats.t_total = time.perf_counter() - self.t_start - self.stats.t_measure
        return self._result()

    def _result(self) -> GenerationResult:
        """The result so far, its stats a copy: `steps()` hands out one a step, and a caller keeping an earlier one
        (a progress log, `list(decoder.steps(...))`) saw the final counts beside its partial text."""
        logprobs = list(self.logprobs) if self.top_logprobs is not None else None
        stats = replace(self.stats, steps=list(self.stats.steps), policy=dict(self.stats.policy))
        return GenerationResult(self.decode(self.new), list(self.new), stats, logprobs, self.prompt_logprobs)

    def _cut(self, proposed: list[int]) -> tuple[list[int], str]:
        """Cut `proposed` at EOS, a stop string, the token budget or the context window; say why we stopped, in that
        order (a stop string completed by the budget's last token read "length", and a caller that trims the stop
        string on "stop" kept it)."""
        kept = []
        for tok in proposed:
            kept.append(tok)
            if tok in self.eos:
                return kept, "eos"
            if self.stop and self._hits_stop(self.new + kept):
                return kept, "stop"
            if len(self.new) + len(kept) >= self.max_new_tokens:
                return kept, "length"
            if len(self.context) + len(kept) >= self.window:
                return kept, "context"
        return kept, ""

    def _hits_stop(self, tokens: list[int]) -> bool:
        """Whether a stop string ends in the last token of `tokens`. Only a tail is decoded: enough tokens for the
        longest stop string and the last token's own text, plus the characters its first token's bytes may be the
        end of (up to 3 U+FFFD); a token can decode to nothing (a special token), so the tail grows until its text
        is that long. The U+FFFD of half a character at either end of the tail is not text yet: a stop string
        holding U+FFFD ended the generation on the first byte of a two-byte character (one that stays invalid
        matches a token later)."""
        need = max(len(s) for s in self.stop) + len(self.decode(tokens[-1:])) + 3
        k = 32
        while len(tail := self.decode(tokens[-k:])) < need and k < len(tokens):
            k *= 2
        tail = tail.rstrip("\ufffd")
        if k < len(tokens):
            tail = tail.lstrip("\ufffd")
        return any(s in tail for s in self.stop)
