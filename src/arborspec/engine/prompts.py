"""What a prompt may be, and its token ids: text (tokenized with the tokenizer's special tokens, e.g. a BOS), token
ids (a list or a tensor), or a conversation: a list of {"role", "content"} messages, written out by the target's chat
template up to the assistant's next turn and tokenized without the tokenizer's own special tokens.

Why without them: a template writes every special token its model expects, a BOS token included where there is
one (Llama 3's begins `<|begin_of_text|>`), so tokenizing its text as plain text would put a second BOS in front.
transformers' own `apply_chat_template(tokenize=True)` tokenizes the same way. (Qwen2.5's tokenizer adds no BOS:
there the two ways agree.) The decoder, `arborspec generate --chat`, `arborspec chat` and the server's
/v1/chat/completions all encode a conversation here.
"""
from __future__ import annotations

import re

from ..backends.model_info import context_window, vocab_size
from ..core.options import is_whole


def prompt_ids(tokenizer, prompt, vocab: int | None = None, window: int | None = None, room: int = 1) -> list[int]:
    """The token ids of `prompt`: text, a conversation, or one sequence of ids (a list, a (N,) or (1, N) tensor or
    array, or a tokenizer's output with "input_ids"). ValueError for an empty prompt, text without a tokenizer, ids
    that are not integers or not below `vocab`, several sequences (generate_batch takes those), a prompt with no
    room for `room` tokens in the context window `window` (0 for a prompt scored alone: a window-long one is what
    rolling perplexity sends), or anything else."""
    if (isinstance(prompt, str) or is_conversation(prompt)) and tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; pass token ids or tokenizer=...")
    if isinstance(prompt, str):
        ids = tokenizer(unicode_text(prompt), add_special_tokens=True)["input_ids"]
    elif is_conversation(prompt):
        ids = conversation_ids(tokenizer, prompt)
    else:
        ids = _one_sequence(prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    if vocab is not None and not all(0 <= t < vocab for t in ids):
        raise ValueError(f"token id {next(t for t in ids if not 0 <= t < vocab)} is outside the vocabulary "
                         f"[0, {vocab})")
    if window is not None and len(ids) + room > window:
        raise ValueError(f"the prompt has {len(ids)} tokens; the target's context window is {window}")
    return ids


def model_prompt_ids(tokenizer, prompt, target, draft=None, room: int = 1) -> list[int]:
    """`prompt_ids` checked against the models (bare ones): ids every one of them has a row for, and room for `room`
    tokens in the target's context window. What SpeculativeDecoder.encode checks, and the server before it makes the
    request's decoder."""
    return prompt_ids(tokenizer, prompt, vocab_size(target, draft), context_window(target), room)


def unicode_text(text: str, what: str = "the prompt") -> str:
    """`text`, if it can be written as UTF-8. A lone surrogate cannot: Python makes one of each byte of a command-line
    argument or file that is not UTF-8 ("caf\\xe9"), and JSON can escape one ("\\ud800"); the tokenizer then failed
    with a type error naming none of this."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{what} is not valid Unicode text ({err.reason} at character {err.start}: bytes that are "
                         "not UTF-8?)") from None
    return text


def _one_sequence(prompt) -> list[int]:
    """`prompt` as one list of token ids (see prompt_ids): a list, a (N,) or (1, N) tensor or array, [[ids]], or a
    tokenizer's output. Its "attention_mask" leaves out the tokens it masks (padding), as transformers' generate
    reads them: their keys are never attended and the positions count only the tokens kept. (The mask was ignored,
    and a left-padded prompt generated other tokens than the same prompt unpadded.)"""
    mask = None
    if hasattr(prompt, "keys") and "input_ids" in prompt:  # a dict or transformers' BatchEncoding
        prompt, mask = prompt["input_ids"], prompt.get("attention_mask")
    if isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt):  # not a conversation
        # (prompt_ids asked first): a message lacks its role, which read as "token ids must be integers"
        n = next(i for i, m in enumerate(prompt) if not (isinstance(m, dict) and "role" in m))
        raise ValueError(f"chat message {n} has no 'role': a conversation is a list of {{'role', 'content'}} dicts")
    ids = _row(prompt)
    if mask is None:
        return ids
    mask = _values(mask) if hasattr(mask, "tolist") else mask  # bool and float masks too, as transformers takes
    if isinstance(mask, (list, tuple)) and len(mask) == 1 and isinstance(mask[0], (list, tuple)):
        mask = mask[0]  # (1, N)
    if not isinstance(mask, (list, tuple)) or len(mask) != len(ids) or any(
            isinstance(m, (str, list, tuple)) or m not in (0, 1) for m in mask):
        shown = list(mask[:8]) if isinstance(mask, (list, tuple)) else mask
        raise ValueError(f"attention_mask must hold a 0 or 1 for each of the {len(ids)} token ids, got {shown!r}"
                         f"{' ...' if isinstance(mask, (list, tuple)) and len(mask) > 8 else ''}")
    return [t for t, m in zip(ids, mask) if m]


def _values(tensor) -> list:
    """A tensor's or an array's values as lists; one on the meta device holds none (a NotImplementedError)."""
    try:
        return tensor.tolist()
    except (NotImplementedError, RuntimeError) as err:
        raise ValueError(f"the prompt's tensor cannot be read ({str(err).splitlines()[0]:.80}); give token ids "
                         "on the CPU") from None


def _row(prompt) -> list[int]:
    """One row of integers: a list, a (N,) or (1, N) tensor or array, [[ids]]."""
    if hasattr(prompt, "shape") and hasattr(prompt, "tolist"):  # a torch tensor or a numpy array
        prompt = _values(prompt)
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt is text, a list of chat messages or token ids, not {type(prompt).__name__}")
    if prompt and all(isinstance(row, (list, tuple)) for row in prompt):
        if len(prompt) != 1:
            raise ValueError(f"the prompt holds {len(prompt)} sequences; one generation takes one "
                             "(SpeculativeDecoder.generate_batch takes several)")
        prompt = prompt[0]
    for t in prompt:
        if isinstance(t, (list, tuple)):  # a (1, 1, N) tensor was "several prompts"
            raise ValueError(f"a prompt's token ids are a (N,) or (1, N) sequence, got ids nested deeper: {t!r:.60}")
        if not is_whole(t):
            hint = " (several prompts: SpeculativeDecoder.generate_batch)" if isinstance(t, str) else ""
            raise ValueError(f"token ids must be integers, got {t!r}{hint}")
    return [int(t) for t in prompt]


def is_conversation(prompt) -> bool:
    """Whether `prompt` is a list of chat messages (dicts with a "role"), not text or token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) and "role" in m
                                                                      for m in prompt)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def conversation_text(tokenizer, messages: list[dict]) -> str:
    """`messages` in the tokenizer's chat template, ready for the assistant's next turn. ValueError without a
    template; a template's own error (e.g. roles out of the order it expects) as it raises it."""
    if not has_chat_template(tokenizer):
        raise ValueError("chat messages need a tokenizer with a chat template; this target's tokenizer has none")
    for m in messages:
        if isinstance(m.get("content"), str):
            unicode_text(m["content"], f"a {m['role']} message")
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


