"""How often the draft's greedy choice is the target's: top-1 agreement and top-k coverage, teacher-forced.

One chain forward of each model over each reference text, through its own sessions (so any backend: transformers,
llama.cpp, native, lean variants), compares the draft's ranking with the target's argmax at every position. The
auto policy starts from it (a pair's first tree is judged by this evidence, not a generic prior) and the draft
variant choice scores every variant by it (tuning/draft_choice.py). The same pass keeps both models' likely logits
(logit_table.py), from which the overlap sum_y min(p, q) that auto starts from at T > 0 comes at any sampling
settings without running the models again.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..backends import make_session
from ..backends.model_info import context_window
from ..core.disk_cache import keep_record, read_record, record_path
from ..core.sampling import SamplingConfig
from ..core.tree import TokenTree
from .costs import measured_role, profile_key
from .logit_table import TABLE_K, LogitTable
from .reference_texts import reference_texts


@dataclass(frozen=True)
class Agreement:
    top1: float  # fraction of positions where the draft's argmax is the target's
    cover: float  # fraction where the target's argmax is among the draft's `k` most likely tokens
    positions: int


def reference_ids(tokenizer) -> list[list[int]]:
    """The reference texts (reference_texts.py) as token-id lists."""
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in reference_texts()]


def next_token_logits(model, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, vocab): the model's logits for the token after each proper prefix of `ids` (one chain
    forward through a fresh session of its own backend)."""
    chain = TokenTree.from_parents(ids, [-1] + list(range(len(ids) - 1)))
    return make_session(model, measured_role(model)).forward(list(ids[:1]), chain, list(range(len(ids))))[:-1]


def fitting(texts: list[list[int]], *models) -> list[list[int]]:
    """`texts` cut to the smallest context window of `models` (at most 4096 tokens), those of 2+ tokens only."""
    room = min([4096, *(context_window(m) for m in models)])
    return [list(ids[:room]) for ids in texts if len(ids[:room]) >= 2]


def target_choices(target, texts: list[list[int]]) -> list[torch.Tensor]:
    """The target's argmax after each prefix of each text: [(positions,)] (computed once, compared with many
    drafts by `agreement_with`)."""
    return [next_token_logits(target, ids).float().argmax(-1) for ids in texts]


def agreement_with(choices: list[torch.Tensor], draft, texts: list[list[int]], k: int = 4) -> Agreement:
    """`draft`'s agreement with the target `choices` (target_choices of the same `texts`)."""
    return _count(((want, next_token_logits(draft, ids).float()) for want, ids in zip(choices, texts)), k)


def _count(texts: Iterable[tuple[torch.Tensor, torch.Tensor]], k: int = 4) -> Agreement:
    """Agreement over texts given as (the target's choices (positions,), the draft's logits (positions, vocab)),
    one text at a time (a text's logits: ~100 MB for 150k-token vocabularies)."""
    hits = cover = total = 0
    for want, logits in texts:
        top = logits.topk(k, dim=-1).indices  # (positions, k)
        hits += int((top[:, 0] == want).sum())
        cover += int((top == want[:, None]).any(-1).sum())
        total += len(want)
    if not total:
        raise ValueError("no text to measure agreement on")
    return Agreement(hits / total, cover / total, total)


def measure_agreement(target, draft, texts: list[list[int]], k: int = 4) -> Agreement:
    """Greedy agreement of `draft` with `target` on `texts` (token-id lists), teacher-forced."""
    texts = fitting(texts, target, draft)
    return agreement_with(target_choices(target, texts), draft, texts, k)


def pair_agreement(target, draft, tokenizer, refresh: bool = False) -> tuple[float, str]:
    """(agreement, source): the greedy agreement on the reference texts (reference_texts.py), cached per pair like the
    cost profiles ('cache' or 'measured': `measure_pair`, which gives the overlap's LogitTable too)."""
    cached = None if refresh else read_record("agreement", _pair_key(target, draft))
    table = record_path("logit-table", _table_key(target, draft))
    saved = cached.get("agreement") if isinstance(cached, dict) else None
    if isinstance(saved, float) and 0 <= saved <= 1 and table.exists():  # a NaN, 7.5 or -3 in a damaged record
        return saved, "cache"  # was a ZeroDivisionError in auto, or kept as a "probability" in its calibration
    # measured, or an agreement from before the table: both now, so that a request at T > 0 finds the table (the
    # server's warm-up at its default temperature runs this)
    agreement, _ = _measure_and_save(target, draft, tokenizer)
    return agreement.top1, "measured"


