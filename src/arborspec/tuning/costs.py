"""Cost profiles: what one forward over a tree of n tokens costs a given model on this machine, measured and cached.

`measure_forward_cost` times a model's tree forwards (the fastest of repeats, on a ~200-token prefix) through the same
sessions generation uses (`backends.make_session`), so it times any backend, a llama.cpp model included.

The auto policy (drafting/auto/) sizes every tree from two such curves: the target's t(n) (one forward over n tree
tokens, root included) and the draft's d(w) (one draft call over w nodes: the cost of one drafted layer).
`profile_model` returns a model's `CostCurve`, measured once and cached under cache_dir()/profiles/ as JSON. A cached
profile is used only when its key (model fingerprint, dtype, thread count, machine) and its versions (profile format,
arborspec, torch, transformers) equal the current ones; otherwise it is measured again and overwritten.

cost_plots.py draws them (`arborspec profile --model` / `--pair`).
"""
from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..backends import is_ssm_model, make_session
from ..backends.model_info import branch_limit, context_window
from ..backends.native import file_fingerprint
from ..core import cpu_load
from ..core.disk_cache import keep_record, model_fingerprint, read_record, record_path, sha256_key
from ..core.host import machine_id
from ..core.isotonic import pool_adjacent_violators
from ..core.options import is_whole
from ..core.tree import TokenTree

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


# ---- measuring ------------------------------------------------------------------------------------------------------
def full_tree(n: int, root: int, tokens: list[int], arity: int = 2, leaves: int | None = None) -> TokenTree:
    """An n-token complete `arity`-ary tree (parents first), root token `root`, other tokens from `tokens`; with
    `leaves`, its first layers only, until they have that many leaves, then each leaf grown into a chain in turn (the
    same n tokens for a backend whose forwards take no more leaves: llama.cpp's n_seq_max - 1, `branch_limit`; a
    forward's cost follows its tokens, and the complete trees of a profile's 128 tokens stopped auto from starting on
    a llama.cpp model loaded with fewer than 64 sequences)."""
    tree = TokenTree.root(root)
    tips = [0]  # the leaves, in the order they were added
    for i in range(1, n):
        parent = (i - 1) // arity
        if leaves is not None and parent not in tips and len(tips) >= leaves:  # a new leaf too many: a chain
            parent = tips[0]
        if parent in tips:
            tips.remove(parent)
        tips.append(tree.add(parent, tokens[(i - 1) % len(tokens)]))
    return tree


