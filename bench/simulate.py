"""Replay a :class:`schedule.Schedule` with modelled GPU compute and NVLink / InfiniBand transfer times.

    python bench/simulate.py                                   # 8 GPUs, 7B, long-context SFT, NVLink and IB
    python bench/simulate.py --world 32 --link ib --preset swe_agentic --model 32b

Small and deterministic. Per task (one layer of one micro-batch, :meth:`schedule.Schedule.program`):

- compute = the schedule's modelled seconds (cost model of the chosen model on the chosen GPU and MFU);
- communication = ``latency + bytes·(W-1)/W / bandwidth`` for each all-gather / fetch of the layer's parameters
  and each reduce-scatter / push of its gradient (bf16, 2 bytes per parameter);
- with ``overlap`` (FSDP prefetch, the default) a task takes ``max(compute, communication)``, else their sum.

``collective``: lockstep. Every task index is a barrier: the step takes the slowest rank's task (ranks run the
same program shape; padded micro-batches compute nothing but communicate). ``odc``: every rank runs its own
program at its own pace; the minibatch ends at the slowest rank's total, plus one sync. Both pay the same
``sync_s`` per minibatch (optimizer step / fence), so a perfectly balanced plan takes the same time in both.
HSDP (``schedule.replicas`` R > 1, shard groups of S = W/R ranks): the per-layer transfers run within a shard
group (``(S-1)/S`` of the bytes), collectives are in lockstep within each shard group only, and every minibatch
adds one all-reduce of a rank's gradient shards across the R replicas (:func:`allreduce_seconds`: ring,
``latency + 2·(R-1)/R · (L · layer_bytes / S) / bandwidth`` over ``replica_link``, InfiniBand by default, not
overlapped with compute). Assumed: replicas sit on different nodes, each rank's all-reduce crosses its own NIC
concurrently with the other shard positions' (no contention), one latency per all-reduce, gradients in bf16.
Split samples (``lb_mini_split``): a gang micro-batch starts when its last member is free (each rank runs its
gangs first, in gang order) and runs in per-layer lockstep across its members (the K/V exchange synchronises them
at every layer): each layer task takes the slowest member's, plus the K/V exchange, not overlapped (the gang
attention waits for it): ``latency + max(bytes in, bytes out) / p2p bandwidth`` per layer and direction, with
``bytes in`` the other members' K/V (bf16, ``2 · kv_heads · head_dim · 2`` bytes per token) and ``bytes out`` this
chunk's K/V to each other member; the backward pass returns dK/dV, the same volume.
Not modelled: contention between ranks for the network, stragglers, kernel efficiency changing with length.

Compared with measurements (no assumption was changed to match them). AMD's Primus port of ODC measured
end-to-end speedups over padded collectives of 0.91-1.20× on one node of 8 MI300X and 0.80-1.15× on two,
depending on the global batch. This simulator has no MI300X; for Qwen2.5-7B on 8 H100 (``nvlink``) and 16 GPUs
(``ib``), long-context SFT, odc + lb_mini over collective + verl_lb_micro (the padded, veRL-style baseline)
it predicts 1.00-1.28× and 1.00-1.36× as the minibatch grows from 1 to 32 samples per GPU (1.00 at one sample
per GPU: nothing to balance; the peak at 4-8 per GPU). It never predicts below 1, while the measurement goes
to 0.80: ODC's own costs are what the model leaves out: it gives one-sided transfers the collectives'
bandwidth and latency (``Link.p2p_GBps = collective_GBps``), while the paper measured them 3-4× slower than
NCCL across nodes (see ``bench/netmodel.py``), and it has no per-operation software overhead. Its upper ends
are 1.07× (one node) and 1.18× (two) the measured ones: read it as an upper bound of the balancing gain.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field

if not __package__:  # python bench/simulate.py from a checkout (bench/_checkout.py)
    import _checkout  # noqa: F401

from odc_runtime import cli
from odc_runtime.bench import _common
from odc_runtime.bench.schedule import GPU_PEAK_FLOPS, MODELS, SIMULATED_POLICIES, Schedule, build_schedule, grid


@dataclass(frozen=True)
class Link:
    name: str
    collective_GBps: float  # bus bandwidth of all-gather / reduce-scatter (nccl-tests busbw)
    p2p_GBps: float  # effective bandwidth of ODC's one-sided reads / accumulates, same byte count
    latency_s: float  # per operation


LINKS: dict[str, Link] = {
    # nccl-tests all_gather busbw on 8×H100 SXM is ~350-370 GB/s; one-sided NVLink copies reach the same.
    "nvlink": Link("NVLink 4 (8×H100 SXM)", 360.0, 360.0, 20e-6),
    # 400 Gb/s NDR per GPU: ~45 GB/s achievable by both ring collectives and RDMA reads/writes. This is every rank
    # on a node of its own (all its traffic crosses its NIC); for nodes of 8 GPUs, where NVLink carries part of
    # it and designs differ in how much crosses nodes, see bench/netmodel.py.
    "ib": Link("InfiniBand NDR 400 Gb/s per GPU, one GPU per node", 45.0, 45.0, 30e-6),
    "none": Link("no communication (compute only)", math.inf, math.inf, 0.0),
}


@dataclass
class SimResult:
    time_s: float
    tokens: int
    busy_s: list[float]  # per rank
    minibatch_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def utilization(self) -> float:
        return sum(self.busy_s) / (len(self.busy_s) * self.time_s) if self.time_s > 0 else 1.0


def comm_seconds(link: Link, nbytes: float, world: int, *, odc: bool) -> float:
    if nbytes <= 0 or world <= 1:
        return 0.0
    bw = link.p2p_GBps if odc else link.collective_GBps
    return link.latency_s + nbytes * (world - 1) / world / (bw * 1e9)


def allreduce_seconds(link: Link, nbytes: float, replicas: int) -> float:
    """HSDP's end-of-minibatch all-reduce of ``nbytes`` (one rank's gradient shards) across ``replicas`` ranks:
    α–β model of a ring all-reduce (reduce-scatter + all-gather, ``2·(R-1)/R`` of the bytes per rank) with one
    ``latency_s`` per all-reduce, at the link's collective bandwidth."""
    if nbytes <= 0 or replicas <= 1:
        return 0.0
    return link.latency_s + 2.0 * nbytes * (replicas - 1) / replicas / (link.collective_GBps * 1e9)


