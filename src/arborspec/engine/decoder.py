"""The draft -> verify -> commit loop. It knows the seams (policy, verifier, sessions), not any paper.

One step: the policy drafts a tree on the draft model's cache; the target runs the whole tree in one forward; the
verifier picks the accepted path and a bonus token; both caches keep only what was committed.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch

from ..backends import check_session_support, make_session
from ..backends.batching import sharing
from ..backends.model_info import check_pair, context_window, eos_ids, pair_names
from ..core.options import check_int
from ..core.sampling import SamplingConfig, make_generator
from ..core.tree import ORDERS, DrawRule, TokenTree
from ..drafting import POLICIES, DraftContext
from ..drafting.budget_tuner import make_policy
from ..drafting.grafts.budget import GraftBudget
from ..drafting.grafts.lookahead import Lookahead
from ..drafting.grafts.ngram import add_ngram_branch
from ..drafting.grafts.suffix import default_suffix_nodes, graft_suffix_branches
from ..drafting.grafts.suffix_index import SuffixIndex
from ..verify import VERIFIERS, fits
from ..verify.base import draw, root_optimum, target_probs


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


@dataclass
class GenerationStats:
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
    steps: list[StepStats] = field(default_factory=list)
    policy: dict = field(default_factory=dict)  # the policy's account of its choices (auto: trees, calibration,
    # guard); the speculative loop fills it in when the generation ends, not at every step

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens committed per target forward (the papers' tau / M / MAT), bonus token included."""
        return self.new_tokens / max(self.n_steps, 1)

    @property
    def mean_accepted(self) -> float:
        """Mean drafted tokens accepted per step (bonus excluded)."""
        return sum(s.accepted for s in self.steps) / max(self.n_steps, 1)

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

    @property
    def decode_time(self) -> float:
        return self.t_total - self.t_prefill

    @property
    def tokens_per_s(self) -> float:
        """Decoding throughput: new tokens over the time after the prompt was prefilled."""
        return self.new_tokens / self.decode_time if self.decode_time > 0 else 0.0

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
            mean_tree_size=sum(s.tree_size for s in self.steps) / max(self.n_steps, 1),
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


def _unwrap(model_or_loaded, tokenizer=None):
    """Accept a LoadedModel, a (model, tokenizer) pair, or a bare model; return (model, tokenizer)."""
    if hasattr(model_or_loaded, "model") and hasattr(model_or_loaded, "tokenizer"):
        return model_or_loaded.model, model_or_loaded.tokenizer
    return model_or_loaded, tokenizer



def suffix_nodes(method: str | None, suffix: int | None) -> int:
    """The suffix-tree nodes a step of `method` may graft: `suffix` as asked, or for None the method's default
    (drafting/grafts/suffix.py: default_suffix_nodes); the one place that default is resolved (the decoder, and the
    bench's records through RunSpec.suffix_nodes)."""
    return default_suffix_nodes(method) if suffix is None else suffix