class TreeTimer:
    """One session of `model`, prefilled with `prefix` random tokens, whose forwards over complete binary trees are
    timed a round at a time (`round`). Each timed forward is followed by commit([0]), so the prefix grows by one token
    per call. `new_session(model, role)` makes the session (a benchmark's alternative), else the model's own kind."""

    def __init__(self, model, prefix: int = 200, seed: int = 0, ssm_tree: str = "packed", new_session=None):
        self.rng = random.Random(seed)
        self.vocab = int(model.config.vocab_size)
        self.context = [self.rng.randrange(self.vocab) for _ in range(prefix)]
        role = measured_role(model)
        self.session = new_session(model, role) if new_session else make_session(model, role, ssm_tree=ssm_tree)
        self.leaves = branch_limit(model)
        self.session.prefill(self.context[:-1])

    def round(self, sizes) -> list[float]:
        """Seconds of one forward over an N-node tree for each N in `sizes` (in their order), the largest run first:
        after a 128-node forward the caches hold none of a small forward's data, which read the q4_0 draft's d(1)
        ~8% high."""
        times = [0.0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            n = sizes[i]
            tree = full_tree(n, self.context[-1], [self.rng.randrange(self.vocab) for _ in range(max(n - 1, 1))],
                             leaves=self.leaves)
            start = time.perf_counter()
            self.session.forward(self.context, tree, list(range(len(tree))))
            times[i] = time.perf_counter() - start
            self.session.commit([0])
            self.context.append(self.rng.randrange(self.vocab))
        return times


def measure_forward_cost(model, sizes=DEFAULT_SIZES, prefix: int = 200, repeats: int = 3, ssm_tree: str = "packed",
                         seed: int = 0, new_session=None) -> list[float]:
    """Seconds of one forward over an N-token complete binary tree, for each N in `sizes`: the fastest of `repeats`.

    One session (`TreeTimer`) is prefilled with `prefix` random tokens, and the prefix grows by len(sizes) *
    (repeats + 1) tokens in all. The sizes are measured in rounds, one call of each per round (the first round
    untimed, a warm-up), not one size after the other: a shared host's memory speed can drift within minutes, and
    size by size a slow minute fell on a few sizes alone (an AVX2 profile read t(1) = 35.6 ms above t(2) = 30.7 ms,
    where decoding ran at 27 ms a token; Zen 4, 2026-11-26), so the draft choice and the gate compared sizes measured
    in different states.
    Why the fastest and not the median: a forward's time only grows with what else runs, and on a shared host calls
    stall at random. The 1.5B target's one-token forwards (22.7 ms) took +15-30 ms stalls, about one call in eight,
    so a median of 3 read its t(1) at 31-35 ms in two of five profiles while t(8) read right: its extra rows then
    looked nearly free, and `auto` drafted and grafted at a loss (AVX2 build, Zen 4, 2026-11-26).
    """
    timer = TreeTimer(model, prefix, seed, ssm_tree, new_session)
    rounds = [timer.round(sizes) for _ in range(repeats + 1)][1:]
    return [min(r[i] for r in rounds) for i in range(len(sizes))]


# ---- cost curves ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostCurve:
    """Measured seconds of one forward over n tree tokens, at `sizes`; piecewise linear in between, linear past the
    last size. From n = 2 on the curve is made non-decreasing (noise only: more tokens never cost less), while t(1)
    is kept as measured: in bf16 a one-token forward can be slower than a two-token one (on this project's CPU the
    lm_head matmul took 23 ms for one token against 18 ms for two)."""

    sizes: tuple[int, ...]
    times: tuple[float, ...]

    @classmethod
    def from_measurements(cls, sizes, times) -> "CostCurve":
        # whole sizes >= 1 and finite times > 0: a damaged cached record held NaN times (auto sized its trees from
        # NaN costs) or an infinite size (an OverflowError traceback)
        if not all(is_whole(s) or (isinstance(s, float) and s.is_integer()) for s in sizes):
            raise ValueError("a cost curve's sizes are whole numbers of tokens")
        if len(sizes) != len(times):  # zip below would drop the unpaired ones in silence
            raise ValueError(f"a cost curve needs one time a size, got {len(sizes)} sizes and {len(times)} times")
        pairs = sorted(zip((int(s) for s in sizes), (float(t) for t in times)))
        positive = all(n >= 1 and math.isfinite(t) and t > 0 for n, t in pairs)
        if not pairs or not positive or len({s for s, _ in pairs}) != len(pairs):
            raise ValueError("a cost curve needs distinct sizes of at least 1 with positive, finite times")
        s, t = zip(*pairs)
        start = next((i for i, n in enumerate(s) if n >= 2), len(s))
        return cls(tuple(s), t[:start] + tuple(float(v) for v in pool_adjacent_violators(t[start:])))

    def __call__(self, n):
        n = np.asarray(n, dtype=np.float64)
        out = np.interp(n, self.sizes, self.times)
        if len(self.sizes) > 1:
            slope = (self.times[-1] - self.times[-2]) / (self.sizes[-1] - self.sizes[-2])
            out = np.where(n > self.sizes[-1], self.times[-1] + max(slope, 0.0) * (n - self.sizes[-1]), out)
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "times": list(self.times)}


# ---- profiles: curves cached per model, dtype, thread count, machine and library versions ---------------------------
def measured_role(model) -> str:
    """How errors name a model measured here, target or draft alike ("the profiled draft.gguf model produced
    non-finite logits"): a session's role said "target" for either, which blamed the target for a broken draft."""
    name = _name(model) or type(model).__name__
    return f"profiled {Path(name).name or name}"


def _name(model) -> str:
    """Where `model` was loaded from, as its config says ("" when it does not)."""
    return str(getattr(model.config, "_name_or_path", "") or "")


def model_threads(model) -> int:
    """The threads `model` computes with: its own setting for a backend that has one (llama.cpp), else torch's."""
    return getattr(model, "n_threads", None) or torch.get_num_threads()