def simulate(
    schedule: Schedule,
    *,
    layer_bytes: float,
    link: Link,
    overlap: bool = True,
    sync_s: float = 0.0,
    time_scale: float = 1.0,
    replica_link: Link | None = None,
    kv_token_bytes: float = 0.0,
) -> SimResult:
    """Predicted wall time of ``schedule`` (compute scaled by ``time_scale``; communication is not).

    ``replica_link`` carries HSDP's cross-replica all-reduce (default: ``link``); ``kv_token_bytes``: K/V bytes of
    one token in one layer, exchanged within the gangs of split samples."""
    w = schedule.world_size
    odc = schedule.comm == "odc"
    gather = comm_seconds(link, layer_bytes, schedule.shard_size, odc=odc)
    scatter = gather
    shard_bytes = layer_bytes * schedule.num_layers / schedule.shard_size
    allreduce = allreduce_seconds(replica_link or link, shard_bytes, schedule.replicas)

    def task_time(compute: float, comm: float) -> float:
        return max(compute, comm) if overlap else compute + comm

    busy = [0.0] * w
    times = []
    for k in range(len(schedule.minibatches)):
        programs = [schedule.program(k, r) for r in range(w)]
        for r, prog in enumerate(programs):
            busy[r] += sum(t.compute_s for t in prog) * time_scale
        if odc:
            mbs = schedule.minibatches[k].ranks
            clock = [0.0] * w
            gangs: dict[int, list[int]] = {}  # gang -> member ranks
            for r in range(w):
                for m in mbs[r]:
                    if m.chunk is not None:
                        gangs.setdefault(m.chunk.gang, []).append(r)
            for g in sorted(gangs):  # every member runs its gangs first, in gang order
                members = gangs[g]
                mine = {r: next(i for i, m in enumerate(mbs[r]) if m.chunk is not None and m.chunk.gang == g)
                        for r in members}
                tasks = {r: [t for t in programs[r] if t.micro_batch == mine[r]] for r in members}
                chunk = mbs[members[0]][mine[members[0]]].chunk
                own = chunk.tokens  # chunks are equal within one token; the exchange is priced on one of them
                kv = link.latency_s + max(chunk.length - own, own * (chunk.parts - 1)) * kv_token_bytes / (
                    link.p2p_GBps * 1e9) if kv_token_bytes > 0 else 0.0
                duration = sum(
                    max(task_time(tasks[r][j].compute_s * time_scale,
                                  gather + (scatter if tasks[r][j].scatter else 0.0)) for r in members) + kv
                    for j in range(len(tasks[members[0]]))
                )
                start = max(clock[r] for r in members)
                for r in members:
                    clock[r] = start + duration
            for r, prog in enumerate(programs):
                clock[r] += sum(task_time(t.compute_s * time_scale, gather + (scatter if t.scatter else 0.0))
                                for t in prog if mbs[r][t.micro_batch].chunk is None)
            t_mb = max(clock, default=0.0)
        else:
            depth = len(programs[0])
            if any(len(p) != depth for p in programs):
                raise ValueError("collective schedule with unequal programs: it must be padded")
            t_mb = 0.0
            for ranks in schedule.shard_groups():  # lockstep within a shard group; groups run side by side
                t_group = 0.0
                for j in range(depth):
                    comm = gather + (scatter if programs[0][j].scatter else 0.0)
                    t_group += task_time(max(programs[r][j].compute_s for r in ranks) * time_scale, comm)
                t_mb = max(t_mb, t_group)
        times.append(t_mb + allreduce + sync_s)
    return SimResult(sum(times), schedule.tokens, busy, times)


