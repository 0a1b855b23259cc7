"""Each request's own SpeculativeDecoder, made from the loaded pair, the server's run spec (arborspec/runspec.py, the
grammar and defaults `arborspec generate` uses) and the request's sampling settings and `arborspec` overrides.

A decoder per request is what keeps requests independent: the policy's state (auto's calibration, DynaTree's
history, the budget tuner), the sampling settings and the verifier they imply are all per decoder. Making one is
cheap: the models are shared and nothing is measured again (the draft's quantization was chosen when the server
started; auto's cost profiles are measured once per model and cached on disk, by the start-up warm-up when the
server's own method is auto, else by the first request that asks for auto).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..backends.model_info import context_window
from ..core.sampling import SamplingConfig
from ..engine import DecoderConfig, SpeculativeDecoder
from ..engine.prefix_cache import PrefixCache
from ..engine.prompts import model_prompt_ids
from ..runspec import RunSpec, build_decoder, check_verifier, options_for, parse

# method options a request may not set, though `arborspec serve --method` may: what each would let any client do
SERVER_ONLY_OPTIONS = {
    "acceptance_file": "read a file on the server (and learn from the error whether it exists)",
    "reprofile": "make the server measure its cost profiles again, for minutes",
}


@dataclass
class Decoders:
    """The loaded pair and the server's settings, from which every request's decoder is made."""

    spec: RunSpec  # the server's method, as --method and its flags named it
    target: object  # LoadedModel
    draft: object | None  # LoadedModel prepared by loading.pair.prepare_draft, or None when the server's method drafts nothing
    quant: str  # the draft's quantization, "auto" resolved
    vocab: int  # the draft's head size, "auto" resolved (0: the whole vocabulary)
    # the server's flags: sampling (what a request leaves out, seed included), draft temperature, token order, SSM tree
    config: DecoderConfig
    prefix_cache: PrefixCache | None = None  # finished requests' caches, for requests that begin the same way
    prefill_chunk: int = 0  # prompt tokens a model reads per round (SpeculativeDecoder.steps; 0: all at once)

    @property
    def defaults(self) -> SamplingConfig:
        return self.config.sampling

    def spec_for(self, method: str | None = None, verifier: str | None = None, budget: int | None = None,
                 allow_lossy: bool = False) -> RunSpec:
        """The server's spec, or the one a request's `arborspec` field makes of it (ValueError if this server cannot
        run that, or not exactly: a lossy verifier needs the request's own `allow_lossy`)."""
        if method is None and verifier is None and budget is None:
            return self.spec
        refused = {name: f"a request may not set {name} (it would {why}); start the server with it in --method "
                         "instead" for name, why in SERVER_ONLY_OPTIONS.items()}  # refused before any check reads
        # the server's own method with its draft as prepared ("auto" resolved), or the request's
        base = replace(self.spec, quant=self.quant) if method is None else parse(method, draft_quant=self.quant,
                                                                                 allow_lossy=True, refused=refused)
        if base.policy is None:
            raise ValueError(f"{base.name!r} is a baseline (transformers' or llama.cpp's own loop), which "
                             "`arborspec bench` runs, not the server")
        if budget is not None and method is not None and base.budget is not None:
            raise ValueError(f"method {method!r} pins its budget already; drop 'budget' or the @{base.budget}")
        if verifier and method is not None and base.verifier is not None:  # the field won in silence
            raise ValueError(f"method {method!r} names its verifier ({base.verifier}) already; drop 'verifier' or "
                             "that part of the name")
        spec = replace(base, verifier=check_verifier(verifier) if verifier else base.verifier, allow_lossy=allow_lossy,
                       budget=base.budget if budget is None else budget)
        if spec.budget is not None and spec.size is None:
            raise ValueError(f"method {spec.name!r} has no size option for a budget")
        _, warning = options_for(spec)
        if warning:
            raise ValueError(warning)
        if spec.needs_draft and self.draft is None:
            raise ValueError(f"method {spec.name!r} needs a draft model, and this server runs without one (its "
                             f"method {self.spec.name!r} drafts nothing)")
        if spec.needs_draft and not spec.vocab:  # a request naming no head size runs the server's draft as it is
            spec = replace(spec, vocab=self.vocab)
        if spec.needs_draft and (spec.quant, spec.vocab) != (self.quant, self.vocab):
            raise ValueError(f"method {spec.name!r} needs a draft prepared with quantization {spec.quant} and "
                             f"vocabulary {spec.vocab or 'full'}; this server's draft has {self.quant} and "
                             f"{self.vocab or 'full'} (start the server with those levers)")
        if spec.lossy and not allow_lossy:
            raise ValueError(f"verifier {spec.verifier!r} does not preserve the target distribution; set "
                             '"allow_lossy": true in the request\'s "arborspec" field to use it anyway')
        return spec

    @property
    def context_window(self) -> int:
        return context_window(self.target.model)

    def encode(self, prompt, room: int = 1) -> list[int]:
        """A request's prompt ids, checked as its decoder checks them (SpeculativeDecoder.encode), before the decoder
        is made: making one waits for the running round, and a prompt too long for the window is a 400 at once."""
        return model_prompt_ids(self.target.tokenizer, prompt, self.target.model, getattr(self.draft, "model", None),
                                room)

    def build(self, spec: RunSpec, sampling: SamplingConfig) -> SpeculativeDecoder:
        """The decoder for one request (ValueError for settings it cannot run, e.g. top_p 0 or a chain-only
        verifier on a tree)."""
        # The bare draft model: the server checked once that it shares the target's tokenizer, and a LoadedModel
        # would have every request's decoder compare the two vocabularies again.
        draft = getattr(self.draft, "model", None)
        decoder = build_decoder(spec, self.target, draft, replace(self.config, sampling=sampling))
        decoder.prefix_cache = self.prefix_cache
        return decoder

    def sampling(self, temperature: float | None, top_k: int | None, top_p: float | None,
                 seed: int | None) -> SamplingConfig:
        """A request's sampling: what it names, the server's flags for the rest (ValueError for a bad value)."""
        asked = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return replace(self.defaults, **{k: v for k, v in asked.items() if v is not None})
