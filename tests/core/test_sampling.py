"""core/sampling.py: check_finite (every NaN or inf refused, finite logits passed, a pruned head's spread included), the
sampling settings' bounds, and the draws (inverse CDF; distinct draws by successive sampling)."""
import pytest
import torch

from arborspec.core.sampling import check_finite, spread


def pruned_logits(rows=3, vocab=5000, kept=1200) -> torch.Tensor:
    """A pruned head's logits over the whole vocabulary: the lowest finite logit off its ids (their sum is -inf)."""
    gen = torch.Generator().manual_seed(0)
    keep = torch.randperm(vocab, generator=gen)[:kept].sort().values
    return spread(torch.randn(rows, kept, generator=gen), keep, vocab)


@pytest.mark.parametrize("logits", [torch.randn(4, 3000), pruned_logits(), torch.empty(0, 10)],
                         ids=["dense", "pruned", "empty"])
def test_finite_logits_pass(logits):
    assert logits.numel() == 0 or torch.isfinite(logits).all()
    check_finite(logits, "draft")  # no error


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("base", ["dense", "pruned"])
def test_any_nan_or_inf_is_refused(bad, base):
    logits = torch.randn(4, 5000) if base == "dense" else pruned_logits(rows=4)
    assert base == "dense" or not torch.isfinite(logits.sum())  # the pruned case takes the second test
    for where in [(0, 0), (2, 4321), (3, 4999)]:
        spoiled = logits.clone()
        spoiled[where] = bad
        with pytest.raises(FloatingPointError, match="draft model produced non-finite logits"):
            check_finite(spoiled, "draft")


def test_numpy_numbers_are_numbers_and_bools_are_not():
    import numpy as np

    from arborspec.core.sampling import SamplingConfig
    assert SamplingConfig(np.float32(0.7), top_p=np.float64(0.9)).temperature == pytest.approx(0.7)
    for bad in (dict(temperature=True), dict(temperature=1.0, top_p=True), dict(temperature=1.0, top_p="0.9")):
        with pytest.raises(ValueError, match="temperature|top_p"):
            SamplingConfig(**bad)


def test_numpy_sampling_settings_run_the_default_method():
    """numpy numbers were taken as given: auto's calibration key (JSON) then failed with "Object of type float32 is
    not JSON serializable" when the decoder was made."""
    import numpy as np

    from arborspec import SpeculativeDecoder
    from tests.conftest import noisy_copy, tiny_model
    target = tiny_model("llama")
    dec = SpeculativeDecoder(target, noisy_copy(target, 0.1), temperature=np.float32(0.75), top_k=np.int64(5),
                             top_p=np.float32(0.5), seed=np.int64(3), draft_temperature=np.float32(0.5))
    s = dec.config.sampling
    assert (type(s.temperature), type(s.top_k), type(s.top_p), type(s.seed)) == (float, int, float, int)
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.75, 5, 0.5, 3)
    assert type(dec.config.draft_temperature) is float
    plain = SpeculativeDecoder(target, noisy_copy(target, 0.1), temperature=0.75, top_k=5, top_p=0.5, seed=3,
                               draft_temperature=0.5)
    assert dec.generate([3, 4], max_new_tokens=6).token_ids == plain.generate([3, 4], max_new_tokens=6).token_ids


