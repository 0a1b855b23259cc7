"""`arborspec report DIR`: report.md and PNG plots from DIR/results.json alone; `--check-equal` for greedy outputs.

Everything here is recomputed from the recorded runs (tables.py, metrics.py), so a report can be regenerated, or a
results.json from another machine reported, at any time. Tables: one per dataset x temperature, a row per method
(x budget): MAT (= tau / M / L-bar, committed tokens per step, bonus included), acceptance rate, acceptance at depths
1-3, zero-accept share, root acceptance against the best any exact verifier could reach (T > 0), tokens/s median and
IQR, speed-up over `ar` and over `hf-assisted` from the same run (aggregate throughput on the prompts both completed),
TTFT, TPOT, target perplexity of the output, memory. Per-category tables when a dataset has categories (MT-Bench).
"Accepted by source": per method, which source (draft model, ngram, suffix, lookahead) proposed the drafted tokens
and supplied the accepted ones. "Where the time goes": per method, a step's drafting, verification and the rest.

Plots (figures.py): throughput.png (tokens/s and speed-up bars), mat_vs_tree_size.png (DySpec Fig. 5, when a method
ran with several budgets), acceptance_vs_draft_prob.png (DySpec Fig. 2: drafted nodes the verifier reached,
binned by draft probability, fraction accepted), sps_vs_asps.png (chain length vs MAT for each chain verifier, when
ASpS and SpS both ran with several k), accepted_by_source.png (accepted tokens per step, stacked by source, per
dataset and method). `--reproduction` writes the paper-by-paper report instead (reproduction.py).
"""
from __future__ import annotations

from pathlib import Path

from ..core import cpu_load
from . import metrics, records
from .figures import write_plots
from .reproduction import write_reproduction
from .tables import category_tables, depth_cell, fmt, ordered_sources, resumed_lines, root_cell, tables


def load_results(path: str | Path) -> tuple[dict, Path]:
    """(results, directory) from a results directory or a results.json path (plain or gzipped: records.py)."""
    file = records.find(path)
    if file is None:
        raise FileNotFoundError(f"no results.json at {str(path)!r}")
    results = records.read(file)
    if not (isinstance(results, dict) and isinstance(results.get("runs"), list)
            and all(isinstance(run, dict) for run in results["runs"])):
        raise ValueError(f"{file} is not a results.json of `arborspec bench`: no list of runs under \"runs\"")
    return results, file.parent


# ----------------------------------------------------------------------------------------------------- report
GLOSSARY = """\
- **MAT** (Spec-Bench's *mean accepted tokens*) = tokens committed per decoding step (one target forward each), the
  bonus token included (plain decoding: 1.00); the prompt's forward, which makes the first token, is no step. The same number is called *M* / tokens per step (DySpec, Sequoia), *tau* (Medusa, EAGLE),
  *L-bar* mean generated length (WETAP), average acceptance length / ATN elsewhere. *acc./step* excludes the bonus.
- **acc. rate** = accepted drafted tokens / drafted tokens; **tree** = mean drafted tokens per step.
- **acc@1/2/3** = per-position acceptance: among steps whose tree reached depth d, the share that accepted at least d
  drafted tokens, for d = 1, 2, 3. **zero %** = steps that drafted something and accepted none of it, in percent.
- **root acc / opt** (T > 0) = over steps whose root children were sampled, the share that accepted a first drafted
  token / the mean best rate any exact verifier could reach on the same trees, given the draft distribution at the
  root and its number of children (verify/base.py: root_optimum): exact for one child, i.i.d. children and greedy
  multi-draft children (k-1 top tokens + one sample), an upper bound for children drawn without replacement (exact
  for 2 children on every instance tested, a few points loose at worst from 3 on). The gap is the distance to the
  optimum; computing it is left out of the timings.
- **tok/s** = new tokens / wall time of the whole call (prefill included), median and interquartile range over
  prompts. **speed-up** = aggregate tokens/s over that of `ar` (resp. `hf-assisted`) on the same prompts, measured
  interleaved in the same process.
- **accepted by source** (its own table) = per source of drafted nodes -- the draft model (`draft`), prompt-lookup
  n-grams (`ngram`), suffix statistics (`suffix`), lookahead's n-gram pool (`lookahead`) -- the nodes it proposed and
  the accepted ones credited to it, per step; a node two sources proposed is credited to the first (the draft model,
  then ngram, suffix, lookahead), and *also* counts the accepted tokens a source proposed too but was not credited
  with.
- **TTFT** = time to the first generated token; **TPOT** = time per output token after the first.
- **ppl** = perplexity of the output under the target (exp of the mean NLL of the generated tokens).
- **peak RSS** = the process's peak resident memory (monotone over the whole benchmark); **ΔRSS** = mean change
  of resident memory over a run.
- **LOSSY** methods do not preserve the target distribution; their speed is not comparable to an exact method's.
"""