def _pair_key(target, draft) -> dict:
    return {"target": profile_key(target), "draft": profile_key(draft), "texts": "reference-v1"}


def _table_key(target, draft) -> dict:
    return _pair_key(target, draft) | {"table_k": TABLE_K}


def _measure_and_save(target, draft, tokenizer) -> tuple[Agreement, LogitTable]:
    """`measure_pair` on the reference texts, both records written (a read-only cache: neither, and no error)."""
    with torch.inference_mode():
        agreement, table = measure_pair(target, draft, reference_ids(tokenizer))
    keep_record("agreement", _pair_key(target, draft), {"agreement": agreement.top1, "positions": agreement.positions})
    keep_record("logit-table", _table_key(target, draft), table.to_record())
    return agreement, table


def measure_overlap(target, draft, texts: list[list[int]], sampling: SamplingConfig,
                    draft_sampling: SamplingConfig | None = None) -> float:
    """Mean over the positions of `texts` of sum_y min(p(y), q(y)), p and q the target's and the draft's next-token
    distributions warped by `sampling` (the draft's by `draft_sampling`, default the same), teacher-forced: the
    probability that speculative sampling accepts one drafted token, the root's first child at T > 0. One text at a
    time (a text's two (positions, vocab) tables: ~100 MB for 150k-token vocabularies)."""
    texts = fitting(texts, target, draft)
    total, positions = 0.0, 0
    for ids in texts:
        p = sampling.probs(next_token_logits(target, ids).float())
        q = (draft_sampling or sampling).probs(next_token_logits(draft, ids).float())
        total += float(torch.minimum(p, q).sum(-1).double().sum())
        positions += p.shape[0]
    if not positions:
        raise ValueError("no text to measure overlap on")
    return total / positions


def measure_pair(target, draft, texts: list[list[int]]) -> tuple[Agreement, LogitTable]:
    """One teacher-forced pass of both models over `texts`: the greedy agreement (measure_agreement's, k = 4) and the
    LogitTable that the overlap at any sampling settings comes from (logit_table.py)."""
    tables = []

    def both(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # a text's table kept on the way
        p, q = next_token_logits(target, ids).float(), next_token_logits(draft, ids).float()  # (positions, vocab)
        tables.append(LogitTable.of(p, q))
        return p.argmax(-1), q

    agreement = _count(both(ids) for ids in fitting(texts, target, draft))
    return agreement, LogitTable.join(tables)


def pair_table(target, draft, tokenizer, refresh: bool = False) -> tuple[LogitTable, str]:
    """(table, source): the pair's LogitTable on the reference texts, cached per pair ('cache' or 'measured'; a
    measurement writes the pair's agreement record too)."""
    path = record_path("logit-table", _table_key(target, draft))
    if not refresh and path in _TABLES:
        return _TABLES[path], "cache"
    cached = None if refresh else read_record("logit-table", _table_key(target, draft))
    if cached is not None:
        try:
            _TABLES[path] = LogitTable.from_record(cached)
            return _TABLES[path], "cache"
        except (KeyError, TypeError, ValueError):
            pass  # a damaged record: measure again
    _TABLES[path] = _measure_and_save(target, draft, tokenizer)[1]
    return _TABLES[path], "measured"


# the tables this process has read or measured, by record path: the server makes a decoder per request, and at T > 0
# each read the 1.2 MB record again (16-25 ms for the default pair, Zen 4, with the scheduler's lock held)
_TABLES: dict = {}


def pair_overlap(target, draft, tokenizer, sampling: SamplingConfig, draft_sampling: SamplingConfig,
                 refresh: bool = False) -> tuple[float, str]:
    """(overlap, source): the overlap at these sampling settings from the pair's LogitTable (`pair_table`: measured
    once per pair, at any settings; 'cache' or 'measured')."""
    table, source = pair_table(target, draft, tokenizer, refresh)
    return table.overlap(sampling, draft_sampling), source