def test_the_sampling_bounds_are_where_the_rules_say():
    """The smallest temperature is allowed (TEMPERATURE_RULE says >=), top_p 0 is not: it would keep no token, and
    read as greedy in all but name."""
    from arborspec.core.sampling import MIN_TEMPERATURE, SamplingConfig

    assert SamplingConfig(MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    with pytest.raises(ValueError, match="temperature must be"):
        SamplingConfig(MIN_TEMPERATURE / 2)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingConfig(1.0, top_p=0.0)


def test_a_uniform_that_rounds_up_to_the_total_draws_the_last_token_with_mass(monkeypatch):
    """sample_one's rounding guard: a uniform times the total that equals the total draws the last token with mass,
    never a zero-mass token after it."""
    from arborspec.core import sampling

    monkeypatch.setattr(sampling.torch, "rand", lambda *args, **kwargs: torch.tensor(1.0, dtype=torch.float64))
    assert sampling.sample_one(torch.tensor([0.3, 0.7, 0.0, 0.0], dtype=torch.float64), None) == 1


def successive_sampling(q: torch.Tensor, k: int) -> dict[tuple[int, ...], float]:
    """P(the ordered draws t_1..t_k) without replacement: each draw from what the earlier ones left, renormalised."""
    import itertools

    support = torch.nonzero(q).flatten().tolist()
    out = {}
    for tokens in itertools.permutations(support, k):
        p, left = 1.0, float(q.sum())
        for t in tokens:
            p *= float(q[t]) / left
            left -= float(q[t])
        out[tokens] = p
    return out


def assert_draws_follow_successive_sampling(q: torch.Tensor, k: int, seed: int) -> None:
    """The ordered k-tuples `sample(q, num=k, replacement=False)` draws follow the exact law (chi-square at 1e-3,
    power 0.95 against a TV error of 0.05); a zero-mass or repeated token is a KeyError."""
    from arborspec.core.sampling import sample
    from tests.verify.harness import assert_same_distribution, plan_samples

    law = successive_sampling(q.double(), k)
    outcomes = list(law)
    probs = torch.tensor([law[o] for o in outcomes], dtype=torch.float64)
    index = {o: i for i, o in enumerate(outcomes)}
    counts = torch.zeros(len(outcomes), dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(plan_samples(probs, tv=0.05)):
        counts[index[tuple(sample(q, gen, num=k, replacement=False))]] += 1
    assert_same_distribution(counts, probs, tv=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_distinct_draws_from_a_large_vocabulary_follow_successive_sampling(dtype):
    """sample(..., replacement=False) past DISTINCT_BY_MULTINOMIAL_BELOW: redraws until new while a quarter of the
    mass is left (token 0 then 1 leave 0.45, then 0.25), then one draw from the rest alone. The ordered triples
    follow the exact law (chi-square at 1e-3, power 0.95 against a TV error of 0.05); zero-mass tokens are never
    drawn."""
    from arborspec.core.sampling import DISTINCT_BY_MULTINOMIAL_BELOW

    q = torch.zeros(2 * DISTINCT_BY_MULTINOMIAL_BELOW, dtype=dtype)
    support = [3, 700, 701, 1500, 4095]
    q[support] = torch.tensor([0.55, 0.2, 0.12, 0.08, 0.05], dtype=dtype) * 3  # unnormalised
    assert_draws_follow_successive_sampling(q, 3, seed=3)


@pytest.mark.parametrize("vocab", [8, 4096])
def test_one_draw_is_sample_one(vocab):
    from arborspec.core.sampling import sample, sample_one

    q = torch.rand(vocab)
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [sample(q, a)[0] for _ in range(50)] == [sample_one(q, b) for _ in range(50)]


def test_more_distinct_draws_than_the_support_holds_are_refused():
    """Not a zero-mass token, nor a wait for one (torch's multinomial, below DISTINCT_BY_MULTINOMIAL_BELOW, returns
    one: callers cap the draws at the support, drafting/layers.py)."""
    from arborspec.core.sampling import DISTINCT_BY_MULTINOMIAL_BELOW, sample

    q = torch.zeros(2 * DISTINCT_BY_MULTINOMIAL_BELOW)
    q[[1, 5]] = torch.tensor([0.9, 0.1])
    assert sorted(sample(q, torch.Generator().manual_seed(0), num=2, replacement=False)) == [1, 5]
    with pytest.raises(ValueError, match="the 2 with probability are all drawn"):
        sample(q, torch.Generator().manual_seed(0), num=3, replacement=False)


def test_a_new_draw_has_the_residual_distribution():
    """draw_new (auto's tree builder draws each child with it): from q by inverse CDF with repeats rejected, or, with
    less than a quarter of the mass left, once from q with the taken tokens zeroed; both R(y) = q(y) / (1 - q(taken))
    exactly: every token within four standard errors (at worst) over 6000 draws."""
    import numpy as np

    from arborspec.core.sampling import draw_new

    gen = torch.Generator().manual_seed(0)
    for q, taken in (([0.5, 0.3, 0.15, 0.05], [1]), ([0.995, 0.004, 0.001], [0]), ([0.6, 0.2, 0.2], [])):
        qt = torch.tensor(q, dtype=torch.float64)
        cdf = torch.cumsum(qt, 0)
        n = 6000
        counts = np.bincount([draw_new(qt, cdf, taken, gen) for _ in range(n)], minlength=len(q))
        expect = np.array(q) / (1 - sum(q[t] for t in taken))
        expect[taken] = 0
        assert counts[taken].sum() == 0
        assert np.abs(counts / n - expect).max() < 4 * np.sqrt(0.25 / n)
    with pytest.raises(ValueError, match="the 2 with probability are all drawn"):
        draw_new(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.5, 1.0, 1.0]), [0, 1], gen)


@pytest.mark.parametrize("vocab", [8, 4096])
def test_draws_with_replacement_repeat_tokens(vocab):
    """sample(..., replacement=True) is i.i.d. at any vocabulary size (SpecInfer's children, verifier mss): six draws
    from a two-token support must repeat, where a distinct-draw path would fail or run out of tokens."""
    from arborspec.core.sampling import sample

    q = torch.zeros(vocab)
    q[[1, vocab - 2]] = torch.tensor([0.6, 0.4])
    tokens = sample(q, torch.Generator().manual_seed(0), num=6, replacement=True)
    assert len(tokens) == 6 and set(tokens) <= {1, vocab - 2}


def test_distinct_draws_from_a_small_vocabulary_follow_successive_sampling():
    """Below DISTINCT_BY_MULTINOMIAL_BELOW (torch.multinomial's path) the draws come back in drawing order: the
    ordered pairs follow successive sampling (a reversed or sorted order would not, and mbr reads the order)."""
    assert_draws_follow_successive_sampling(torch.tensor([0.0, 0.5, 0.3, 0.0, 0.15, 0.05]), 2, seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_uniform_of_zero_never_draws_a_leading_zero_mass_token(monkeypatch, dtype):
    """inverse_cdf takes the first cumulative sum *above* the uniform (searchsorted right=True): a uniform of exactly
    0 lands past the leading zero-mass tokens (their sums are 0), on the first token with mass."""
    from arborspec.core import sampling

    monkeypatch.setattr(sampling.torch, "rand", lambda *args, **kwargs: torch.tensor(0.0, dtype=dtype))
    assert sampling.sample_one(torch.tensor([0.0, 0.0, 0.3, 0.0, 0.7], dtype=dtype), None) == 2


def test_a_seed_picks_its_own_reproducible_stream():
    """make_generator: the same seed gives the same draws, different seeds different ones (a request's seed is the
    only way two runs differ on purpose); None is torch's global generator."""
    from arborspec.core.sampling import make_generator

    def draws(seed):
        return torch.rand(8, generator=make_generator(seed)).tolist()

    assert draws(3) == draws(3) and draws(3) != draws(4) and draws(-1) != draws(0)
    assert make_generator(None) is None