def _row(label: str, s: dict, peer: bool = False) -> str:
    """One table row; `peer`: with the speed-up over plain llama.cpp (runs that have a llamacpp-ar row)."""
    tps = s["tps"]
    tps_text = "–" if tps is None else f"{tps[0]:.2f} [{tps[1]:.2f}–{tps[2]:.2f}]"
    name = f"{label} **LOSSY**" if s["lossy"] else label
    cells = [name, s["verifier"], f"{s['runs'] - s['errors']}/{s['runs']}", fmt(s["mat"]), fmt(s["accepted"]),
             fmt(s["acceptance_rate"]), depth_cell(s["acc_at_depth"]), fmt(s["zero_accept"], 1, 100),
             root_cell(s["root"]), fmt(s["tree_size"], 1), tps_text,
             fmt(s["speedup"].get("ar")), fmt(s["speedup"].get("hf-assisted"))]
    cells += [fmt(s["speedup"].get("llamacpp-ar"))] if peer else []
    cells += [fmt(s["ttft"]), fmt(s["tpot"], 1, 1000), fmt(s["perplexity"]), fmt(s["peak_rss"], 0),
              fmt(s["rss_delta"], 1)]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| method | verifier | runs ok | MAT | acc./step | acc. rate | acc@1/2/3 | zero % | root acc / opt | tree | "
          "tok/s median [IQR] | speed-up vs ar | speed-up vs hf-assisted | TTFT s | TPOT ms | ppl | peak RSS MB | "
          "ΔRSS MB |\n" + "|---" * 18 + "|")
PEER_HEADER = HEADER.replace("speed-up vs hf-assisted |", "speed-up vs hf-assisted | speed-up vs llamacpp-ar |",
                             1).replace("|---" * 18, "|---" * 19)


SOURCE_HEADER = ("| dataset | T | method | source | proposed/step | accepted/step | acc. rate | share of accepted | "
                 "also accepted/step |\n" + "|---" * 9 + "|")


def source_lines(groups: dict) -> list[str]:
    """The "accepted by source" table: for every method that drafted anything, which source supplied its tokens."""
    rows = []
    for (dataset, temp), by_label in groups.items():
        for label, s in by_label.items():
            for source, c in ordered_sources(s.get("sources") or {}):
                cells = [dataset, f"{temp:g}", label, source, fmt(c["proposed"]), fmt(c["accepted"]), fmt(c["rate"]),
                         fmt(c["share"]), fmt(c["also"])]
                rows.append("| " + " | ".join(cells) + " |")
    return ["## Accepted by source", "", SOURCE_HEADER, *rows, ""] if rows else []


TIME_HEADER = ("| dataset | T | method | prefill ms/run | draft ms/step | verify ms/step | rest ms/step | draft % | "
               "verify % | rest % |\n" + "|---" * 10 + "|")


