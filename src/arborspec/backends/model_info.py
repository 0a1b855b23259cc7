"""What arborspec reads off a model object, whatever its backend: its tokenizer, its context window, its
end-of-sequence ids, and whether a draft can serve a target.

Only `model.config` (vocab_size, max_position_embeddings or GPT-2's n_positions) and `model.generation_config`
(eos_token_id) are read, so a model object that is not a torch module (e.g. a llama.cpp model offering a
`types.SimpleNamespace` config) works as well as a transformers one.
"""
from __future__ import annotations

import warnings
import weakref

NO_LIMIT = 2**31  # the context window of a model whose config names none


def model_and_tokenizer(model_or_loaded, tokenizer=None) -> tuple:
    """(model, tokenizer) of a LoadedModel, a (model, tokenizer) pair, or a bare model and `tokenizer`. TypeError for
    anything that is not a loaded model (a name or a path, as transformers users may pass: it failed deep inside)."""
    if type(model_or_loaded).__module__.startswith("llama_cpp"):  # its .model is a pointer: "got int" said nothing
        raise TypeError(f"expected a loaded model, got llama-cpp-python's {type(model_or_loaded).__name__}; load the "
                        "GGUF file with arborspec.load_model(path, backend='llamacpp') (or load_pair), which runs "
                        "it on llama.cpp with the tree sessions speculation needs")
    if hasattr(model_or_loaded, "model") and hasattr(model_or_loaded, "tokenizer"):
        model, tokenizer = model_or_loaded.model, model_or_loaded.tokenizer
    elif isinstance(model_or_loaded, tuple) and len(model_or_loaded) == 2:
        model, tokenizer = model_or_loaded
    else:
        model = model_or_loaded
    if not hasattr(model, "config") or isinstance(model, (str, bytes)):
        shown = f" {model!r}" if isinstance(model, (str, bytes)) else ""
        raise TypeError(f"expected a loaded model (arborspec.load_model / load_pair, a transformers model, or a "
                        f"(model, tokenizer) pair), got {type(model).__name__}{shown[:80]}; a name or path loads "
                        "with arborspec.load_model(name)")
    if tokenizer is not None and (isinstance(tokenizer, (str, bytes)) or not callable(tokenizer)):
        shown = f" {tokenizer!r}"[:80] if isinstance(tokenizer, (str, bytes)) else ""  # failed at the first generate
        raise TypeError(f"tokenizer must be a loaded tokenizer (transformers.AutoTokenizer.from_pretrained(name)), "
                        f"got {type(tokenizer).__name__}{shown}")
    return model, tokenizer


def context_window(model, default: int = NO_LIMIT) -> int:
    """The longest sequence `model` takes: max_position_embeddings, or n_positions (GPT-2); `default` if neither.
    With longrope or dynamic RoPE (Phi-3's 128k models), the original length: past it those change every key's
    frequencies, so keys already cached go stale (Phi-3's own generate recomputes its cache there, a tree forward
    cannot), and a generation that ran on past it differed from the model's own from the next token on."""
    cfg = model.config
    window = int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or default)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("longrope", "dynamic"):
        original = rope.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings",
                                                                           None)
        if original:
            window = min(window, int(original))
    return window


def branch_limit(model) -> int | None:
    """How many leaves one forward's tree may have on `model`, None for no limit: llama.cpp's sessions give every
    branch a sequence id of their own, n_seq_max - 1 of them (backends/llamacpp.py); the other backends take any."""
    n_seq_max = getattr(model, "n_seq_max", None)
    return max(1, int(n_seq_max) - 1) if isinstance(n_seq_max, int) else None


def vocab_size(*models) -> int | None:
    """The fewest output rows among `models` (None entries skipped): the token ids every one of them can read (a
    prompt's ids must be below it); None when no model says."""
    sizes = [m.config.vocab_size for m in models if m is not None and getattr(m.config, "vocab_size", None)]
    return min(sizes) if sizes else None


