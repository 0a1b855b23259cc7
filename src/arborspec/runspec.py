"""What to run, named once for every front end: `arborspec generate`, `arborspec bench` and the Python API.

A run spec is one decoding method with everything that shapes it, written as

    NAME[(option=value,...)][@BUDGET][+LEVER...]

- NAME: a tree policy (`arborspec methods`), one of the named variants in METHODS below (`sps`, `wetap-lossy`, ...),
  or, for `arborspec bench` only, a transformers or llama.cpp baseline (`hf-ar`, `hf-assisted`, `hf-lookup`,
  `llamacpp-ar`, `llamacpp-lookup`, `llamacpp-lookahead`);
- `(option=value,...)`: policy options, e.g. `dynatree(adapt=false)`, `static(widths=3,3,3,3)` (a value may hold
  commas); `verifier=NAME` picks the verification rule, e.g. `chain(verifier=asps)`;
- `@BUDGET`: drafted tokens per step, mapped to the policy's own size option (`chain@5` is k = 5, `static@16` four
  layers of 4; see `options_for`);
- levers on the draft this method uses (tuning/draft_levers.py; the output stays exact): `+int8`, `+int4`
  (a quantized PyTorch draft), `+q4_0`, `+iq4_nl` (a GGUF draft on the native backend, requantized to a lean 4-bit
  file: tuning/gguf_requant.py), `+noquant` (the draft as loaded, whatever the run's --draft-quant says), `+vocab32768` or
  `+vocab32k` (a head over the most frequent tokens), `+ngram` / `+ngram3` (prompt-lookup branches grafted onto
  every tree), `+suffix` / `+suffix8` (suffix-tree branches), `+lookahead` / `+lookahead4` / `+lookahead4x3`
  (lookahead branches: a Jacobi window 4 guesses wide building 3-grams; drafting/grafts/lookahead.py). On `ar` these
  draft-free levers are the whole draft: `ar+lookahead` is lookahead decoding, `ar+suffix8` suffix decoding.
  `auto` grafts suffix branches unless told otherwise (drafting/grafts/suffix.py: default_suffix_nodes; at T > 0 only onto
  the steps it drafts nothing for); `auto+suffix0` turns them off.

`generate`'s flags compose the same spec (--method takes the whole grammar; --k, --verifier, --draft-quant,
--ngram ... add to it), so the default method (`auto`) and the levers live here once; the default pair, dtype,
backend and draft variant (`auto`: the one measured fastest for the pair on this machine) in loading/pair.py. A method whose name carries no quantization lever
uses the run's --draft-quant, in `generate` and in `bench` alike.

`wetap` is WETAP's trees with an exact verifier everywhere; the paper's lossy verifier is `wetap-lossy` (or
`wetap(verifier=wetap)`) and, like every lossy rule, runs only when the run allows it (--allow-lossy). Benchmarks
recorded before this naming used `wetap` for the lossy rule and `wetap-exact` for the exact one; their runs carry
the `lossy` flag, which is what reports read, and `wetap-exact` stays a name for the exact one.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from .core.options import option_parser
from .drafting import POLICIES
from .drafting.budget_tuner import tuned_options
from .drafting.grafts import FreeBranches, suffix_nodes
from .engine import DecoderConfig, SpeculativeDecoder
from .loading.pair import DEFAULT_DRAFT_QUANT, DRAFT_QUANTS
from .verify import VERIFIERS

DEFAULT_METHOD = "auto"
NGRAM_DEFAULT = 3  # `+ngram` without a number
NGRAM_LEN = 8  # tokens per prompt-lookup branch
SUFFIX_DEFAULT = 8  # `+suffix` without a number: suffix-tree nodes grafted per step
LOOKAHEAD_DEFAULT = (4, 3)  # `+lookahead` without numbers: window width W, n-gram size N (pool guesses G = W)
GRAMMAR = "NAME[(option=value,...)][@BUDGET][+LEVER...]"


@dataclass(frozen=True)
class RunSpec:
    """One method with everything that shapes it; `parse` makes one from a name, `build_decoder` runs it."""

    name: str = DEFAULT_METHOD  # as written: the bench's row label
    policy: str | None = DEFAULT_METHOD  # an arborspec policy; None for a transformers baseline
    options: tuple = ()  # (option, value) pairs given in the name or by flags, in that order
    budget: int | None = None  # pinned by @BUDGET
    verifier: str | None = None  # None: the policy's default for the sampling settings
    allow_lossy: bool = False  # a run-wide consent (--allow-lossy), needed by a lossy verifier
    quant: str = DEFAULT_DRAFT_QUANT  # the draft's quantization: one of loading.pair.DRAFT_QUANTS
    vocab: int = 0  # draft head over this many most frequent tokens (0: all)
    ngram: int = 0  # prompt-lookup branches matching up to this many tokens (0: off)
    ngram_len: int = NGRAM_LEN
    suffix: int | None = None  # suffix-tree branches: at most this many nodes a step (0: off; None: the method's
    # default: drafting/grafts/suffix.py, default_suffix_nodes)
    lookahead: int = 0  # lookahead branches: the Jacobi window's width (0: off; drafting/grafts/lookahead.py)
    lookahead_ngram: int = LOOKAHEAD_DEFAULT[1]  # ... and the size of the n-grams it collects
    hf: dict | None = None  # a transformers baseline's generate() settings (bench/methods.py)
    llamacpp: dict | None = None  # a llama.cpp peer's settings (bench/llamacpp_peers.py): {"lookup": drafted tokens} or
    # {"lookahead": True}
    size: Callable[[int], dict] | None = field(default=None, compare=False)  # budget -> policy options
    about: str = field(default="", compare=False)  # a named variant's one line in `arborspec methods`

    @property
    def needs_draft(self) -> bool:
        if self.hf is not None:
            return bool(self.hf.get("assistant_model"))
        if self.llamacpp is not None:
            return False
        return POLICIES[self.policy].needs_draft

    @property
    def suffix_nodes(self) -> int:
        """The suffix-tree nodes a step may graft, as the engine resolves them (drafting.grafts.suffix_nodes)."""
        return suffix_nodes(self.policy, self.suffix)

    @property
    def lossy(self) -> bool:
        return self.verifier is not None and not VERIFIERS[self.verifier].exact


# ---- budget -> each policy's size option ------------------------------------------------------------------------
def chain_length(budget: int) -> dict:
    return {"k": budget}


def static_widths(budget: int) -> dict:
    """A static tree of about `budget` nodes: ceil(log2 B) layers (at least 1), nodes spread evenly, wider first."""
    depth = min(max(1, math.ceil(math.log2(max(budget, 1)))), budget)
    widths = [budget // depth + (1 if i < budget % depth else 0) for i in range(depth)]
    return {"widths": ",".join(map(str, widths))}


def tree_budget(budget: int) -> dict:
    return {"budget": budget}


def beam_shape(budget: int) -> dict:
    """4 beams (fewer under a budget of 4: beam@1 drafted 4 nodes), as many steps as the budget holds."""
    beams = min(4, budget)
    return {"beams": beams, "steps": max(1, budget // beams)}


# Options a budget decides besides the ones its size function returns: a static tree sized by @N is a widths tree,
# which replaces a k-ary tree's depth and branch (and its draw rule); they were dropped without a word.
SIZED_TOO = {static_widths: {"depth", "branch", "draw"}}


# Names that are not simply a policy sized by its `budget` option. Any other registered policy is its own name, sized
# by `budget` when it has that option (dyspec, dynatree, wetap, sequoia, ...).
METHODS: dict[str, RunSpec] = {m.name: m for m in [
    RunSpec("auto", "auto"),  # sizes its trees itself from measured costs: no @BUDGET
    RunSpec("chain", "chain", size=chain_length),
    RunSpec("sps", "chain", verifier="sps", size=chain_length, about="chain verified by standard speculative sampling"),
    RunSpec("asps", "chain", verifier="asps", size=chain_length, about="chain verified by ASpS's one coupling"),
    RunSpec("static", "static", size=static_widths),
    RunSpec("beam", "beam", size=beam_shape),
    RunSpec("wetap-lossy", "wetap", verifier="wetap", size=tree_budget,  # the paper's rule: LOSSY
            about="WETAP's trees and its own acceptance rule [LOSSY: needs --allow-lossy]"),
    RunSpec("wetap-exact", "wetap", size=tree_budget,  # the bench's name for wetap before wetap became exact
            about="WETAP's trees, verified exactly (= wetap)"),
    RunSpec("hf-ar", None, hf={}, about="baseline: transformers' plain generate"),
    RunSpec("hf-assisted", None, hf={"assistant_model": True},
            about="baseline: transformers' assisted generation with the draft"),
    RunSpec("hf-lookup", None, hf={"prompt_lookup_num_tokens": 10}, about="baseline: transformers' prompt lookup"),
    RunSpec("llamacpp-ar", None, llamacpp={"lookup": 0},
            about="baseline: plain llama.cpp decoding of the target's GGUF"),
    RunSpec("llamacpp-lookup", None, llamacpp={"lookup": 10}, about="baseline: llama-cpp-python's prompt lookup"),
    RunSpec("llamacpp-lookahead", None, llamacpp={"lookahead": True},
            about="baseline: llama.cpp's lookahead example program"),
]}


# ---- parsing -----------------------------------------------------------------------------------------------------
_NAME = re.compile(r"(?P<base>[a-z0-9][a-z0-9-]*)(?:\((?P<opts>[^()]*)\))?(?:@(?P<budget>[0-9]+))?"
                   r"(?P<levers>(?:\+[a-z0-9_]+)*)")  # fullmatch: "$" let a final newline into the name


def parse(name: str, draft_quant: str = DEFAULT_DRAFT_QUANT, allow_lossy: bool = False,
          refused: dict[str, str] | None = None) -> RunSpec:
    """The spec a method name stands for (ValueError, naming what is wrong, if it stands for none).

    `draft_quant` and `allow_lossy` are the run's settings: the quantization of a method without a quantization
    lever, and whether lossy verifiers may run. `refused`: options the name may not set here (option -> the error),
    refused as the name reads them, before their checks run (a server request's `acceptance-file` read a file on
    the server: the server's own text match knew only the underscore spelling)."""
    if draft_quant not in DRAFT_QUANTS:
        raise ValueError(f"unknown draft quantization {draft_quant!r}; choose one of: {', '.join(DRAFT_QUANTS)}")
    m = _NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"method {name!r} does not read as {GRAMMAR}")
    spec = replace(_base(m["base"]), name=name, quant=draft_quant, allow_lossy=allow_lossy)
    try:
        if m["opts"] is not None:
            spec = _with_options(spec, m["opts"])
        if m["budget"] is not None:
            if spec.size is None:
                raise ValueError(f"{m['base']} has no size option for @{m['budget']}")
            if int(m["budget"]) < 1:
                raise ValueError("a tree budget @N needs N >= 1 node")
            spec = replace(spec, budget=int(m["budget"]))
        levers = [lever for lever in m["levers"].split("+") if lever]
        kinds: dict[str, str] = {}
        for lever in levers:
            kind = "quantization" if lever in QUANT_LEVERS else re.match(r"[a-z]*", lever)[0]
            if kind in kinds:  # the last one won: static+int8+int4 ran int4
                raise ValueError(f"+{kinds[kind]} and +{lever} set the same thing; give one")
            kinds[kind] = lever
            spec = _with_lever(spec, lever)
    except ValueError as err:
        raise ValueError(f"method {name!r}: {err}") from None
    for key, _ in spec.options:
        if key in (refused or {}):
            raise ValueError(f"method {name!r}: {refused[key]}")
    if not spec.needs_draft:
        if spec.vocab or any(lever in QUANT_LEVERS for lever in levers):
            raise ValueError(f"method {name!r}: draft levers on a method without a draft")
        spec = replace(spec, quant="none")
    return check_lossy(check_options(spec))


