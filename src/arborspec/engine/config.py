"""Everything a SpeculativeDecoder runs with but the models: one value that front ends build once and pass on.

`SpeculativeDecoder(target, draft, method="static", temperature=0.7, depth=4)` reads its keywords through
`DecoderConfig.of`: the sampling settings go into `sampling` (core/sampling.py: the one sampling type, seed
included), the names below into their fields, and any other keyword is an option of the method's policy
(`arborspec methods`), checked when the policy is made. runspec.build_decoder, the server (a base config from its
flags, each request's sampling on top) and `fork()` (engine/many_prompts.py) pass a config whole.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field, fields, replace

from ..core.options import check_bool
from ..core.sampling import TEMPERATURE_RULE, SamplingConfig, valid_temperature
from ..core.tree import ORDERS
from ..drafting import POLICIES
from ..drafting.grafts import FreeBranches

SAMPLING_KEYWORDS = ("temperature", "top_k", "top_p", "seed")  # SpeculativeDecoder's keywords for `sampling`'s fields
# keywords a transformers user may hand SpeculativeDecoder(...) that belong to each generate() call instead
CALL_KEYWORDS = ("max_new_tokens", "stop", "ignore_eos", "logprobs", "prompt_logprobs")
# transformers' generation keywords arborspec has no counterpart for, with what to use instead: they were refused as
# "method 'chain' takes no option 'repetition_penalty'", which reads as if another method took them
NOT_SUPPORTED = dict.fromkeys(("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram_size",
                               "min_p", "typical_p", "logit_bias", "bad_words_ids", "num_beams", "length_penalty",
                               "num_return_sequences", "generation_config", "encoder_repetition_penalty",
                               "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "forced_bos_token_id",
                               "forced_eos_token_id", "min_length", "epsilon_cutoff", "eta_cutoff", "penalty_alpha",
                               "guidance_scale", "prefix_allowed_tokens_fn", "renormalize_logits", "logits_processor",
                               "num_beam_groups", "diversity_penalty", "constraints", "force_words_ids"),
                              "arborspec verifies against the target's own logits and samples with temperature, "
                              "top_k, top_p and seed only")
# transformers' other generate() keywords a user may carry over (a hunt found them refused as options of `auto`)
NOT_SUPPORTED |= dict.fromkeys(("return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                                "output_hidden_states"), "generate() returns a GenerationResult (text, token_ids, "
                               "stats); logprobs=k gives each token's log-probability and its k best alternatives")
NOT_SUPPORTED |= {"stop_strings": "give generate() stop=[...]", "max_time": "give generate() max_new_tokens",
                  "assistant_model": "the draft is SpeculativeDecoder's second argument",
                  "prompt_lookup_num_tokens": "SpeculativeDecoder(..., ngram=N) drafts N tokens from the prompt"}
NOT_SUPPORTED |= {"max_length": "give generate() max_new_tokens", "eos_token_id": "generate() stops at the "
                  "model's EOS ids (its generation config's, else the tokenizer's; ignore_eos=True: never) or at its "
                  "stop strings (stop=[...])",
                  "pad_token_id": "prompts are not padded (generate_batch takes prompts of any lengths)",
                  "streamer": "stream() yields the text as it is generated",
                  "stopping_criteria": "generate() stops at stop=[...] strings, EOS ids or max_new_tokens",
                  "min_new_tokens": "generate() stops at the model's EOS ids unless ignore_eos=True"}
# transformers' generate(**tokenizer(text, return_tensors="pt")): the prompt is arborspec's first argument
NOT_SUPPORTED |= dict.fromkeys(("input_ids", "attention_mask", "inputs"), "pass the prompt (text, token ids, a tensor "
                               "or the tokenizer's whole output) as generate()'s first argument")


@dataclass(frozen=True)
class DecoderConfig:
    method: str = "auto"  # a tree policy (drafting.POLICIES); auto sizes its trees from this machine's costs
    sampling: SamplingConfig = SamplingConfig()  # the target's warp (temperature 0: greedy), and the default seed
    draft_temperature: float | None = None  # the draft's own temperature (None: the target's; 0 when that is 0)
    verifier: str | None = None  # None: the policy's default for the sampling settings (engine/verifier_choice.py)
    allow_lossy: bool = False  # a verifier that does not preserve the target distribution may run
    token_order: str = "bfs"  # how tree tokens are laid out in the target's forward (DySpec App. C)
    record_trees: bool = False  # StepStats.tree: every step's tree (viz/trees.py draws them)
    # per step at T > 0, the best first-token acceptance any exact verifier could reach on the tree (the bench's
    # "distance to the optimum"); a sort of the vocabulary a step, so only on request, and its time is left out
    measure_optimum: bool = False
    ssm_tree: str = "packed"  # STree backend for Mamba2 / hybrid models: 'packed' tree or 'unrolled' paths
    # free branches (drafting/grafts/branches.py): prompt lookup, suffix tree (None: the method's default), lookahead
    ngram: int = 0
    ngram_len: int = 8
    suffix: int | None = None
    suffix_store: int = 0
    lookahead: int = 0
    lookahead_ngram: int = 3
    lookahead_guesses: int | None = None
    method_options: dict = field(default_factory=dict)  # the policy's options, e.g. {"k": 4} for chain

    def __post_init__(self):
        for name in ("allow_lossy", "record_trees", "measure_optimum"):  # allow_lossy="no" ran a lossy verifier
            object.__setattr__(self, name, check_bool(getattr(self, name), name))
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}; pass "
                            "temperature / top_k / top_p / seed as keywords instead")
        if self.token_order not in ORDERS:
            raise ValueError(f"unknown token order {self.token_order!r}; choose one of: {', '.join(ORDERS)}")
        if self.ssm_tree not in ("packed", "unrolled"):
            raise ValueError(f"unknown ssm_tree {self.ssm_tree!r}; choose 'packed' or 'unrolled'")
        if self.method not in POLICIES:
            raise ValueError(f"unknown method {self.method!r}; choose one of: {', '.join(sorted(POLICIES))}")
        if self.draft_temperature is not None and not valid_temperature(self.draft_temperature):  # at T = 0 too
            raise ValueError(f"draft_temperature must be {TEMPERATURE_RULE}, got {self.draft_temperature!r}")
        if self.draft_temperature is not None:  # a numpy float failed the JSON of auto's calibration key
            object.__setattr__(self, "draft_temperature", float(self.draft_temperature))

    @classmethod
    def of(cls, base: DecoderConfig | None = None, **options) -> DecoderConfig:
        """`base` (default: the defaults) with SpeculativeDecoder's keywords on top: temperature, top_k and top_p
        for `sampling`, this class's fields by name, and the rest as the policy's options."""
        base = cls() if base is None else base
        own = {f.name for f in fields(cls)}
        settings = {k: options.pop(k) for k in list(options) if k in own}
        warp = {k: options.pop(k) for k in SAMPLING_KEYWORDS if k in options}
        misplaced = [k for k in CALL_KEYWORDS if k in options]
        if misplaced:
            raise ValueError(f"{misplaced[0]} is an argument of generate() / stream(), not of SpeculativeDecoder(...)")
        unsupported = [k for k in NOT_SUPPORTED if k in options]
        if unsupported:
            raise ValueError(f"{unsupported[0]} is not supported: {NOT_SUPPORTED[unsupported[0]]}")
        if "do_sample" in options:
            raise ValueError("do_sample: arborspec samples when temperature > 0; temperature 0 (the default) is greedy")
        if warp:
            settings["sampling"] = replace(settings.get("sampling", base.sampling), **warp)
        given = settings.get("method_options", {})
        if not isinstance(given, dict):
            raise TypeError(f"method_options must be a dict of the method's options, got {type(given).__name__}")
        if twice := sorted(set(given) & set(options)):  # the keyword won in silence
            raise ValueError(f"{twice[0]} is given twice, in method_options and as a keyword; give it once")
        settings["method_options"] = {**base.method_options, **given, **options}
        return replace(base, **settings)

    @property
    def draft_sampling(self) -> SamplingConfig:
        """The draft's warp: its own temperature if given, else the target's; greedy when the target is."""
        if self.sampling.greedy:
            return SamplingConfig(0.0)
        t = self.sampling.temperature if self.draft_temperature is None else self.draft_temperature
        return SamplingConfig(t, self.sampling.top_k, self.sampling.top_p)

    def free_branches(self) -> FreeBranches:
        """The draft-free branches these settings ask for (ValueError for numbers out of range)."""
        return FreeBranches(self.method, self.ngram, self.ngram_len, self.suffix, self.suffix_store, self.lookahead,
                            self.lookahead_ngram, self.lookahead_guesses)


def per_call(method):
    """SpeculativeDecoder's per-call methods (generate, stream, ...) with the constructor's settings refused by name:
    transformers users pass temperature / top_k / do_sample to each generate call, and got Python's bare "unexpected
    keyword argument" (the settings belong to SpeculativeDecoder(...): its sessions, policy and verifier follow
    them)."""
    takes = set(inspect.signature(method).parameters)
    settings = (set(SAMPLING_KEYWORDS) | {f.name for f in fields(DecoderConfig)}) - takes  # once, not every call

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        for key in set(kwargs) - takes:
            if key == "seed" and "seeds" in takes:
                raise TypeError(f"{method.__name__}() takes seeds=[...], one seed (or None) per prompt")
            if key in settings:
                raise TypeError(f"{key} is a setting of SpeculativeDecoder(..., {key}=...), not an argument of "
                                f"{method.__name__}()")
            if key in NOT_SUPPORTED or key == "do_sample":
                raise TypeError(f"{key} is not an argument of {method.__name__}(): "
                                f"{NOT_SUPPORTED.get(key, 'temperature > 0 samples (set on SpeculativeDecoder)')}")
        return method(self, *args, **kwargs)
    return call
