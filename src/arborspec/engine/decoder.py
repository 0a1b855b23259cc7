"""The draft -> verify -> commit loop. It knows the seams (policy, free branches, verifier, sessions), not any paper.

One step (`steps`): the policy drafts a tree on the draft model's cache and the free branches are grafted onto it
(drafting/grafts/branches.py); the target runs the whole tree in one forward; the verifier picks the accepted path
and a bonus token; both caches keep only what was committed. Around it: the settings (config.py), the verifier's
choice (verifier_choice.py), a generation's stopping rules and clocks (generation.py), what a step records
(stats.py), torch's threads during a step (threads.py).
"""
from __future__ import annotations

import time
from typing import Generator, Iterator

import torch

from ..backends import check_session_support, make_session
from ..backends.batching import sharing
from ..backends.model_info import check_pair, context_window, eos_ids, model_and_tokenizer, pair_names, warn_unapplied
from ..backends.session import vocab_aligned
from ..core.options import check_bool, check_int
from ..core.sampling import make_generator
from ..core.tree import ORDERS, TokenTree
from ..drafting import POLICIES, DraftContext
from ..drafting.budget_tuner import make_policy
from ..verify.base import draw, root_optimum, target_probs
from .config import DecoderConfig, per_call
from .generation import Generation, check_budget
from .logprobs import TokenLogprob, token_logprobs
from .prefix_cache import PrefixCache
from .prompts import decode_text, model_prompt_ids
from .stats import GenerationResult, GenerationStats, StepStats, tree_record
from .threads import step_threads, torch_threads
from .verifier_choice import changes_outputs, choose_verifiers, with_free_branches

PROMPT_PIECE = 64  # prompt tokens a forward reads when it keeps their logits: (64, vocab) rows, ~39 MB for Qwen2.5