def check_options(spec: RunSpec) -> RunSpec:
    """`spec`, once its policy's options (those in its name, sized by a budget its name pins) pass the policy's own
    checks (ValueError naming the method): a bad value such as `static(depth=0)` is refused when the name is read,
    not after the ~15 s of loading the pair that building the decoder waits for."""
    if spec.policy is not None:
        try:
            cls, options = POLICIES[spec.policy], options_for(spec)[0]
            cls.Options(**(tuned_options(cls, options) or options))  # budget "auto": as make_policy reads it
        except (TypeError, ValueError) as err:
            raise ValueError(f"method {spec.name!r}: {err}") from None
    levers = {"draft vocabulary": spec.vocab, "n-gram branches": spec.ngram, "suffix nodes": spec.suffix or 0,
              "lookahead window": spec.lookahead}
    for what, value in levers.items():  # refused here, not after the pair has loaded
        if value < 0:
            raise ValueError(f"method {spec.name!r}: the {what} must be 0 (off) or more, got {value}")
    if spec.ngram and spec.ngram_len < 1:
        raise ValueError(f"method {spec.name!r}: an n-gram branch needs at least 1 token, got {spec.ngram_len}")
    if spec.policy is not None:
        try:  # their sizes (a request's chain+lookahead1000x1000 grew ~1M rows a step), before anything loads
            FreeBranches(spec.policy, spec.ngram, spec.ngram_len, spec.suffix, 0, spec.lookahead, spec.lookahead_ngram)
        except ValueError as err:
            raise ValueError(f"method {spec.name!r}: {err}") from None
    return spec


