"""Load-balancing benchmark: planning time and per-rank balance of each policy on a long-tailed preset.

For each world size, ``samples_per_rank × world_size`` lengths are drawn from the preset and planned with every
policy. Reported per policy: median planning time over ``--repeats`` runs (wall clock, and CPU time, which is
steadier on a shared machine), max/mean of per-rank total cost, micro-batches per rank, and the predicted
minibatch time (default cost model, seconds) under a collective schedule (every micro-batch step is a barrier,
FSDP) and under ODC (one barrier per minibatch). The last column is each policy's time under the schedule it
is meant for (collective for local_sort and lb_micro, ODC for lb_mini). A final case times the largest input
(64 ranks × 10,000 samples by default).

Run: ``python bench/balance.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from odc_runtime.balance import POLICIES, imbalance, plan
from odc_runtime.workloads import PRESETS, sample_lengths

# The schedule each policy is designed for: collectives need equal counts, ODC does not.
NATIVE_SCHEDULE = {"local_sort": "collective", "lb_micro": "collective", "lb_mini": "odc"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="longalign_sft", choices=sorted(PRESETS))
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32], help="world sizes to compare")
    parser.add_argument("--samples-per-rank", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=131072, help="token cap per micro-batch")
    parser.add_argument("--big-ranks", type=int, default=64, help="world size of the timing-only case")
    parser.add_argument("--big-samples", type=int, default=10_000, help="samples of the timing-only case")
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats (the median is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write results as JSON")
    return parser.parse_args(argv)


def run_case(lengths: list[int], world_size: int, policy: str, args: argparse.Namespace) -> dict:
    """Plan ``repeats`` times; return the median time and the plan's predicted balance."""
    times, cpu_times = [], []
    for _ in range(args.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        result = plan(lengths, world_size, max_tokens=args.max_tokens, policy=policy)
        cpu_times.append(time.process_time() - cpu_start)
        times.append(time.perf_counter() - start)
    imb = imbalance(result, lengths)
    counts = [len(micro_batches) for micro_batches in result]
    native = imb.collective_time if NATIVE_SCHEDULE[policy] == "collective" else imb.odc_time
    return {
        "world_size": world_size,
        "samples": len(lengths),
        "policy": policy,
        "plan_seconds_median": statistics.median(times),
        "plan_cpu_seconds_median": statistics.median(cpu_times),
        "max_over_mean": imb.max_over_mean,
        "micro_batches_min": min(counts),
        "micro_batches_max": max(counts),
        "collective_time": imb.collective_time,
        "odc_time": imb.odc_time,
        "native_schedule": NATIVE_SCHEDULE[policy],
        "native_time": native,
    }


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'ranks':>5} {'samples':>7} {'policy':<10} {'plan ms':>8} {'cpu ms':>8} {'max/mean':>8} {'mb/rank':>7} "
        f"{'coll s':>8} {'odc s':>8} {'native s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        counts = f"{r['micro_batches_min']}-{r['micro_batches_max']}"
        lines.append(
            f"{r['world_size']:>5} {r['samples']:>7} {r['policy']:<10} {r['plan_seconds_median'] * 1e3:>8.1f} "
            f"{r['plan_cpu_seconds_median'] * 1e3:>8.1f} "
            f"{r['max_over_mean']:>8.4f} {counts:>7} {r['collective_time']:>8.3f} {r['odc_time']:>8.3f} "
            f"{r['native_time']:>8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cases = [(w, w * args.samples_per_rank) for w in args.ranks] + [(args.big_ranks, args.big_samples)]
    rows = []
    for world_size, n in cases:
        lengths = sample_lengths(args.preset, n, seed=args.seed)
        rows.extend(run_case(lengths, world_size, policy, args) for policy in POLICIES)
    print(f"preset={args.preset} max_tokens={args.max_tokens} repeats={args.repeats} seed={args.seed}")
    print(format_table(rows))
    if args.json is not None:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": config, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
