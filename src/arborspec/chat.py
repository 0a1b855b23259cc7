"""`arborspec chat`: a conversation with the target in the terminal, every answer decoded speculatively.

Each turn templates the whole conversation with the target's chat template and decodes the answer as `generate`
would (same method, verifier and sampling: the answer is the target's own, only faster). The decoder keeps each
finished answer's KV cache (engine/prefix_cache.py), so a turn prefills only what is new since the last answer, on
the target and on the draft: the conversation's earlier turns are not read again. On the default pair (Zen 4,
2026-11-27, benchmarks/chat_turns.py) a fourth turn's 575-token prompt reached its first token in 0.12 s, against
2.94-2.98 s read whole. (Only the native backend's caches can be kept exactly; elsewhere each turn reads it all.)
"""
from __future__ import annotations

import re
import signal
import sys
import threading
from collections.abc import Iterator

from .console import CliError, typed_text
from .engine import GenerationResult, SpeculativeDecoder
from .engine.prefix_cache import PrefixCache
from .engine.prompts import has_chat_template

KEPT_BYTES = 1 << 30  # the kept KV caches: the last turn's, per model (~57 KB a token for the 1.5B target in float32)
HELP = ('/reset starts a new conversation, /exit (or Ctrl-D) ends; Ctrl-C stops an answer; """ starts and ends a '
        'message of several lines')
QUOTE = '"""'


class Conversation:
    """The messages so far and the decoder that answers them."""

    def __init__(self, decoder: SpeculativeDecoder, system: str | None = None, max_new_tokens: int = 512,
                 seed: int | None = None):
        if not has_chat_template(decoder.tokenizer):
            raise ValueError("the target's tokenizer has no chat template: `arborspec generate` takes plain prompts")
        self.own_cache = decoder.prefix_cache is None  # the chat's alone: it keeps the last turn's caches only
        if self.own_cache:
            decoder.prefix_cache = PrefixCache(KEPT_BYTES)
        self.decoder, self.system, self.max_new_tokens, self.seed = decoder, system, max_new_tokens, seed
        self.messages: list[dict] = []
        self.last: GenerationResult | None = None  # the last finished answer's result (its statistics)
        self.reset()
        if system:  # checked once: a system message past the window (or not UTF-8) failed every turn, /reset or not
            decoder.encode(self.prompt("x"))  # with a user message: some templates write the system into its turn

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        if self.own_cache:
            self.decoder.prefix_cache.clear()

    @property
    def started(self) -> bool:
        """Whether the conversation holds an exchange (a /reset would shorten it)."""
        return len(self.messages) > bool(self.system)

    def prompt(self, text: str) -> list[dict]:
        """The conversation with `text` as the next user message: what the decoder reads, in the target's chat
        template (engine/prompts.py)."""
        return self.messages + [{"role": "user", "content": text}]

    def answer(self, text: str) -> Iterator[str]:
        """Stream the answer to user message `text`; the exchange joins the conversation once the answer ends, or
        with the text shown so far if the caller stops early (Ctrl-C). ValueError (nothing joins) for a conversation
        past the target's context window."""
        shown, self.last = "", None
        try:
            for chunk in self.decoder.stream(self.prompt(text), self.max_new_tokens, seed=self.seed):
                shown += chunk  # before the yield: a caller that stops here has been shown it
                yield chunk
            self.last = self.decoder.last_result
        finally:
            if shown or self.last is not None:
                self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": shown}]
            if self.own_cache:
                self.decoder.prefix_cache.keep_newest()