def eos_ids(model, tokenizer) -> set[int]:
    """Every token id that ends generation, as transformers' generate reads them: the model's generation config's
    (one id or a list; instruction-tuned models often name several), else the tokenizer's EOS. (Both at once
    stopped at a tokenizer EOS the config leaves out, where generate goes on.)"""
    generation_config = getattr(model, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            return {value}
        if value:
            return {int(v) for v in value}
    return set()


def check_pair(target, draft, target_tokenizer, draft_tokenizer=None, names: str = "draft and target") -> None:
    """Raise ValueError unless `draft`'s token ids mean what `target`'s do.

    Speculative decoding hands token ids from the draft to the target, so (1) the two tokenizers, when both are given
    and are not the same object, must be identical: same vocabulary, same ids, same EOS; and (2) both models' output
    rows must cover the tokenizer (`vocab_size`; embedding tables padded past the tokenizer may differ between draft
    and target: the draft's logits are cut or padded to the target's width, session.VocabAligned). Either model may
    be None to check the tokenizers only.
    """
    if draft_tokenizer is not None and target_tokenizer is not None and draft_tokenizer is not target_tokenizer:
        _check_tokenizers(target_tokenizer, draft_tokenizer, names)
    if target is None or draft is None:
        return
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    n_tok = len(target_tokenizer) if target_tokenizer is not None else min(tv, dv)
    if min(tv, dv) < n_tok:
        raise ValueError(f"draft vocabulary ({dv}) and target vocabulary ({tv}) do not cover the tokenizer ({n_tok})")


def _check_tokenizers(t_tok, d_tok, names: str) -> None:
    needs = "speculative decoding needs a draft that shares the target's tokenizer"
    if len(d_tok) != len(t_tok):
        raise ValueError(f"{names} tokenizers differ (vocab {len(d_tok)} vs {len(t_tok)} tokens): {needs}")
    d_vocab, t_vocab = d_tok.get_vocab(), t_tok.get_vocab()
    if d_vocab != t_vocab:
        differing = sorted(set(d_vocab.items()) ^ set(t_vocab.items()), key=lambda item: item[1])
        example = ", ".join(f"{tok!r}->{idx}" for tok, idx in differing[:3])
        raise ValueError(
            f"{names} tokenizers differ ({len(differing)} token/id pairs not shared, e.g. {example}): {needs}")
    if d_tok.eos_token_id != t_tok.eos_token_id:
        raise ValueError(f"{names} tokenizers differ (eos_token_id {d_tok.eos_token_id} vs {t_tok.eos_token_id}): "
                         f"{needs}")


def pair_names(target, draft) -> str:
    """How error messages name a pair: by the specs they were loaded from (LoadedModel.name), '?' if unknown."""
    return f"draft {getattr(draft, 'name', '?')!r} and target {getattr(target, 'name', '?')!r}"


# transformers' logits processors a generation config may switch on, each with its neutral value: generate applies
# them to greedy decoding too, arborspec (every method, `ar` included) reads the raw logits
PROCESSOR_SETTINGS = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                      "min_new_tokens": 0, "min_length": 0, "suppress_tokens": None, "begin_suppress_tokens": None,
                      "bad_words_ids": None, "sequence_bias": None, "forced_bos_token_id": None,
                      "forced_eos_token_id": None}
_warned: weakref.WeakSet = weakref.WeakSet()  # models warned about (by identity, forgotten with them)


def _first_time(model) -> bool:
    """Whether `model` was not warned about yet (an object that takes no weak reference: every time). Not by id():
    a new model could get a freed one's id and go unwarned."""
    try:
        if model in _warned:
            return False
        _warned.add(model)
    except TypeError:
        pass
    return True


def warn_unapplied(model) -> None:
    """Warn once per model whose saved generation config switches on a logits processor (a checkpoint's
    repetition_penalty, min_new_tokens, suppress_tokens, ...): transformers' generate would apply it and its output
    would part from arborspec's, with no word of why."""
    config = getattr(model, "generation_config", None)
    found = [f"{name}={getattr(config, name)!r}" for name, neutral in PROCESSOR_SETTINGS.items()
             if getattr(config, name, neutral) not in (neutral, None, [], {})]
    if found and _first_time(model):
        warnings.warn(f"the model's generation config sets {', '.join(found)}; arborspec decodes from the raw "
                      "logits and does not apply it (transformers' generate would)", stacklevel=3)
