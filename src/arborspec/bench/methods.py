"""What `--methods` names mean: an arborspec policy (+ verifier) sized by `--budgets`, or a transformers baseline.

`--budgets B` is the number of drafted tokens per step a method may use, mapped to each method's own size option:

| bench method | policy / verifier | options for budget B |
|---|---|---|
| ar | ar | (none: plain decoding, the baseline) |
| chain, sps, asps | chain / default (greedy, sps), sps, asps | k = B |
| static | static | widths: ceil(log2 B) layers sharing B nodes, e.g. 16 -> 4,4,4,4 |
| dyspec, dyspec-threshold, dynatree, wetap-exact, sequoia | same name | budget = B |
| wetap | wetap / wetap (the paper's verifier: LOSSY, needs allow_lossy) | budget = B |
| beam | beam | beams = 4, steps = B // 4 |
| auto | auto (greedy / mbr) | (none: each tree is sized from the measured cost profile; see drafting/auto.py) |
| hf-ar, hf-assisted, hf-lookup | transformers `generate`: plain, `assistant_model=draft`, `prompt_lookup_num_tokens=10` | (none) |

Without `--budgets` every method runs with its own defaults. A method whose policy is not registered (yet) is skipped
with a warning, and so is a size option its policy does not take.

A method name can carry its own settings, so one run can hold variants side by side:

    NAME[(option=value,...)][@BUDGET][+LEVER...]

- `(option=value,...)`: policy options, e.g. `dynatree(adapt=false)`, `wetap(gamma=0.8,alpha=0.3)`;
- `@BUDGET`: this method runs at this budget only, whatever `--budgets` says, e.g. `chain@5`;
- levers (arborspec.models.draft_levers), on the draft this method uses: `+int8`, `+int4` (quantized draft),
  `+vocab32768` (or `+vocab32k`: a draft head over the 32768 most frequent tokens), and `+ngram` / `+ngram3`
  (prompt-lookup branches grafted into the tree; arborspec policies only), e.g. `auto+int8+ngram`,
  `hf-assisted+int8` (transformers' assisted generation given the same quantized draft).
"""
from __future__ import annotations

import copy
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from ..drafting import POLICIES
from ..drafting.base import option_parser


@dataclass(frozen=True)
class MethodSpec:
    name: str
    policy: str | None = None  # arborspec policy; None for a transformers baseline
    verifier: str | None = None  # None: the policy's default
    allow_lossy: bool = False
    size: Callable[[int], dict] | None = None  # budget -> policy options
    hf: dict | None = None  # transformers generate() kwargs (besides sampling); "assistant" means the draft model
    fixed: tuple = ()  # (option, value) pairs given in the method name
    budget: int | None = None  # a budget pinned in the method name (@B)
    quant: str = "none"  # draft levers given in the method name
    vocab: int = 0
    ngram: int = 0

    @property
    def draft_key(self) -> tuple[str, int]:
        """Which prepared draft this method runs with."""
        return self.quant, self.vocab

    @property
    def needs_draft(self) -> bool:
        if self.hf is not None:
            return bool(self.hf.get("assistant_model"))
        return self.policy in POLICIES and POLICIES[self.policy].needs_draft


