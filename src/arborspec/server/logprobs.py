"""OpenAI's `logprobs` shapes from a generation's TokenLogprobs (engine/logprobs.py), for completions and chat.

Completions (`"logprobs": k`, k <= 5): {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}.
Chat (`"logprobs": true, "top_logprobs": k`, k <= 20): {content: [{token, logprob, bytes, top_logprobs: [...]}]}.

A token's entry goes out with the text it makes: once the text the client has been shown (cut at a stop string,
held back while it may still grow into one or into a whole character; server/output.py) covers the token's text.
So a stream's logprobs arrive with its content, a stop string's tokens never arrive, and a token whose bytes end
in the middle of a character waits for the token that completes it. Chat leaves special tokens out (the end of the
turn is no part of the content); completions keep them, as OpenAI's legacy completions list `<|endoftext|>`.
`bytes` are a token's own bytes (a byte-level BPE token that splits a character holds part of its UTF-8), where
`token` is its text as the tokenizer decodes it. Completions have no `bytes`: there such a token is written as OpenAI
writes it, `bytes:\\xe2\\x80`, so two of them (both "\ufffd" decoded) are not one key of `top_logprobs`, and a
`text_offset` counts whole characters only (the three tokens of one 3-byte character all start where it starts).

Each token's text is found by decoding it after the WINDOW tokens before it, not its whole prefix: a 6000-token
echo with logprobs decoded every prefix (quadratic: 6.5 s at 8k tokens, on the server's event loop).
"""
from __future__ import annotations

import os

from ..engine import GenerationResult
from ..engine.prompts import decode_text

try:  # GPT-2's byte <-> printable-character table, which byte-level BPE vocabularies (Qwen, Llama 3) are written in
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    _BYTE_OF = {ch: b for b, ch in bytes_to_unicode().items()}
except ImportError:  # another transformers layout: bytes from the decoded text (exact for whole characters)
    _BYTE_OF = {}

MAX_COMPLETION_TOP, MAX_CHAT_TOP = 5, 20  # OpenAI's limits on completions' logprobs and chat's top_logprobs
# tokens decoded before each new one: a character's bytes (at most 4 tokens) and a SentencePiece decoder's rule for
# the first token's leading space both lie within it, so the new token changes the text's length as in its prefix
WINDOW = 8


def grown(tokenizer, ids: list[int], i: int, length: int, skip_special_tokens: bool = False) -> tuple[int, int]:
    """(len(decode(ids[:i + 1])), where token i starts in that text), given `length` = len(decode(ids[:i])); decoding
    at most WINDOW + 1 tokens.

    A token starts at the first character its decoding changes: where a half character it completes starts, or
    after a U+FFFD that stays one (invalid bytes: taking every trailing U+FFFD for a half character put the next
    token one character early). A token that changes nothing shown continues the half character shown last (one
    U+FFFD), and starts where it does: token i - 1 may hold whole characters before it (Qwen's " \xf0\x9f" of
    " 🍉", whose next token was given the space's offset); or it has no text (a special token skipped), and then
    starts at the end."""
    lo = max(0, i - WINDOW)
    before = decode_text(tokenizer, ids[lo:i], skip_special_tokens)
    after = decode_text(tokenizer, ids[lo:i + 1], skip_special_tokens)
    at = length - len(before)  # where the window's text starts
    if after == before:
        own = decode_text(tokenizer, ids[i:i + 1], skip_special_tokens)
        return length, at + len(after) - 1 if own and after.endswith("\ufffd") else length
    return at + len(after), at + len(os.path.commonprefix([before, after]))


