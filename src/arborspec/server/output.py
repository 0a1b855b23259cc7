"""What a client sees of a generation: the text (cut at a stop string), OpenAI's response and stream-chunk shapes,
`usage`, and the speculative statistics in the `arborspec` extension field.

Stop strings follow OpenAI: the returned text ends before the stop string. The engine notices a stop string only
once its last token is committed, so while streaming, text that might be the start of a stop string is held back
until the next step shows whether it is one; so is a trailing U+FFFD (a multi-byte character split across steps).

A stream's `usage` follows OpenAI too: with `stream_options.include_usage` every chunk carries `"usage": null` and
one more chunk with empty `choices` carries it at the end; without it (OpenAI sends none then), the finish chunk
carries it, as this server always did, and with it the `arborspec` statistics.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..engine import GenerationResult
from .logprobs import Logprobs

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}  # engine -> OpenAI


def visible_text(text: str, stop: list[str], done: bool) -> str:
    """The part of `text` a client may see now: up to the first stop string; while not `done`, without a tail that
    could still grow into a stop string or a whole character."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    if cuts:
        return text[:min(cuts)]
    if done:
        return text
    text = text.rstrip("\ufffd")  # first: a stop string's start must be seen before the half character after it
    return text[:len(text) - max((_stop_start(text, s) for s in stop), default=0)]


def _stop_start(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop` (and is shorter than it); checked from the longest
    candidate down, so a match stops the search (a 900 KB stop string cost 13 s an event tried every length)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if stop.startswith(text[len(text) - k:]):
            return k
    return 0


def usage(result: GenerationResult) -> dict:
    """OpenAI's usage, with prompt_tokens_details.cached_tokens: the prompt tokens an earlier request's cache held
    (the server's prefix cache, engine/prefix_cache.py)."""
    prompt, completion = result.stats.prompt_tokens, result.stats.new_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": result.stats.cached_tokens}}


def speculative_stats(result: GenerationResult, token_ids: bool = False) -> dict:
    """The `arborspec` extension: how the speculation went for this request."""
    s = result.stats
    out = {"method": s.method, "verifier": s.verifier, "lossy": s.lossy, "steps": s.n_steps,
           "tokens_per_step": s.tokens_per_step, "acceptance_rate": s.acceptance_rate,
           "drafted_tokens": sum(step.tree_size for step in s.steps),
           "accepted_tokens": sum(step.accepted for step in s.steps),
           "tokens_per_s": s.tokens_per_s, "finish_reason": s.finish_reason}
    if token_ids:
        out["token_ids"] = list(result.token_ids)
    return out


@dataclass
class Reply:
    """One response's fixed parts and the shape of its choices: `chat` (chat.completion) or text_completion."""

    model: str
    chat: bool
    stop: list[str]
    token_ids: bool = False  # arborspec.return_token_ids
    include_usage: bool = False  # stream_options.include_usage: usage in a chunk of its own, after the finish chunk
    logprobs: Logprobs | None = None  # the request asked for logprobs: handed out with the text they make
    echo: str | None = None  # completions' echo: the prompt's text, sent in front of the completion's
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    echoed: bool = field(default=False, repr=False)  # the echo has gone out (a stream sends it once, first)

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        head = {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": kind, "created": self.created,
                "model": self.model}
        if chunk and self.include_usage:
            head["usage"] = None
        return head

    def _choice(self, text: str | None, finish: str | None, chunk: bool, logprobs: dict | None = None) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if chunk:
            return {"index": 0, "delta": {} if text is None else {"content": text}, "logprobs": logprobs,
                    "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}

    def _piece(self, text: str | None, result: GenerationResult, shown: str,
               last: bool = False) -> tuple[str | None, dict | None]:
        """New completion text and the logprobs of the tokens whose text `shown` now covers (none unless asked
        for); the first time, with an echoed prompt and its tokens' logprobs in front. The `last` piece of a
        response that asked for logprobs and has sent none carries the empty shape."""
        text, logprobs = self._echoed(text, result, self.logprobs.take(result, shown, last) if self.logprobs else None)
        if last and logprobs is None and self.logprobs is not None and not self.logprobs.given:
            logprobs = self.logprobs.empty()
        return text, logprobs

    def _echoed(self, text: str | None, result: GenerationResult, logprobs: dict | None):
        if self.echo is None or self.echoed:
            return text, logprobs
        self.echoed = True
        if self.logprobs is not None and result.prompt_logprobs is not None:
            front = self.logprobs.prompt(result, self.echo)
            logprobs = front if logprobs is None else {k: front[k] + logprobs[k] for k in front}
        return self.echo + (text or ""), logprobs

    def _tail(self, result: GenerationResult) -> dict:
        return {"usage": usage(result), "arborspec": speculative_stats(result, self.token_ids)}

    def body(self, result: GenerationResult) -> dict:
        """The whole non-streaming response."""
        text = visible_text(result.text, self.stop, done=True)
        out, logprobs = self._piece(text, result, text, last=True)
        choice = self._choice(out, finish_reason(result, text), False, logprobs)
        return {**self._head(False), "choices": [choice], **self._tail(result)}

    def first_event(self) -> str | None:
        """A chat stream opens with the assistant's role, as OpenAI's does."""
        if not self.chat:
            return None
        return event({**self._head(True), "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})

    def text_event(self, text: str, result: GenerationResult, shown: str) -> str:
        """A chunk of new text (`text`: what `shown`, all the client has now, adds), with its tokens' logprobs."""
        out, logprobs = self._piece(text, result, shown)
        return event({**self._head(True), "choices": [self._choice(out, None, True, logprobs)]})

    def last_events(self, result: GenerationResult, shown: str) -> list[str]:
        """The final chunk (finish reason) and the usage with the speculative statistics: on that chunk, or with
        `include_usage` in a chunk of their own with empty `choices`."""
        out, logprobs = self._piece(None, result, shown, last=True)  # an EOS token's logprob, an echo not yet sent
        choice = self._choice(out, finish_reason(result, shown), True, logprobs)
        finish = {**self._head(True), "choices": [choice]}
        if not self.include_usage:
            return [event({**finish, **self._tail(result)})]
        return [event(finish), event({**self._head(True), "choices": [], **self._tail(result)})]


def finish_reason(result: GenerationResult, text: str) -> str:
    reason = FINISH_REASONS.get(result.stats.finish_reason, "stop")
    return "stop" if len(text) < len(result.text) else reason  # `text` was cut at a stop string


def event(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


DONE = event("[DONE]")
