"""A distribution-equivalence harness: does a decoder emit exactly the target's distribution of the first k tokens?

The pieces, usable from any test:

- `TableModel.from_model(model, prompt, depth)`: a causal LM's next-token logits for *every* continuation of `prompt`
  up to `depth` tokens, computed once with one batched forward per length (tiny vocabularies make this cheap).
- `TableSession`: serves those logits through the same `forward(context, tree, nodes)` / `prefill` / `commit`
  interface as `models.hf.TreeSession`, so the real policies and verifiers run thousands of times per second.
- `IIDTreePolicy`, `GreedyDraftTreePolicy`: test-only k-ary policies for the i.i.d. and greedy multi-draft rules
  (k-1 top draft tokens plus one sample), written apart from the library's `static(draw=iid|greedy)`: the trees
  deliberately wrong verifiers are tried on, and end-to-end runs of a policy outside the registry; the greedy one
  draws with the library's own `drafting.layers.greedy_children`.
- `TableDecoder`: the engine's draft -> verify -> commit loop on table sessions (no compatibility checks, so a
  deliberately wrong verifier can be tried). `SpeculativeDecoder` itself works with the same helpers, only slower.
- `exact_target_distribution(model_or_table, prompt, k, sampling)`: the exact probability of each of the vocab^k
  continuations under the warped target, vectorised.
- `sample_outputs(decoder_or_factory, prompt, k, n, seed)`: counts of the first k generated tokens over n runs.
- `assert_same_distribution(counts, probs, tv=0.02)`: a chi-square goodness-of-fit test that fails on a mismatch, and
  that also refuses to pass when n is too small for it to catch *any* deviation of total variation `tv` with
  probability `power` (so a pass means something).
- `total_variation(counts, probs)`: the empirical TV distance (for reporting lossy verifiers).

Outcome index: a continuation (t_1, ..., t_k) is cell sum_i t_i * vocab^(k - i), i.e. itertools.product order.
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from scipy import stats

from arborspec.core.sampling import SamplingConfig, make_generator, sample
from arborspec.core.tree import DrawRule, TokenTree
from arborspec.drafting import POLICIES, DraftContext
from arborspec.drafting.base import Policy
from arborspec.drafting.layers import greedy_children, layer_probs
from arborspec.verify import VERIFIERS
from arborspec.verify.base import Verifier


# ---- table models --------------------------------------------------------------------------------------------------
class TableModel:
    """Next-token logits of one model after `prompt + c` for every continuation c of length 0..depth."""

    def __init__(self, prompt: list[int], vocab: int, rows: dict[tuple[int, ...], torch.Tensor], depth: int):
        self.prompt, self.vocab, self.rows, self.depth = list(prompt), vocab, rows, depth

    @classmethod
    @torch.no_grad()
    def from_model(cls, model, prompt: list[int], depth: int, batch: int = 4096) -> "TableModel":
        vocab = model.config.vocab_size
        rows: dict[tuple[int, ...], torch.Tensor] = {}
        for length in range(depth + 1):
            conts = list(itertools.product(range(vocab), repeat=length))
            for start in range(0, len(conts), batch):
                chunk = conts[start : start + batch]
                ids = torch.tensor([list(prompt) + list(c) for c in chunk])
                logits = model(input_ids=ids).logits[:, -1].float()
                rows.update(zip(chunk, logits))
        return cls(prompt, vocab, rows, depth)

    def logits(self, continuation: tuple[int, ...]) -> torch.Tensor:
        try:
            return self.rows[continuation]
        except KeyError:
            raise KeyError(f"continuation {continuation} is deeper than this table ({self.depth} tokens)") from None

    def layer(self, length: int) -> torch.Tensor:
        """(vocab^length, vocab) logits for every continuation of that length, in product order."""
        return torch.stack([self.rows[c] for c in itertools.product(range(self.vocab), repeat=length)])

    def session(self) -> "TableSession":
        return TableSession(self)


class TableSession:
    """TreeSession's interface, served from a TableModel."""

    def __init__(self, table: TableModel):
        self.table = table
        self.slot: dict[int, int] = {}
        self.cached: list[int] = []
        self.forwards = 0
        self._tree, self._keys = None, {}

    def forward(self, context: list[int], tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        if self._tree is not tree:  # a new step: continuation of the root = the committed tokens after the prompt
            prompt = self.table.prompt
            if context[: len(prompt)] != prompt:
                raise ValueError("the context does not start with the table's prompt")
            self._tree, self._keys = tree, {0: tuple(context[len(prompt):])}
        rows = []
        for node in nodes:
            key = self._keys.get(node)
            if key is None:
                key = self._keys[node] = self._keys[tree.parents[node]] + (tree.tokens[node],)
            rows.append(self.table.logits(key))
            self.slot.setdefault(node, len(self.slot))
        self.forwards += 1
        return torch.stack(rows)

    def prefill(self, ids: list[int]) -> None:
        self.cached = list(ids)

    def commit(self, path: list[int]) -> None:
        self.slot = {}
        self._tree, self._keys = None, {}


# ---- test-only policies for the i.i.d. and greedy multi-draft rules ------------------------------------------------
@dataclass
class KaryOptions:
    depth: int = 3
    branch: int = 2


class KaryTestPolicy(Policy):
    """A k-ary tree, `depth` layers of `branch` children a node: the top draft tokens at T = 0, and when sampling the
    children `children(q, generator)` returns, recorded under drawing rule `rule` (verified by `verifier`)."""

    Options = KaryOptions
    rule: DrawRule
    verifier: str

    def draw_rules(self, sampling: SamplingConfig) -> set[DrawRule]:
        return {DrawRule.DETERMINISTIC} if sampling.greedy else {self.rule}

    def default_verifier(self, sampling: SamplingConfig) -> str:
        return "greedy" if sampling.greedy else self.verifier

    @property
    def max_tree_depth(self) -> int:
        return self.options.depth

    def children(self, q: torch.Tensor, generator) -> list[int]:
        raise NotImplementedError

    def draft(self, ctx: DraftContext) -> TokenTree:
        tree = TokenTree.root(ctx.context[-1])
        frontier = [0]
        for _ in range(min(self.options.depth, ctx.max_depth)):
            warped, plain = layer_probs(ctx, tree, frontier)
            new = []
            for i, node in enumerate(frontier):
                if ctx.sampling.greedy:
                    tokens = torch.topk(plain[i], self.options.branch).indices.tolist()
                    tree.set_children_dist(node, warped[i], DrawRule.DETERMINISTIC)
                else:
                    tokens = self.children(warped[i], ctx.generator)
                    tree.set_children_dist(node, warped[i], self.rule)
                new += [tree.add(node, t, float(warped[i, t])) for t in tokens]
            frontier = new
        return tree


class IIDTreePolicy(KaryTestPolicy):
    """Children are `branch` i.i.d. samples (WITH replacement; duplicates allowed), like SpecInfer."""

    name = "iid_tree"
    summary = "test-only: children drawn with replacement"
    rule, verifier = DrawRule.WITH_REPLACEMENT, "mss"

    def children(self, q: torch.Tensor, generator) -> list[int]:
        return sample(q, generator, num=self.options.branch, replacement=True)


class GreedyDraftTreePolicy(KaryTestPolicy):
    """Greedy multi-draft (Hu et al., ICLR 2025): the draft's `branch` - 1 most probable tokens, then one token
    sampled from the draft restricted to the other tokens (DrawRule.GREEDY_TOPK_PLUS_ONE), as `static(draw=greedy)`
    draws. The recorded distribution is the warped draft q itself; the deterministic children come first, the
    sampled one last. When q's support has no token left after the deterministic ones, the node gets only those."""

    name = "greedy_draft_tree"
    summary = "test-only: k-1 top draft tokens plus one sample"
    rule, verifier = DrawRule.GREEDY_TOPK_PLUS_ONE, "greedy-draft"

    def children(self, q: torch.Tensor, generator) -> list[int]:
        return greedy_children(q, self.options.branch, generator)


# ---- the loop -----------------------------------------------------------------------------------------------------
@dataclass
class TableResult:
    token_ids: list[int]
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per step


class TableDecoder:
    """The engine's loop (drafting, one target call over the tree, verification, commit) on table sessions.

    `horizon`: trees are sized as if `horizon` tokens were wanted, though `generate` stops after max_new_tokens, so
    trees can be deeper than the tokens looked at (the table must then hold horizon - 1 tokens).
    The draft warp follows the engine: the draft's temperature defaults to the target's, and is 0 when the target's is.
    """

    def __init__(self, target: TableModel, draft: TableModel | None, method: str | Policy = "chain",
                 verifier: str | Verifier = "sps", temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 draft_temperature: float | None = None, horizon: int | None = None, **method_options):
        self.target, self.draft = target, draft
        self.policy = POLICIES[method](**method_options) if isinstance(method, str) else method
        self.verifier = VERIFIERS[verifier]() if isinstance(verifier, str) else verifier
        self.sampling = SamplingConfig(temperature, top_k, top_p)
        dt = temperature if draft_temperature is None else draft_temperature
        self.draft_sampling = SamplingConfig(dt, top_k, top_p) if not self.sampling.greedy else SamplingConfig(0.0)
        self.horizon = horizon
        self.vocab = target.vocab

    def generate(self, prompt, max_new_tokens: int, seed: int | None = None, ignore_eos: bool = True,
                 generator: torch.Generator | None = None) -> TableResult:
        gen = generator if generator is not None else make_generator(seed)
        horizon = max(self.horizon or 0, max_new_tokens)
        target = self.target.session()
        draft = self.draft.session() if self.draft is not None else None
        context, out = list(prompt), TableResult([])
        while len(out.token_ids) < max_new_tokens:
            room = horizon - len(out.token_ids) - 1
            tree = self.policy.draft(DraftContext(draft, context, self.draft_sampling, gen, max(room, 0)))
            logits = target.forward(context, tree, list(range(len(tree))))
            verdict = self.verifier.verify(tree, logits, self.sampling, gen)
            proposed = [tree.tokens[i] for i in verdict.path] + [verdict.bonus]
            kept = proposed[: max_new_tokens - len(out.token_ids)]
            target.commit([0] + verdict.path)
            if draft is not None:
                draft.commit([0] + verdict.path)
            context += kept
            out.token_ids += kept
            out.accepted.append(len(verdict.path))
        return out


# ---- exact and sampled distributions ------------------------------------------------------------------------------
def exact_target_distribution(model_or_table, prompt: list[int], k: int, sampling: SamplingConfig) -> torch.Tensor:
    """P(first k generated tokens = c) under the warped target, for all vocab^k continuations c (float64)."""
    table = model_or_table if isinstance(model_or_table, TableModel) else TableModel.from_model(model_or_table, prompt, k - 1)
    if table.prompt != list(prompt) or table.depth < k - 1:
        raise ValueError("the table does not cover this prompt to depth k - 1")
    dist = torch.ones(1, dtype=torch.float64)
    for length in range(k):
        step = sampling.probs(table.layer(length)).to(torch.float64)  # (vocab^length, vocab)
        dist = (dist[:, None] * step).reshape(-1)
    return dist


def seeds(seed: int, n: int) -> list[int]:
    """n well-separated seeds derived from one."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**62, (n,), generator=g).tolist()


def cell(tokens: list[int], vocab: int) -> int:
    index = 0
    for t in tokens:
        index = index * vocab + t
    return index


@contextmanager
def sampling_mode():
    """How the statistical tests run their tens of thousands of generations: torch on one intra-op thread (tiny
    tensors are ~100x faster without thread hand-offs on a busy machine), and no autograd bookkeeping
    (inference_mode: no version counters or grad tracking on the thousands of tiny tensors a generation makes, 20-25%
    of a sample on 8-token tables: traversal 1.04 -> 0.81 ms, greedy-draft 0.83 -> 0.66 ms; Intel Xeon host,
    2026-11-29). Gradients play no part in decoding, so the draws are the same."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(before)


def sample_outputs(decoder_or_factory, prompt: list[int], k: int, n: int, seed: int,
                   max_new_tokens: int | None = None, vocab: int | None = None) -> torch.Tensor:
    """Counts (vocab^k,) of the first k generated tokens over n generations.

    Works with a TableDecoder (all runs share one generator seeded with `seed`) or a SpeculativeDecoder (each run gets
    its own seed, derived from `seed`), or a zero-argument factory of either; generation runs for `max_new_tokens`
    (default k) tokens with ignore_eos, so trees may reach past the k tokens that are counted.
    """
    dec = decoder_or_factory if hasattr(decoder_or_factory, "generate") else decoder_or_factory()
    vocab = vocab or getattr(dec, "vocab", None) or dec.target.config.vocab_size
    counts = torch.zeros(vocab**k, dtype=torch.float64)
    with sampling_mode():
        if isinstance(dec, TableDecoder):
            gen = make_generator(seed)
            runs = (dec.generate(prompt, max_new_tokens or k, generator=gen) for _ in range(n))
        else:
            runs = (dec.generate(prompt, max_new_tokens=max_new_tokens or k, seed=s, ignore_eos=True) for s in seeds(seed, n))
        for res in runs:
            counts[cell(res.token_ids[:k], vocab)] += 1
    return counts


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


@dataclass
class FitReport:
    n: int
    cells: int  # after pooling cells with small expected counts
    chi2: float
    p_value: float
    power: float  # probability of rejecting when the truth is any distribution at TV distance `tv`
    tv_detectable: float
    empirical_tv: float


def power_against_tv(n: int, df: int, tv: float, alpha: float) -> float:
    """Lower bound on the chi-square test's power against every alternative at total-variation distance tv.

    Under an alternative p' the statistic is about noncentral chi-square with noncentrality n * chi2(p' || p), and
    chi2(p' || p) = sum (p' - p)^2 / p >= (sum |p' - p|)^2 = (2 tv)^2 (Cauchy-Schwarz), so lambda >= 4 n tv^2.
    """
    crit = stats.chi2.isf(alpha, df)
    return float(stats.ncx2.sf(crit, df, 4 * n * tv * tv))


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor, tv: float = 0.02, alpha: float = 1e-3,
                    min_expected: float = 5.0) -> FitReport:
    counts, probs = counts.double(), probs.double()
    n = int(counts.sum())
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < min_expected:  # fold a too-small pooled cell into the smallest regular one
        if exp[-1] > 0 or obs[-1] > 0:
            j = int(torch.argmin(exp[:-1]))
            obs[j] += obs[-1]
            exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    impossible = float(counts[probs == 0].sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = max(len(obs) - 1, 1)
    p_value = 0.0 if impossible else float(stats.chi2.sf(chi2, df))
    return FitReport(n, len(obs), chi2, p_value, power_against_tv(n, df, tv, alpha), tv,
                     total_variation(counts, probs))


def assert_same_distribution(counts: torch.Tensor, probs: torch.Tensor, tv: float = 0.02, alpha: float = 1e-3,
                             power: float = 0.95) -> FitReport:
    """Fail if the samples do not fit `probs` (chi-square, level alpha), or if there are too few of them to catch
    any deviation of total variation >= tv with probability >= power. Returns the report."""
    rep = goodness_of_fit(counts, probs, tv, alpha)
    if rep.power < power:
        raise AssertionError(f"too few samples ({rep.n}) to detect a TV error of {tv} with power {power} "
                             f"(power {rep.power:.3f} over {rep.cells} cells); the test would have no teeth")
    if rep.p_value < alpha:
        raise AssertionError(f"samples do not follow the target distribution: chi2 = {rep.chi2:.1f} over "
                             f"{rep.cells} cells, p = {rep.p_value:.2e} < {alpha}, empirical TV = {rep.empirical_tv:.4f}")
    return rep


def samples_needed(df: int, tv: float = 0.02, alpha: float = 1e-3, power: float = 0.95) -> int:
    """Smallest n with power_against_tv(n, df, tv, alpha) >= power."""
    lo, hi = 1, 1
    while power_against_tv(hi, df, tv, alpha) < power:
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if power_against_tv(mid, df, tv, alpha) < power else (lo, mid)
    return lo


def plan_samples(probs: torch.Tensor, tv: float = 0.02, alpha: float = 1e-3, power: float = 0.95,
                 min_expected: float = 5.0) -> int:
    """How many samples `assert_same_distribution(..., tv, alpha, power)` needs for this target distribution."""
    n = samples_needed(max(len(probs) - 1, 1), tv, alpha, power)
    for _ in range(8):
        cells = int((probs * n >= min_expected).sum()) + 1  # the regular cells and the pooled one
        new = samples_needed(max(cells - 1, 1), tv, alpha, power)
        if new == n:
            break
        n = new
    return int(n * 1.03) + 1
