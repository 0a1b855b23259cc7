"""The bucketed nucleus cut (core/top_p.py) against the whole sort it stands in for, on vocabularies large enough to
take it; tests/verify/test_warp.py holds both to transformers."""
import math

import pytest
import torch

from arborspec.core import top_p
from arborspec.core.top_p import BUCKETS, SORT_BELOW, nucleus_cut, sorted_cut

VOCAB = 3 * SORT_BELOW
TOP_PS = [1e-9, 0.05, 0.5, 0.8, 0.9, 0.95, 0.99, 1 - 1e-6]


def batches():
    gen = torch.Generator().manual_seed(0)
    for scale in (0.3, 1.0, 3.0, 10.0):
        yield f"normal x{scale}", torch.randn(8, VOCAB, generator=gen) * scale
    yield "ties", (torch.randn(8, VOCAB, generator=gen) * 4).round()  # whole numbers: many ties, some at the cut
    peaked = torch.randn(4, VOCAB, generator=gen)
    peaked[:, 11] += 25
    yield "one token holds the mass", peaked
    topk = torch.randn(4, VOCAB, generator=gen) * 2
    yield "top-k's -inf", topk.masked_fill(topk < topk.topk(40, dim=-1).values[:, -1:], -math.inf)
    wide = torch.randn(4, VOCAB, generator=gen) * 30  # a spread past SPAN: the lowest logits share bucket 0
    yield "wider than SPAN", wide
    # cumulative masses 0.125, 0.25, 0.5, 1 exactly: a cut on a sum, the same in float32 and float64
    exact = torch.full((1, VOCAB), -math.inf)
    exact[0, [5, 900, 1700, 2900]] = torch.log(torch.tensor([0.125, 0.125, 0.25, 0.5]))
    yield "cut on an exact sum", exact


@pytest.mark.parametrize("name,logits", list(batches()), ids=lambda x: x if isinstance(x, str) else "")
def test_the_bucketed_cut_drops_what_the_whole_sort_drops(name, logits):
    for p in TOP_PS:
        assert torch.equal(nucleus_cut(logits, p), sorted_cut(logits, p)), (name, p)


def test_every_row_is_cut_on_its_own():
    """A row's cut does not depend on the rows beside it, nor on the batch's shape."""
    logits = torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    whole = nucleus_cut(logits, 0.9)
    assert whole.shape == logits.shape
    for i in range(2):
        for j in range(3):
            assert torch.equal(whole[i, j], nucleus_cut(logits[i, j], 0.9))


def test_a_cut_between_tied_logits_goes_to_the_whole_sort(monkeypatch):
    """Ties are ordered by torch's sort, which is not stable: sorting the cut's bucket alone orders them otherwise,
    so such a row is the reference's. 1000 tied tokens over 1000 lower ones, the cut inside the tie."""
    shuffle = torch.randperm(2000, generator=torch.Generator().manual_seed(2))
    logits = torch.cat([torch.zeros(1000), torch.full((1000,), -3.0)])[shuffle]
    called = []
    monkeypatch.setattr(top_p, "sorted_cut", lambda *a: called.append(1) or sorted_cut(*a))
    assert torch.equal(nucleus_cut(logits, 0.5), sorted_cut(logits, 0.5)) and called
    kept = ~nucleus_cut(logits, 0.5)
    assert bool((logits[kept] == 0).all()) and 0 < int(kept.sum()) < 1000  # a part of the tie