# --------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser(__doc__)
    p.add_argument("--world", type=int, default=8, help="GPUs (data-parallel ranks)")
    _common.add_workload_args(p)
    p.add_argument("--model", default="7b", choices=sorted(MODELS))
    p.add_argument("--gpu", default="h100", choices=sorted(GPU_PEAK_FLOPS))
    p.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of the GPU's bf16 peak")
    p.add_argument("--link", default="nvlink,ib", type=_common.comma_list(LINKS),
                   help=f"comma-separated subset of {','.join(LINKS)}")
    p.add_argument("--minibatch-size", type=int, default=None, help="samples per minibatch (default 16 × world)")
    p.add_argument("--minibatches", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=65536, help="token cap of a micro-batch")
    p.add_argument("--no-overlap", action="store_true", help="communication not overlapped with compute")
    p.add_argument("--replicas", type=int, default=1,
                   help="HSDP: replicas R (shard groups of world/R ranks; their gradient all-reduce crosses "
                        "--replica-link once per minibatch); 1 = shard over every rank")
    p.add_argument("--replica-link", default="ib", choices=sorted(LINKS), help="link of the HSDP all-reduce")
    _common.add_output_args(p, "simulate")
    return p


LEGEND = {
    "link": "modelled interconnect (LINKS: bandwidth and latency per operation)",
    "comm": "collective = lockstep all-gather / reduce-scatter per layer; odc = fetch / push, one sync per minibatch",
    "policy": "balancing policy (odc_runtime.balance.POLICY_REGISTRY)",
    "s/minibatch": "predicted seconds per minibatch (compute + communication not hidden by overlap)",
    "tokens/s": "predicted tokens per second over all GPUs",
    "util": "predicted device utilisation: compute time / (GPUs × wall)",
    "speedup": "time of the link's collective + local_sort / this one's",
    "× verl": "time of the link's collective + verl_lb_micro (veRL's dynamic batching, what a veRL user runs) / "
              "this one's",
    "× lb_micro": "time of the link's collective + lb_micro (the best collective schedule) / this one's",
}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    spec = MODELS[args.model]
    cost = spec.cost_model(GPU_PEAK_FLOPS[args.gpu] * args.mfu)
    mbs = args.minibatch_size or 16 * args.world
    batches, source = _common.load_minibatches(args, args.minibatches, mbs)
    _common.check_cap(args, (s for b in batches for s in b))
    layer_bytes = 2 * spec.layer_params()
    rows = []
    for link_name in args.link:
        link = LINKS[link_name]
        times = {}
        for comm, policy in grid(policies=SIMULATED_POLICIES):
            sched = build_schedule(batches, args.world, comm=comm, policy=policy, cost=cost,
                                   max_tokens=args.max_tokens, num_layers=spec.num_layers, replicas=args.replicas,
                                   allow_oversized=args.allow_oversized)
            res = simulate(sched, layer_bytes=layer_bytes, link=link, overlap=not args.no_overlap,
                           replica_link=LINKS[args.replica_link], kv_token_bytes=spec.kv_token_bytes())
            times[comm, policy] = res.time_s
            rows.append({"link": link_name, "comm": comm, "policy": policy, "time_s": res.time_s,
                         "s_per_minibatch": res.time_s / len(batches), "tokens_per_s": res.tokens_per_s,
                         "utilization": res.utilization})
        for r in rows[-len(times):]:
            for key, policy in (("speedup", "local_sort"), ("speedup_vs_collective_verl_lb_micro", "verl_lb_micro"),
                                ("speedup_vs_collective_lb_micro", "lb_micro")):
                r[key] = times[("collective", policy)] / r["time_s"]
    hsdp = f" (HSDP {args.replicas}×{args.world // args.replicas}, all-reduce over {args.replica_link})" \
        if args.replicas > 1 else ""
    print(f"\nSimulated: {args.world} × {args.gpu.upper()}{hsdp} at MFU {args.mfu:g}, {spec.name} "
          f"({layer_bytes / 2**20:.0f} MiB bf16 per layer), {len(batches)} minibatches × {mbs} samples from "
          f"{source}, max {args.max_tokens} tokens per micro-batch, overlap={not args.no_overlap}")
    _common.print_table(
        list(LEGEND),
        [[r["link"], r["comm"], r["policy"], r["s_per_minibatch"], r["tokens_per_s"], f"{r['utilization']:.1%}",
          *(f"{r[k]:.3f}" for k in ("speedup", "speedup_vs_collective_verl_lb_micro",
                                    "speedup_vs_collective_lb_micro"))] for r in rows], LEGEND)
    note = _common.oversized_note(_common.oversized((s for b in batches for s in b), args.max_tokens),
                                  len(batches) * mbs, args.max_tokens)
    if note:
        print(f"  NOTE: {note}")
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    config.update(minibatch_size=mbs, layer_bytes=layer_bytes, links={k: vars(v) for k, v in LINKS.items()})
    first = rows[0]["link"]
    title = f"simulated, {args.world}×{args.gpu} {first}, {spec.name}, {args.preset}" + (f"\n{note}" if note else "")
    _common.write_outputs(
        args, "simulate", {"runs": rows, "config": config, "machine": _common.machine_info()},
        lambda plots, path: plots.plot_simulation([r for r in rows if r["link"] == first], path, title=title),
    )


if __name__ == "__main__":
    sys.exit(main())
