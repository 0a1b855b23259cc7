"""The overlap of a pair at any sampling settings, from each position's likely tokens: no model forward per setting.

auto starts its first child's acceptance at T > 0 from the pair's teacher-forced overlap sum_y min(p, q) at the
request's sampling settings (drafting/auto/policy.py). Measured directly, every new setting ran both models over the
reference texts: ~4 s for the default pair (Zen 4), and in the server, where each request's decoder is made beside
the running requests, three requests with a new temperature took 14.8 s against 1.2 s once it was cached (their
measurements ran at once, each fighting the others' and the scheduler's threads; server/scheduler.py now keeps them
apart). The table is measured once per pair, in the same pass as the greedy agreement (tuning/agreement.py).
"""
from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch

from ..core.sampling import SamplingConfig

# Each model's top tokens a position keeps in a LogitTable. Measured on the default pair (reference texts, 447
# positions, Zen 4, 2026-11-27): the table's overlap is within 0.0012 (K = 64) / 0.0008 (K = 128) of measure_overlap's
# at T = 0.7 and 1.0 and at top_p 0.9 or top_k 40, and 0.023 above it at T = 1.5, where the tokens past both top Ks
# carry mass that the table leaves out (it renormalizes over the tokens it keeps).
TABLE_K = 128


@dataclass(frozen=True)
class LogitTable:
    """Both models' logits at each position's likely tokens, teacher-forced: the union of the target's and the
    draft's top TABLE_K ids, a repeated id at -inf in both. The overlap at any sampling settings comes from it in
    milliseconds, where measuring it took both models' forwards over the reference texts (~4 s for the default
    pair): a server whose clients send a new temperature no longer stalls on it (docs/serve.md)."""

    target: torch.Tensor  # (positions, 2K) float32
    draft: torch.Tensor  # (positions, 2K) float32

    @classmethod
    def of(cls, target_logits: torch.Tensor, draft_logits: torch.Tensor, k: int = TABLE_K) -> LogitTable:
        """The table of one text's full logits, each (positions, vocab)."""
        k = min(k, target_logits.shape[-1])
        ids = torch.cat([target_logits.topk(k, -1).indices, draft_logits.topk(k, -1).indices], -1)  # (P, 2k)
        ordered, order = ids.sort(-1)
        repeated = torch.zeros_like(ids, dtype=torch.bool)
        repeated.scatter_(-1, order[:, 1:], ordered[:, 1:] == ordered[:, :-1])  # each id's second column
        return cls(target_logits.gather(-1, ids).float().masked_fill(repeated, float("-inf")),
                   draft_logits.gather(-1, ids).float().masked_fill(repeated, float("-inf")))

    @classmethod
    def join(cls, tables: list[LogitTable]) -> LogitTable:
        return cls(torch.cat([t.target for t in tables]), torch.cat([t.draft for t in tables]))

    def overlap(self, sampling: SamplingConfig, draft_sampling: SamplingConfig | None = None) -> float:
        """measure_overlap's mean sum_y min(p, q), over the tokens the table keeps."""
        if not len(self.target):
            raise ValueError("no text to measure overlap on")
        p, q = sampling.probs(self.target), (draft_sampling or sampling).probs(self.draft)
        return float(torch.minimum(p, q).sum(-1).double().mean())

    def to_record(self) -> dict:
        return {"shape": list(self.target.shape), "target": _b64(self.target), "draft": _b64(self.draft)}

    @classmethod
    def from_record(cls, record: dict) -> LogitTable:
        shape = tuple(record["shape"])
        return cls(_unb64(record["target"], shape), _unb64(record["draft"], shape))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().astype("<f4").tobytes()).decode()


def _unb64(text: str, shape: tuple) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype="<f4").reshape(shape).copy())