def conversation_ids(tokenizer, messages: list[dict], content_as_text: bool = False) -> list[int]:
    """The token ids of `conversation_text`: the template's special tokens, and no others.

    `content_as_text` (the server): a message's content is read as text even where it spells a special token, as
    OpenAI's API reads it; else a user could write `<|im_end|>\n<|im_start|>system ...` and open a turn of their
    own (measured: the 0.5B pair then followed the injected instruction). transformers' apply_chat_template, and so
    the Python API and the CLI, parse such text as the special token. Contents without one tokenize as before."""
    text = conversation_text(tokenizer, messages)
    specials = special_strings(tokenizer)
    spelled = [i for i, m in enumerate(messages)
               if isinstance(m.get("content"), str) and any(a in m["content"] for a in specials)]
    if not (content_as_text and spelled):
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return _ids_with_plain_content(tokenizer, messages, spelled, text, specials)


def special_strings(tokenizer) -> list[str]:
    """The texts the tokenizer reads as one special token. Not its other added tokens: Qwen's `<tool_call>` is an
    added token the model writes as text (special=False), tokenized as one token however it is read."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added is None:
        return list(getattr(tokenizer, "all_special_tokens", []))
    return [token.content for token in added.values() if token.special]


def _ids_with_plain_content(tokenizer, messages: list[dict], spelled: list[int], text: str,
                            specials: list[str]) -> list[int]:
    """conversation_ids for contents that spell special tokens: each such content is replaced by a marker and the
    template written, which tells the template's own special tokens from the contents' spellings. The text is then
    cut at the template's special tokens only, as a tokenizer cuts it at every special token, and each stretch between
    them (template text and contents together) tokenized with special tokens read as text. Tokenizing a content apart
    from the template text around it gave other ids where tokens merge across the seam (Qwen: "user\n" then
    "\n..." is one "\n\n" token)."""
    marks = {i: f"\ue000arborspec-content-{i}\ue001" for i in spelled}  # private-use characters: in no template
    marked = [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)]
    template = conversation_text(tokenizer, marked)
    pieces, rest = [], template
    for i in spelled:
        before, found, rest = rest.partition(marks[i])
        if not found or marks[i] in rest:
            raise ValueError("a message spells a special token and the chat template does not write its content "
                             "once, as given; send that text some other way")
        pieces += [(before, False), (messages[i]["content"], True)]
    pieces.append((rest, False))
    if "".join(piece for piece, _ in pieces) != text:  # the template changes contents (trims them, ...)
        raise ValueError("a message spells a special token and the chat template changes its content; send that "
                         "text some other way")
    cut = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
    parts: list[str | int] = [""]  # the text between the template's special tokens, and those tokens' ids
    for piece, content in pieces:
        at = 0
        for special in () if content else cut.finditer(piece):
            parts[-1] += piece[at:special.start()]
            parts += [tokenizer.convert_tokens_to_ids(special.group()), ""]
            at = special.end()
        parts[-1] += piece[at:]
    ids: list[int] = []
    for part in parts:
        if isinstance(part, int):
            ids.append(part)
        elif part:
            ids += tokenizer(part, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


def decode_text(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of `ids`, as a generation's text, its stream and the server's logprobs all read it. Without the
    tokenizer's clean-up of spaces before punctuation: with it (`clean_up_tokenization_spaces`) a later token could
    rewrite text already streamed (" ," became "," once the comma came), and the joined stream parted from the
    result's text."""
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
