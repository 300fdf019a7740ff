"""Read ODC traces and draw them: busy and waiting per rank over time, and each rank's idle share.

    python -m odc_runtime.report TRACE_DIR [TRACE_DIR ...] [--out report.png] [--run -1] [--json summary.json]

A trace directory holds one ``rank<r>.jsonl`` per rank (``ODC_TRACE_DIR``, or ``bench/imbalance.py --trace-dir``;
the line format is ``odc_runtime.telemetry.make_record``'s). Each directory gives one timeline panel per label
in it (the runtime's traces have none; the main job labels each configuration), all on one time axis, under a bar
chart of every rank's idle share. A file may hold several runs (appended, e.g. after a crash and a restart into
the same directory): the ranks' lines of one run are tied together by its run id, and ``--run`` picks a run by its
position among them in order of start (default ``-1``, the last); a run that a rank traced nothing of is refused,
naming the rank.

Definitions (the main job's, ``bench/imbalance.py``): a minibatch's *wall* time runs from the first rank's start to
the last rank's end; a rank is *busy* for its ``[start, end]`` less the intervals it waited (``waits``: in ``sync``,
or in a collective for the main job's collective runs); its *idle* time is the wall time less its busy time, its
*idle share* the idle time over the wall time, summed over the minibatches every rank traced. For the runtime's
traces, busy includes the time spent issuing fetches and pushes: what is idle is what waiting for the other ranks
(and the time outside the rank's minibatch) cost.

The timeline drawing (``draw_timelines``) is also the main job's (``bench/plots.py``). Plotting needs
matplotlib (the ``bench`` extra); reading and summarising do not.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from odc_runtime import cli
from odc_runtime.errors import OdcUsageError
from odc_runtime.telemetry import records

log = logging.getLogger(__name__)

#: Colours of the timeline's kinds of time (the main job's: compute, waiting in a collective, end of minibatch).
TIMELINE_COLORS = {"compute": "#2ca02c", "comm": "#ff7f0e", "sync": "#7f7f7f"}
Event = tuple[str, float, float]  # (kind, start, stop)


@dataclass
class Run:
    """One traced run of one label: ``ranks[r]`` holds rank r's lines in minibatch order."""

    label: str
    ranks: list[list[dict[str, Any]]]


def _runs_by_id(files: dict[int, str]) -> dict[str, list[list[dict[str, Any]]]]:
    """Every run of the rank files ``files`` (rank -> path), by run id, each as its lines per rank (empty for a rank
    that traced none of it), in the order the runs started. A run's lines carry the job's id on every rank (trace
    version 2); version 1 lines carried a per-rank id, so those runs are paired by their position in each file."""
    world = max(files) + 1
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    for r, path in files.items():
        positions: dict[str, str] = {}  # version 1: this file's run id -> its position
        for line in records(path):
            key = line["run"]
            if line.get("v", 1) < 2:
                key = positions.setdefault(key, f"v1 run #{len(positions)}")
            runs.setdefault(key, [[] for _ in range(world)])[r].append(line)
    return dict(sorted(runs.items(), key=lambda kv: min(x["start"] for lines in kv[1] for x in lines)))


def load(path: str, run: int = -1) -> list[Run]:
    """The runs of trace directory ``path`` (one per label, in order of first appearance), taking the job's run
    number ``run`` (runs in the order they started, each tied together across the rank files by its run id; ``-1``:
    the last). OdcUsageError when ``path`` holds no ``rank<r>.jsonl``, a rank file is missing, there is no such run,
    or a rank traced nothing of it (e.g. it crashed before its first minibatch ended: say so, rather than draw
    another run's lines in its place)."""
    files = {}
    for f in glob.glob(os.path.join(path, "rank*.jsonl")):
        m = re.fullmatch(r"rank(\d+)\.jsonl", os.path.basename(f))
        if m:
            files[int(m.group(1))] = f
    if not files:
        raise OdcUsageError(f"{path}: no rank<r>.jsonl trace files (set ODC_TRACE_DIR={path} in the job)")
    world = max(files) + 1
    missing = sorted(set(range(world)) - set(files))
    if missing:
        raise OdcUsageError(f"{path}: no trace of rank(s) {missing} (of {world}); every rank writes its own file")
    runs = _runs_by_id(files)
    if not -len(runs) <= run < len(runs):
        raise OdcUsageError(f"{path}: holds {len(runs)} run(s), no run {run}")
    run_id, per_rank = list(runs.items())[run]
    absent = [r for r, lines in enumerate(per_rank) if not lines]
    if absent:
        raise OdcUsageError(
            f"{path}: run {run} (id {run_id!r}) has no trace line of rank(s) {absent} (of {world}): they ended no "
            "minibatch of it (a crash or a restart before the first one ended); pick another run with --run"
        )
    labels = list(dict.fromkeys(line["label"] or "odc" for lines in per_rank for line in lines))
    return [Run(label, [sorted((x for x in lines if (x["label"] or "odc") == label), key=lambda x: x["minibatch"])
                        for lines in per_rank]) for label in labels]