def describe(result: GenerationResult) -> str:
    """One line of a turn's figures: speed, tokens a step, first token, and the prompt read from the kept cache."""
    s = result.stats
    ended = {"length": "; the answer reached --max-new-tokens",
             "context": "; the conversation fills the context window: /reset"}.get(s.finish_reason, "")
    # one token has no time after the first, so no rate (it read "0.0 tokens/s")
    rate = f"{s.tokens_per_s:.1f} tokens/s, " if s.new_tokens > 1 else ""
    return (f"[{s.new_tokens} token{'s' * (s.new_tokens != 1)}, {rate}{s.tokens_per_step:.2f} tokens/step, first "
            f"token {s.t_first_token:.2f} s, prompt {s.prompt_tokens} tokens of which {s.cached_tokens} kept from the "
            f"last turn{ended}]")


def read_message() -> str:
    """The next message typed: one line, or the lines from one that starts with QUOTE to one that ends with it; after
    a bare QUOTE line, to the next bare QUOTE line (a paste of code, whose docstrings end with QUOTE). EOFError /
    KeyboardInterrupt as input() raises them. The prompts show on a terminal only: with the messages piped in,
    standard output holds the answers alone."""
    prompt = (lambda text: text) if sys.stdin.isatty() else (lambda text: "")
    text = typed_text(input(prompt("> ")), "the message").strip()
    if not text.startswith(QUOTE):
        return text
    lines = [text[len(QUOTE):]]
    # after a bare opening line only a bare closing line ends it: pasted code has docstrings ending in QUOTE
    bare = not lines[0].strip()
    while not (lines[-1].strip() == QUOTE if bare and len(lines) > 1 else lines[-1].rstrip().endswith(QUOTE)):
        try:
            lines.append(typed_text(input(prompt("... ")), "the message"))
        except EOFError:  # the input ended inside the message: what came is the message (it was dropped)
            return "\n".join(lines).strip()
    return "\n".join(lines).rstrip()[:-len(QUOTE)].rstrip().lstrip("\n")  # a first line's indent is kept


def run(conversation: Conversation, banner: str) -> int:
    """The terminal loop: a line in, the answer streamed out, its figures on stderr. Exit status 0 when the input
    ends (Ctrl-D, the end of a pipe) or at /exit; 130 at a Ctrl-C at the prompt, as every other command it stops."""
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    print(f"{banner}\n{HELP}", file=sys.stderr)
    while True:
        try:
            text = read_message()
        except (EOFError, KeyboardInterrupt) as end:
            if sys.stdin.isatty():  # ends the prompt's line
                print()
            return 130 if isinstance(end, KeyboardInterrupt) else 0
        except CliError as err:  # a line that is not UTF-8: the conversation goes on
            print(f"[{err}]", file=sys.stderr)
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            conversation.reset()
            print("[a new conversation]", file=sys.stderr)
            continue
        if not text:
            continue
        if re.fullmatch(r"/[a-z]+", text):  # a mistyped command is not a message
            print(f"[unknown command {text}; {HELP}]", file=sys.stderr)
            continue
        try:
            stopped = stream(conversation.answer(text))
        except ValueError as err:  # the conversation no longer fits the context window, or the message alone
            again = "; /reset starts a new conversation" if conversation.started else ""
            print(f"[{err}{again}]", file=sys.stderr)
            continue
        print()
        print("[stopped]" if stopped else describe(conversation.last), file=sys.stderr)


def stream(answer: Iterator[str]) -> bool:
    """Print `answer` as it comes; True if Ctrl-C stopped it. A first Ctrl-C stops it after the step in progress, so
    the decoder keeps what it committed (the next turn starts from it); a second one interrupts at once."""
    pressed = []

    def on_interrupt(signum, frame):
        if pressed:
            raise KeyboardInterrupt
        pressed.append(signum)

    main = threading.current_thread() is threading.main_thread()  # where Python lets a handler be set
    previous = signal.signal(signal.SIGINT, on_interrupt) if main else None
    try:
        for chunk in answer:
            print(chunk, end="", flush=True)
            if pressed:
                break
    except KeyboardInterrupt:
        pressed.append(signal.SIGINT)
    finally:
        answer.close()  # the text shown so far joins the conversation now, before the next turn
        if main:
            signal.signal(signal.SIGINT, previous)
    return bool(pressed)