def static_widths(budget: int) -> dict:
    """A static tree of about `budget` nodes: ceil(log2 B) layers (at least 1), nodes spread evenly, wider first."""
    depth = max(1, math.ceil(math.log2(max(budget, 1))))
    depth = min(depth, budget)
    widths = [budget // depth + (1 if i < budget % depth else 0) for i in range(depth)]
    return {"widths": ",".join(map(str, widths))}


def _budget(b: int) -> dict:
    return {"budget": b}


METHODS: dict[str, MethodSpec] = {m.name: m for m in [
    MethodSpec("ar", "ar"),
    MethodSpec("chain", "chain", size=lambda b: {"k": b}),
    MethodSpec("sps", "chain", verifier="sps", size=lambda b: {"k": b}),
    MethodSpec("asps", "chain", verifier="asps", size=lambda b: {"k": b}),
    MethodSpec("static", "static", size=static_widths),
    MethodSpec("dyspec", "dyspec", size=_budget),
    MethodSpec("dyspec-threshold", "dyspec-threshold", size=_budget),
    MethodSpec("dynatree", "dynatree", size=_budget),
    MethodSpec("wetap", "wetap", verifier="wetap", allow_lossy=True, size=_budget),
    MethodSpec("wetap-exact", "wetap", size=_budget),
    MethodSpec("sequoia", "sequoia", size=_budget),
    MethodSpec("beam", "beam", size=lambda b: {"beams": 4, "steps": max(1, b // 4)}),
    MethodSpec("auto", "auto"),
    MethodSpec("hf-ar", hf={}),
    MethodSpec("hf-assisted", hf={"assistant_model": True}),
    MethodSpec("hf-lookup", hf={"prompt_lookup_num_tokens": 10}),
]}


_NAME = re.compile(r"^(?P<base>[a-z0-9][a-z0-9-]*)(?:\((?P<opts>[^()]*)\))?(?:@(?P<budget>\d+))?"
                   r"(?P<levers>(?:\+[a-z0-9]+)*)$")
NGRAM_DEFAULT = 3


def split_label(label: str) -> tuple[str, int | None]:
    """('dyspec', 16) from a report label 'dyspec@16'; ('auto+int8', None) from 'auto+int8'."""
    m = re.search(r"@(\d+)", label)
    return (label[: m.start()] + label[m.end():], int(m[1])) if m else (label, None)


def split_methods(text: str) -> list[str]:
    """Split --methods at the commas that are not inside a method's (option=value,...) list."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [m for m in out if m]


def _lever(spec: MethodSpec, lever: str) -> MethodSpec:
    if lever in ("int8", "int4"):
        return replace(spec, quant=lever)
    if m := re.fullmatch(r"vocab(\d+)(k?)", lever):
        return replace(spec, vocab=int(m[1]) * (1024 if m[2] else 1))
    if m := re.fullmatch(r"ngram(\d*)", lever):
        if spec.hf is not None:
            raise ValueError("+ngram grafts branches into arborspec trees; transformers baselines do not take it")
        return replace(spec, ngram=int(m[1] or NGRAM_DEFAULT))
    raise ValueError(f"unknown lever +{lever} (levers: +int8, +int4, +vocabK, +ngram[N])")


def _fixed_options(spec: MethodSpec, text: str) -> tuple:
    if spec.policy is None:
        raise ValueError("transformers baselines take no (option=value) list")
    known = {f.name: f for f in fields(POLICIES[spec.policy].Options)}
    out = []
    for item in filter(None, (x.strip() for x in re.split(r",(?=\s*[a-z_-]+\s*=)", text))):  # values may hold commas
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known:
            raise ValueError(f"{item!r} is not option=value for policy {spec.policy!r} "
                             f"(options: {', '.join(known) or 'none'})")
        out.append((key, option_parser(known[key])(value.strip())))
    return tuple(out)


def resolve(name: str) -> tuple[MethodSpec | None, str | None]:
    """(spec, None), or (None, why it is skipped), for a method name with its optional settings (see above)."""
    m = _NAME.match(name)
    if m is None:
        return None, f"method {name!r} does not read as NAME[(option=value,...)][@BUDGET][+LEVER...]; skipped"
    spec, why = _resolve_base(m["base"])
    if spec is None:
        return None, why
    try:
        if m["opts"] is not None:
            spec = replace(spec, fixed=_fixed_options(spec, m["opts"]))
        if m["budget"] is not None:
            if spec.size is None:
                raise ValueError(f"{m['base']} has no size option for @{m['budget']}")
            spec = replace(spec, budget=int(m["budget"]))
        for lever in filter(None, m["levers"].split("+")):
            spec = _lever(spec, lever)
    except ValueError as err:
        return None, f"method {name!r}: {err}; skipped"
    if (spec.quant != "none" or spec.vocab) and not spec.needs_draft:
        return None, f"method {name!r}: draft levers on a method without a draft; skipped"
    return replace(spec, name=name), None


def _resolve_base(name: str) -> tuple[MethodSpec | None, str | None]:
    """(spec, None), or (None, why it is skipped). A registered policy missing from the table runs with defaults."""
    spec = METHODS.get(name)
    if spec is None:
        if name in POLICIES:
            return MethodSpec(name, name, size=_budget if "budget" in _option_names(name) else None), None
        return None, f"method {name!r} is not known (policies: {', '.join(POLICIES)}; baselines: hf-ar, " \
                     "hf-assisted, hf-lookup); skipped"
    if spec.policy is not None and spec.policy not in POLICIES:
        return None, f"method {name!r} needs policy {spec.policy!r}, which is not registered; skipped"
    return spec, None


def _option_names(policy: str) -> set[str]:
    return {f.name for f in fields(POLICIES[policy].Options)}


def options_for(spec: MethodSpec, budget: int | None) -> tuple[dict, str | None]:
    """Policy options for `budget` (None: the defaults) plus those fixed in the method name, and a warning if the
    policy lacks a size option."""
    fixed = dict(spec.fixed)
    if budget is None or spec.size is None or spec.policy is None:
        return fixed, None
    opts = spec.size(budget)
    unknown = sorted(set(opts) - _option_names(spec.policy))
    if unknown:
        return {k: v for k, v in opts.items() if k not in unknown} | fixed, \
            f"method {spec.name!r}: policy {spec.policy!r} takes no option {', '.join(unknown)}; budget not applied"
    return opts | fixed, None


# ------------------------------------------------------------------------------------- transformers baselines
class _Clock:
    """A transformers streamer that timestamps every put(): the first is the prompt, each later one a decoding round
    (one token for plain decoding, the accepted tokens + 1 for assisted generation)."""

    def __init__(self):
        self.rounds: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.rounds.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


class _CountDrafts:
    """Patch the candidate generators' update_candidate_strategy to record each round's drafted/accepted counts."""

    def __init__(self):
        from transformers.generation import candidate_generator as cg

        self.classes = [c for c in vars(cg).values()
                        if isinstance(c, type) and issubclass(c, cg.CandidateGenerator)
                        and "update_candidate_strategy" in vars(c)]
        self.rounds: list[tuple[int, int]] = []  # (drafted, accepted)
        self.inside = 0

    def __enter__(self):
        self.saved = {c: vars(c)["update_candidate_strategy"] for c in self.classes}
        for cls, orig in self.saved.items():
            def wrapped(gen, input_ids, scores, num_matches, _orig=orig):
                if not self.inside:  # count a round once, even if one override calls another
                    self.rounds.append((int(scores.shape[1]) - 1, int(num_matches)))  # scores: (1, drafted + 1, V)
                self.inside += 1
                try:
                    return _orig(gen, input_ids, scores, num_matches)
                finally:
                    self.inside -= 1
            cls.update_candidate_strategy = wrapped
        return self

    def __exit__(self, *exc):
        for cls, orig in self.saved.items():
            cls.update_candidate_strategy = orig


def hf_generate(spec: MethodSpec, target, draft, ids: list[int], max_new_tokens: int, temperature: float,
                top_k: int, top_p: float, eos: list[int], seed: int | None) -> dict:
    """Run transformers' own generate (plain, assisted, or prompt lookup) and time it like an arborspec run."""
    from transformers import GenerationConfig

    # every sampling setting explicit: a None would be filled from the model's generation config or transformers'
    # global defaults (top_k=50), which the arborspec runs do not use
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0, eos_token_id=list(eos),
                           pad_token_id=(eos[0] if eos else 0), temperature=temperature if temperature > 0 else 1.0,
                           top_k=top_k, top_p=top_p, repetition_penalty=1.0)
    kwargs = dict(spec.hf)
    if kwargs.pop("assistant_model", False):
        kwargs["assistant_model"] = draft
    for key in ("prompt_lookup_num_tokens",):
        if key in kwargs:
            setattr(cfg, key, kwargs.pop(key))
    if seed is not None:
        torch.manual_seed(seed)
    clock, inputs = _Clock(), torch.tensor([ids])
    with torch.no_grad(), _CountDrafts() as counts:
        start = time.perf_counter()
        out = target.generate(inputs, generation_config=copy.deepcopy(cfg), streamer=clock,
                              attention_mask=torch.ones_like(inputs), **kwargs)
        wall = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    committed = [n for _, n in clock.rounds]
    drafted = [d for d, _ in counts.rounds] if counts.rounds else [0] * len(committed)
    return dict(
        token_ids=new, wall=wall, ttft=(clock.rounds[0][0] - start) if clock.rounds else None,
        committed_per_step=committed, accepted_per_step=[max(n - 1, 0) for n in committed],
        drafted_per_step=drafted if len(drafted) == len(committed) else None,
        finish_reason="eos" if new and new[-1] in eos else "length",
    )
