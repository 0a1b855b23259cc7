"""The acceptance rules as pure functions on distributions: no trees, no models, no hidden randomness.

Every function takes target probabilities `p` (already warped: temperature, top-k, top-p), draft probabilities `q`
(the distribution the drafted tokens were drawn from), and the drafted tokens, and returns probabilities: how likely
each drafted token is to be accepted, and what the target falls back to. Verifiers (the other modules of this package)
draw their random numbers against these; the tests enumerate them exactly.

Conventions: distributions are 1-D (vocab,) or 2-D (positions, vocab) torch tensors (numpy arrays work too); results
are float64 torch tensors. The arithmetic runs in numpy float64: for the small vectors of tests and small vocabularies
it is several times faster than torch, and for a real vocabulary the two cost the same.

Over 400 lines: every acceptance rule's mathematics on one page, so the rules can be compared line by line and the
exact-enumeration tests cover them from one import; the verifier files beside it are thin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..core.sampling import sample_one

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

    def acceptance(self) -> float:
        """P(some child is accepted) for these children; its mean over the draws is the rule's acceptance rate."""
        return 1.0 - math.prod(1.0 - a for a in self.accept)


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


def _sequential(out: np.ndarray, children: list[int]) -> MultiDraftPlan:
    """The plan that emits distribution `out` by trying `children` (distinct tokens) in order: child i is accepted with
    out[y_i] / (mass not yet handed out), and the fallback is `out` off the children, renormalised."""
    accept, left = [], 1.0
    for y in children:
        accept.append(min(1.0, float(out[y]) / left) if left > 0 else 0.0)
        left -= float(out[y])
    rest = out.copy()
    rest[children] = 0.0
    fallback = normalize(rest)
    return MultiDraftPlan(accept, _torch(fallback if fallback is not None else out))


def greedy_draft_plan(p: torch.Tensor, q: torch.Tensor, children: list[int]) -> MultiDraftPlan:
    """The optimal verification of greedy multi-draft children (Hu et al., ICLR 2025), exact for GREEDY_TOPK_PLUS_ONE.

    children[:-1] = D are deterministic, children[-1] = z was sampled from q' = norm(q off D). Emit z with probability
    min(1, p(z) / q'(z)), else a draw from norm(max(p - q', 0)), and accept the child carrying the emitted token if
    there is one. Averaged over z the emitted token is distributed as p, and a child is accepted with probability
    p(D) + sum over x not in D of min(p(x), q'(x)) = `optimal_acceptance_greedy`: the target's mass on D is never
    lost (q' has none there, so the residual keeps all of it), and no coupling of z with the target's token can
    match more than the overlap of q' and p off D. When q has no mass off D (all children deterministic: the policy
    ran out of draft support) the emitted token is a plain draw from p, which is exact for any children.
    """
    p_, q_ = _np(p), _np(q)
    if not children:
        return MultiDraftPlan([], _torch(p_))
    *fixed, z = children
    rest = q_.copy()
    rest[fixed] = 0.0
    q1 = normalize(rest)
    if q1 is None:
        return _sequential(p_, children)
    a = accept_prob(float(p_[z]), float(q1[z]))
    out = (1 - a) * _residual(p_, q1)
    out[z] += a
    return _sequential(out, children)


# ---- the best any verifier can do: optimal acceptance rates of one node's children ---------------------------------
# For children drawn as a random set S (of k draws) from q, the best exact verifier accepts a child with probability
# alpha* = max over couplings of P(target's token in S) = 1 - max over token sets A of [P(S inside A) - p(A)] (max-flow
# min-cut on the bipartite graph "draw -> tokens it contains"; Hu et al., ICLR 2025, Sec. 4). For i.i.d. draws the
# maximising A is among the prefixes of the tokens sorted by p/q ascending (P(S inside A) = q(A)^k is convex in q(A),
# p(A) is at least the piecewise-linear cheapest cover of q-mass q(A), so the maximum sits on that cover's corners);
# tests/verify/test_greedy_draft.py checks both closed forms against the linear program. Every set A gives an upper
# bound 1 - P(S inside A) + p(A) on alpha*, which is how `acceptance_bound_without_replacement` bounds the rule that
# has no closed form. The bench computes these per step at the root (cost: one sort of the vocabulary for the i.i.d.
# and without-replacement rules, O(vocab) otherwise), so they avoid Python loops over the vocabulary.
def optimal_acceptance_one(p, q) -> float:
    """The highest acceptance rate of one child drawn from q: sum min(p, q) = 1 - TV(p, q), which speculative
    sampling reaches. Every sampled drawing rule is this one draw when k = 1."""
    return float(min(1.0, np.minimum(_np(p), _np(q)).sum()))