def _base(name: str) -> RunSpec:
    spec = METHODS.get(name)
    if spec is None and name in POLICIES:
        return RunSpec(name, name, size=tree_budget if "budget" in option_names(name) else None)
    if spec is None:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(POLICIES)}, or a named variant: "
                         f"{', '.join(n for n in METHODS if n not in POLICIES)}")
    if spec.policy is not None and spec.policy not in POLICIES:
        raise ValueError(f"method {name!r} needs policy {spec.policy!r}, which is not registered")
    return spec


def option_names(policy: str) -> set[str]:
    return {f.name for f in fields(POLICIES[policy].Options)}


def _with_options(spec: RunSpec, text: str) -> RunSpec:
    """`spec` with the (option=value,...) list `text`: policy options, and `verifier=NAME`."""
    if spec.policy is None:
        raise ValueError("baselines (transformers', llama.cpp's) take no (option=value) list")
    known = {f.name: f for f in fields(POLICIES[spec.policy].Options)}
    options, seen = list(spec.options), set()
    for item in filter(None, (x.strip() for x in re.split(r",(?=\s*[a-z_-]+\s*=)", text))):  # values may hold commas
        key, sep, value = item.partition("=")
        key, value = key.strip().replace("-", "_"), value.strip()
        if any(key == given for given, _ in options[len(spec.options):]) or (key == "verifier" and key in seen):
            raise ValueError(f"{key} is given twice in {text!r}")
        seen.add(key)
        if sep and key == "verifier":
            spec = replace(spec, verifier=check_verifier(value))
        elif sep and key in known:
            options.append((key, option_parser(known[key])(value)))
        else:
            raise ValueError(f"{item!r} is not option=value for policy {spec.policy!r} "
                             f"(options: {', '.join([*known, 'verifier']) or 'none'})")
    return replace(spec, options=tuple(options))


