"""The benchmark's PNG plots, from results.json alone (matplotlib through arborspec.viz.canvas). Each returns its path
or None when the run has nothing to show (e.g. no method ran with several budgets)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..runspec import split_label
from ..viz.canvas import grid, save_figure
from . import metrics
from .tables import ordered_sources, tables


def throughput_plot(results: dict, path: Path) -> str | None:
    groups = tables(results)
    if not groups:
        return None
    fig, axes = grid(2 * len(groups), cols=2)
    for i, ((dataset, temp), rows) in enumerate(groups.items()):
        labels = [label for label, s in rows.items() if s["tps"]]
        med = [rows[l]["tps"][0] for l in labels]
        err = [[rows[l]["tps"][0] - rows[l]["tps"][1] for l in labels],
               [rows[l]["tps"][2] - rows[l]["tps"][0] for l in labels]]
        hatch = ["//" if rows[l]["lossy"] else "" for l in labels]
        ax = axes[2 * i]
        ax.bar(labels, med, yerr=err, capsize=3, color="tab:blue", hatch=hatch)
        ax.set_title(f"{dataset}, T={temp:g}: tokens/s (median, IQR)")
        ax.set_ylabel("tokens/s")
        ax = axes[2 * i + 1]
        shown = [(l, rows[l]["speedup"].get("ar"), h) for l, h in zip(labels, hatch)
                 if rows[l]["speedup"].get("ar") is not None]  # a label without one was drawn as a 0x bar
        if shown:
            ax.bar([l for l, _, _ in shown], [s for _, s, _ in shown], color="tab:green", hatch=[h for *_, h in shown])
        else:
            ax.text(0.5, 0.5, "no `ar` run to compare with", ha="center", va="center", transform=ax.transAxes)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_title(f"{dataset}, T={temp:g}: speed-up over ar (hatched: lossy)")
        ax.set_ylabel("x ar")
        for a in axes[2 * i: 2 * i + 2]:
            a.tick_params(axis="x", rotation=45, labelsize=8)
    return save_figure(fig, path)


def mat_vs_tree_size_plot(results: dict, path: Path) -> str | None:
    """DySpec Fig. 5: MAT against the mean drafted tree size, a line per method that ran with several budgets."""
    series = {}
    for (dataset, temp), rows in tables(results).items():
        by_method = defaultdict(list)
        for label, s in rows.items():
            name, budget = split_label(label)
            if budget is not None and s["mat"] is not None and s["tree_size"] is not None:
                by_method[name].append((budget, s["tree_size"], s["mat"]))
        lines = {m: sorted(pts) for m, pts in by_method.items() if len(pts) >= 2}
        if lines:
            series[(dataset, temp)] = lines
    if not series:
        return None
    fig, axes = grid(len(series), cols=min(2, len(series)))
    for ax, ((dataset, temp), lines) in zip(axes, series.items()):
        for name, pts in lines.items():
            ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=name)
            for b, x, y in pts:
                ax.annotate(str(b), (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("drafted tokens per step (mean tree size; labels: budget)")
        ax.set_ylabel("MAT (tokens per step)")
        ax.set_title(f"{dataset}, T={temp:g}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def acceptance_vs_prob_plot(results: dict, path: Path, bins: int = 10) -> str | None:
    """DySpec Fig. 2: drafted nodes the verifier reached, binned by draft probability: the fraction accepted."""
    pooled = defaultdict(lambda: defaultdict(list))  # temperature -> label -> [(p, accepted)]
    for r in results["runs"]:
        if r.get("node_outcomes"):
            pooled[r["temperature"]][r["label"]] += r["node_outcomes"]
    if not pooled:
        return None
    fig, axes = grid(len(pooled), cols=min(2, len(pooled)))
    for ax, temp in zip(axes, sorted(pooled)):
        for label, outcomes in pooled[temp].items():
            pts = metrics.acceptance_by_probability(outcomes, bins)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{label} ({len(outcomes)} nodes)")
        ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("draft probability of the node")
        ax.set_ylabel("fraction accepted")
        ax.set_title(f"acceptance vs draft probability, T={temp:g}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def sps_vs_asps_plot(results: dict, path: Path) -> str | None:
    """MAT against chain length k for each chain verifier, when ASpS and SpS both ran with several k."""
    data = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # T -> verifier -> k -> committed per step
    for r in results["runs"]:
        if r.get("policy") == "chain" and not r.get("error") and r.get("budget"):
            data[r["temperature"]][r["verifier"]][r["budget"]] += r["committed_per_step"]
    temps = [t for t, v in data.items() if len(v.get("sps", {})) >= 2 and len(v.get("asps", {})) >= 2]
    if not temps:
        return None
    fig, axes = grid(len(temps), cols=min(2, len(temps)))
    for ax, temp in zip(axes, sorted(temps)):
        for verifier, by_k in sorted(data[temp].items()):
            ks = sorted(by_k)
            ax.plot(ks, [metrics.mat(by_k[k]) for k in ks], marker="o", label=verifier)
        ax.set_xlabel("chain length k (drafted tokens per step)")
        ax.set_ylabel("MAT (tokens per step)")
        ax.set_title(f"SpS vs ASpS, T={temp:g}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def accepted_by_source_plot(results: dict, path: Path) -> str | None:
    """Which source supplied the accepted tokens: per dataset and temperature, a bar per method that drafted, its
    accepted tokens per step stacked by source (the draft model, ngram, suffix, lookahead; tables.ordered_sources)."""
    panels = {}
    for key, rows in tables(results).items():
        bars = {label: dict(ordered_sources(s["sources"])) for label, s in rows.items() if s.get("sources")}
        if bars:
            panels[key] = bars
    if not panels:
        return None
    seen = {name for bars in panels.values() for by_source in bars.values() for name in by_source}
    names = [name for name, _ in ordered_sources(dict.fromkeys(seen))]
    colors = {n: f"C{i}" for i, n in enumerate(names)}
    fig, axes = grid(len(panels), cols=min(2, len(panels)))
    for ax, ((dataset, temp), bars) in zip(axes, panels.items()):
        labels, bottom = list(bars), [0.0] * len(bars)
        for name in names:
            heights = [bars[label].get(name, {}).get("accepted") or 0.0 for label in labels]
            ax.bar(labels, heights, bottom=bottom, color=colors[name], label=name)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_ylabel("accepted drafted tokens per step")
        ax.set_title(f"{dataset}, T={temp:g}: accepted tokens by source")
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


PLOTS = {"throughput.png": throughput_plot, "mat_vs_tree_size.png": mat_vs_tree_size_plot,
         "acceptance_vs_draft_prob.png": acceptance_vs_prob_plot, "sps_vs_asps.png": sps_vs_asps_plot,
         "accepted_by_source.png": accepted_by_source_plot}


def write_plots(results: dict, directory: Path) -> list[Path]:
    """The plots this record has data for; one it has none for is removed, so that an earlier record's picture
    (a rerun with other methods into the same folder) is not left beside the new report."""
    made = []
    for name, plot in PLOTS.items():
        if plot(results, directory / name) is not None:
            made.append(directory / name)
        else:
            (directory / name).unlink(missing_ok=True)
    return made