def _by_ratio(p_: np.ndarray, q_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(p, q) on the draft's support, ordered by p/q ascending: the candidate sets A are the prefixes. Tokens the
    draft never proposes only add target mass to A, so they never belong to it. Ties keep any order: a tie group is one
    straight piece of the cover, so the prefixes that matter end at group boundaries, which every order shares."""
    pos = q_ > 0
    pp, qq = p_[pos], q_[pos]
    order = np.argsort(pp / qq)
    return pp[order], qq[order]


def optimal_acceptance_iid(p, q, k: int) -> float:
    """The highest acceptance rate any exact verifier reaches on k children drawn i.i.d. (WITH replacement) from q."""
    pp, qq = _by_ratio(_np(p), _np(q))
    gap = np.cumsum(qq) ** k - np.cumsum(pp)
    return float(min(1.0, 1.0 - max(0.0, float(gap.max(initial=0.0)))))


def acceptance_bound_without_replacement(p, q, k: int) -> float:
    """An upper bound on the acceptance rate any exact verifier reaches on k children drawn WITHOUT replacement from
    q: min over the p/q-sorted prefixes A of 1 - L(A) + p(A), with L(A) <= P(S inside A). Exact for k = 1 and when
    the k draws take the whole support (S is then fixed); for k = 2 L is exact, and the bound equalled the linear
    program on every instance tested (tests/verify/test_rules.py); for k >= 3 it is a true bound, a few points loose
    at worst on those instances.

    Drawing one token after another, with mass s of A already drawn, the next draw lands in A with probability
    (a - s) / (1 - s), a = q(A). So P(first two in A) = sum over x in A of q(x) (a - q(x)) / (1 - q(x)) (prefix sums),
    and each later draw lands in A with probability at least (a - s_i) / (1 - s_i), where s_i bounds the mass of the
    i tokens drawn: at most the i largest q in A, itself at most min(i largest q overall, i * max q in A).
    """
    p_, q_ = _np(p), _np(q)
    support = int((q_ > 0).sum())
    if k >= support:  # every token the draft can propose is drawn
        return float(min(1.0, p_[q_ > 0].sum()))
    if k == 1:
        return optimal_acceptance_one(p_, q_)
    pp, qq = _by_ratio(p_, q_)
    qq = qq / qq.sum()
    a = np.cumsum(qq)  # q(A) of each prefix A
    # 1 - q(A) and 1 - q(x) as sums of the other tokens' mass, not as differences from 1: a draft that puts all but
    # 1e-17 of its mass on one token would otherwise divide by zero.
    outside = np.concatenate([np.cumsum(qq[::-1])[::-1][1:], [0.0]])  # 1 - q(A)
    others = np.concatenate([[0.0], a[:-1]]) + outside  # 1 - q(x)
    # P(first two draws in A) = sum_{x in A} q(x) (q(A) - q(x)) / (1 - q(x))
    #                         = q(A) - (1 - q(A)) sum_{x in A} q(x) / (1 - q(x))
    inside = np.maximum(a - outside * np.cumsum(qq / others), 0.0)
    ranked = np.sort(qq)[::-1]
    largest = np.cumsum(ranked)  # largest[i - 1]: the i largest q overall
    rest = np.cumsum(ranked[::-1])[::-1]  # rest[i]: 1 - largest[i - 1], > 0 as k < support
    biggest_in_a = np.maximum.accumulate(qq)
    for i in range(2, k):  # draw i + 1, after i draws inside A
        drawn = np.minimum(largest[i - 1], i * biggest_in_a)
        inside = inside * np.minimum(np.maximum(a - drawn, 0.0) / np.maximum(1.0 - drawn, rest[i]), 1.0)
    return float(min(1.0, (1.0 - inside + np.cumsum(pp)).min(initial=1.0)))


def _top_tokens(q_: np.ndarray, m: int) -> np.ndarray:
    """The m most probable tokens of q among those it can draw, most probable first, ties to the lower id (as a
    stable sort orders them), in O(vocab): only the tokens at or above the m-th largest value are sorted."""
    support = np.flatnonzero(q_ > 0)
    if m <= 0:
        return support[:0]
    if m < len(support):
        cut = np.partition(q_[support], len(support) - m)[len(support) - m]
        support = support[q_[support] >= cut]
    return support[np.argsort(-q_[support], kind="stable")[:m]]


def optimal_acceptance_greedy(p, q, k: int) -> float:
    """The highest acceptance rate any exact verifier reaches on greedy multi-draft children: the k-1 most probable
    tokens of q (D) plus one sample from q off D; `greedy_draft_plan` reaches it. p(D) + sum_{x not in D} min(p, q')."""
    p_, q_ = _np(p), _np(q)
    fixed = _top_tokens(q_, k - 1)
    rest = q_.copy()
    rest[fixed] = 0.0
    q1 = normalize(rest)
    overlap = 0.0 if q1 is None else float(np.minimum(np.delete(p_, fixed), np.delete(q1, fixed)).sum())
    return float(min(1.0, p_[fixed].sum() + overlap))


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
    idx = sample_one(w, generator)  # n x vocab outcomes: a multinomial would draw an exponential for each
    return divmod(idx, log_neighbor.shape[1])


# ---- sequence-level acceptance: block verification (chains) and traversal verification (trees) ---------------------
# Token-wise rules decide each drafted token on its own ratio p/q. The sequence-level rules carry a *weight* down the
# path instead, alpha(child) = min(1, alpha(parent) * p(y) / q(y)) from alpha(root) = 1, so a token the target likes
# more than the draft can pay for an earlier one it liked less. When everything below a node has been rejected, the
# node itself is accepted with the probability `reject_below` returns, and the bonus comes from its residual.
def weight_step(alpha: float, p_y: float, q_y: float) -> float:
    """min(1, alpha * p(y) / q(y)): the weight of a child carrying y, given its parent's weight alpha.

    q(y) = 0 is read as `accept_prob` reads it ("the draft never proposes y"): weight 1 if the target can emit y (and
    alpha > 0), else 0. That keeps temperature 0, where deterministic siblings carry draft probability 0, greedy.
    """
    if q_y <= 0:
        return 1.0 if alpha * p_y > 0 else 0.0
    return min(1.0, alpha * p_y / q_y)


def _reject_below(alpha: float, p: np.ndarray, q: np.ndarray) -> tuple[float, np.ndarray]:
    r = np.maximum(alpha * p - q, 0.0)
    mass = float(r.sum())
    denom = mass + 1.0 - alpha
    # denom = 0 means alpha = 1 and p <= q (p = q): a draw from q is then never rejected, so this is reached only by
    # rounding, or at temperature 0 by a deterministic child the draft did not put first; accepting the node with
    # the target's own distribution is exact there (and greedy at temperature 0).
    return (mass / denom if denom > 0 else 1.0), (r / mass if mass > 0 else p)


def reject_below(alpha: float, p, q) -> tuple[float, torch.Tensor]:
    """A node of weight `alpha`, target `p` and draft `q`, after the child drawn from q (and its subtree) was rejected.

    Returns (alpha', p'): the probability with which the node itself will be accepted if nothing else below it is,
    alpha' = R / (R + 1 - alpha) with R = sum(max(alpha * p - q, 0)), and the distribution p' = norm(max(alpha * p - q,
    0)) that its remaining children are verified against and its bonus is drawn from. At the root (alpha = 1) this is
    SpecInfer's residual step and alpha' stays 1.
    """
    alpha2, p2 = _reject_below(float(alpha), _np(p), _np(q))
    return alpha2, _torch(p2)


@dataclass
class BlockPlan:
    """Block verification of one drafted chain of n tokens, as probabilities (Sun et al. 2025, Alg. 2).

    `stop[i]` (i = 0..n) is the probability that the longest accepted prefix is tokens[:i] given that no longer
    prefix was accepted: the verifier tries i = n, n-1, ..., 1 with independent uniforms and stops at the first
    success (stop[0] = 1). `residual[i]` (i < n) is the distribution the bonus comes from after accepting exactly i
    tokens; after all n the bonus comes from the target at the end of the chain.
    """

    stop: list[float]
    residual: np.ndarray  # (n, vocab), rows normalised

    def accepted_distribution(self) -> np.ndarray:
        """(n + 1,): P(exactly i drafted tokens are accepted), i = 0..n."""
        out, reach = np.zeros(len(self.stop)), 1.0
        for i in range(len(self.stop) - 1, -1, -1):
            out[i] = reach * self.stop[i]
            reach *= 1 - self.stop[i]
        return out

    def neighbor(self, tokens: list[int]) -> torch.Tensor:
        """The outcome distribution in `sps_neighbor`'s layout (n, vocab).

        Row i < n-1 never holds tokens[i] (stop[i + 1] = 1 whenever residual[i] could emit it), so the layout is the
        same as speculative sampling's and `expected_tokens` applies.
        """
        n = len(tokens)
        acc = self.accepted_distribution()
        out = self.residual * acc[:n, None]
        if n:
            out[n - 1, tokens[n - 1]] += acc[n]
        return _torch(out)


def block_plan(tokens: list[int], q, p) -> BlockPlan:
    """Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh; ICLR 2025, Alg. 2).

    Weights w_0 = 1, w_i = min(1, w_{i-1} p_i(y_i) / q_i(y_i)); for i < n, with r_i = max(w_i p_{i+1} - q_{i+1}, 0)
    and R_i = sum(r_i): stop[i] = R_i / (R_i + 1 - w_i) (`reject_below`), residual[i] = norm(r_i); stop[n] = w_n.
    Exact for a chain whose tokens were sampled from the recorded q (each y_i ~ q_i); optimal among all exact
    verifiers of that chain that see only the drafted tokens and both models' conditionals along it. With one token
    it is standard speculative sampling. q: (n, vocab), p: (n, vocab) or (n + 1, vocab) (row n unused).
    """
    n = len(tokens)
    q, p = _np(q[:n]), _np(p[:n])
    stop, residual, w = [1.0], np.zeros_like(q), 1.0
    for i, y in enumerate(tokens):  # here w = w_i, the weight of the first i tokens
        h, residual[i] = _reject_below(w, p[i], q[i])
        if i:
            stop.append(h)
        w = weight_step(w, float(p[i, y]), float(q[i, y]))
    if n:
        stop.append(w)
    return BlockPlan(stop, residual)


def block_neighbor(tokens: list[int], q, p) -> torch.Tensor:
    """Block verification as a distribution over its outcomes, in `sps_neighbor`'s layout (n, vocab)."""
    return block_plan(tokens, q, p).neighbor(tokens)


def block_expected_tokens_by_prefix(tokens: list[int], q, p) -> list[float]:
    """expected_tokens(block_neighbor(tokens[:m], ...)) for m = 1..n in one pass (the weights and stops of a prefix
    do not depend on the tokens after it; only the last stop changes, to w_m)."""
    n = len(tokens)
    q, p = _np(q[:n]), _np(p[:n])
    w, inner, out = 1.0, [], []  # inner[i - 1] = R_i / (R_i + 1 - w_i), i = 1..m-1
    for i, y in enumerate(tokens):
        if i:
            inner.append(_reject_below(w, p[i], q[i])[0])
        w = weight_step(w, float(p[i, y]), float(q[i, y]))
        stop = [1.0] + inner + [w]
        total, reach = 0.0, 1.0
        for j in range(len(stop) - 1, -1, -1):
            total += reach * stop[j] * (j + 1)
            reach *= 1 - stop[j]
        out.append(total)
    return out
