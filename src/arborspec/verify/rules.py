"""The acceptance rules as pure functions on distributions: no trees, no models, no hidden randomness.

Every function takes target probabilities `p` (already warped: temperature, top-k, top-p), draft probabilities `q`
(the distribution the drafted tokens were drawn from), and the drafted tokens, and returns probabilities: how likely
each drafted token is to be accepted, and what the target falls back to. Verifiers (the other modules of this package)
draw their random numbers against these; the tests enumerate them exactly.

Conventions: distributions are 1-D (vocab,) or 2-D (positions, vocab) torch tensors (numpy arrays work too); results
are float64 torch tensors. The arithmetic runs in numpy float64: for the small vectors of tests and small vocabularies
it is several times faster than torch, and for a real vocabulary the two cost the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

_EMPTY = -math.inf


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _torch(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


def normalize(x):
    """x / sum(x), or None when x has no mass (a caller must then know what to fall back to)."""
    total = float(x.sum())
    return x / total if total > 0 else None


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    out = normalize(np.maximum(p - q, 0.0))
    return p / p.sum() if out is None else out


def residual(p, q) -> torch.Tensor:
    """norm(max(p - q, 0)): where the target goes after rejecting a token drawn from q.

    When p <= q everywhere (so p == q up to rounding) no draw from q is ever rejected; rounding may still reject one
    with a vanishing probability, and then p itself is the right fallback.
    """
    return _torch(_residual(_np(p), _np(q)))


def accept_prob(p_y: float, q_y: float) -> float:
    """min(1, p(y) / q(y)), with q(y) = 0 read as "the draft never proposes y": accept iff the target can emit it."""
    if q_y <= 0:
        return 1.0 if p_y > 0 else 0.0
    return min(1.0, p_y / q_y)


# ---- several children of one node ------------------------------------------------------------------------------
@dataclass
class MultiDraftPlan:
    """What multi-draft rejection does at one node, as probabilities.

    The verifier tries `children` in order and accepts child i (having rejected 0..i-1) with probability `accept[i]`;
    `accept` may be shorter than the children (multi-branch rejection stops once the draft has no mass left). If no
    child is accepted, the bonus is drawn from `fallback`.
    """

    accept: list[float]
    fallback: torch.Tensor  # float64

    def output_distribution(self, children: list[int]) -> torch.Tensor:
        """Exact distribution of the emitted token (the accepted child's, or the fallback draw)."""
        out = torch.zeros_like(self.fallback)
        reach = 1.0
        for y, a in zip(children, self.accept):
            out[y] += reach * a
            reach *= 1 - a
        return out + reach * self.fallback


def mss_plan(p: torch.Tensor, q: torch.Tensor, children: list[int]) -> MultiDraftPlan:
    """SpecInfer's multi-step speculative sampling, exact for children drawn i.i.d. (WITH replacement) from q.

    Accept child y with probability min(1, R[y] / q[y]); after a rejection R <- norm(max(R - q, 0)); q never changes.
    """
    r, q = _np(p), _np(q)
    accept = []
    for i, y in enumerate(children):
        accept.append(accept_prob(float(r[y]), float(q[y])))
        if accept[-1] >= 1:
            break  # never rejected: later children are never tried
        r = _residual(r, q)
    return MultiDraftPlan(accept, _torch(r))


def mbr_plan(p: torch.Tensor, q: torch.Tensor, children: list[int]) -> MultiDraftPlan:
    """Multi-branch rejection (DySpec Alg. 3, Sequoia), exact for children drawn WITHOUT replacement from q.

    Accept child y with probability min(1, R[y] / D[y]); after a rejection R <- norm(max(R - D, 0)), D[y] <- 0,
    D <- norm(D); once D has no mass left the remaining children (there are none when they were really drawn without
    replacement from q) are not tried and the bonus comes from R.
    """
    r, d = _np(p), _np(q).copy()
    accept = []
    for y in children:
        accept.append(accept_prob(float(r[y]), float(d[y])))
        if accept[-1] >= 1:
            break  # never rejected: later children are never tried
        r = _residual(r, d)
        d[y] = 0
        d = normalize(d)
        if d is None:
            break
    return MultiDraftPlan(accept, _torch(r))


# ---- a chain: standard and accelerated speculative sampling --------------------------------------------------------
def sps_neighbor(tokens: list[int], q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Standard speculative sampling over a drafted chain, as a distribution over its outcomes.

    tokens: the n drafted tokens; q: (n, vocab), q[i] the draft distribution tokens[i] was drawn from; p: (n, vocab)
    or (n + 1, vocab), p[i] the target's distribution at the same position (row n, if given, is unused here).
    Returns N (n, vocab): N[i, v] = P(the step emits tokens[:i] + [v]); N[n-1, tokens[n-1]] is full acceptance (then
    a bonus token follows from p[n]); for i < n-1, N[i, tokens[i]] = 0. Rows sum to 1 overall.
    """
    n = len(tokens)
    q, p = _np(q[:n]), _np(p[:n])
    out = np.zeros_like(q)
    reach = 1.0
    for i, y in enumerate(tokens):
        a = accept_prob(float(p[i, y]), float(q[i, y]))
        if a < 1:
            out[i] = reach * (1 - a) * _residual(p[i], q[i])
        reach *= a
    if n:
        out[n - 1, tokens[n - 1]] += reach
    return _torch(out)


def _log_sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.full_like(a, _EMPTY)
    pos = a > b  # there a is finite, and b - a < 0 (or -inf): no inf - inf, no log(0)
    ap = a[pos]
    out[pos] = ap + np.log1p(-np.exp(b[pos] - ap))
    return out


def log_sub(a, b) -> torch.Tensor:
    """log(max(exp(a) - exp(b), 0)) elementwise, -inf where a <= b (and where both are -inf)."""
    return _torch(_log_sub(_np(a), _np(b)))


def _logsumexp(x: np.ndarray) -> float:
    m = float(x.max())
    if not math.isfinite(m):
        return m
    return m + math.log(float(np.exp(x - m).sum()))


def _asps_rows(tokens: list[int], q, p) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pass of Alg. 1 in log space. Returns, per position i: `rows[i]` (log of "reject at i, emit v", before the
    later positions' rescaling; the drafted token's entry is -inf), `scales[i]` (log C2 / P_ref[y], by which Alg. 1
    rescales every earlier row at position i) and `log_s[i]` (log P_N_s after position i: "accept the whole prefix").
    None of these depends on tokens after i, so any prefix of the chain reuses them."""
    n = len(tokens)
    with np.errstate(divide="ignore"):
        lq, lp = np.log(_np(q[:n])), np.log(_np(p[:n]))
    rows = np.full_like(lq, _EMPTY)
    scales, log_s = np.zeros(n), np.zeros(n)
    s = 0.0  # log P_N_s: the mass of "the outcome is still the whole drafted prefix"
    for i, y in enumerate(tokens):
        lq_y = float(lq[i, y])
        if not math.isfinite(lq_y):
            raise ValueError(f"drafted token {y} at position {i} has draft probability 0; it cannot have been drawn")
        ls_p = lp[i] + s  # log(P_N_s * P[i])
        log_c1 = _log_sub(lq[i], ls_p)  # log max(0, P_ref - P_N_s * P)
        total = _logsumexp(log_c1)
        log_c2 = float(log_c1[y]) - total if math.isfinite(total) else _EMPTY
        scales[i] = log_c2 - lq_y  # log(C2 / P_ref[y])
        rows[i] = scales[i] + _log_sub(ls_p, lq[i])  # reject here, emit v: C2 / P_ref[y] * max(0, P_N_s * P - P_ref)
        rows[i, y] = _EMPTY  # the drafted token itself: "accept", kept in log_s
        s = log_s[i] = min(0.0, float(ls_p[y]) - lq_y)  # min(1, P_N_s * P[y] / P_ref[y])
    return rows, scales, log_s


def _later(scales: np.ndarray) -> np.ndarray:
    """later[j] = sum of scales[i] for i > j: the rescaling row j receives from the positions after it."""
    return np.concatenate([np.cumsum(scales[::-1])[::-1][1:], [0.0]])


def asps_log_neighbor(tokens: list[int], q, p) -> torch.Tensor:
    """Accelerated speculative sampling (Hu & Huang 2024, Alg. 1) in log space: log N, same layout as `sps_neighbor`.

    Division guards (the paper asks for them without spelling them out):
    - sum(C1) = 0 means the draft row equals the scaled target row, so the drafted token is accepted with
      probability 1 and no mass is left to move: C2 := 0 (log C2 = -inf).
    - P_ref[y] = 0 cannot happen for a token that was drawn from P_ref; it is refused loudly.
    Every other operation is a sum of logs (multiplication) or `log_sub` (the clipped subtraction), so -inf stands for
    an exact zero throughout and no inf - inf arises. Alg. 1 rescales all earlier rows by C2 / P_ref[y] at every
    position; here each row keeps its own value and the rescalings are summed once at the end (the same products).
    """
    n = len(tokens)
    rows, scales, log_s = _asps_rows(tokens, q, p)
    if n:
        rows[n - 1, tokens[n - 1]] = log_s[n - 1]  # full acceptance (inner prefixes' mass moved on)
    return _torch(rows + _later(scales)[:, None])  # -inf + -inf stays -inf; no scale is +inf, so no NaN


def asps_expected_tokens_by_prefix(tokens: list[int], q, p) -> list[float]:
    """expected_tokens(asps_neighbor(tokens[:m], ...)) for m = 1..n in one pass (benchmarks evaluate every prefix)."""
    n = len(tokens)
    rows, scales, log_s = _asps_rows(tokens, q, p)
    mass = np.array([_logsumexp(r) for r in rows])  # log of each row's rejection mass, before rescaling
    out = []
    for m in range(1, n + 1):
        later = _later(scales[:m])
        total = float(sum((j + 1) * math.exp(mass[j] + later[j]) for j in range(m) if math.isfinite(mass[j] + later[j])))
        out.append(total + (m + 1) * math.exp(log_s[m - 1]))  # full acceptance: m drafted + the bonus
    return out


def sps_expected_tokens_by_prefix(tokens: list[int], q, p) -> list[float]:
    """expected_tokens(sps_neighbor(tokens[:m], ...)) for m = 1..n: 1 + sum over j <= m of P(first j accepted)."""
    q, p = _np(q), _np(p)
    out, reach, total = [], 1.0, 1.0
    for i, y in enumerate(tokens):
        reach *= accept_prob(float(p[i, y]), float(q[i, y]))
        total += reach
        out.append(total)
    return out


def asps_neighbor(tokens: list[int], q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`asps_log_neighbor`, exponentiated."""
    return asps_log_neighbor(tokens, q, p).exp()


def expected_tokens(neighbor, tokens: list[int]) -> float:
    """Expected tokens a step commits under outcome distribution `neighbor` (drafted tokens accepted + the bonus).

    An outcome in row i commits i + 1 tokens; full acceptance commits n + 1 (the n drafted and a bonus).
    """
    n = len(tokens)
    if n == 0:
        return 1.0
    neighbor = _np(neighbor)
    mass = neighbor.sum(axis=1)
    return float((mass * np.arange(1, n + 1)).sum() + neighbor[n - 1, tokens[n - 1]])


def sample_neighbor(log_neighbor: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """Draw (row, token) from a log outcome distribution."""
    flat = log_neighbor.flatten()
    w = torch.exp(flat - flat.max())
    idx = int(torch.multinomial(w, 1, generator=generator))
    return divmod(idx, log_neighbor.shape[1])