def time_lines(groups: dict) -> list[str]:
    """The "where the time goes" table: per method that ran arborspec's engine, a step's draft, verification and
    the rest (tables.time_profile), so a speed-up that falls short says which part to work on."""
    rows = []
    for (dataset, temp), by_label in groups.items():
        for label, s in by_label.items():
            t = s.get("time")
            if t is None:
                continue
            cells = [dataset, f"{temp:g}", label, fmt(t["prefill_ms"], 1), fmt(t["draft_ms"], 2),
                     fmt(t["verify_ms"], 2), fmt(t["rest_ms"], 2), fmt(t["draft_share"], 0, 100),
                     fmt(t["verify_share"], 0, 100), fmt(t["rest_share"], 0, 100)]
            rows.append("| " + " | ".join(cells) + " |")
    return ["## Where the time goes", "", TIME_HEADER, *rows, ""] if rows else []


def load_warnings(runs: list[dict]) -> list[str]:
    """A warning where other processes kept the CPUs busy during runs (`others_cpu`, core/cpu_load.py): their
    timings read slow, and a run that shared the machine with a spinning process at the lowest priority ran its 1.5B
    target at half speed (interleaving spreads such load over the methods, not away)."""
    busy = [r["others_cpu"] for r in runs if cpu_load.is_busy(r.get("others_cpu"))]
    if not busy:
        return []
    return [f"other processes kept {cpu_load.BUSY:.0%} or more of the CPUs busy during {len(busy)} of {len(runs)} "
            f"runs (up to {max(busy):.0%}): their timings are slow; rerun on a quiet machine for figures to compare"]