@pytest.mark.parametrize("p", [1e-9, 1e-20])
def test_the_most_likely_token_is_kept_however_small_top_p(p):
    """At 1e-20, 1 - top_p is 1.0 in float64: every cumulative mass is <= it, and the top token is kept by the rule's
    exception alone."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    assert (~nucleus_cut(logits, p)).nonzero().flatten().tolist() == [int(logits.argmax())]
    assert torch.equal(nucleus_cut(logits, p), sorted_cut(logits, p))


def test_a_wide_nucleus_cut_falls_inside_one_bucket_and_is_sorted_there(monkeypatch):
    """Flat logits: the cut lands among thousands of tokens of tiny mass, and only its bucket is sorted."""
    logits = torch.randn(4 * VOCAB, generator=torch.Generator().manual_seed(4)) * 0.5
    sorted_sizes = []
    original = torch.argsort
    monkeypatch.setattr(torch, "argsort", lambda x, *a, **k: sorted_sizes.append(len(x)) or original(x, *a, **k))
    assert torch.equal(nucleus_cut(logits, 0.9), sorted_cut(logits, 0.9))
    assert sorted_sizes and max(sorted_sizes) < 4 * VOCAB / BUCKETS * 40  # a bucket's share, not the row


def test_nan_logits_get_the_references_answer_not_an_error():
    logits = torch.randn(VOCAB)
    logits[7] = math.nan
    assert torch.equal(nucleus_cut(logits, 0.9), sorted_cut(logits, 0.9))


def test_only_a_vocabulary_under_sort_below_is_sorted_whole(monkeypatch):
    """The routing of the module docstring: SORT_BELOW - 1 tokens go to the whole sort, SORT_BELOW to the buckets."""
    bucketed = []
    original = top_p._bucketed_cut
    monkeypatch.setattr(top_p, "_bucketed_cut", lambda row, p: bucketed.append(len(row)) or original(row, p))
    gen = torch.Generator().manual_seed(5)
    for vocab in (SORT_BELOW - 1, SORT_BELOW):
        logits = torch.randn(2, vocab, generator=gen)
        assert torch.equal(nucleus_cut(logits, 0.9), sorted_cut(logits, 0.9))
    assert bucketed == [SORT_BELOW, SORT_BELOW]


@pytest.mark.parametrize("row", ["+inf", "all -inf", "+inf and -inf"])
def test_infinite_logits_get_the_references_answer(row):
    """An infinite top logit makes the bucket arithmetic NaN: such a row is left to the reference."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(6))
    if row != "+inf":
        logits[::2] = -math.inf
    if row == "all -inf":
        logits[:] = -math.inf
    else:
        logits[3] = math.inf
    for p in (0.5, 0.9):
        assert torch.equal(nucleus_cut(logits, p), sorted_cut(logits, p)), p


def test_narrow_logits_are_bucketed_over_their_own_span(monkeypatch):
    """Logits spread far less than SPAN still fill all BUCKETS (lo is the row's minimum, not top - SPAN): the
    sorted bucket holds a few dozen of 48k tokens, not thousands."""
    logits = torch.randn(4 * VOCAB, generator=torch.Generator().manual_seed(7)) * 0.05
    sorted_sizes = []
    original = torch.argsort
    monkeypatch.setattr(torch, "argsort", lambda x, *a, **k: sorted_sizes.append(len(x)) or original(x, *a, **k))
    for p in (0.5, 0.9):
        assert torch.equal(nucleus_cut(logits, p), sorted_cut(logits, p))
    assert sorted_sizes and max(sorted_sizes) < 200


def test_the_top_token_is_kept_when_its_bucket_falls_short_of_the_last():
    """In float32, (hi - lo) * (BUCKETS - 1) / (hi - lo) can land the top logit in bucket BUCKETS - 2: `top` is the
    last bucket holding mass, so the top token is still the one kept at a vanishing top_p."""
    lo, hi = -11.899001121520996, 11.006041526794434  # float32 values whose top lands in bucket BUCKETS - 2
    logits = torch.rand(VOCAB, generator=torch.Generator().manual_seed(8)) * (hi - lo) * 0.9 + lo
    logits[0], logits[1] = lo, hi
    for p in (1e-9, 1e-20):
        assert (~nucleus_cut(logits, p)).nonzero().flatten().tolist() == [1], p


def test_a_cut_inside_a_bucket_follows_its_tokens_sorted_order():
    """Two tokens share a bucket, the more likely one at the lower index; 1 - top_p lies between their masses: the
    less likely one goes (it comes first in ascending order), the more likely one stays."""
    logits = torch.full((VOCAB,), -math.inf)
    logits[10], logits[20], logits[30] = 0.01, 0.0, 1.0  # the two at 0.0 and 0.01 share a bucket of width 64/4095
    probs = logits.double().softmax(-1)
    p = 1 - float(probs[20] + probs[10]) / 2
    kept = (~nucleus_cut(logits, p)).nonzero().flatten().tolist()
    assert kept == [10, 30] and torch.equal(nucleus_cut(logits, p), sorted_cut(logits, p))


def test_the_bucketed_cut_sums_in_float64():
    """With 1 - top_p set 1e-12 either side of a token's cumulative mass (float64), the token is dropped (above) or
    kept (below): float32 sums, rounded to a 6e-8 grid, would drop it both times (module docstring)."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(9))
    weight = (logits - logits.max()).exp().double()
    order = torch.argsort(logits)
    cum = (weight / weight.sum())[order].cumsum(0)
    for k in range(VOCAB - 3000, VOCAB - 10, 97):
        for gap, dropped in ((1e-12, k + 1), (-1e-12, k)):
            drop = nucleus_cut(logits, 1 - (float(cum[k]) + gap))
            assert bool(drop[order[:dropped]].all()) and not bool(drop[order[dropped:]].any()), (k, gap)
