"""PNG plots of the benchmarks (matplotlib, the ``bench`` extra; headless ``Agg`` backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from odc_runtime.report import draw_timelines  # the timelines of `python -m odc_runtime.report` too

COLORS = {
    "copy": "#999999", "add": "#cccccc", "all_gather": "#d62728", "fetch": "#1f77b4",
    "red_scatter": "#ff7f0e", "push": "#2ca02c",
}


def _save(fig: Figure, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_comm(results: list[dict], path: str | Path, *, title: str = "") -> None:
    """Algorithm bandwidth against size, one line per operation."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op, color in COLORS.items():
        rows = sorted((r for r in results if r["op"] == op), key=lambda r: r["bytes"])
        if rows:
            style = "--" if op in ("copy", "add") else "-"
            ax.plot([r["bytes"] / 2**20 for r in rows], [r["algbw_GBps"] for r in rows], style, marker="o",
                    color=color, label=op)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("full tensor size (MiB)")
    ax.set_ylabel("algorithm bandwidth (GB/s)")
    ax.set_title(title or "fetch / push vs collectives")
    ax.grid(True, alpha=0.3)
    ax.legend()
    _save(fig, path)


def _label(run: dict) -> str:
    return f"{run['comm']}\n{run['policy']}"


def plot_imbalance(runs: list[dict], timelines: dict[str, list[list[tuple]]], path: str | Path, *,
                   title: str = "", minibatch: int | None = None) -> None:
    """Top: throughput per configuration (measured, and simulated when present). Bottom: per-rank timeline of
    one minibatch for each timeline given (busy = modelled compute, the rest = communication and waiting)."""
    n_tl = len(timelines)
    fig = plt.figure(figsize=(11, 3.6 + 1.9 * n_tl))
    grid = fig.add_gridspec(1 + n_tl, 1, height_ratios=[2.2] + [1.3] * n_tl)
    ax = fig.add_subplot(grid[0])
    labels = [_label(r) for r in runs]
    xs = range(len(runs))
    tps = [r["tokens_per_s"] for r in runs]
    bars = ax.bar(xs, tps, color=["#d62728" if r["comm"] == "collective" else "#1f77b4" for r in runs])
    for x, r, b in zip(xs, runs, bars, strict=True):
        speedup = f"{r['speedup']:.2f}×\n" if r.get("speedup") else ""  # none without collective + local_sort
        ax.text(x, b.get_height(), f"{speedup}util {r['utilization']:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("tokens / s (measured)")
    ax.set_ylim(0, max(tps) * 1.3 if tps else 1)
    ax.set_title(title or "throughput (speedup over collective + local_sort)")
    ax.grid(True, axis="y", alpha=0.3)
    which = f", minibatch {minibatch}" if minibatch is not None else ""
    draw_timelines(fig, [grid[1 + k] for k in range(n_tl)], {f"{name}{which}": tl for name, tl in timelines.items()},
                   "green = compute, orange = not computing: communication, issuing it, waiting for slower ranks; "
                   "grey = end of minibatch (sync, optimizer); white = not started yet")
    _save(fig, path)


def plot_simulation(rows: list[dict], path: str | Path, *, title: str = "") -> None:
    """Simulated throughput per configuration."""
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    ax.bar(xs, [r["speedup"] for r in rows],
           color=["#d62728" if r["comm"] == "collective" else "#1f77b4" for r in rows])
    ax.set_xticks(list(xs), [_label(r) for r in rows], fontsize=8)
    ax.set_ylabel("speedup over collective + local_sort")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    _save(fig, path)


def plot_balance(rows: list[dict], path: str | Path, *, title: str = "") -> None:
    """Per policy, grouped by case: the per-rank quality (max/mean per-rank cost, what ODC waits for), the
    per-step quality (collective time / mean, what lockstep collectives wait for) and the median planning time
    (log scale)."""
    cases = list(dict.fromkeys((r["world_size"], r["samples"]) for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    by = {(r["world_size"], r["samples"], r["policy"]): r for r in rows}
    fig, (rank_ax, step_ax, right) = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.8 / max(len(policies), 1)
    for j, policy in enumerate(policies):
        xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(cases))]
        got = [by.get((*case, policy)) for case in cases]
        rank_ax.bar(xs, [g["max_over_mean"] if g else 0 for g in got], width, label=policy)
        step_ax.bar(xs, [g["step_over_mean"] if g else 0 for g in got], width, label=policy)
        right.bar(xs, [g["plan_seconds_median"] * 1e3 if g else 0 for g in got], width, label=policy)
    labels = [f"{w} ranks\n{n} samples" for w, n in cases]
    for ax in (rank_ax, step_ax, right):
        ax.set_xticks(range(len(cases)), labels, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    for ax, key, label in ((rank_ax, "max_over_mean", "per rank: max / mean cost (ODC waits for this)"),
                           (step_ax, "step_over_mean", "per step: collective time / mean (1 = ideal)")):
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(label, fontsize=8)
        ax.set_ylim(bottom=min(0.95, min((r[key] for r in rows), default=1.0)))
    right.set_yscale("log")
    right.set_ylabel("planning time (ms, median)")
    rank_ax.legend(fontsize=8)
    fig.suptitle(title or "load-balancing policies")
    _save(fig, path)


def plot_netmodel(rows: list[dict], path: str | Path, *, title: str = "") -> None:
    """Predicted communication time per minibatch relative to the better NCCL algorithm, against nodes; one
    panel per model, one line per design."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 4.2), squeeze=False, sharey=True)
    styles = {"nccl_ring": ("#d62728", "--"), "nccl_tree": ("#ff7f0e", "--"), "odc_hier": ("#1f77b4", "-"),
              "odc_hier_streaming": ("#17becf", ":"), "odc_direct": ("#9467bd", "-."), "odc_locked": ("#7f7f7f", ":")}
    for ax, model in zip(axes[0], models, strict=True):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["nodes"])
        nodes = [r["nodes"] for r in mine]
        for design, (color, style) in styles.items():
            ax.plot(nodes, [r["ratio_to_nccl"][design] for r in mine], style, marker="o", color=color,
                    label={"odc_hier": "odc_hier (built)", "odc_hier_streaming": "odc_hier_streaming (not built)"}
                    .get(design, design), markersize=3)
        ax.axhline(1.3, color="black", linewidth=0.8, linestyle="-.", label="target 1.3")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("nodes of 8 GPUs")
        ax.set_title(model, fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
    axes[0][0].set_ylabel("communication time / best collective")
    axes[0][-1].legend(fontsize=7, bbox_to_anchor=(1.02, 1.0), loc="upper left")
    fig.suptitle(title or "α–β model")
    _save(fig, path)
