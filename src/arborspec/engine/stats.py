"""What a generation reports: one StepStats per draft -> verify -> commit step, their sums and means
(GenerationStats: the papers' tokens per step, acceptance by depth, throughput, TTFT), and the result around them."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, TypeVar

from .logprobs import TokenLogprob

T = TypeVar("T")


@dataclass
class StepStats:
    tree_size: int  # drafted nodes (root excluded)
    depth: int
    widths: list[int]  # nodes per depth, root layer included
    accepted: int  # drafted tokens the target accepted
    committed: int  # tokens committed this step (accepted + bonus, after stopping rules)
    draft_calls: int
    t_draft: float
    t_verify: float
    t_other: float
    tree: dict | None = None  # with record_trees: tokens, parents, probs, accepted path (node indices), bonus
    path: list[int] = field(default_factory=list)  # accepted node indices (as drafted), for policies that learn
    # with measure_optimum at T > 0: the best rate at which any exact verifier accepts a first token of this tree
    # (verify.base.root_optimum; None where the root's children were not sampled)
    root_optimum: float | None = None
    # who proposed the tree's nodes and the accepted ones: {source: {proposed, accepted, also_accepted}}, credited to
    # the first source that proposed a node (core/tree.py: TokenTree.by_source); accepted adds up to `accepted`
    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    prefill: bool = False  # the prompt's own forward, which makes the first token: no decoding step (see below)


@dataclass
class GenerationStats:
    """Per-step figures (tokens per step, accepted per step, mean tree size, the step count) are over decoding
    steps: the prompt's forward, which makes the first token and drafts nothing, is none, as in the papers' MAT / tau.
    Counted as one, a chain of 5 reported trees of 4.2 and its MAT fell short on short runs. A run of one token has
    only that forward: its figures are that forward's."""

    method: str
    verifier: str
    lossy: bool
    prompt_tokens: int
    new_tokens: int = 0
    finish_reason: str = ""
    t_prefill: float = 0.0
    t_first_token: float = 0.0  # TTFT: from the call to the first committed token
    t_total: float = 0.0
    t_measure: float = 0.0  # seconds spent on measure_optimum's statistics, left out of t_total and t_first_token
    cached_tokens: int = 0  # prompt tokens the target did not prefill: an earlier request's cache (prefix_cache.py)
    steps: list[StepStats] = field(default_factory=list)
    policy: dict = field(default_factory=dict)  # the policy's account of its choices (auto: trees, calibration,
    # guard); the speculative loop fills it in when the generation ends, not at every step

    @property
    def decoding_steps(self) -> list[StepStats]:
        """The steps after the prompt's forward (all of them where there is nothing else)."""
        return [s for s in self.steps if not s.prefill] or self.steps

    @property
    def n_steps(self) -> int:
        return len(self.decoding_steps)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens committed per decoding step's target forward (the papers' tau / M / MAT), bonus included."""
        return sum(s.committed for s in self.decoding_steps) / max(self.n_steps, 1)

    @property
    def mean_accepted(self) -> float:
        """Mean drafted tokens accepted per decoding step (bonus excluded)."""
        return sum(s.accepted for s in self.decoding_steps) / max(self.n_steps, 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens / drafted tokens."""
        drafted = sum(s.tree_size for s in self.steps)
        return sum(s.accepted for s in self.steps) / drafted if drafted else 0.0

    @property
    def accepted_at_depth(self) -> list[float]:
        """Per-position acceptance: entry d-1 is the share of the steps whose tree reached depth d that accepted at
        least d drafted tokens (how far into its trees the target follows the draft)."""
        deepest = max((s.depth for s in self.steps), default=0)
        shares = []
        for d in range(1, deepest + 1):
            reached = [s for s in self.steps if s.depth >= d]
            shares.append(sum(s.accepted >= d for s in reached) / len(reached))
        return shares

    @property
    def zero_accept_share(self) -> float:
        """Among steps that drafted anything, the share whose drafted tokens were all rejected."""
        drafted = [s for s in self.steps if s.tree_size > 0]
        return sum(s.accepted == 0 for s in drafted) / len(drafted) if drafted else 0.0

    @property
    def root_acceptance(self) -> float | None:
        """Over the steps with a root optimum (measure_optimum, T > 0, sampled root children): the share that
        accepted a first drafted token. None without such steps."""
        measured = [s for s in self.steps if s.root_optimum is not None]
        return sum(s.accepted >= 1 for s in measured) / len(measured) if measured else None

    @property
    def root_optimum(self) -> float | None:
        """The mean of the steps' root optimum: what root_acceptance would be under the best exact verifier for the
        same trees (an upper bound where children were drawn without replacement; rules.py says how tight)."""
        values = [s.root_optimum for s in self.steps if s.root_optimum is not None]
        return sum(values) / len(values) if values else None

    @property
    def sources(self) -> dict[str, dict[str, int]]:
        """The steps' per-source counts summed (StepStats.sources): which source supplied the accepted tokens."""
        out: dict[str, dict[str, int]] = {}
        for step in self.steps:
            for source, counts in step.sources.items():
                total = out.setdefault(source, dict.fromkeys(counts, 0))
                for key, n in counts.items():
                    total[key] = total.get(key, 0) + n
        return out

    def measure(self, work: Callable[[], T]) -> T:
        """`work()`, its time added to t_measure: a statistic (measure_optimum's) whose time must not slow the step
        timings it is compared with."""
        t = time.perf_counter()
        try:
            return work()
        finally:
            self.t_measure += time.perf_counter() - t

    @property
    def tokens_per_s(self) -> float:
        """Decoding throughput: the tokens after the first over the time after the first (1 / TPOT; 0 for a single
        token). Everything after the first token counts, a speculative run's draft prefill included, so plain and
        speculative runs compare on the same terms: new tokens over the time after the prefill counted the first
        token, which the prompt's own forward makes, without its time, and left the draft's prefill out (a run of
        one token read 5000 tokens/s)."""
        after = self.t_total - self.t_first_token
        return (self.new_tokens - 1) / after if self.new_tokens > 1 and after > 0 else 0.0

    @property
    def tpot(self) -> float:
        """Time per output token after the first one."""
        return (self.t_total - self.t_first_token) / max(self.new_tokens - 1, 1)

    def to_dict(self, per_step: bool = False) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "steps"}
        out.update(
            steps=self.n_steps,
            tokens_per_step=self.tokens_per_step,
            mean_accepted=self.mean_accepted,
            acceptance_rate=self.acceptance_rate,
            accepted_at_depth=self.accepted_at_depth,
            zero_accept_share=self.zero_accept_share,
            root_acceptance=self.root_acceptance,
            root_optimum=self.root_optimum,
            tokens_per_s=self.tokens_per_s,
            tpot=self.tpot,
            t_draft=sum(s.t_draft for s in self.steps),
            t_verify=sum(s.t_verify for s in self.steps),
            t_other=sum(s.t_other for s in self.steps),
            mean_tree_size=sum(s.tree_size for s in self.decoding_steps) / max(self.n_steps, 1),
            draft_calls=sum(s.draft_calls for s in self.steps),
            sources=self.sources,
        )
        if per_step:
            out["per_step"] = [asdict(s) for s in self.steps]
        return out


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for (engine/logprobs.py)
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token, when asked for


def tree_record(tree, path: list[int], bonus: int) -> dict:
    """StepStats.tree with record_trees: the step's tree as drafted (tokens, parents, probs, who proposed each node),
    the accepted path (node indices) and the bonus token; what viz/trees.py draws."""
    return dict(tokens=list(tree.tokens), parents=list(tree.parents), probs=list(tree.probs), path=list(path),
                bonus=int(bonus), sources=list(tree.sources))