QUANT_LEVERS = {"int8": "int8", "int4": "int4", "q4_0": "q4_0", "iq4_nl": "iq4_nl", "noquant": "none"}


def _with_lever(spec: RunSpec, lever: str) -> RunSpec:
    if lever in QUANT_LEVERS:
        return replace(spec, quant=QUANT_LEVERS[lever])
    if m := re.fullmatch(r"vocab(\d+)(k?)", lever):
        return replace(spec, vocab=int(m[1]) * (1024 if m[2] else 1))
    if m := re.fullmatch(r"ngram(\d*)", lever):
        if spec.policy is None:
            raise ValueError("+ngram grafts branches into arborspec trees; baselines do not take it")
        return replace(spec, ngram=int(m[1] or NGRAM_DEFAULT))
    if m := re.fullmatch(r"suffix(\d*)", lever):
        if spec.policy is None:
            raise ValueError("+suffix grafts branches into arborspec trees; baselines do not take it")
        return replace(spec, suffix=int(m[1] or SUFFIX_DEFAULT))
    if m := re.fullmatch(r"lookahead(\d*)(?:x(\d+))?", lever):
        if spec.policy is None:
            raise ValueError("+lookahead grafts branches into arborspec trees; baselines do not take it")
        width, ngram = int(m[1] or LOOKAHEAD_DEFAULT[0]), int(m[2] or LOOKAHEAD_DEFAULT[1])
        if width < 1 or ngram < 2:
            raise ValueError(f"+{lever}: the window needs at least 1 guess and n-grams at least 2 tokens")
        return replace(spec, lookahead=width, lookahead_ngram=ngram)
    raise ValueError(f"unknown lever +{lever} (levers: {', '.join('+' + q for q in QUANT_LEVERS)}, +vocabK, "
                     "+ngram[N], +suffix[N], +lookahead[W[xN]])")