def render(results: dict, plots: list[str]) -> str:
    env, st = results.get("env") or {}, results.get("settings") or {}
    lines = ["# arborspec benchmark", "",
             f"Command: `{results.get('command', '')}`", "",
             f"Machine: {env.get('cpu', '?')}, {env.get('cores', '?')} cores, {env.get('threads', '?')} torch threads; "
             f"arborspec {env.get('arborspec')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
             f"Python {env.get('python')}", "",
             f"Target `{results.get('target')}`, draft `{results.get('draft')}`"
             + (f" on {env['backend']}" + (f" / {env['draft_backend']}" if env.get("draft_backend") not in
                                           (None, env["backend"]) else "") if env.get("backend") else "")
             + f", dtype {env.get('dtype')}; "
             f"max new tokens {st.get('max_new_tokens')}, {'EOS ignored' if st.get('ignore_eos') else 'stops at EOS'}; "
             f"{len(results.get('prompts', []))} prompts; {len(results['runs'])} runs; "
             f"started {results.get('started')}, finished {results.get('finished') or '(not finished)'}.", ""]
    lines += resumed_lines(results)
    if st.get("budgets"):
        lines += [f"Budgets (drafted tokens per step): {', '.join(map(str, st['budgets']))}; `method@B` is a method at "
                  "budget B (see docs/benchmarks.md for how B maps to each method's options).", ""]
    warnings = results.get("warnings", []) + load_warnings(results["runs"])
    for w in warnings:
        lines.append(f"> warning: {w}")
    for s in results.get("skipped", []):
        lines.append(f"> skipped {s['label']} at T={s['temperature']}: {s['reason']}")
    if warnings or results.get("skipped"):
        lines.append("")
    lines += ["## Metrics", "", GLOSSARY]
    groups = tables(results)
    for (dataset, temp), rows in groups.items():
        peer = "llamacpp-ar" in rows
        lines += [f"## {dataset}, T={temp:g}", "", PEER_HEADER if peer else HEADER]
        lines += [_row(label, s, peer) for label, s in rows.items()] + [""]
    for (dataset, temp), rows in category_tables(results).items():
        lines += [f"### {dataset}, T={temp:g}, per category", "",
                  "| category | method | runs ok | MAT | acc. rate | tok/s median | speed-up vs ar |", "|---" * 7 + "|"]
        for (cat, label), s in rows.items():
            lines.append(f"| {cat} | {label}{' **LOSSY**' if s['lossy'] else ''} | {s['runs'] - s['errors']}/{s['runs']} "
                         f"| {fmt(s['mat'])} | {fmt(s['acceptance_rate'])} | {fmt(s['tps'][0] if s['tps'] else None)} "
                         f"| {fmt(s['speedup'].get('ar'))} |")
        lines.append("")
    lines += source_lines(groups)
    lines += time_lines(groups)
    errors = [r for r in results["runs"] if r.get("error")]
    if errors:
        lines += ["## Failed runs", ""]
        lines += [f"- {r['label']} T={r['temperature']:g} {r['prompt_key']}: {r['error']}" for r in errors[:20]]
        lines += [f"- ... and {len(errors) - 20} more" if len(errors) > 20 else "", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def write_report(results_dir: str | Path) -> list[Path]:
    """Write report.md and the plots next to results.json; returns the written paths."""
    return _write_report(*load_results(results_dir))


def _write_report(results: dict, directory: Path) -> list[Path]:
    plots = write_plots(results, directory)
    report = directory / "report.md"
    report.write_text(render(results, [str(p) for p in plots]))
    return [report, *plots]


# ------------------------------------------------------------------------------------------------ equality check
def check_equal(results: dict) -> tuple[bool, list[str]]:
    """Greedy (T=0) outputs of every exact method must equal plain decoding's token ids on the same prompt, run by
    run, on the same kernels: arborspec's methods against `ar`'s, the llama.cpp peers (`llamacpp-*`) against
    `llamacpp-ar`'s. Held against native `ar` the peer never passed (other kernels break a near-tie of the top two
    logits the other way: they differed on 21 of 40 prompts in the 2026-11 Zen 4 record), so their agreement is
    shown, not checked; a peer speculating apart from llama.cpp's plain decoding is listed, not failed (it is not
    arborspec's to hold).
    A bench without `ar` on the llama.cpp backend (or one whose backend was not recorded) falls back to
    `llamacpp-ar` for all."""
    greedy = [r for r in results["runs"] if r["temperature"] == 0]
    if not greedy:
        return False, ["no greedy (T=0) runs to check"]
    labels = {r["label"] for r in greedy}
    backend = _target_backend(results)
    methods = [r for r in greedy if not _is_peer(r["label"])]
    peers = [r for r in greedy if _is_peer(r["label"])]
    method_ref = "ar"
    if "ar" not in labels and backend in (None, "llamacpp"):
        methods, peers, method_ref = greedy, [], "llamacpp-ar"
    lines, counts = [], {"same": 0, "failures": 0, "lossy": 0, "peer": 0}
    for group, ref, who in ((methods, method_ref, "arborspec methods"), (peers, "llamacpp-ar", "llama.cpp peers")):
        if ref not in {r["label"] for r in group} and any(r["label"] != ref for r in group):
            counts["failures"] += 1
            lines.append(f"NO AR RUN {who}: no `{ref}` run at T=0 on their kernels to compare with; add `{ref}` "
                         "to --methods")
        elif group:
            _compare(group, ref, lines, counts)
    if "ar" in labels and "llamacpp-ar" in labels:
        lines.append(_peer_against_ar(greedy, backend))
    same, failures, lossy_diff = counts["same"], counts["failures"], counts["lossy"] + counts["peer"]
    dtype = (results.get("env") or {}).get("dtype")
    bf16 = failures and dtype in ("bf16", "bfloat16") and backend in (None, "torch")
    lines.append(f"{same} identical, {failures} failing, {counts['lossy']} lossy differences"
                 + (f", {counts['peer']} peer differences" if any(map(_is_peer, labels)) else "") + f"; dtype {dtype}"
                 + (" (bf16: a near-tie of the target's top two logits can flip an argmax in multi-token forwards)"
                    if bf16 else ""))
    if same + lossy_diff + failures == 0:  # only `ar` ran at T = 0: "0 identical, 0 failing" passed, exit 0
        plain = " or ".join(f"`{label}`" for label in ("ar", "llamacpp-ar") if label in labels)
        return False, lines[:-1] + [f"no exact method besides {plain} ran at T=0: nothing to compare"]
    return failures == 0, lines


def _peer_against_ar(greedy: list[dict], backend: str | None) -> str:
    """How often llama.cpp's plain decoding gave `ar`'s tokens: shown, not checked (other kernels)."""
    ar = {r["prompt_key"]: r["token_ids"] for r in greedy if r["label"] == "ar" and not r.get("error")}
    pairs = [(ar[r["prompt_key"]], r["token_ids"]) for r in greedy
             if r["label"] == "llamacpp-ar" and not r.get("error") and r["prompt_key"] in ar]
    same = sum(metrics.first_divergence(a, b) is None for a, b in pairs)
    return (f"not checked: llamacpp-ar equals `ar` on {same} of {len(pairs)} prompts (llama.cpp's own loop against "
            f"arborspec's on {backend or 'the bench backend'}: other kernels or batching break near-ties of the top "
            "two logits either way)")


def _is_peer(label: str) -> bool:
    return label.startswith("llamacpp-")


def _target_backend(results: dict) -> str | None:
    """What ran the target: the record's resolved backend, or (records before it was kept) the --backend asked
    for, unless that was `auto`."""
    backend = (results.get("env") or {}).get("backend") or (results.get("settings") or {}).get("backend")
    return None if backend == "auto" else backend


def _compare(group: list[dict], ref: str, lines: list[str], counts: dict) -> None:
    """Each run of `group` against the `ref` run on its prompt; counts and lines as check_equal prints them."""
    base = {r["prompt_key"]: r for r in group if r["label"] == ref and not r.get("error")}
    for r in group:
        if r["label"] == ref:
            continue
        where = f"{r['label']} on {r['prompt_key']}"
        if r.get("error"):
            counts["failures"] += 1
            lines.append(f"ERROR     {where}: {r['error']}")
            continue
        if r["prompt_key"] not in base:
            counts["failures"] += 1
            lines.append(f"NO AR RUN {where}: no successful `{ref}` run on this prompt to compare with")
            continue
        a, b = base[r["prompt_key"]]["token_ids"], r["token_ids"]
        i = metrics.first_divergence(a, b)
        if i is None:
            counts["same"] += 1
            continue
        detail = (f"first divergence at token {i} of {len(a)}/{len(b)} "
                  f"({ref}: {a[i] if i < len(a) else 'end'}, {r['label']}: {b[i] if i < len(b) else 'end'})")
        if r.get("lossy"):
            counts["lossy"] += 1
            lines.append(f"lossy     {where}: {detail} (allowed: the method is lossy)")
        elif _is_peer(r["label"]) and _is_peer(ref):
            counts["peer"] += 1
            lines.append(f"peer      {where}: {detail} (allowed: llama.cpp's own speculation, not arborspec's)")
        else:
            counts["failures"] += 1
            lines.append(f"MISMATCH  {where}: {detail}")


def report_from_args(args) -> int:
    """`arborspec report`. A results.json whose runs lack a field or hold one of another type or an impossible value
    (edited by hand, or from another tool) is one error line naming the file, not a traceback from deep in the
    tables or a bare "math domain error"."""
    loaded = None if getattr(args, "reproduction", None) else load_results(args.results)  # its own message
    try:
        return _report(args, loaded)
    except (KeyError, TypeError, AttributeError, ValueError) as err:  # AttributeError: a field set to null
        raise ValueError(f"{args.results}: the record lacks a field or holds a wrong value "
                         f"({type(err).__name__}: {err}); was it written by `arborspec bench`?") from err


def _report(args, loaded: tuple[dict, Path] | None) -> int:
    """`loaded`: the record and its directory (None with --reproduction, which reads a root of records)."""
    if loaded is None:
        if not Path(args.results).is_dir():
            raise FileNotFoundError(f"--reproduction needs a results directory, got {args.results!r}")
        print(write_reproduction(args.results, args.reproduction))
        return 0
    if args.check_equal:
        ok, lines = check_equal(loaded[0])
        print("\n".join(lines))
        return 0 if ok else 1
    for path in _write_report(*loaded):
        print(path)
    return 0