def _common_minibatches(run: Run) -> list[int]:
    sets = [{x["minibatch"] for x in lines} for lines in run.ranks]
    common = set.intersection(*sets) if sets else set()
    partial = set.union(*sets) - common if sets else set()
    if partial:
        log.warning("%s: minibatches %s are not traced by every rank; left out", run.label, sorted(partial)[:10])
    return sorted(common)


def _busy(line: dict[str, Any]) -> float:
    waited = sum(min(t1, line["end"]) - max(t0, line["start"]) for t0, t1, _ in line["waits"] if t1 > t0)
    return (line["end"] - line["start"]) - waited


def summarize(run: Run) -> dict[str, Any]:
    """Per rank (lists indexed by rank): ``micro_batches``, ``busy_s``, ``idle_s``, ``idle_share``,
    ``sync_wait_s``, ``fetch_bytes``, ``push_bytes``; and ``minibatches``, ``wall_s``, ``utilization`` (busy over
    ranks × wall), over the minibatches every rank traced."""
    ks = _common_minibatches(run)
    by_k = [{x["minibatch"]: x for x in lines} for lines in run.ranks]
    walls = [max(b[k]["end"] for b in by_k) - min(b[k]["start"] for b in by_k) for k in ks]
    wall = sum(walls)
    busy = [sum(_busy(b[k]) for k in ks) for b in by_k]

    def total(key: str) -> list[float]:
        return [sum(b[k].get(key, 0) for k in ks) for b in by_k]

    return {
        "label": run.label, "world": len(run.ranks), "minibatches": len(ks), "wall_s": wall,
        "utilization": sum(busy) / (len(busy) * wall) if wall > 0 else 0.0,
        "micro_batches": total("micro_batches"), "busy_s": busy, "idle_s": [wall - b for b in busy],
        "idle_share": [(wall - b) / wall if wall > 0 else 0.0 for b in busy],
        "sync_wait_s": total("sync_wait_s"), "fetch_bytes": total("fetch_bytes"), "push_bytes": total("push_bytes"),
    }


def timeline(run: Run) -> list[list[Event]]:
    """Per rank, the events to draw: each wait as its kind, the rest of each minibatch as ``"compute"`` (busy)."""
    out = []
    for lines in run.ranks:
        events: list[Event] = []
        for line in lines:
            t = line["start"]
            for t0, t1, kind in sorted(line["waits"]):
                t0, t1 = max(t0, t), min(t1, line["end"])
                if t0 > t:
                    events.append(("compute", t, t0))
                if t1 > t0:
                    events.append((kind, t0, t1))
                t = max(t, t1)
            if line["end"] > t:
                events.append(("compute", t, line["end"]))
        out.append(events)
    return out


def draw_timelines(fig: Any, slots: Sequence[Any], timelines: dict[str, list[list[Event]]], caption: str) -> None:
    """One panel per timeline (``name -> per-rank events``) in the subplot specs ``slots``, on one time axis from
    each timeline's first event, so their lengths compare directly; ``caption`` says what the colours are (once,
    under the last panel: in every title it made them too long for the figure)."""
    spans = []
    for per_rank in timelines.values():
        t0 = min((ev[1] for evs in per_rank for ev in evs), default=0.0)
        spans.append((t0, max((ev[2] - t0 for evs in per_rank for ev in evs), default=0.0)))
    xmax = max((s for _, s in spans), default=1.0) * 1.01 or 1.0
    last = len(timelines) - 1
    for i, (slot, ((name, per_rank), (t0, _))) in enumerate(
            zip(slots, zip(timelines.items(), spans, strict=True), strict=True)):
        ax = fig.add_subplot(slot)
        for rank, events in enumerate(per_rank):
            by_kind: dict[str, list[tuple[float, float]]] = {}
            for kind, start, stop in events:
                by_kind.setdefault(kind, []).append((start - t0, stop - start))
            for kind, xranges in by_kind.items():  # one artist per rank and kind: fast with many events
                ax.broken_barh(xranges, (rank - 0.35, 0.7), facecolors=TIMELINE_COLORS.get(kind, "#000000"),
                               linewidth=0)
        ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, xmax)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(f"seconds; {caption}" if i == last else "seconds", fontsize=8)