def check_verifier(name: str) -> str:
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; choose one of: {', '.join(VERIFIERS)}")
    return name


def check_lossy(spec: RunSpec) -> RunSpec:
    """`spec`, unless its verifier is lossy and the run does not allow that (ValueError)."""
    if spec.lossy and not spec.allow_lossy:
        raise ValueError(f"method {spec.name!r} uses the lossy verifier {spec.verifier!r}, which does not preserve "
                         "the target distribution; pass --allow-lossy (allow_lossy=True) to run it anyway")
    return spec


def split_methods(text: str) -> list[str]:
    """Split a comma-separated list of method names at the commas outside any (option=value,...) list."""
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


def split_label(label: str) -> tuple[str, int | None]:
    """('dyspec', 16) from a report label 'dyspec@16'; ('auto+int8', None) from 'auto+int8'."""
    m = re.search(r"@(\d+)", label)
    return (label[: m.start()] + label[m.end():], int(m[1])) if m else (label, None)


def options_for(spec: RunSpec, budget: int | None = None) -> tuple[dict, str | None]:
    """The policy options `spec` runs with at `budget` (the budget its name pins wins; None and no pin: the policy's
    own sizes), the options in its name or flags on top; and a warning when the policy lacks the size option the
    budget maps to (the budget is then not applied)."""
    fixed = dict(spec.options)
    budget = spec.budget if spec.budget is not None else budget
    if budget is None or spec.size is None or spec.policy is None:
        return fixed, None
    sized = spec.size(budget)
    unknown = sorted(set(sized) - option_names(spec.policy))
    if unknown:
        return fixed, (f"method {spec.name!r}: policy {spec.policy!r} takes no option {', '.join(unknown)}; "
                       "budget not applied")
    clash = sorted((set(sized) | SIZED_TOO.get(spec.size, set())) & set(fixed))
    if clash and spec.budget is not None:  # the name gives both: one of them was dropped without a word
        raise ValueError(f"@{budget} sizes the tree by {', '.join(sorted(sized))}, so it does not combine with "
                         f"{', '.join(clash)}; give one or the other")
    if clash:
        return fixed, f"method {spec.name!r} sets {', '.join(clash)} itself; budget {budget} not applied"
    return sized | fixed, None


# ---- the flags every command that runs a method shares ------------------------------------------------------------


# ---- models ------------------------------------------------------------------------------------------------------


def build_decoder(spec: RunSpec, target, draft=None, config: DecoderConfig | None = None, budget: int | None = None,
                  **settings) -> SpeculativeDecoder:
    """The decoder that runs `spec` on loaded models (the draft as `prepare_draft` made it), sized for `budget`
    when the name pins none. `config`: the run's settings (sampling, draft temperature, token order, ...; default:
    DecoderConfig's), with keyword `settings` on top (DecoderConfig.of: temperature=..., record_trees=...); the
    spec names the method, its options, the verifier and the free branches."""
    if spec.policy is None:
        raise ValueError(f"{spec.name!r} is a baseline (transformers' or llama.cpp's own loop): `arborspec bench` runs "
                         "it, not the engine")
    options, _ = options_for(spec, budget)
    config = DecoderConfig.of(
        config, method=spec.policy, verifier=spec.verifier, allow_lossy=spec.allow_lossy, ngram=spec.ngram,
        ngram_len=spec.ngram_len, suffix=spec.suffix, lookahead=spec.lookahead, lookahead_ngram=spec.lookahead_ngram,
        **settings, **options)
    return SpeculativeDecoder(target, draft if spec.needs_draft else None, config)