class Logprobs:
    """One response's logprobs, handed out as its text is shown (`take`)."""

    def __init__(self, tokenizer, chat: bool, base: int = 0):
        self.tokenizer, self.chat, self.base = tokenizer, chat, base  # base: an echoed prompt's characters
        self.sent = 0  # tokens whose entries have gone out
        self.length = 0  # len(decode(the tokens sent)), special tokens skipped
        self.given = False  # some entry has gone out (a response that asked for logprobs and has none gets [])
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel" and bool(_BYTE_OF)
        # chat's entries are its content's tokens: a special token (the end of the turn, Qwen's <|im_start|> and its
        # 18 other added special tokens, which all_special_ids leaves out) is no part of the content
        self.skip = special_ids(tokenizer) if chat else set()

    def take(self, result: GenerationResult, shown: str, last: bool = False) -> dict | None:
        """The entries of the tokens not yet sent whose text lies within `shown` (the text the client has), in
        OpenAI's shape; None when there are none. The `last` take also sends a token that a stop string cuts
        through: the text shows its first characters (its entry never went out, and the tokens did not spell the
        text)."""
        ids, entries = result.token_ids, []
        while self.sent < len(ids):
            end, start = grown(self.tokenizer, ids, self.sent, self.length, skip_special_tokens=True)
            cut = end > len(shown)
            if cut and not (last and start < len(shown)):
                break
            if ids[self.sent] not in self.skip:
                entries.append((result.logprobs[self.sent], self.base + start))
            self.sent, self.length = self.sent + 1, end
            if cut:
                break
        return self._shape(entries) if entries else None

    def empty(self) -> dict:
        """The shape with no entries: a response that asked for logprobs and shows no token (cut by a stop string
        at once) gets empty lists, not null, which clients read as "none were asked for"."""
        return self._shape([])

    def _shape(self, entries) -> dict:
        self.given = self.given or bool(entries)
        return self._chat(entries) if self.chat else self._completion(entries)

    def prompt(self, result: GenerationResult, text: str) -> dict:
        """An echoed prompt's entries (completions' shape): its first token has no logprob (null, as OpenAI's).
        Offsets index `text`, the echoed prompt: a token the tokenizer put in front of it (a BOS token, whose text
        `<s>` the client never sees) starts at 0 and moves no later token."""
        ids = [lp.token for lp in result.prompt_logprobs]
        length, starts = 0, []  # starts[i]: where token i starts in decode(ids)
        for i in range(len(ids)):
            length, start = grown(self.tokenizer, ids, i, length)
            starts.append(start)
        self.given = True
        if decode_text(self.tokenizer, ids, False).endswith(text):
            lead = length - len(text)  # the characters of the tokens the tokenizer put in front
            return self._completion(list(zip(result.prompt_logprobs, [max(0, start - lead) for start in starts])))
        return self._completion(list(zip(result.prompt_logprobs, self._mapped(ids, text) or starts)))

    def _mapped(self, ids: list[int], text: str) -> list[int] | None:
        """Where each token of a prompt that its decoding does not spell back starts in `text`, as the tokenizer's
        offset mapping says (Qwen's normalizes "e" + U+0301 to "é": offsets on the decoding pointed at other
        characters); tokens put in front start at 0. None where the tokenizer keeps no offsets or encodes `text`
        to other ids (a prompt sent as token ids)."""
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, TypeError, ValueError):
            return None
        own = list(enc["input_ids"])
        if not own or ids[len(ids) - len(own):] != own:
            return None
        return [0] * (len(ids) - len(own)) + [start for start, _ in enc["offset_mapping"]]

    def _chat(self, entries) -> dict:
        return {"content": [{**self._token(lp.token, lp.logprob),
                             "top_logprobs": [self._token(t, v) for t, v in lp.top]} for lp, _ in entries],
                "refusal": None}

    def _completion(self, entries) -> dict:
        return {"tokens": [self.key(lp.token) for lp, _ in entries],
                "token_logprobs": [lp.logprob for lp, _ in entries],
                "top_logprobs": [self._top(lp.top) if lp.logprob is not None else None for lp, _ in entries],
                "text_offset": [offset for _, offset in entries]}

    def _top(self, top) -> dict[str, float]:
        """Completions' alternatives by text; where two tokens' texts are one (OpenAI has the same), the likelier's
        value stays."""
        out: dict[str, float] = {}
        for token, value in top:
            out.setdefault(self.key(token), value)
        return out

    def _token(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self.bytes(token))}

    def text(self, token: int) -> str:
        return decode_text(self.tokenizer, [token], False)

    def key(self, token: int) -> str:
        """Completions' name for a token: its text, or `bytes:\\xNN...` where it holds part of a character."""
        text = self.text(token)
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.bytes(token)) if "\ufffd" in text else text

    def bytes(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token) if self.byte_level else None
        if piece is not None and all(ch in _BYTE_OF for ch in piece):
            return bytes(_BYTE_OF[ch] for ch in piece)
        return self.text(token).encode("utf-8")


def special_ids(tokenizer) -> set[int]:
    """The ids `decode(skip_special_tokens=True)` leaves out: the named special tokens and every added token marked
    special (Qwen2.5-Coder: 20 ids, where all_special_ids names 2)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    marked = {i for i, token in added.items() if getattr(token, "special", False)}
    return set(getattr(tokenizer, "all_special_ids", ())) | marked
