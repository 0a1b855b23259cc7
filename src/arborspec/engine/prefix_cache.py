"""Finished generations' KV caches, kept so that a later request that begins with the same tokens skips their prefill.

Why: a chat client sends the whole conversation with every turn, and each request prefilled all of it, on the target
and again on the draft: ~5 ms a token for the 1.5B target and ~1.5-2 ms for the 0.5B draft on 2 Zen 4 cores, so a
1000-token conversation waited ~5 s for every answer's first token however short the new turn. A request now starts
from a copy of the kept cache that shares the longest prefix with it, and prefills only the rest.

Exactness: only sessions that can copy and cut their cache (`fork`, `truncate`) and compute every row alone
(`rows_alone`: the native backend's, kernels/forward.cpp) are kept, so a key or value vector is the same bits whether
its token was prefilled in one call, in another request's prompt, or decoded: the output is the one a fresh session
gives (tests/test_prefix_cache.py). Other backends' sessions start fresh as before.

What is kept: the session of each generation that finished or was stopped between steps (a client that left, Ctrl-C
in `arborspec chat`): its committed tokens, prompt and answer, per model and role, most recently used last; an entry
whose tokens begin another's is dropped for it; the oldest go once the kept caches pass `max_bytes`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

MIN_REUSE = 16  # tokens in common below which a fresh session is as good (a copy of the cache costs its bytes)


@dataclass
class _Entry:
    model: object
    role: str
    tokens: list[int]  # the session's committed tokens when it was kept
    session: object

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.session.keys, self.session.values))


def can_keep(session) -> bool:
    """Whether `session` can start another request exactly: it copies and cuts its cache, and computes each row
    alone (`rows_alone`), so a kept key is the bits a fresh prefill would give (the native backend's)."""
    return getattr(session, "rows_alone", False) and callable(getattr(session, "fork", None)) and \
        callable(getattr(session, "truncate", None)) and hasattr(session, "keys") and hasattr(session, "values")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """The kept sessions, shared by every request's decoder (the server's); safe to call from any thread."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"the prefix cache's size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: list[_Entry] = []  # least recently used first
        self._lock = threading.Lock()
        self.hits = self.reused_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def start(self, model, role: str, context: list[int]):
        """A copy of the kept session of `model` in `role` that shares the longest prefix with `context` (at least
        MIN_REUSE tokens), cut to that prefix and never past context[:-1] (the next forward's root is context[-1]);
        None when none does."""
        with self._lock:
            best, length = None, 0
            for entry in self._entries:
                if entry.model is model and entry.role == role:
                    n = min(common_prefix(entry.tokens, context), len(context) - 1)
                    if n > length:
                        best, length = entry, n
            if best is None or length < MIN_REUSE:
                return None
            self._entries.remove(best)
            self._entries.append(best)  # most recently used
            session = best.session.fork()
            self.hits += 1
            self.reused_tokens += length
        session.truncate(length)
        return session

    def keep_newest(self) -> None:
        """Drop every entry but the newest of each model and role (a chat's cache: the last turn's; an answer whose
        text tokenizes otherwise in the next prompt left its entry behind, and a /reset every entry)."""
        with self._lock:
            newest = {(id(e.model), e.role): e for e in self._entries}
            self._entries = [e for e in self._entries if newest[(id(e.model), e.role)] is e]

    def clear(self) -> None:
        with self._lock:
            self._entries = []

    def keep(self, model, role: str, session) -> None:
        """Keep `session` (a generation's between steps: no tree open) for later requests; entries it extends go."""
        if self.max_bytes == 0 or not can_keep(session) or not session.cached:
            return
        entry = _Entry(model, role, list(session.cached), session)
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            self._entries = [e for e in self._entries if not (
                e.model is model and e.role == role and common_prefix(e.tokens, entry.tokens) == len(e.tokens))]
            self._entries.append(entry)
            total = self.nbytes
            while total > self.max_bytes:
                total -= self._entries.pop(0).nbytes
