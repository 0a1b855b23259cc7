"""The benchmark's numbers, as pure functions of recorded runs (no models, no clocks), so each is unit-tested.

Names, because every paper calls the same thing something else:

- **MAT** (Spec-Bench: "mean accepted tokens") = committed tokens per decoding step's target forward, the bonus token
  included, so plain decoding scores 1.00. The prompt's forward, which makes the first token and drafts nothing, is
  no decoding step (so a chain of k drafts trees of k, not of k times steps / (steps + 1)); transformers' assisted
  generation has no such forward (its first verification reads the prompt). The same quantity is DySpec's and
  Sequoia's "tokens/step" / *M*, Medusa's and EAGLE's *tau*, WETAP's mean generated length *L-bar*, DynaTree's
  average accepted length, and "ATN" (accepted tokens number) elsewhere. `mat` computes it.
- **acceptance rate** = drafted tokens the target accepted / drafted tokens (bonus tokens are not drafted).
- **acceptance at depth d** = among steps whose tree reached depth d, the share that accepted at least d drafted tokens;
  **zero-accept share** = among steps that drafted anything, the share that accepted none.
- **root acceptance / optimum** = among steps whose root children were sampled, the share that accepted a first
  drafted token, beside the mean of the best rate any exact verifier could reach on those trees (verify/base.py:
  root_optimum; an upper bound for children drawn without replacement).
- **accepted by source** = per source of drafted nodes (the draft model, ngram, suffix, lookahead), the tokens it
  proposed and the accepted tokens credited to it (a node two sources proposed counts for the first), per step.
- **TTFT** = seconds from the call to the first generated token; **TPOT** = seconds per output token after the first.
- **speed-up** = tokens/s of a method over tokens/s of a baseline measured in the same process on the same prompts.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

import torch


def mat(committed_per_step: Sequence[int]) -> float | None:
    """Mean accepted tokens per step (MAT / tau / M / L-bar): committed tokens per decoding step, bonus included."""
    if not committed_per_step:
        return None
    return sum(committed_per_step) / len(committed_per_step)


def mean_accepted_drafted(accepted_per_step: Sequence[int]) -> float | None:
    """Mean drafted tokens accepted per step, bonus excluded (MAT - 1 when no stopping rule cut a step short)."""
    if not accepted_per_step:
        return None
    return sum(accepted_per_step) / len(accepted_per_step)


def acceptance_rate(accepted: Iterable[int], drafted: Iterable[int]) -> float | None:
    """Accepted drafted tokens / drafted tokens, summed over steps (and runs); None when nothing was drafted."""
    n_drafted = sum(drafted)
    return sum(accepted) / n_drafted if n_drafted else None


def accepted_at_depth(accepted_per_step: Sequence[int], depth_per_step: Sequence[int]) -> list[float]:
    """Per-position acceptance: entry d-1 is the share of the steps whose tree reached depth d that accepted at least
    d drafted tokens (engine.GenerationStats.accepted_at_depth, here over the steps of any number of runs)."""
    shares = []
    for d in range(1, max(depth_per_step, default=0) + 1):
        reached = [a for a, depth in zip(accepted_per_step, depth_per_step) if depth >= d]
        shares.append(sum(a >= d for a in reached) / len(reached))
    return shares


def zero_accept_share(accepted_per_step: Sequence[int], drafted_per_step: Sequence[int]) -> float | None:
    """Among steps that drafted anything, the share that accepted none of it; None when nothing was drafted."""
    drafted = [a for a, n in zip(accepted_per_step, drafted_per_step) if n > 0]
    return sum(a == 0 for a in drafted) / len(drafted) if drafted else None


def root_acceptance(accepted_per_step: Sequence[int],
                    optimum_per_step: Sequence[float | None]) -> tuple[float, float] | None:
    """(measured, optimum) over the steps with a recorded root optimum: the share that accepted a first drafted token,
    and the mean optimum (engine.GenerationStats.root_acceptance / root_optimum). None without such steps."""
    pairs = [(a >= 1, o) for a, o in zip(accepted_per_step, optimum_per_step) if o is not None]
    if not pairs:
        return None
    return sum(a for a, _ in pairs) / len(pairs), sum(o for _, o in pairs) / len(pairs)


def median_iqr(values: Iterable[float]) -> tuple[float, float, float] | None:
    """(median, first quartile, third quartile) with linear interpolation between order statistics; None if empty."""
    xs = sorted(float(v) for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return med, q1, q3


def mean(values: Iterable[float | None]) -> float | None:
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    return sum(xs) / len(xs) if xs else None


def pooled_perplexity(runs: Iterable[tuple[float | None, int | None]]) -> float | None:
    """The perplexity of several runs' outputs taken together, from (perplexity, tokens) per run: exp of the mean NLL
    over all their tokens, as the perplexity of one run is (a mean of the runs' perplexities weighted a 5-token
    answer as a 500-token one)."""
    pairs = [(float(p), int(n)) for p, n in runs if p is not None and n and not math.isnan(p)]
    if any(p < 1 for p, _ in pairs):  # exp of a mean NLL >= 0; a 0 gave "math domain error"
        raise ValueError(f"a run's perplexity is {min(p for p, _ in pairs):g}; a perplexity is at least 1")
    total = sum(n for _, n in pairs)
    return math.exp(sum(n * math.log(p) for p, n in pairs) / total) if total else None


def throughput(tokens: int, seconds: float) -> float | None:
    """Tokens per second, None when no time was measured."""
    return tokens / seconds if seconds and seconds > 0 else None


def speedup(runs: Sequence[Mapping], baseline: Sequence[Mapping], key: str = "prompt_key") -> float | None:
    """Throughput of `runs` over that of `baseline` on the prompts both completed (paired by `key`).

    Aggregate throughput (total tokens / total wall time) on each side, as Spec-Bench does, so long generations weigh
    more than short ones. Each run needs `new_tokens` and `wall`.
    """
    ok = lambda r: not r.get("error") and r.get("wall")  # noqa: E731
    base = {r[key]: r for r in baseline if ok(r)}
    pairs = [(r, base[r[key]]) for r in runs if ok(r) and r[key] in base]
    if not pairs:
        return None
    mine = throughput(sum(r["new_tokens"] for r, _ in pairs), sum(r["wall"] for r, _ in pairs))
    theirs = throughput(sum(b["new_tokens"] for _, b in pairs), sum(b["wall"] for _, b in pairs))
    return mine / theirs if mine is not None and theirs else None


def tpot(total: float, ttft: float | None, new_tokens: int) -> float | None:
    """Time per output token after the first: (total - TTFT) / (tokens - 1); None if it cannot be measured."""
    if ttft is None or new_tokens < 2:
        return None
    return (total - ttft) / (new_tokens - 1)


def perplexity(logits: torch.Tensor, ids: Sequence[int] | torch.Tensor) -> float | None:
    """exp(mean negative log-likelihood) of `ids` under `logits`.

    logits: (n, vocab), row i = the model's next-token logits just before ids[i] (i.e. given the prompt and ids[:i]).
    Computed in float64 from log_softmax; None for an empty sequence.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        return None
    if logits.shape[0] != ids.numel():
        raise ValueError(f"perplexity: {logits.shape[0]} rows of logits for {ids.numel()} tokens")
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    nll = -logp.gather(1, ids[:, None]).squeeze(1)
    return float(torch.exp(nll.mean()))


