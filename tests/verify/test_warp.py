"""The one warp (core/sampling.py) is transformers' temperature -> top-k -> top-p, ties and edges included."""
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from arborspec.core import top_p as top_p_module
from arborspec.core.sampling import SamplingConfig, warp
from arborspec.verify.base import TargetRows, target_probs

SETTINGS = [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 0, 1.0), (1.0, 5, 1.0), (1.0, 1, 1.0), (1.0, 60, 1.0), (1.0, 0, 0.9),
    (1.0, 0, 0.5), (1.0, 0, 0.01), (0.8, 10, 0.9), (1.3, 3, 0.6), (2.0, 20, 0.95), (0.3, 0, 0.3),
]


def hf_probs(logits, temperature, top_k, top_p):
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)


def logit_batches():
    gen = torch.Generator().manual_seed(0)
    yield torch.randn(64, 50, generator=gen) * 3  # generic
    yield (torch.randn(64, 50, generator=gen) * 2).round()  # many ties
    yield torch.zeros(4, 50)  # all tied
    peaked = torch.randn(8, 50, generator=gen)
    peaked[:, 7] += 30
    yield peaked  # one token holds all the mass
    # top-p boundary exactly on a cumulative sum: probabilities 0.5, 0.25, 0.125, 0.125
    yield torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))


@pytest.fixture(params=["sorted", "bucketed"])
def cut_path(request, monkeypatch):
    """Each top-p test runs on the whole sort and on the bucketed cut (core/top_p.py), which only vocabularies of
    SORT_BELOW tokens or more take by default."""
    if request.param == "bucketed":
        monkeypatch.setattr(top_p_module, "SORT_BELOW", 0)
    return request.param


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_warp_matches_transformers(temperature, top_k, top_p, cut_path):
    cfg = SamplingConfig(temperature, top_k, top_p)
    for logits in logit_batches():
        ours = warp(logits, cfg)
        theirs = hf_probs(logits, temperature, min(top_k, logits.shape[-1]) if top_k else 0, top_p)
        assert torch.equal(ours > 0, theirs > 0)  # the same support, tie by tie
        assert torch.allclose(ours, theirs, atol=1e-6)


@pytest.mark.parametrize("top_p", [0.5, 0.75, 0.875, 1 - 1e-9])
def test_top_p_edges_match_transformers(top_p, cut_path):
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    ours = warp(logits, SamplingConfig(1.0, 0, top_p))
    assert torch.equal(ours > 0, hf_probs(logits, 1.0, 0, top_p) > 0)


@pytest.mark.parametrize("top_p", [1e-9, 1e-3])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p, cut_path):
    """Below the top token's own mass, top-p keeps that token alone: without the guard that always keeps it, every
    token was dropped and the row came out NaN."""
    logits = torch.log(torch.tensor([[0.125, 0.5, 0.25, 0.125]]))
    assert warp(logits, SamplingConfig(1.0, 0, top_p)).tolist() == [[0, 1, 0, 0]]


def test_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    assert warp(logits, SamplingConfig(0.0)).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]  # ties -> lowest id


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS + [(0.0, 0, 1.0)])
def test_target_rows_are_the_rows_of_target_probs(temperature, top_k, top_p, cut_path):
    """TargetRows (what traversal verification reads) warps a row when first read: the same float64 values, bit for
    bit, as warping the whole batch."""
    cfg = SamplingConfig(temperature, top_k, top_p)
    for logits in logit_batches():
        whole, rows = target_probs(logits, cfg), TargetRows(logits, cfg)
        assert len(rows) == len(whole)
        for i in reversed(range(len(whole))):
            assert rows[i].dtype == torch.float64 and torch.equal(rows[i], whole[i])
        assert rows[0] is rows[0]  # warped once


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 10, 0.9), (0.0, 0, 1.0)])
def test_half_precision_logits_warp_in_float32(dtype, temperature, top_k, top_p):
    """A half-precision model's logits are warped in float32 (SamplingConfig.probs says so): the same probabilities
    as warping the float32 copy, not a top-p cut and softmax rounded to 8 or 11 bits."""
    logits = (torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    cfg = SamplingConfig(temperature, top_k, top_p)
    ours = warp(logits, cfg)
    assert ours.dtype == torch.float32 and torch.equal(ours, warp(logits.float(), cfg))
