"""The sampling warp and seeded sampling helpers: the one place that says what distribution is being preserved.

The warp follows transformers' order: temperature, then top-k, then top-p. Temperature 0 means greedy: the
"distribution" is a one-hot at the argmax (ties go to the lowest token id, as `torch.argmax` does), so every verifier
degenerates to greedy verification.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .options import is_whole
from .top_p import nucleus_cut

# The smallest positive temperature. Below it sampling is greedy in all but name, and logits / T leave float32's range
# (1e-40 is subnormal there: every logit became inf, the softmax NaN, and the tokens garbage or a sampling error).
MIN_TEMPERATURE = 1e-6
TEMPERATURE_RULE = f"0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}"  # what valid_temperature accepts


def valid_temperature(t) -> bool:
    """The one temperature rule: the target's, the draft's, a server flag's and a request's field."""
    return is_real(t) and math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)


def is_real(x) -> bool:
    """A real number, numpy's included, and not a bool (True read as temperature 1.0, while top_k=True was refused;
    numpy's float32 was refused as a temperature and taken as a top_p)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def check_seed(seed) -> None:
    """ValueError unless `seed` is None or an integer torch's generator takes (a larger one failed with "Overflow when
    unpacking long long", naming no seed)."""
    if seed is not None and not (is_whole(seed) and SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] or None, got {seed!r}")


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    # a request's seed: a decoder's generate / steps draw from it when their call names none (None: torch's global
    # generator); not part of the warp
    seed: int | None = None

    def __post_init__(self):
        if not valid_temperature(self.temperature):
            raise ValueError(f"temperature must be {TEMPERATURE_RULE}, got {self.temperature!r}")
        if not is_whole(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        check_seed(self.seed)
        if not (is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        # Python's own numbers from numpy's: a float32 temperature failed the JSON of auto's calibration key
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("seed", int)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, kind(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped probabilities, float32, same shape as `logits` (..., vocab)."""
        return warp(logits, self)


def check_finite(logits: torch.Tensor, who: str) -> None:
    """Refuse NaN/inf logits loudly: a NaN would otherwise turn into a silent argmax of 0 or a sampling crash.

    A sum is finite only if every element is: over a 150k vocabulary it costs ~6 us a row against ~120 us for
    `isfinite().all()` (one CPU thread), which a plain decoding step would pay every token. When the sum is not
    finite (a NaN or inf, or finite logits whose sum overflows: a pruned head's `spread` fills ~86k ids with the
    lowest finite logit, whose sum is -inf), the smallest and largest logit decide (NaN propagates to both): ~12 us a
    row. With `isfinite` there, the 0.5B draft with a 65536-id head paid 0.15-0.45 ms a call (Zen 4, 2026-11-26)."""
    if math.isfinite(float(logits.sum())):
        return
    low, high = torch.aminmax(logits)
    if not (math.isfinite(float(low)) and math.isfinite(float(high))):
        raise non_finite(who)


def non_finite(who: str) -> FloatingPointError:
    """The error for NaN/inf logits of the `who` model (check_finite's, and the native step's own check's)."""
    return FloatingPointError(
        f"the {who} model produced non-finite logits (NaN or inf); check the weights and the dtype"
    )


def spread(small: torch.Tensor, keep: torch.Tensor, vocab: int) -> torch.Tensor:
    """(..., len(keep)) logits of the token ids `keep` -> (..., vocab), the lowest finite logit elsewhere: a pruned
    draft head's distribution, probability exactly 0 off its ids after the softmax (in float32). scatter_, not
    index_copy_ along the last dim: 0.07 against 0.57 ms for 4 rows of a 65536-id head (Zen 4, 2026-11-26)."""
    out = small.new_full((*small.shape[:-1], vocab), torch.finfo(small.dtype).min)
    return out.scatter_(-1, keep.expand(*small.shape[:-1], -1), small)


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., vocab) float32 probabilities: temperature, top-k, then top-p (core/top_p.py), in transformers' order."""
    logits = logits.float()
    if cfg.greedy:
        out = torch.zeros_like(logits)
        return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if cfg.top_p < 1:
        logits = logits.masked_fill(nucleus_cut(logits, cfg.top_p), -math.inf)
    return logits.softmax(dim=-1)


def make_generator(seed: int | None) -> torch.Generator | None:
    """None -> torch's global generator; an int -> a private generator, so one call is reproducible."""
    if seed is None:
        return None
    check_seed(seed)
    gen = torch.Generator()
    gen.manual_seed(int(seed))
    return gen


DISTINCT_BY_MULTINOMIAL_BELOW = 2048  # sample(): several distinct draws from fewer entries go to torch.multinomial


def sample(probs: torch.Tensor, generator: torch.Generator | None, num: int = 1, replacement: bool = True) -> list[int]:
    """Draw `num` token ids from a (vocab,) distribution (unnormalised is fine), in drawing order; without
    replacement, each draw from what the earlier ones left (successive sampling, as `torch.multinomial` defines it):
    a draw from the whole distribution, repeated until it is new, which is a draw from the rest renormalised.

    Why not `torch.multinomial` throughout: for one draw, and for any draw without replacement, it draws an
    exponential for every token, 3.1-3.4 ms over the 152k vocabulary on one thread, where this takes 0.12-0.18 ms
    for 1-4 tokens (19-25x; `python benchmarks/draws.py`, Intel Xeon host, 2026-11-29). DySpec drew every child that
    way at T > 0, so a 16-node tree paid ~50 ms of drawing, about a step of the target. Several draws with
    replacement keep torch's own, which already goes by the cumulative sums, and so do several distinct draws from
    fewer than DISTINCT_BY_MULTINOMIAL_BELOW entries, where its exponentials cost less than this loop's Python (28
    against 64 us for 4 tokens of 512; 640 against 74 of 32768)."""
    if num == 1:
        return [sample_one(probs, generator)]
    if replacement or len(probs) < DISTINCT_BY_MULTINOMIAL_BELOW:
        return torch.multinomial(probs, num, replacement=replacement, generator=generator).tolist()
    cdf = torch.cumsum(probs, 0)
    tokens: list[int] = []
    while len(tokens) < num:
        tokens.append(draw_new(probs, cdf, tokens, generator))
    return tokens


def draw_new(probs: torch.Tensor, cdf: torch.Tensor, taken: list[int], generator: torch.Generator | None) -> int:
    """One draw from (vocab,) `probs` restricted to the tokens not in `taken`, renormalised; `cdf`: probs' cumulative
    sums. While a quarter of the mass or more is left, a draw from the whole by inverse CDF, repeated until it is new
    (4 tries at most on average, ~5 us each); below that, one draw from probs with the taken tokens zeroed (a cumsum
    over the vocabulary, ~0.1 ms of 152k). Shared by `sample` and auto's tree builder, which draws children one at
    a time between other nodes' draws."""
    total = float(cdf[-1])
    if total - sum(float(probs[t]) for t in taken) >= 0.25 * total:
        while (y := inverse_cdf(cdf, probs, generator)) in taken:
            pass
        return y
    rest = probs.index_fill(0, torch.tensor(taken, dtype=torch.long), 0.0)
    if not bool(rest.any()):
        raise ValueError(f"no token is left to draw: the {len(taken)} with probability are all drawn")
    return sample_one(rest, generator)


def sample_one(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from a (vocab,) distribution (unnormalised is fine) by inverse CDF. Exact like
    `torch.multinomial(probs, 1)`, but ~0.2 ms instead of 3-6 ms over a 150k vocabulary on one CPU thread, a tenth of
    a plain llama.cpp step."""
    return inverse_cdf(torch.cumsum(probs, 0), probs, generator)


def inverse_cdf(cdf: torch.Tensor, probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One uniform from `generator` against `probs`' cumulative sums `cdf` (in probs' dtype: torch's float32 sums over
    152k entries stay within 6e-8 of float64's, and summing in float64 took 0.73 ms against 0.09). A token with no
    mass is never drawn (its cumulative sum equals its predecessor's, so it is never the first to exceed the
    uniform)."""
    u = torch.rand((), generator=generator, dtype=cdf.dtype) * cdf[-1]
    token = int(torch.searchsorted(cdf, u, right=True))
    if token >= len(cdf):  # u rounded up to the total: the last token with mass
        token = int(torch.nonzero(probs)[-1])
    return token


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))