def plot(runs: list[Run], summaries: list[dict[str, Any]], path: str, *, title: str = "") -> None:
    """The report's picture: idle share per rank and run (top), then each run's timeline (matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        raise OdcUsageError("odc_runtime.report: drawing needs matplotlib (pip install matplotlib, or the "
                            "odc_runtime[bench] extra); --out none prints the summary only") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(11, 3.2 + 1.2 * sum(0.8 + 0.25 * len(r.ranks) for r in runs)))
    grid = fig.add_gridspec(1 + len(runs), 1, height_ratios=[2.0] + [0.8 + 0.25 * len(r.ranks) for r in runs])
    ax = fig.add_subplot(grid[0])
    width = 0.8 / max(len(runs), 1)
    for j, s in enumerate(summaries):
        xs = [r + (j - (len(runs) - 1) / 2) * width for r in range(s["world"])]
        ax.bar(xs, [100 * v for v in s["idle_share"]], width, label=f"{s['label']} (utilisation "
                                                                     f"{s['utilization']:.0%})")
    world = max(s["world"] for s in summaries)
    ax.set_xticks(range(world), [f"rank {r}" for r in range(world)], fontsize=8)
    ax.set_ylabel("idle share of the wall time (%)")
    ax.set_title(title or "idle share per rank")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    draw_timelines(fig, [grid[1 + i] for i in range(len(runs))], {r.label: timeline(r) for r in runs},
                   "green = busy, grey = waiting in sync, orange = waiting in a collective")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(summary: dict[str, Any]) -> str:
    rows = [f"{summary['label']}: {summary['world']} ranks, {summary['minibatches']} minibatches, wall "
            f"{summary['wall_s']:.2f} s, utilisation {summary['utilization']:.1%}",
            "  rank  micro-batches  busy s  idle s  idle share  sync wait s  fetch MiB  push MiB"]
    for r in range(summary["world"]):
        rows.append(f"  {r:4d}  {summary['micro_batches'][r]:13d}  {summary['busy_s'][r]:6.2f}  "
                    f"{summary['idle_s'][r]:6.2f}  {summary['idle_share'][r]:10.1%}  {summary['sync_wait_s'][r]:11.3f}"
                    f"  {summary['fetch_bytes'][r] / 2**20:9.1f}  {summary['push_bytes'][r] / 2**20:8.1f}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = cli.parser(__doc__, prog="python -m odc_runtime.report", first_paragraph=True)
    parser.add_argument("paths", nargs="+", metavar="TRACE_DIR", help="directories of rank<r>.jsonl files")
    parser.add_argument("--out", default=None, help="PNG path (default: report.png in the first TRACE_DIR); "
                                                    "'none' to skip the picture")
    parser.add_argument("--run", type=int, default=-1,
                        help="which run of the job, in order of start (default -1: the last)")
    parser.add_argument("--json", default=None, help="write the summaries to this file")
    parser.add_argument("--title", default="", help="the picture's title")
    args = parser.parse_args(argv)
    runs = []
    for path in args.paths:
        for run in load(path, args.run):
            if len(args.paths) > 1:
                run.label = f"{os.path.basename(os.path.normpath(path))}: {run.label}"
            runs.append(run)
    summaries = [summarize(r) for r in runs]
    for s in summaries:
        print(_table(s))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summaries, f, indent=1)
    out = args.out or os.path.join(args.paths[0], "report.png")
    if out != "none":
        plot(runs, summaries, out, title=args.title)
        print(f"wrote {out}")
    return summaries


if __name__ == "__main__":
    try:
        main()
    except OdcUsageError as e:
        sys.exit(f"odc_runtime.report: {e}")