def node_outcomes(tree: Mapping) -> list[tuple[float, bool]]:
    """(draft probability, accepted?) for every drafted node the verifier actually reached in one step.

    `tree` is a recorded step tree (`StepStats.tree`: tokens, parents, probs, path). A node is reached when its
    parent is the root or an accepted node: only those had a chance; the others were cut off with a rejected ancestor
    (DySpec Fig. 2 bins exactly these by draft probability).
    """
    on_path = set(tree["path"])
    reached_parents = on_path | {0}
    return [(float(tree["probs"][i]), i in on_path)
            for i in range(1, len(tree["tokens"])) if tree["parents"][i] in reached_parents]


def acceptance_by_probability(outcomes: Iterable[tuple[float, bool]], bins: int = 10) -> list[tuple[float, float, int]]:
    """Bin (draft prob, accepted) pairs into `bins` equal bins of [0, 1]: (bin centre, fraction accepted, count),
    empty bins left out."""
    counts, hits = [0] * bins, [0] * bins
    for p, accepted in outcomes:
        b = min(int(float(p) * bins), bins - 1) if p == p else 0
        counts[b] += 1
        hits[b] += bool(accepted)
    return [((b + 0.5) / bins, hits[b] / counts[b], counts[b]) for b in range(bins) if counts[b]]


def by_source(per_run: Iterable[Mapping[str, Mapping[str, int]]], steps: int) -> dict[str, dict]:
    """Which source supplied the drafted tokens and the accepted ones, pooled over runs.

    `per_run`: each run's per-source counts (engine.GenerationStats.sources: proposed, accepted, also_accepted per
    source); `steps`: the steps of those runs. Per source: `proposed` and `accepted` per step, `rate` (accepted /
    proposed), `share` of all accepted tokens (the shares add up to 1), `also` accepted tokens per step that the source
    proposed too but that are credited to an earlier source. Sources that proposed nothing are left out."""
    totals: dict[str, dict[str, int]] = {}
    for counts in per_run:
        for source, c in counts.items():
            t = totals.setdefault(source, {"proposed": 0, "accepted": 0, "also_accepted": 0})
            for key in t:
                t[key] += c.get(key, 0)
    accepted = sum(t["accepted"] for t in totals.values())
    per_step = lambda n: n / steps if steps else None  # noqa: E731
    return {source: dict(proposed=per_step(t["proposed"]), accepted=per_step(t["accepted"]),
                         rate=t["accepted"] / t["proposed"] if t["proposed"] else None,
                         share=t["accepted"] / accepted if accepted else None, also=per_step(t["also_accepted"]))
            for source, t in totals.items() if t["proposed"] or t["also_accepted"]}


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where `a` and `b` differ (a length difference counts at the shorter length), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
