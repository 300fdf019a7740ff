"""Load-balancing benchmark: planning time and per-rank balance of every registered policy.

    python bench/balance.py                                  # 8 and 32 ranks × 64 samples, then 64 × 10,000
    python bench/balance.py --ranks 8 --big-samples 0 --preset swe_agentic --json out.json --plot out.png

For each world size, ``samples_per_rank × world_size`` lengths are drawn from the preset (or read from
``--lengths-file``) and planned with every policy of :data:`odc_runtime.balance.POLICY_REGISTRY`. Each plan is
checked first (every sample exactly once, the token cap, equal counts where the policy promises them), then
timed. Reported per policy: median planning time over ``--repeats`` runs (wall clock, and CPU time, which is
steadier on a shared machine), the plan's quality per rank (max/mean of per-rank total cost: what ODC's one
barrier per minibatch waits for) and per step (collective time / mean per-rank total: what lockstep
collectives wait for, 1 = no step waits for anyone), micro-batches per rank, and the predicted
minibatch time (default cost model, seconds) under a collective schedule (every micro-batch step is a barrier,
FSDP) and under ODC (one barrier per minibatch). The last column is each policy's time under the schedule it
is meant for (``Policy.native_comm``: collective for equal-count policies, ODC otherwise). A final case times
the largest input (64 ranks × 10,000 samples by default; ``--big-samples 0`` skips it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

if not __package__:  # python bench/balance.py from a checkout (bench/_checkout.py)
    import _checkout  # noqa: F401

from odc_runtime import cli
from odc_runtime.balance import POLICY_REGISTRY, imbalance, plan
from odc_runtime.bench import _common

LEGEND = {
    "ranks": "world size (data-parallel ranks)",
    "samples": "samples planned (one minibatch)",
    "policy": "balancing policy (odc_runtime.balance.POLICY_REGISTRY)",
    "plan ms": "median wall-clock milliseconds of one plan() call",
    "cpu ms": "median CPU milliseconds of the same call (steadier on a shared machine)",
    "max/mean": "per-rank quality: largest per-rank total cost / mean per-rank total cost (1 = perfectly balanced)",
    "step/mean": "per-step (collective) quality: sum over micro-batch steps of the slowest rank's micro-batch / "
                 "mean per-rank total (1 = no step waits for a slower rank)",
    "mb/rank": "micro-batches per rank, min-max (equal for policies that collectives can run)",
    "coll s": "predicted minibatch seconds under a collective schedule: sum over micro-batch steps of the slowest "
              "rank's micro-batch (default cost model, compute only)",
    "odc s": "predicted minibatch seconds under ODC: the slowest rank's total",
    "native s": "the policy's time under the schedule it is designed for (coll s for equal-count policies, "
                "odc s otherwise)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser(__doc__)
    _common.add_workload_args(parser)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32], help="world sizes to compare")
    parser.add_argument("--samples-per-rank", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=65536,
                        help="token cap per micro-batch (a longer sample is refused unless --allow-oversized)")
    parser.add_argument("--big-ranks", type=int, default=64, help="world size of the largest case")
    parser.add_argument("--big-samples", type=int, default=10_000, help="samples of the largest case (0: skip)")
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats (the median is reported)")
    _common.add_output_args(parser, "balance")
    return parser


def run_case(lengths: list[int], world_size: int, policy: str, args: argparse.Namespace) -> dict:
    """Check one plan, then plan ``repeats`` times; return the median times and the plan's predicted balance."""
    entry = POLICY_REGISTRY[policy]
    result = plan(lengths, world_size, max_tokens=args.max_tokens, policy=policy,
                  allow_oversized=args.allow_oversized)
    _common.check_plan(result, lengths, world_size=world_size, max_tokens=args.max_tokens,
                       equal_counts=entry.equal_counts, what=f"{policy} on {world_size} ranks")
    times, cpu_times = [], []
    for _ in range(args.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        again = plan(lengths, world_size, max_tokens=args.max_tokens, policy=policy,
                     allow_oversized=args.allow_oversized)
        cpu_times.append(time.process_time() - cpu_start)
        times.append(time.perf_counter() - start)
        if again != result:
            raise RuntimeError(f"{policy}: plan() is not deterministic")
    imb = imbalance(result, lengths)
    counts = [len(micro_batches) for micro_batches in result]
    return {
        "world_size": world_size,
        "samples": len(lengths),
        "policy": policy,
        "plan_seconds_median": statistics.median(times),
        "plan_cpu_seconds_median": statistics.median(cpu_times),
        "max_over_mean": imb.max_over_mean,
        "step_over_mean": imb.collective_time / imb.mean_cost if imb.mean_cost > 0 else 1.0,
        "oversized_samples": _common.oversized(lengths, args.max_tokens),
        "micro_batches_min": min(counts),
        "micro_batches_max": max(counts),
        "collective_time": imb.collective_time,
        "odc_time": imb.odc_time,
        "native_schedule": entry.native_comm,
        "native_time": imb.collective_time if entry.native_comm == "collective" else imb.odc_time,
    }


def table_rows(rows: list[dict]) -> list[list[object]]:
    return [[r["world_size"], r["samples"], r["policy"], r["plan_seconds_median"] * 1e3,
             r["plan_cpu_seconds_median"] * 1e3, f"{r['max_over_mean']:.4f}", f"{r['step_over_mean']:.4f}",
             f"{r['micro_batches_min']}-{r['micro_batches_max']}", f"{r['collective_time']:.3f}",
             f"{r['odc_time']:.3f}", f"{r['native_time']:.3f}"] for r in rows]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    cases = [(w, w * args.samples_per_rank) for w in args.ranks]
    if args.big_samples > 0:
        cases.append((args.big_ranks, args.big_samples))
    rows, sources = [], set()
    for world_size, n in cases:
        lengths, source = _common.load_lengths(args, n)
        if len(lengths) < n:
            raise SystemExit(f"{source}: {len(lengths)} lengths, the case of {world_size} ranks needs {n}")
        _common.check_cap(args, lengths)
        sources.add(source)
        rows.extend(run_case(lengths, world_size, policy, args) for policy in POLICY_REGISTRY)
    title = (f"\nplanners on {', '.join(sorted(sources))}: max_tokens={args.max_tokens}, median of "
             f"{args.repeats} repeats")
    _common.print_table(list(LEGEND), table_rows(rows), LEGEND, title=title)
    over = {(r["world_size"], r["samples"]): r["oversized_samples"] for r in rows}
    notes = [f"{w} ranks: {_common.oversized_note(k, n, args.max_tokens)}" for (w, n), k in over.items() if k]
    for note in notes:
        print(f"  NOTE: {note}")
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    config["policies"] = {name: {"equal_counts": p.equal_counts, "summary": p.summary}
                          for name, p in POLICY_REGISTRY.items()}
    _common.write_outputs(
        args, "balance", {"results": rows, "config": config, "machine": _common.machine_info()},
        lambda plots, path: plots.plot_balance(
            rows, path, title=f"planners, {', '.join(sorted(sources))}" + ("\n" + "; ".join(notes) if notes else "")),
    )


if __name__ == "__main__":
    sys.exit(main())
