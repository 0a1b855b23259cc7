"""Top-p (nucleus) cut: which tokens fall outside the smallest set of most likely tokens whose mass reaches top_p.

The rule is transformers' (`TopPLogitsWarper`): sort a row's logits ascending, drop every token whose cumulative mass
from the bottom is <= 1 - top_p, always keep the most likely one. `sorted_cut` is that rule as written: the
reference, and what a vocabulary under SORT_BELOW tokens gets.

Why a second path: with the whole sort a top-p warp cost 12-14 ms a row over the 152k tokens of the Qwen pair (one
thread, Intel Xeon host, 2026-11-29), a fifth of a target token's forward, and at top_p < 1 every verified and every
drafted row paid it; with this one 1.9-2.7 ms (`python benchmarks/top_p.py`), and the default pair on native at T = 1,
top_p 0.9 decoded 9.7-11.2 -> 12.7-14.3 tokens/s plainly (`ar`) and 11.2-12.6 -> 17.8-19.6 with `auto`. Only the order
near the cut matters, so `nucleus_cut` counts each row's mass in BUCKETS even logit buckets (a few passes over the row),
finds the bucket the cut falls in and sorts that bucket alone (1 to ~100 tokens on the 0.5B draft's logits). Its sums
are float64 where the reference's are float32 (which part from exact ones by up to 8.3e-7, measured on the draft's
logits at T = 3), so a token whose cumulative mass lies that close to 1 - top_p could fall on the other side; on 63 rows
of the draft's logits at T 0.7-1.3 and top_p 0.8-0.99 (756 cuts) no token did. A cut between two tied logits goes to the
reference: torch's sort (not a stable one) orders ties.
"""
from __future__ import annotations

import math

import torch

BUCKETS = 4096  # logit buckets a row's mass is counted in; the cut's bucket is sorted (1-100 tokens on the Qwen draft)
SPAN = 64.0  # the buckets cover the top SPAN logits: lower ones hold < 1e-22 of a row together (e^-64 x 152k)
SORT_BELOW = 4096  # a smaller vocabulary is sorted whole: a row took 83 vs 472 us at 1024 tokens, 517 vs 367 at 4096


def nucleus_cut(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """(..., vocab) bool, True where a token is outside the top-p nucleus of its row's softmax(logits)."""
    vocab = logits.shape[-1]
    if vocab < SORT_BELOW:
        return sorted_cut(logits, top_p)
    rows = logits.reshape(-1, vocab)  # (n, vocab)
    drop = torch.empty(rows.shape, dtype=torch.bool)
    for i, row in enumerate(rows):  # one row at a time: its passes stay in the cache (a (n, vocab) pass did not)
        cut = _bucketed_cut(row, top_p)
        drop[i] = sorted_cut(row, top_p) if cut is None else cut
    return drop.reshape(logits.shape)


def _bucketed_cut(row: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """`nucleus_cut` of one row (vocab,) by its buckets, or None where the reference must decide (module doc)."""
    lo, hi = (float(v) for v in torch.aminmax(row))
    if math.isnan(lo) or not math.isfinite(hi):
        return None  # NaN or inf logits (the backends refuse them first): the reference says what it says
    lo = max(lo, hi - SPAN)  # (top-k's -inf, and every logit SPAN below the top, go to bucket 0)
    weight = (row - hi).exp_().double()  # (vocab,) the softmax before it is divided by its sum (`total`)
    bucket = torch.sub(row, lo).mul_((BUCKETS - 1) / max(hi - lo, 1e-30)).clamp_(0, BUCKETS - 1).to(torch.int32)
    mass = torch.bincount(bucket, weights=weight, minlength=BUCKETS)  # (BUCKETS,): ascending logits, ties together
    total = float(mass.sum())
    mass /= total
    under = mass.cumsum(dim=0) - mass  # the mass of the buckets below each
    top = int(mass.nonzero()[-1])  # the top token's bucket (its float32 arithmetic may not reach BUCKETS - 1)
    cut = min(int(((under + mass) <= 1 - top_p).sum()), top)  # the bucket of the first kept token
    band = (bucket == cut).nonzero().flatten()
    kept = _cut_among(row[band], weight[band] / total, float(under[cut]), top_p, top=cut == top)
    if kept is None:
        return None
    drop = bucket <= cut  # below the cut's bucket: dropped; above it: kept; in it: as `_cut_among` says
    drop[band[kept]] = False
    return drop


def _cut_among(logits: torch.Tensor, probs: torch.Tensor, under: float, top_p: float, top: bool) -> torch.Tensor | None:
    """The positions (m,) of the band's tokens that the rule keeps, their cumulative mass starting at `under` (what
    the tokens below hold); `top`: the band holds the most likely token, which is always kept. None where the cut
    falls between two tied logits: then the reference's sort order decides."""
    order = torch.argsort(logits)  # ascending, as the reference sorts
    cum = under + probs[order].cumsum(dim=0)  # (m,) float64
    first = int((cum <= 1 - top_p).sum())  # the first kept: the drops are a prefix
    if top:
        first = min(first, len(order) - 1)
    if 0 < first < len(order) and bool(logits[order[first - 1]] == logits[order[first]]):
        return None
    return order[first:]


def sorted_cut(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: transformers' rule over the whole sorted row (module docstring)."""
    sorted_logits, idx = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= 1 - top_p  # the low tail whose mass stays below 1 - top_p
    drop_sorted[..., -1] = False  # always keep the most likely token
    return drop_sorted.scatter(-1, idx, drop_sorted)