@contextmanager
def torch_threads(n: int | None):
    """torch on `n` intra-op threads inside the block (None: unchanged); restored after, also on errors."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None and n != before:
            torch.set_num_threads(before)


def with_free_branches(tree: TokenTree, graft: Callable[[TokenTree], TokenTree], bare_only: bool, verifier,
                       free_verifier) -> tuple[TokenTree, object]:
    """(the step's tree, its verifier): `graft` adds the free branches (n-gram, suffix, lookahead) to the drafted
    `tree`, or, with `bare_only`, only to a tree the policy left bare; a tree that got some is verified by
    `free_verifier` (SpeculativeDecoder._grafts_bare_trees_only says why and when that is naive)."""
    drafted = len(tree)
    if bare_only and drafted > 1:
        return tree, verifier
    tree = graft(tree)
    return tree, (free_verifier if len(tree) > drafted else verifier)


class SpeculativeDecoder:
    """Tree speculative decoding of `target`, drafted by `draft`, with one policy and one verifier.

    >>> dec = SpeculativeDecoder(target, draft)  # method "auto": trees sized from this machine's measured costs
    >>> dec.generate("def fib(n):", max_new_tokens=64).text
    """

    def __init__(
        self,
        target,
        draft=None,
        method: str = "auto",
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        draft_temperature: float | None = None,
        verifier: str | None = None,
        allow_lossy: bool = False,
        tokenizer=None,
        token_order: str = "bfs",
        record_trees: bool = False,
        measure_optimum: bool = False,
        ssm_tree: str = "packed",
        ngram: int = 0,
        ngram_len: int = 8,
        suffix: int | None = None,
        suffix_store: int = 0,
        lookahead: int = 0,
        lookahead_ngram: int = 3,
        lookahead_guesses: int | None = None,
        **method_options,
    ):
        # every setting but the models, for fork(): the same decoder again, with a policy state of its own
        self._settings = {k: v for k, v in locals().items()
                          if k not in ("self", "target", "draft", "tokenizer", "method_options")} | method_options
        if token_order not in ORDERS:
            raise ValueError(f"unknown token order {token_order!r}; choose one of: {', '.join(ORDERS)}")
        self.token_order = token_order  # how tree tokens are laid out in the target's forward (DySpec App. C)
        self.record_trees = record_trees
        # per step at T > 0, the best first-token acceptance any exact verifier could reach on the tree (the bench's
        # "distance to the optimum"); a sort of the vocabulary a step, so only on request, and its time is left out
        self.measure_optimum = measure_optimum
        if ssm_tree not in ("packed", "unrolled"):
            raise ValueError(f"unknown ssm_tree {ssm_tree!r}; choose 'packed' or 'unrolled'")
        self.ssm_tree = ssm_tree  # STree backend for Mamba2 / hybrid models: 'packed' tree or 'unrolled' paths
        # free branches the caller did not ask for (auto's default suffix branches) are grafted at T > 0 only onto
        # the trees the policy left bare (`bare_grafts`, set with the verifier)
        by_default = suffix is None and not ngram and not lookahead
        suffix = suffix_nodes(method, suffix)  # the method's default for None: auto grafts suffix branches
        for name, value in (("ngram", ngram), ("ngram_len", ngram_len), ("suffix", suffix),
                            ("suffix_store", suffix_store)):
            check_int(value, name, 0)
        self.ngram, self.ngram_len = int(ngram), int(ngram_len)  # prompt-lookup branches (drafting/grafts/ngram.py)
        # suffix branches (drafting/grafts/suffix.py): up to `suffix` nodes a step, as deep as that (a copied span is a
        # chain); the index (and its store of earlier outputs) lives as long as the decoder, so later requests can
        # draft from earlier ones
        self.suffix = int(suffix)
        self.suffix_index = SuffixIndex(max_depth=max(8, self.suffix), store=int(suffix_store)) if suffix else None
        # lookahead branches (drafting/grafts/lookahead.py): a Jacobi window `lookahead` guesses wide, `lookahead_ngram`-grams,
        # up to `lookahead_guesses` pool n-grams a step (default: as many as the window is wide, the paper's G = W);
        # one window and pool per request (made in `steps`)
        check_int(lookahead, "lookahead", 0)
        lookahead_guesses = lookahead if lookahead_guesses is None else lookahead_guesses
        if lookahead:
            Lookahead(lookahead, lookahead_ngram, lookahead_guesses)  # checks the numbers now, not at the first step
        self.lookahead = (int(lookahead), int(lookahead_ngram), int(lookahead_guesses)) if lookahead else None
        self.target, self.tokenizer = _unwrap(target, tokenizer)
        self.draft, draft_tok = _unwrap(draft) if draft is not None else (None, None)
        if self.tokenizer is None:
            self.tokenizer = draft_tok
        if self.draft is not None:  # the draft's token ids must mean what the target's do
            check_pair(self.target, self.draft, self.tokenizer, draft_tok, pair_names(target, draft))
        if method not in POLICIES:
            raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(sorted(POLICIES))}")
        self.policy = make_policy(POLICIES[method], method_options)
        self.sampling = SamplingConfig(temperature, top_k, top_p)
        dt = temperature if draft_temperature is None else draft_temperature
        self.draft_sampling = SamplingConfig(dt, top_k, top_p) if not self.sampling.greedy else SamplingConfig(0.0)
        if self.policy.needs_draft and self.draft is None:
            raise ValueError(f"method {method!r} needs a draft model")
        # at T > 0 the default free branches may stay off the drafted trees, whose verifier need not take them then
        may_stay_off = by_default and self.grafts and not self.sampling.greedy
        self.verifier = self._pick_verifier(verifier, allow_lossy, free=self.grafts and not may_stay_off)
        self.bare_grafts = may_stay_off and self._grafts_bare_trees_only()
        # the verifier of a step whose tree carries free branches: naive when they go onto bare trees only
        self.free_verifier = VERIFIERS["naive"]() if self.bare_grafts else self.verifier
        check_session_support(self.target)
        if self.draft is not None and self.policy.needs_draft:
            check_session_support(self.draft)
        # llama.cpp runs its own thread pool; the torch work around its calls (logits checks, warps, verifiers) is
        # small, and on a 2-core CPU torch's second thread only fights llama.cpp's threads for the cores (measured
        # ~10% of a plain step): with no torch model in the loop, torch keeps to one thread during a step
        models = [self.target] + ([self.draft] if self.draft is not None and self.policy.needs_draft else [])
        self.step_threads = None if any(isinstance(m, torch.nn.Module) for m in models) else 1
        # e.g. auto: load or measure the models' cost profiles
        self.policy.bind(self.target, self.draft, self.sampling, self.draft_sampling, self.tokenizer)
        if self.grafts:  # e.g. ar: measure the target's costs, so the budget keeps only free rows that pay
            self.policy.price_free_branches(self.target)

    @property
    def verifier_name(self) -> str:
        """The verifier, as the stats report it: e.g. 'traversal+naive' when bare trees with free branches get naive."""
        return self.verifier.name + ("+naive" if self.free_verifier is not self.verifier else "")

    @property
    def grafts(self) -> bool:
        """Whether draft-free branches (n-gram, suffix, lookahead) are grafted onto every tree."""
        return bool(self.ngram or self.suffix or self.lookahead)

    # ---- construction checks ---------------------------------------------------------------------------------
    def _grafts_bare_trees_only(self) -> bool:
        """Whether free branches go only onto the trees the policy leaves bare (the root alone), each such step
        verified by naive, and the drafted trees, without them, by the policy's own verifier.

        Why: at T > 0 free branches are deterministic children, which only verifiers exact for any tree (naive)
        handle, and naive accepts fewer of a sampled draft's tokens than the policy's own rule (auto's traversal).
        Mixing them would trade draft tokens for free ones; on a bare tree there is nothing to trade, so a step with
        nothing drafted still gets them. Exact because the choice is made before anything is drawn: a policy decides
        whether the root gets children before drawing any (auto: tree_builder.py; a plain or guard step, or no draft
        model at all), so the drafted trees keep their distribution given that choice, and naive is exact for
        whatever tree it is given. Only for free branches the caller did not ask for (auto's default suffix
        branches, at T > 0: __init__ asks only then), and only where the verifier picked for the drafted trees is not
        exact for them (a greedy draft's: naive, which takes them on every tree); `+suffixN` (or ngram, lookahead) at
        T > 0 asks for naive on every tree, and gets it."""
        rules = self.policy.draw_rules(self.draft_sampling) | {DrawRule.DETERMINISTIC}
        return not fits(type(self.verifier), rules, False)

    def _pick_verifier(self, name: str | None, allow_lossy: bool, free: bool):
        """The verifier for the drafted trees; with `free`, for the free branches grafted onto them too."""
        # how children are really drawn depends on the draft's own warp (a greedy draft picks them deterministically)
        rules = self.policy.draw_rules(self.draft_sampling)
        chain = self.policy.draws_chains
        if free:  # grafted branches are deterministic children, and make chains into trees
            rules, chain = rules | {DrawRule.DETERMINISTIC}, False
        if name is None:
            name = self.policy.default_verifier(self.sampling)
            if not self.sampling.greedy and not fits(VERIFIERS[name], rules, chain):
                name = "naive"  # exact for any tree
        if name not in VERIFIERS:
            raise ValueError(f"unknown verifier {name!r}; choose one of: {', '.join(sorted(VERIFIERS))}")
        cls = VERIFIERS[name]
        if not self.sampling.greedy and name == "greedy":
            raise ValueError("verifier 'greedy' needs temperature 0; use a sampling verifier (e.g. 'naive')")
        # at T=0 every rule is greedy, so only the tree shape matters
        if not fits(cls, set() if self.sampling.greedy else rules, chain):
            alternatives = sorted(
                n for n, v in VERIFIERS.items()
                if v.exact and (n != "greedy" or self.sampling.greedy)
                and fits(v, set() if self.sampling.greedy else rules, chain)
            )
            what = (
                "trees with several children per node (it handles chains only)" if cls.chain_only and not chain
                else f"trees whose children are drawn {'/'.join(sorted(r.value for r in rules))}"
            )
            raise ValueError(
                f"verifier {name!r} is not exact for {what} (method {self.policy.name!r} with these options and "
                f"sampling settings); exact alternatives: {', '.join(alternatives) or 'none'}"
            )
        if not cls.exact and not allow_lossy:
            raise ValueError(
                f"verifier {name!r} does not preserve the target distribution; pass allow_lossy=True (--allow-lossy) "
                "to use it anyway"
            )
        return cls()

    # ---- public API ------------------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or tokenizer=...")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.reshape(-1).tolist()
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        window = context_window(self.target)
        if len(ids) >= window:
            raise ValueError(f"the prompt has {len(ids)} tokens; the target's context window is {window}")
        return ids

    def generate(self, prompt, max_new_tokens: int = 128, stop: list[str] | None = None, seed: int | None = None,
                 ignore_eos: bool = False) -> GenerationResult:
        result = None
        for result in self.steps(prompt, max_new_tokens, stop, seed, ignore_eos):
            pass
        return result

    def generate_batch(self, prompts: list, max_new_tokens: int = 128, stop: list[str] | None = None,
                       seeds: list[int | None] | None = None, ignore_eos: bool = False,
                       concurrency: int | None = None) -> list[GenerationResult]:
        """Decode `prompts` at once (at most `concurrency` at a time), one GenerationResult each, in order: every
        round advances each active prompt by one step, with ONE target forward for all of them where the target
        batches (the native backend; engine/batch.py). Each prompt decodes on its own `fork()` with its own seed
        (`seeds[i]`), so its result is what it gets alone, token for token; `stats.t_total` runs from when it joined."""
        from .batch import generate_batch

        return generate_batch(self, prompts, max_new_tokens, stop, seeds, ignore_eos, concurrency)

    def fork(self) -> "SpeculativeDecoder":
        """A decoder with this one's models and settings and a fresh policy: its own calibration, history and suffix
        index, as a new SpeculativeDecoder would have. Cheap: nothing is loaded or measured again."""
        return SpeculativeDecoder(self.target, self.draft, tokenizer=self.tokenizer, **self._settings)

    def stream(self, prompt, max_new_tokens: int = 128, stop: list[str] | None = None, seed: int | None = None,
               ignore_eos: bool = False) -> Iterator[str]:
        """Yield the generated text incrementally, one chunk per step."""
        shown = ""
        for result in self.steps(prompt, max_new_tokens, stop, seed, ignore_eos):
            if result.text.endswith("\ufffd") and result.stats.finish_reason == "":
                continue  # a multi-byte character is split across steps; wait for the rest
            if len(result.text) > len(shown):
                yield result.text[len(shown):]
                shown = result.text
        self.last_result = result

    # ---- the loop --------------------------------------------------------------------------------------------
    def steps(self, prompt, max_new_tokens: int = 128, stop: list[str] | None = None, seed: int | None = None,
              ignore_eos: bool = False) -> Iterator[GenerationResult]:
        """Generate step by step: the result so far after every draft -> verify -> commit step (the server advances
        many requests this way, one step each in turn)."""
        if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        t_start = time.perf_counter()
        ids = self.encode(prompt)
        gen = make_generator(seed)
        eos = set() if ignore_eos else eos_ids(self.target, self.tokenizer)
        window = context_window(self.target)
        stats = GenerationStats(self.policy.name, self.verifier_name, not self.verifier.exact, len(ids))
        use_draft = self.policy.needs_draft and self.policy.uses_draft(len(ids), max_new_tokens)  # auto: can it pay?
        if (self.policy.plain or (self.policy.needs_draft and not use_draft)) and not self.grafts:
            yield from self._plain_steps(ids, max_new_tokens, stop, gen, eos, window, stats, t_start)
            return
        target = make_session(self.target, "target", ssm_tree=self.ssm_tree)
        draft = make_session(self.draft, "draft", ssm_tree=self.ssm_tree) if use_draft else None
        target.prefill(ids[:-1]) if len(ids) > 1 else None
        if draft is not None and len(ids) > 1:
            draft.prefill(ids[:-1])
        stats.t_prefill = time.perf_counter() - t_start
        context, new = list(ids), []
        lookahead = Lookahead(*self.lookahead) if self.lookahead else None
        budget = GraftBudget(getattr(self.policy, "costs", None)) if self.grafts else None  # graft_budget.py
        while not stats.finish_reason:
            with torch_threads(self.step_threads):  # see __init__
                room = min(max_new_tokens - len(new), window - len(context)) - 1  # tokens the tree may add
                t0 = time.perf_counter()
                calls0 = draft.forwards if draft else 0
                tree = self.policy.draft(DraftContext(draft, context, self.draft_sampling, gen, max(room, 0),
                                                      sharing=sharing()))
                verifier = self.verifier
                if self.grafts:
                    tree, verifier = with_free_branches(
                        tree, lambda t: self._graft(t, context, max(room, 0), budget, lookahead), self.bare_grafts,
                        self.verifier, self.free_verifier)
                t1 = time.perf_counter()
                # the target sees the tree packed in `token_order`; the verifier sees it as drafted (sibling order is
                # drawing order) and the draft's cache keeps the drafted indices, so only target rows/slots are mapped
                order = ORDERS[self.token_order](tree)
                packed = order != list(range(len(tree)))
                logits = target.forward(context, tree.permute(order) if packed else tree, list(range(len(tree))))
                at = torch.empty(len(order), dtype=torch.long)
                at[torch.tensor(order)] = torch.arange(len(order))  # at[drafted node] = its packed position
                logits = logits[at] if packed else logits  # (len(tree), vocab), rows in drafted order
                verdict = verifier.verify(tree, logits, self.sampling, gen)
                if lookahead:
                    lookahead.observe(logits)  # the Jacobi step: the window's next guesses from this forward
                t2 = time.perf_counter()
                proposed = [tree.tokens[i] for i in verdict.path] + [verdict.bonus]
                kept, stats.finish_reason = self._apply_stops(new, proposed, eos, max_new_tokens, stop, len(context), window)
                target.commit([0] + [int(at[n]) for n in verdict.path])
                if draft is not None:  # the draft keeps the accepted nodes it has forwarded (leaves never were)
                    draft.commit([n for n in [0] + verdict.path if draft.has(n)])
                context += kept
                new += kept
                step = StepStats(
                    tree_size=len(tree) - 1, depth=tree.depth, widths=tree.widths(), accepted=len(verdict.path),
                    committed=len(kept), draft_calls=(draft.forwards - calls0) if draft else 0,
                    t_draft=t1 - t0, t_verify=t2 - t1, t_other=time.perf_counter() - t2, path=list(verdict.path),
                    sources=tree.by_source(verdict.path),
                )
                if self.record_trees:
                    step.tree = dict(tokens=list(tree.tokens), parents=list(tree.parents), probs=list(tree.probs),
                                     path=list(verdict.path), bonus=int(verdict.bonus), sources=list(tree.sources))
                if self.measure_optimum and not self.sampling.greedy:
                    step.root_optimum = self._root_optimum(tree, logits, stats)
                stats.steps.append(step)
                self.policy.update(step)
                if budget is not None:
                    budget.observe(step.sources)
                    budget.settle(kept)
                if stats.finish_reason:  # the policy's account, once: auto's takes ~2 ms, paid B times a batching round
                    stats.policy = self.policy.explain()
                    if budget is not None:
                        stats.policy = dict(stats.policy, grafts=budget.describe())
                stats.new_tokens = len(new)
                now = time.perf_counter()
                if len(stats.steps) == 1:
                    stats.t_first_token = now - t_start - stats.t_measure
                stats.t_total = now - t_start - stats.t_measure
            yield GenerationResult(self._decode(new), list(new), stats)

    def _graft(self, tree: TokenTree, context: list[int], room: int, budget: GraftBudget,
               lookahead: Lookahead | None) -> TokenTree:
        """`tree` with the draft-free branches (n-gram, suffix, lookahead, in that order) that pay under the policy's
        measured costs, or all of them for a policy without costs (graft_budget.py)."""
        estimate = self.policy.estimate()
        if self.ngram:
            tree, _ = budget.graft(tree, "ngram", lambda t: add_ngram_branch(t, context, self.ngram,
                                                                             min(self.ngram_len, room)), estimate)
        if self.suffix:
            scores: dict[int, float] = {}
            tree, _ = budget.graft(tree, "suffix", lambda t: graft_suffix_branches(
                t, self.suffix_index, context, self.suffix, room, scores=scores), estimate, scores)
        if lookahead:
            tree, kept = budget.graft(tree, "lookahead", lambda t: lookahead.graft(t, context, room), estimate)
            if not kept:
                lookahead.skip()
        return tree

    def _root_optimum(self, tree, logits: torch.Tensor, stats: GenerationStats) -> float | None:
        """verify.base.root_optimum of this step's tree, from the target's logits at its root (row 0); the time it
        takes goes to stats.t_measure, so that measuring it does not slow the timings it is compared with."""
        t = time.perf_counter()
        try:
            return root_optimum(tree, logits[0], self.sampling)
        finally:
            stats.t_measure += time.perf_counter() - t

    def _plain_steps(self, ids, max_new_tokens, stop, gen, eos, window, stats,
                     t_start: float) -> Iterator[GenerationResult]:
        """Plain decoding, one target token a step: what `steps` runs when no step would draft anything (method `ar`,
        or `auto` when no tree can pay on this machine, `policy.uses_draft()` False).

        The general loop would commit the same tokens through root-only trees, but its per-step machinery (tree
        packing, the verifier's warp of every row, the policy's bookkeeping and account) costs milliseconds a step,
        5-10% of a step of llama.cpp's CPU kernels, and the llama.cpp backend must stay within 0.95x of llama.cpp's
        own loop (issue #15). Here a step is one forward of the last token and one pick from its logits row
        (`_pick`: the same token the verifiers take from a root-only tree, from the same generator calls). The first
        forward carries the whole prompt (one call instead of a prefill and a one-token forward, as llama.cpp's own
        loop does); its time counts as the prefill. The policy is not stepped; `stats.policy` is its account.
        """
        target = make_session(self.target, "target", ssm_tree=self.ssm_tree)
        stats.policy = self.policy.explain()
        context, new = list(ids), []
        while not stats.finish_reason:
            with torch_threads(self.step_threads):  # see __init__
                t0 = time.perf_counter()
                tree = TokenTree.root(context[-1])
                logits = target.forward(context, tree, [0])  # (1, vocab)
                t1 = time.perf_counter()
                if not stats.steps:
                    stats.t_prefill, t0 = t1 - t_start, t1
                token = self._pick(logits, gen)
                t2 = time.perf_counter()
                kept, stats.finish_reason = self._apply_stops(new, [token], eos, max_new_tokens, stop, len(context),
                                                              window)
                target.commit([0])
                context += kept
                new += kept
                step = StepStats(tree_size=0, depth=0, widths=[1], accepted=0, committed=len(kept), draft_calls=0,
                                 t_draft=0.0, t_verify=t2 - t0, t_other=time.perf_counter() - t2)
                if self.record_trees:
                    step.tree = dict(tokens=list(tree.tokens), parents=list(tree.parents), probs=list(tree.probs),
                                     path=[], bonus=token)
                stats.steps.append(step)
                stats.new_tokens = len(new)
                now = time.perf_counter()
                if len(stats.steps) == 1:
                    stats.t_first_token = now - t_start
                stats.t_total = now - t_start
            yield GenerationResult(self._decode(new), list(new), stats)

    def _pick(self, logits: torch.Tensor, gen) -> int:
        """The next token from a (1, vocab) logits row, as every exact verifier picks it for a root-only tree: the
        argmax at T = 0 (numpy's: the first maximum, like torch's, and ~15x faster on one thread), else one draw from
        the warped row (verify.base.draw)."""
        if self.sampling.greedy:
            return int(logits[0].numpy().argmax())
        return draw(target_probs(logits, self.sampling)[0], gen)

    def _apply_stops(self, new, proposed, eos, max_new, stop, n_context, window) -> tuple[list[int], str]:
        """Cut `proposed` at EOS, the token budget, the context window or a stop string; say why we stopped."""
        kept = []
        for tok in proposed:
            kept.append(tok)
            if tok in eos:
                return kept, "eos"
            if len(new) + len(kept) >= max_new:
                return kept, "length"
            if n_context + len(kept) >= window:
                return kept, "context"
            if stop and self._hits_stop(new + kept, stop):
                return kept, "stop"
        return kept, ""

    def _hits_stop(self, tokens: list[int], stop: list[str]) -> bool:
        tail = self._decode(tokens[-32:])  # a stop string ends within the last few tokens
        return any(s in tail for s in stop)

    def _decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