class SpeculativeDecoder:
    """Tree speculative decoding of `target`, drafted by `draft`, with one policy and one verifier.

    >>> dec = SpeculativeDecoder(target, draft)  # method "auto": trees sized from this machine's measured costs
    >>> dec.generate("def fib(n):", max_new_tokens=64).text
    >>> SpeculativeDecoder(target, draft, method="chain", k=4, temperature=0.7)  # = DecoderConfig.of(method=...)
    """

    def __init__(self, target, draft=None, config: DecoderConfig | None = None, tokenizer=None,
                 prefix_cache: PrefixCache | None = None, **options):
        """`config` (default: DecoderConfig's defaults) with the keyword `options` on top: DecoderConfig's fields,
        temperature / top_k / top_p, and the policy's options (DecoderConfig.of). `prefix_cache`: finished
        generations' caches to start from (engine/prefix_cache.py; the server shares one among its requests)."""
        self.prefix_cache = prefix_cache
        if isinstance(draft, DecoderConfig):
            raise TypeError("got a DecoderConfig as the draft model; pass it as config=... (draft=None: no draft)")
        if config is not None and not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}; name the method by "
                            "keyword (method=...)")
        self.config = c = DecoderConfig.of(config, **options)
        self.free = c.free_branches()  # n-gram, suffix and lookahead branches (false when none)
        self.target, self.tokenizer = model_and_tokenizer(target, tokenizer)
        warn_unapplied(self.target)  # a generation config's logits processors
        self.draft, draft_tok = model_and_tokenizer(draft) if draft is not None else (None, None)
        if self.tokenizer is None:
            self.tokenizer = draft_tok
        if self.draft is not None:  # the draft's token ids must mean what the target's do
            check_pair(self.target, self.draft, self.tokenizer, draft_tok, pair_names(target, draft))
        self.policy = make_policy(POLICIES[c.method], dict(c.method_options))
        self.sampling, self.draft_sampling = c.sampling, c.draft_sampling
        if self.policy.needs_draft and self.draft is None:
            raise ValueError(f"method {c.method!r} needs a draft model")
        self.verifier, self.free_verifier, self.bare_grafts = choose_verifiers(
            self.policy, self.sampling, self.draft_sampling, c.verifier, c.allow_lossy, bool(self.free),
            self.free.by_default)
        drafts = self.draft is not None and self.policy.needs_draft
        for model in [self.target] + ([self.draft] if drafts else []):
            check_session_support(model)
        self.step_threads = step_threads([self.target] + ([self.draft] if drafts else []))
        # e.g. auto: load or measure the models' cost profiles
        self.policy.bind(self.target, self.draft, self.sampling, self.draft_sampling, self.tokenizer,
                         self.verifier.name, c.ssm_tree)
        if self.free:  # e.g. ar: measure the target's costs, so the budget keeps only free rows that pay
            self.policy.price_free_branches(self.target)

    @property
    def verifier_name(self) -> str:
        """The verifier, as the stats report it: e.g. 'traversal+naive' when bare trees with free branches get naive."""
        return self.verifier.name + ("+naive" if self.free_verifier is not self.verifier else "")

    @property
    def context_window(self) -> int:
        """The most tokens the target takes, prompt and generation together."""
        return context_window(self.target)

    # ---- public API ------------------------------------------------------------------------------------------
    def encode(self, prompt, room: int = 1) -> list[int]:
        """A prompt's token ids (text, a conversation or ids: engine/prompts.py), checked to fit the target with
        `room` tokens after it."""
        return model_prompt_ids(self.tokenizer, prompt, self.target, self.draft, room)

    @per_call
    def generate(self, prompt, max_new_tokens: int = 128, stop: list[str] | None = None, seed: int | None = None,
                 ignore_eos: bool = False, logprobs: int | None = None,
                 prompt_logprobs: bool = False) -> GenerationResult:
        """`prompt`: text, a conversation (a list of {"role", "content"} messages) or token ids (`encode`). A `stop`
        string ends the generation with the token that completes it, kept in the text as transformers' stop_strings
        keep it (the server cuts the text before it, as OpenAI does: server/output.py).
        `logprobs` k: result.logprobs holds each token's log-probability under the target and its k most likely
        alternatives (engine/logprobs.py); None: not computed. `prompt_logprobs` (with `logprobs`): the same for
        the prompt's tokens, in result.prompt_logprobs (the first token's logprob is None: nothing predicts it);
        `max_new_tokens` may then be 0, to score the prompt alone."""
        result = None
        for result in self.steps(prompt, max_new_tokens, stop, seed, ignore_eos, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs, partial=False):
            pass
        return result

    @per_call
    def generate_batch(self, prompts: list, max_new_tokens: int = 128, stop: list[str] | None = None,
                       seeds: list[int | None] | None = None, ignore_eos: bool = False,
                       concurrency: int | None = None) -> list[GenerationResult]:
        """Decode `prompts` at once (at most `concurrency` at a time), one GenerationResult each, in order: every
        round advances each active prompt by one step, with ONE target forward for all of them where the target
        batches (the native backend; engine/many_prompts.py). Each prompt decodes on its own `fork()` with its own seed
        (`seeds[i]`), so its result is what it gets alone, token for token; `stats.t_total` runs from when it joined."""
        from .many_prompts import generate_batch

        return generate_batch(self, prompts, max_new_tokens, stop, seeds, ignore_eos, concurrency)

    def fork(self) -> "SpeculativeDecoder":
        """A decoder with this one's models and config and a fresh policy: its own calibration, history and suffix
        index, as a new SpeculativeDecoder would have. Cheap: nothing is loaded or measured again."""
        return SpeculativeDecoder(self.target, self.draft, self.config, tokenizer=self.tokenizer,
                                  prefix_cache=self.prefix_cache)

    @per_call
    def stream(self, prompt, max_new_tokens: int = 128, stop: list[str] | None = None, seed: int | None = None,
               ignore_eos: bool = False) -> Iterator[str]:
        """Yield the generated text incrementally, one chunk per step."""
        shown, self.last_result = "", None  # then the result so far: a stream stopped early keeps what it made
        for result in self.steps(prompt, max_new_tokens, stop, seed, ignore_eos):
            self.last_result = result
            if result.text.endswith("\ufffd") and result.stats.finish_reason == "":
                continue  # a multi-byte character is split across steps; wait for the rest
            if len(result.text) > len(shown):
                yield result.text[len(shown):]
                shown = result.text

    # ---- the loop --------------------------------------------------------------------------------------------
    @per_call
    def steps(self, prompt, max_new_tokens: int = 128, stop: list[str] | None = None, seed: int | None = None,
              ignore_eos: bool = False, prefill_chunk: int = 0, logprobs: int | None = None,
              prompt_logprobs: bool = False, partial: bool = True) -> Iterator[GenerationResult | None]:
        """Generate step by step: the result so far after every draft -> verify -> commit step (the server advances
        many requests this way, one step each in turn). `seed` None: the config's (sampling.seed); `logprobs`,
        `prompt_logprobs`: as `generate`'s (the prompt is then read in chains of forwards that keep its rows).
        `partial` False: None in place of every result but the last, for callers that keep only the last
        (`generate`, `generate_batch`), which then do not pay for decoding the text at every step
        (Generation.record).

        `prefill_chunk` > 0 (the server's `--prefill-chunk`): each model reads a long prompt that many tokens per
        call, and the loop yields None after each such piece, before its next result. A server round then carries
        one piece of a joining request's prompt, not all of it: a 1024-token prompt is ~5.4 s of the default
        target's prefill, and the same total in pieces of 64-512 (Zen 4), so the other requests keep streaming. The
        tokens are the same: only sessions whose rows are computed alone (`rows_alone`: the native backend's) read
        in pieces, so a cached key is the same bits however the prompt was cut; other sessions read it at once."""
        check_int(prefill_chunk, "prefill_chunk", 0)
        prompt_logprobs = check_bool(prompt_logprobs, "prompt_logprobs")  # the text "no" is true to Python
        if logprobs is not None:
            check_int(logprobs, "logprobs", 0)
        elif prompt_logprobs:
            raise ValueError("prompt_logprobs needs logprobs (how many alternatives each token comes with)")
        run = self._start(prompt, max_new_tokens, stop, seed, ignore_eos, scoring=prompt_logprobs)
        run.top_logprobs, run.partial = logprobs, check_bool(partial, "partial")
        policy = self.policy
        use_draft = policy.needs_draft and policy.uses_draft(len(run.context), max_new_tokens)  # auto: can it pay?
        target = yield from self._target_session(run, prefill_chunk, prompt_logprobs)
        if max_new_tokens == 0:  # a prompt scored (prompt_logprobs), nothing generated
            yield run.scored()
            return
        run.sessions.append(target)
        try:
            if (policy.plain or (policy.needs_draft and not use_draft)) and not self.free:
                yield from self._plain_steps(run, target)
            else:
                yield from self._speculative_steps(run, target, use_draft, prefill_chunk)
        except GeneratorExit:  # the caller stopped early (Ctrl-C in `arborspec chat`, a client that left)
            if not run.finished:  # what was committed is good: a next turn that begins with it starts from it
                self._keep(*run.sessions)
            raise

    def _speculative_steps(self, run: Generation, target, use_draft: bool,
                           prefill_chunk: int) -> Iterator[GenerationResult | None]:
        """`steps` once the target has read the prompt: its first token, then draft -> verify -> commit."""
        policy = self.policy
        # The first token comes from the prompt's own forward, as in the plain loop, and is streamed before the draft
        # reads the prompt: time to the first token is the target's prefill alone (the draft's prefill added ~0.2 s
        # of the default pair's 0.66 s on HumanEval prompts, Zen 4), and the prompt's forward yields a token where
        # a prefill of all but its last token yielded none. A request that ends there never prefills the draft.
        first = self._plain_step(run, target)
        if run.finished:  # the result is a copy made before: its stats get the account too
            run.stats.policy = first.stats.policy = policy.explain()
            self._keep(target, None)
        yield first
        if run.finished:
            return
        draft = (yield from self._draft_session(run, prefill_chunk)) if use_draft else None
        run.sessions.append(draft)
        free = self.free.start(policy) if self.free else None  # this generation's lookahead window, graft budget
        while not run.finished:
            with torch_threads(self.step_threads):
                t0, calls0, room = time.perf_counter(), draft.forwards if draft else 0, run.room()
                tree = policy.draft(DraftContext(draft, run.context, self.draft_sampling, run.generator,
                                                 run.draft_room(room, self.draft), sharing=sharing()))
                verifier = self.verifier
                if free:
                    tree, verifier = with_free_branches(tree, lambda t: free.graft(t, run.context, room),
                                                        self.bare_grafts, self.verifier, self.free_verifier)
                t1 = time.perf_counter()
                logits, at = self._target_forward(target, run.context, tree)
                verdict = verifier.verify(tree, logits, self.sampling, run.generator)
                if free:
                    free.observe(logits)  # lookahead's Jacobi step: the window's next guesses from this forward
                t2 = time.perf_counter()
                kept = run.commit([tree.tokens[i] for i in verdict.path] + [verdict.bonus])
                run.note_logprobs(logits, [0] + verdict.path, kept)  # node n's row predicts the token after it
                target.commit([0] + [at[n] for n in verdict.path])
                if draft is not None:  # the draft keeps the accepted nodes it has forwarded (leaves never were)
                    draft.commit([n for n in [0] + verdict.path if draft.has(n)])
                step = self._step_stats(run, tree, logits, verdict, kept, (draft.forwards - calls0) if draft else 0,
                                        (t0, t1, t2))
                policy.update(step)
                if free:
                    free.settle(step.sources, kept)
                if run.finished:  # the policy's account, once: auto's takes ~2 ms, paid B times a batching round
                    run.stats.policy = policy.explain() | ({"grafts": free.describe()} if free else {})
                    self._keep(target, draft)
                result = run.record(step)
            yield result

    def _start(self, prompt, max_new_tokens, stop, seed, ignore_eos, scoring: bool = False) -> Generation:
        check_budget(max_new_tokens, scoring)
        t_start = time.perf_counter()
        ids = self.encode(prompt, room=min(max_new_tokens, 1))  # a prompt scored alone may fill the window
        generator = make_generator(self.sampling.seed if seed is None else seed)
        eos = set() if check_bool(ignore_eos, "ignore_eos") else eos_ids(self.target, self.tokenizer)
        lossy = changes_outputs(self.verifier, self.sampling, self.policy, bool(self.free))
        stats = GenerationStats(self.policy.name, self.verifier_name, lossy, len(ids))
        return Generation(ids, max_new_tokens, stop, eos, context_window(self.target),
                          self._decode if self.tokenizer is not None else None, stats, generator, t_start)

    def _target_forward(self, target, context: list[int], tree: TokenTree) -> tuple[torch.Tensor, list[int]]:
        """The target's logits of `tree` (len(tree), vocab), rows in drafted order, and each drafted node's position
        in the forward. The target sees the tree packed in `token_order`; the verifier sees it as drafted (sibling
        order is drawing order) and the draft's cache keeps the drafted indices, so only target rows/slots map."""
        order = ORDERS[self.config.token_order](tree)
        if order == list(range(len(tree))):
            return target.forward(context, tree, list(range(len(tree)))), order
        logits = target.forward(context, tree.permute(order), list(range(len(tree))))
        at = torch.empty(len(order), dtype=torch.long)
        at[torch.tensor(order)] = torch.arange(len(order))  # at[drafted node] = its packed position
        return logits[at], at.tolist()

    def _step_stats(self, run: Generation, tree: TokenTree, logits: torch.Tensor, verdict, kept: list[int],
                    draft_calls: int, times: tuple[float, float, float]) -> StepStats:
        """What a speculative step records; `times`: when it started, finished drafting, finished verifying."""
        t0, t1, t2 = times
        step = StepStats(
            tree_size=len(tree) - 1, depth=tree.depth, widths=tree.widths(), accepted=len(verdict.path),
            committed=len(kept), draft_calls=draft_calls, t_draft=t1 - t0, t_verify=t2 - t1,
            t_other=time.perf_counter() - t2, path=list(verdict.path), sources=tree.by_source(verdict.path),
        )
        if self.config.record_trees:
            step.tree = tree_record(tree, verdict.path, verdict.bonus)
        if self.config.measure_optimum and not self.sampling.greedy:
            step.root_optimum = run.stats.measure(lambda: root_optimum(tree, logits[0], self.sampling))
        return step

    def _plain_steps(self, run: Generation, target) -> Iterator[GenerationResult]:
        """Plain decoding, one target token a step: what `steps` runs when no step would draft anything (method `ar`,
        or `auto` when no tree can pay on this machine, `policy.uses_draft()` False). The general loop would commit
        the same tokens through root-only trees, but its per-step machinery (tree packing, the verifier's warp of
        every row, the policy's bookkeeping and account) costs milliseconds a step, 5-10% of a step of llama.cpp's
        CPU kernels, and the llama.cpp backend must stay within 0.95x of llama.cpp's own loop (issue #15). The
        policy is not stepped; `stats.policy` is its account."""
        run.stats.policy = self.policy.explain()
        while not run.finished:
            result = self._plain_step(run, target)
            if run.finished:
                self._keep(target, None)
            yield result

    def _target_session(self, run: Generation, prefill_chunk: int,
                        prompt_logprobs: bool) -> Generator[None, None, object]:
        """The target's session for `run` (a kept one that begins with its tokens, if the prefix cache has one), its
        cache holding all but the prompt's last `prefill_chunk` tokens, which the first forward carries; with
        `prompt_logprobs`, a fresh one holding all but the last token, read in chains that keep their rows. Yields
        None after each piece read when `prefill_chunk` is set."""
        if prompt_logprobs:  # a fresh cache: a kept one has no logits for the prompt it holds
            target = make_session(self.target, "target", ssm_tree=self.config.ssm_tree)
            run.prompt_logprobs = [TokenLogprob(run.context[0], None, [])]  # nothing predicts the first token
            for _ in self._read_prompt(target, run, prefill_chunk or PROMPT_PIECE):
                if prefill_chunk:
                    yield None
            return target
        target = self._session(self.target, "target", run)
        chunk = prefill_chunk if getattr(target, "rows_alone", False) else 0
        if chunk:  # all but the last piece here; the first forward carries the last (at most `chunk` rows)
            ahead = run.context[len(target.cached):-1]
            for _ in self._prefill(target, ahead[:max(len(ahead) - chunk + 1, 0)], chunk):
                yield None
        return target

    def _draft_session(self, run: Generation, prefill_chunk: int) -> Generator[None, None, object]:
        """The draft's session for `run`, its cache holding, like the target's, all but the next tree's root: read in
        pieces of `prefill_chunk` where its rows are computed alone, with None yielded between them."""
        draft = vocab_aligned(self._session(self.draft, "draft", run), self.draft.config.vocab_size,
                              self.target.config.vocab_size)
        chunk = prefill_chunk if getattr(draft, "rows_alone", False) else 0
        for seconds, more in self._prefill(draft, run.context[len(draft.cached):-1], chunk):
            run.stats.t_prefill += seconds
            if more:
                yield None
        return draft

    def _prefill(self, session, ids: list[int], chunk: int) -> Iterator[tuple[float, bool]]:
        """Put `ids` into `session`'s cache, `chunk` tokens a call (0: one call); after each call, its seconds and
        whether pieces remain."""
        size = chunk or max(len(ids), 1)
        for start in range(0, len(ids), size):
            t0 = time.perf_counter()
            with torch_threads(self.step_threads):
                session.prefill(ids[start:start + size])
            yield time.perf_counter() - t0, start + size < len(ids)

    def _read_prompt(self, target, run: Generation, piece: int) -> Iterator[None]:
        """Put all but the prompt's last token into `target`'s cache as chains of at most `piece` tokens, each a
        tree forward whose rows give the next tokens' logprobs (run.prompt_logprobs); yields after each chain."""
        ids = run.context
        with torch_threads(self.step_threads):
            for start in range(0, len(ids) - 1, piece):
                end = min(start + piece, len(ids) - 1)  # the chain ids[start:end], its rows predict ids[start+1:end+1]
                chain = TokenTree.from_parents(ids[start:end], list(range(-1, end - start - 1)))
                logits = target.forward(ids[:start + 1], chain, list(range(end - start)))  # (end - start, vocab)
                run.prompt_logprobs += token_logprobs(logits, ids[start + 1:end + 1], run.top_logprobs)
                target.commit(list(range(end - start)))
                yield

    def _session(self, model, role: str, run: Generation):
        """A session of `model` for this generation: a copy of a kept one that begins with its tokens
        (`prefix_cache`, engine/prefix_cache.py), else a fresh one."""
        kept = self.prefix_cache.start(model, role, run.context) if self.prefix_cache is not None else None
        if kept is None:
            return make_session(model, role, ssm_tree=self.config.ssm_tree)
        if role == "target":
            run.stats.cached_tokens = len(kept.cached)
        return kept

    def _keep(self, target, draft=None) -> None:
        """A generation's sessions, kept for later requests that begin the same way (prefix_cache)."""
        if self.prefix_cache is not None:
            self.prefix_cache.keep(self.target, "target", target)
            if draft is not None:
                self.prefix_cache.keep(self.draft, "draft", draft)

    def _plain_step(self, run: Generation, target) -> GenerationResult:
        """One target token: one forward of the last token and one pick from its logits row (`_pick`: the same token
        the verifiers take from a root-only tree, from the same generator calls). The first forward of a session
        carries the whole prompt (one call instead of a prefill and a one-token forward, as llama.cpp's own loop
        does); its time counts as the prefill."""
        with torch_threads(self.step_threads):
            t0 = time.perf_counter()
            tree = TokenTree.root(run.context[-1])
            logits = target.forward(run.context, tree, [0])  # (1, vocab)
            t1 = time.perf_counter()
            first = not run.stats.steps  # the prompt's forward
            if first:
                run.stats.t_prefill, t0 = t1 - run.t_start, t1
            token = self._pick(logits, run.generator)
            t2 = time.perf_counter()
            kept = run.commit([token])
            run.note_logprobs(logits, [0], kept)
            target.commit([0])
            step = StepStats(tree_size=0, depth=0, widths=[1], accepted=0, committed=len(kept), draft_calls=0,
                             t_draft=0.0, t_verify=t2 - t0, t_other=time.perf_counter() - t2, prefill=first)
            if self.config.record_trees:
                step.tree = tree_record(tree, [], token)
            return run.record(step)

    def _pick(self, logits: torch.Tensor, gen) -> int:
        """The next token from a (1, vocab) logits row, as every exact verifier picks it for a root-only tree: the
        argmax at T = 0 (numpy's: the first maximum, like torch's, and ~15x faster on one thread), else one draw from
        the warped row (verify.base.draw)."""
        if self.sampling.greedy:
            return int(logits[0].numpy().argmax())
        return draw(target_probs(logits, self.sampling)[0], gen)

    def _decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return decode_text(self.tokenizer, tokens)