def profile_key(model, ssm_tree: str = "packed") -> dict:
    """What a model's cached curve is measured on. A Mamba2 / hybrid model's tree scan `ssm_tree` "unrolled" costs
    otherwise than the default "packed", so it is keyed too (only then: the keys of every other model stay)."""
    key = _key(model_fingerprint(model), _name(model), model.dtype, model_threads(model))
    return {**key, "ssm_tree": ssm_tree} if ssm_tree != "packed" and is_ssm_model(model) else key


def native_profile_key(info) -> dict:
    """The profile_key of the native model that `info` (backends.native.read_header) describes, before it is loaded:
    a native model is named by its file, computes in float32 and on torch's threads."""
    return _key(file_fingerprint(info), str(info.path), torch.float32, torch.get_num_threads())


def _key(fingerprint: str, name: str, dtype, threads: int) -> dict:
    return {"model": fingerprint, "name": name, "dtype": str(dtype), "threads": threads, "machine": machine_id()}


def profile_model(model, refresh: bool = False, sizes=DEFAULT_SIZES, prefix: int = 200, repeats: int = 3,
                  measure=None, progress: bool = False, ssm_tree: str = "packed") -> tuple[CostCurve, str]:
    """The model's cost curve t(n) from the cache, or measured now (and cached). Returns (curve, source), source
    'cache' or 'measured'. `measure` (default `measure_forward_cost`) is replaceable for tests. `ssm_tree`: the
    tree scan a Mamba2 / hybrid model is to run (auto sized unrolled trees by the packed scan's costs)."""
    key = profile_key(model, ssm_tree)
    cached = None if refresh else read_record("cost", key)
    if cached is not None:
        try:
            curve = CostCurve.from_measurements(cached["sizes"], cached["raw_times"])
        except (KeyError, TypeError, ValueError):
            curve = None
        if curve is not None and not min(curve.sizes) <= min(sizes) <= max(sizes) <= max(curve.sizes):
            # `profile --sizes 1,2` left a curve auto read flat past t(2) for every tree, `--sizes 2,...` one whose
            # t(1) was t(2): a profile is reused only for the sizes it measured
            curve = None
        if curve is not None and (measure is not None or live_agrees(model, curve, key, progress, ssm_tree=ssm_tree)):
            return curve, "cache"
    if progress:
        print(f"[arborspec] profiling {key['name'] or type(model).__name__} ({key['dtype']}, {key['threads']} threads)"
              " for tree sizes " + ",".join(map(str, sizes)) + " ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    prefix = fitting_prefix(model, prefix, sizes, repeats)
    with cpu_load.OtherLoad() as load:
        times = (measure or measure_forward_cost)(model, sizes, prefix=prefix, repeats=repeats, ssm_tree=ssm_tree)
    return save_profile(model, key, sizes, times, prefix, repeats, time.perf_counter() - start, load.share), "measured"


class WindowTooSmall(ValueError):
    """A model whose context window cannot hold a profile's timed forwards (a toy model's 16 positions). `what` says
    so; the message adds what generate's user can do (`arborspec profile` gives its own advice)."""

    def __init__(self, what: str):
        super().__init__(f"{what}; the auto method and the draft choice need those times: use another method "
                         "(chain, static, ...) and --draft-quant none")
        self.what = what


def fitting_prefix(model, prefix: int, sizes, repeats: int) -> int:
    """`prefix`, cut so that it still leaves room in the model's context window for the timed calls (the prefix
    grows by one token per call) and the deepest tree; WindowTooSmall where not even a 2-token prefix leaves it (the
    calls ran past the window, and a model with learned positions, GPT-2's 16, failed with an IndexError)."""
    window = context_window(model, default=0)
    if not window:
        return prefix
    calls = len(sizes) * (repeats + 1)
    deepest = max(full_tree(n, 0, [0], leaves=branch_limit(model)).depth for n in sizes)
    room = window - calls - deepest - 2
    if room < 2:
        raise WindowTooSmall(f"{_name(model) or type(model).__name__}'s context window ({window} tokens) is too small "
                             f"to time its tree forwards ({calls} calls, trees {deepest} deep: {calls + deepest + 4} "
                             "positions)")
    return min(prefix, room)


def save_profile(model, key: dict, sizes, times, prefix: int, repeats: int, seconds: float,
                 others: float | None = None) -> CostCurve:
    """Cache `times` as the model's profile; returns its curve. `others`: the share of the CPUs other processes
    kept busy meanwhile (core/cpu_load.py); a busy one is measured again at the first quiet start (`live_agrees`),
    and comparisons made with it are not cached (`busy`)."""
    global busy
    curve = CostCurve.from_measurements(sizes, times)
    keep_record("cost", key, {"sizes": list(sizes), "raw_times": [float(t) for t in times], "prefix": prefix,
                               "repeats": repeats, "seconds": seconds,
                               "others": None if others is None else round(others, 3)})
    _checked.add(sha256_key(key))  # measured in this process: nothing to check it against
    busy += cpu_load.is_busy(others)
    return curve


def profile_together(models: list, sizes=DEFAULT_SIZES, prefix: int = 200, repeats: int = 3,
                     progress: bool = False) -> list[CostCurve]:
    """Cost curves of models that are to be compared with each other (the draft's variants), measured in the same
    rounds: each model gets one session (`TreeTimer`) and a warm-up round, then each round times every size of every
    model once, and a model's figure is its fastest round. Each is cached as its profile, as `profile_model` would.
    (Before, each round opened, prefilled and warmed up a session per model. With that and nine variants the pair's
    first profile took 97 s; with one session each and six variants, 62.7 s: the two changes were not timed apart.)

    Why not one model after another: a shared host's memory speed drifts within a minute, and whichever variant is
    measured in the slow minute loses. On the Zen 4 host (2026-11-27) the q4_0 draft's d(1) read 10.3 ms against the
    shipped file's 9.8, measured a minute apart, so `auto` kept the shipped file; in the same rounds the two read
    10.1 and 15.0 ms, and 6.9 and 10.2 in a faster minute."""
    if progress:
        print(f"[arborspec] profiling {len(models)} models in the same rounds for tree sizes "
              + ",".join(map(str, sizes)) + " ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    prefixes = [fitting_prefix(m, prefix, sizes, repeats) for m in models]
    timers = [TreeTimer(m, p) for m, p in zip(models, prefixes)]  # one session each, for every round
    with cpu_load.OtherLoad() as load:
        for timer in timers:
            timer.round(sizes)  # a warm-up
        rounds = [[timer.round(sizes) for timer in timers] for _ in range(repeats)]
    seconds = (time.perf_counter() - start) / len(models)
    return [save_profile(m, profile_key(m), sizes, [min(r[i][j] for r in rounds) for j in range(len(sizes))], p,
                         repeats, seconds, load.share)
            for i, (m, p) in enumerate(zip(models, prefixes))]


# ---- cached curves checked against live forwards ------------------------------------------------------------------
LIVE_SIZES = (1, 4)  # the live check's forwards: one plain step and a small tree
LIVE_RATIO = 2.0  # a cached t(n) off by more than this factor from the live one is measured again
LIVE_FLOOR = 0.002  # seconds: differences below this are Python noise on a tiny model, never a stale profile
# a cached t(4)/t(1) more than this factor above the live one is measured again: the live pair of sizes runs within a
# second, so its ratio is this machine's own, whatever state its memory is in (a first profile on a busy host kept
# t(4) = 1.96 t(1) for the 1.5B target against ~1.2 live, t(1) right: auto then judged that no tree could pay and
# never drafted, so no live step ever corrected it; Zen 4, 2026-11-26)
LIVE_SHAPE = 1.3
_checked: set[str] = set()  # the profiles checked (or measured) in this process: each is checked once
busy = 0  # times a figure was taken or kept on a busy machine: others took CPU time while a profile was measured,
# or live forwards ran slower than a cached figure (kept); comparisons that see it grow are not cached (backend_choice)


def live_agrees(model, curve: CostCurve, key: dict, progress: bool = False, measure=None, force: bool = False,
                ssm_tree: str = "packed") -> bool:
    """Whether a few live forwards (`LIVE_SIZES`, 2 each after a warm-up, on a 32-token prefix: ~0.2 s for the 1.5B
    target) leave the cached curve standing; checked once per profile and process. False (after a one-line note)
    means the cached figure is more than `LIVE_RATIO` times slower than the live one: it was measured while something
    else ran (a first start on a busy machine once timed the draft on native at 1064 ms against the 65 ms it runs at,
    and kept that figure for good), and is measured again. Live forwards more than `LIVE_RATIO` times slower than the
    cached figure leave it standing, with a note: load on the machine only ever slows a forward, so the faster of two
    figures is the truer one, and one taken now would be the stale figure of the next start. A profile measured while
    other processes kept the CPUs busy (its record's `others`, core/cpu_load.py) is measured again when the live
    forwards find the machine quiet, however close the figures. `force`: check even if this process checked (or
    measured) it already."""
    global busy
    name = sha256_key(key)
    if name in _checked and not force:
        return True
    _checked.add(name)
    window = context_window(model, default=0)
    prefix = 32 if not window else max(2, min(32, window - 3 * len(LIVE_SIZES) - max(LIVE_SIZES) - 2))
    with cpu_load.OtherLoad() as now:
        live = (measure or measure_forward_cost)(model, LIVE_SIZES, prefix=prefix, repeats=2, ssm_tree=ssm_tree)
    label = key["name"] or type(model).__name__
    then = _busy_share(key)
    if then is not None and now.share is not None and not cpu_load.is_busy(now.share):
        _note(f"the cached cost of {label} was measured while other processes kept {then:.0%} of the CPUs busy: "
              f"measuring it again on the quiet machine ({now.share:.0%})", progress)
        return False
    for n, seconds in zip(LIVE_SIZES, live):
        cached = float(curve(n))
        if abs(seconds - cached) <= LIVE_FLOOR:
            continue
        if seconds * LIVE_RATIO < cached:
            _note(f"the cached cost of {label} is off (t({n}) {cached * 1e3:.1f} ms cached, {seconds * 1e3:.1f} ms "
                  "now): measuring it again", progress)
            return False
        if seconds > LIVE_RATIO * cached:
            _note(f"{label} runs slower than its cached cost (t({n}) {seconds * 1e3:.1f} ms now, {cached * 1e3:.1f} "
                  "ms cached): the machine is busy; keeping the cached figure", progress)
            busy += 1
            return True
    return shape_agrees(curve, live, label, progress)


def shape_agrees(curve: CostCurve, live: list[float], label: str, progress: bool = False) -> bool:
    """Whether the cached curve's growth from one row to the largest of `LIVE_SIZES` is not `LIVE_SHAPE` times the
    live one's (load inflated the cached larger tree). Judged only when the live t(1) is not above the cached one by
    more than 20%: a live one-row forward that a stall slowed would make the live growth look small."""
    n = LIVE_SIZES[-1]
    cached_ratio, live_ratio = float(curve(n)) / float(curve(1)), live[-1] / live[0]
    excess = float(curve(n)) - live[-1] * float(curve(1)) / live[0]  # seconds the cached t(n) has too many
    if live[0] <= 1.2 * float(curve(1)) and cached_ratio > LIVE_SHAPE * live_ratio and excess > LIVE_FLOOR:
        _note(f"the cached cost of {label} grows too fast (t({n})/t(1) {cached_ratio:.2f} cached, {live_ratio:.2f} "
              "now): measuring it again", progress)
        return False
    return True


def confirm_profile(model, progress: bool = False) -> tuple[CostCurve, str]:
    """`profile_model`'s curve, checked against live forwards now even if it was measured a moment ago (a profile
    taken while something else ran for a while is measured again): for comparisons between models measured one
    after another, as `--backend auto` makes (loading/backend_choice.py)."""
    curve, source = profile_model(model, progress=progress)
    if live_agrees(model, curve, profile_key(model), progress, force=True):
        return curve, source
    return profile_model(model, refresh=True, progress=progress)


def _note(text: str, progress: bool) -> None:
    if progress:
        print(f"[arborspec] note: {text}", file=sys.stderr, flush=True)


def busy_share(model, ssm_tree: str = "packed") -> float | None:
    """The share of the CPUs other processes kept busy while `model`'s cached profile was measured, where that made
    it a busy machine's figure (core/cpu_load.py: measured again at the first quiet start); None otherwise."""
    return _busy_share(profile_key(model, ssm_tree))


def _busy_share(key: dict) -> float | None:
    share = (read_record("cost", key) or {}).get("others")
    return share if cpu_load.is_busy(share) else None


def profile_path(model, ssm_tree: str = "packed"):
    """Where `profile_model` keeps `model`'s curve (it may not exist yet)."""
    return record_path("cost", profile_key(model, ssm_tree))
