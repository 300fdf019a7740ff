"""Bandwidth of ODC's one-sided operations against the collectives they replace.

    python bench/comm.py                        # CPU: spawns 4 ranks, host transport vs gloo
    python bench/comm.py --sizes 1M,64M --nproc 2
    torchrun --nproc-per-node 8 bench/comm.py --backend nvshmem   # GPUs: nvshmem transport vs NCCL
    python bench/comm.py --backend nvshmem --pes-per-gpu 4         # one GPU, 4 PEs (start MPS first, below)
    python bench/comm.py --nproc 4 --node-size 2                   # hierarchical mode: 2 virtual nodes of 2

For every size N (bytes of the *full* fp32 tensor; binary units, 1M = 2^20 bytes) all ranks run at once:

========== =========================================================================================
copy        ``dst.copy_(src)`` of N bytes on every rank, no communication: the ceiling
add         ``dst.add_(src)`` of N bytes on every rank, no communication (what a push does, in total)
all_gather  torch.distributed tensor all-gather (gloo / NCCL): every rank receives the full N-byte tensor
fetch       ``odc.fetch(st, out=...)``: every rank reads the full N-byte tensor from its owners
red_scatter torch.distributed tensor reduce-scatter (SUM): every rank sends an N-byte gradient, keeps its shard
push        ``odc.push(st, grad)``: every rank adds its N-byte gradient into the owners' accumulators
sync        ``odc.sync()`` alone (the once-per-minibatch fence that makes pushes visible)
sync_flush  ``odc.sync()`` right after an (untimed) push of the full tensor: with ``--node-size`` the flush of
            the staging rows (one put-with-signal per (source node, owner)), the owners' fold and the mirror
            refresh; without it a fence after a push
sync_busy   GPU: ``odc.sync()`` issued while ~1.5 ms of matmuls are queued; time from after the queued work
            to the end of the sync on the GPU timeline (a sync that drains the GPU shows up here)
mm          GPU: a bf16 matmul alone (the "model compute" of the interference rows)
mm+fetch    GPU: the same matmul on a side stream while fetch runs on the current stream; time of the matmul
mm+push     GPU: the same with push; /local of these rows = slowdown of the matmul (1.0 = no interference)
========== =========================================================================================

Before timing, every size is verified once, exactly (integer-valued fp32, so every order of summation gives
the same bits): fetch returns the owners' values, also after the owners overwrote their shards twice (each
followed by a sync); two rounds of rank-dependent pushes + sync leave exactly the reference sum in every owner's
accumulator; the collectives return what they should. A wrong result stops the run (exit status 1) before
anything is timed. ``host µs`` is the host time of one call (perf_counter around the Python call, not waiting for the
GPU): the per-call cost a training loop pays to keep the GPU fed. ``/local`` compares with the no-communication
bound of the same bytes: fetch and all_gather with ``copy``, push and red_scatter with ``add``.

Hierarchical mode (``--node-size N``, issue 14): passed to ``odc.init(node_size=N)``, so the ranks form
virtual nodes of ``N`` consecutive ranks. Pushes into other-node owners then accumulate on the node-mate with
the owner's local index and cross "nodes" once, at ``sync()``; fetches of other-node owners read that
node-mate's mirror. With the host transport ``--nproc 4 --node-size 2`` exercises every cross-node path on one
machine; with nvshmem, 4 PEs on one GPU under MPS (``--pes-per-gpu 4 --node-size 2``) the same. ``push`` is
then the node-local part only; the cross-node part is in ``sync_flush``. ODC only: the collectives ignore it.

Several PEs on one GPU (``--pes-per-gpu K``): the ranks share GPUs round-robin and torch.distributed uses gloo
(NCCL refuses two ranks on one GPU), so the collective rows are skipped. Start CUDA MPS before the run
(``nvidia-cuda-mps-control -d``; stop it with ``echo quit | nvidia-cuda-mps-control``): without MPS the nvshmem
transport refuses several PEs on one GPU (their spinning kernels would time-slice).

Bytes and bandwidths. For fetch / all-gather the bytes are those of the full tensor each rank receives; for
push / reduce-scatter those of the full gradient each rank sends; for copy / add the N bytes of the
destination. ``algbw = N / time`` (GB/s, 10^9 bytes/s). ``busbw = algbw · (W-1)/W`` for the gather and
scatter operations, as nccl-tests computes it (the bytes that actually cross between ranks); copy and add have
no bus. Time: all ranks start together after a barrier; each measures its own operation (CPU
``perf_counter``; GPU CUDA events, the start event recorded before the Python call so that host time counts,
as in a training loop, after a warm-up); a repeat takes the slowest rank; the table shows the median over
repeats. A push is timed until it returns (on the host transport the additions are then done;
the owners see them after the next ``sync``, timed separately).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if not __package__:  # python bench/comm.py from a checkout (bench/_checkout.py)
    import _checkout  # noqa: F401

from odc_runtime import cli, config
from odc_runtime import transport as registry
from odc_runtime.bench import _common
from odc_runtime.bench._common import launch, progress
from odc_runtime.errors import OdcError

if TYPE_CHECKING:
    import torch

    from odc_runtime import ShardedTensor

OPS = ("copy", "add", "all_gather", "fetch", "red_scatter", "push", "sync", "sync_flush", "sync_busy", "mm",
       "mm+fetch", "mm+push")
GPU_ONLY_OPS = ("sync_busy", "mm", "mm+fetch", "mm+push")
COLLECTIVE_OPS = ("all_gather", "red_scatter")
BUS_FACTOR_OPS = ("all_gather", "fetch", "red_scatter", "push")
LOCAL_BOUND = {"fetch": "copy", "all_gather": "copy", "push": "add", "red_scatter": "add", "mm+fetch": "mm",
               "mm+push": "mm"}
NO_BANDWIDTH_OPS = ("sync", "sync_flush", "sync_busy", "mm", "mm+fetch", "mm+push")
# Default sizes by the transport's device type (GPUs get one more, larger size).
DEFAULT_SIZES = {"cpu": "1M,4M,16M,64M,256M", "cuda": "1M,4M,16M,64M,256M,1G"}
# Heap settings of the transports; when the user set one, the benchmark does not override it with heap_size=.
HEAP_ENV_VARS = ("ODC_HEAP_SIZE", "NVSHMEM_SYMMETRIC_SIZE")

LEGEND = {
    "size": "bytes of the full fp32 tensor (binary units: 1M = 2^20 B)",
    "op": "operation (see --help: copy/add are the no-communication bounds, all_gather/red_scatter the "
          "collectives, fetch/push/sync ODC, sync_flush a sync after a push)",
    "ms": "milliseconds of one call: slowest rank per repeat, median over repeats (GPU: CUDA events, host time "
          "included)",
    "host µs": "microseconds of the Python call alone on rank 0 (median; on GPU: not waiting for the GPU)",
    "algbw GB/s": "size / ms in 10^9 B/s ('-' for ops that move no bytes of their own)",
    "busbw GB/s": "algbw * (W-1)/W for the gather/scatter ops, as nccl-tests (bytes that cross between ranks)",
    "/local": "algbw vs the same bytes without communication: fetch and all_gather vs copy_, push and "
              "red_scatter vs add_; for mm+fetch / mm+push the matmul's slowdown (1.0 = no interference)",
    "/collective": "algbw of fetch vs all_gather, push vs red_scatter (above 1: ODC faster)",
    "host/copy": "host µs of the call vs host µs of a bare copy_ of the same bytes",
}


def size(text: str) -> int:
    """One ``--sizes`` item: a byte count such as ``64K`` or ``1G`` (binary units)."""
    return config.parse_size(text, what="--sizes")


sizes_type = _common.comma_list(cast=size)  # --sizes: "1M,64M" -> [1048576, 67108864]


def human(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser(__doc__)
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to spawn (default 4 for a CPU transport, every GPU x --pes-per-gpu for a GPU one)")
    p.add_argument("--backend", choices=registry.names(), default=None,
                   help="ODC transport from the registry (default: ODC_BACKEND, else the first available)")
    p.add_argument("--sizes", default=None, type=sizes_type,
                   help=f"full-tensor sizes, comma separated (default {DEFAULT_SIZES['cpu']} for a CPU transport, "
                        f"{DEFAULT_SIZES['cuda']} for a GPU one)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per op and size (default by size)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ops", default=None, type=_common.comma_list(OPS),
                   help=f"subset of {','.join(OPS)} (default: all; on CPU without {','.join(GPU_ONLY_OPS)})")
    p.add_argument("--pes-per-gpu", type=int, default=1,
                   help="GPU transports: ranks per GPU (NVSHMEM PEs sharing a GPU; use CUDA MPS, see above)")
    p.add_argument("--node-size", type=int, default=None, metavar="N",
                   help="ODC hierarchical mode: virtual nodes of N consecutive ranks (odc.init(node_size=N); "
                        "default: the transport's own node size); must divide the number of ranks")
    _common.add_output_args(p, "comm")
    return p


def default_repeats(nbytes: int) -> int:
    if nbytes <= 4 << 20:
        return 30
    if nbytes <= 64 << 20:
        return 10
    return 5


# --------------------------------------------------------------------------------------------------- worker


class Timer:
    """Times one operation per repeat on this rank: perf_counter on CPU, CUDA events on GPU (the start event is
    recorded before the Python call, so host time counts). Also returns the host time of the call itself."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def __call__(self, op: Op) -> tuple[float, float]:
        if op.before is not None:
            op.before()
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            stream = op.stream() if op.stream is not None else self.torch.cuda.current_stream()
            start.record(stream)
            t0 = time.perf_counter()
            op.fn()
            host = time.perf_counter() - t0
            end.record(stream)
            end.synchronize()
            return start.elapsed_time(end) / 1e3, host
        t0 = time.perf_counter()
        op.fn()
        host = time.perf_counter() - t0
        return host, host


@dataclass
class Op:
    """One timed operation: ``fn`` is timed; ``before`` runs untimed just before the start event, ``after``
    untimed after the repeat; ``stream`` (GPU) returns the stream whose timeline is measured."""

    fn: Callable[[], object]
    after: Callable[[], object] | None = None
    before: Callable[[], object] | None = None
    stream: Callable[[], object] | None = None


def heap_size(largest: int, world: int) -> int | None:
    """Symmetric heap to ask for: None (the default, 1 GiB, or what the user's heap setting says) unless the
    largest size's parameter shard + fp32 gradient shard would not fit in the default."""
    need = 2 * -(-largest // world) + (64 << 20)
    if any(os.environ.get(env) for env in HEAP_ENV_VARS) or need <= (1 << 30) - (64 << 20):
        return None
    return need


def make_ops(
    nbytes: int, world: int, device: torch.device, collectives: bool
) -> tuple[ShardedTensor, dict[str, Op], Callable[[], None]]:
    """The timed operations at one size: ``{op: Op}``, a verification function and the ShardedTensor."""
    import torch
    import torch.distributed as dist

    import odc_runtime as odc

    all_gather_tensor, reduce_scatter_tensor = _common.tensor_collectives()
    numel = nbytes // 4
    shard_numel = -(-numel // world)
    gen = torch.Generator().manual_seed(nbytes)  # the same values on every rank: expected results are known
    full = torch.randn(numel, generator=gen).to(device)
    out = torch.empty(numel, device=device)
    # the collectives need equal shards: gather / scatter world * shard_numel elements (>= numel)
    shard = torch.randn(shard_numel, generator=gen).to(device)
    gathered = torch.empty(world * shard_numel, device=device)
    grad_full = torch.randn(world * shard_numel, generator=gen).to(device)
    grad_shard = torch.empty(shard_numel, device=device)
    st = odc.shard(full, name=f"bench{nbytes}")
    ops = {
        "copy": Op(lambda: out.copy_(full)),
        "add": Op(lambda: out.add_(full)),
        "fetch": Op(lambda: odc.fetch(st, out=out)),
        # untimed sync after every push: all pushes have landed before the next repeat starts
        "push": Op(lambda: odc.push(st, full), after=odc.sync),
        "sync": Op(odc.sync),
        # the push is untimed (before the start); the timed sync flushes what it staged (hierarchical mode)
        "sync_flush": Op(odc.sync, before=lambda: push_then_wait(st, full)),
    }
    if collectives:
        ops["all_gather"] = Op(lambda: all_gather_tensor(gathered, shard))
        ops["red_scatter"] = Op(lambda: reduce_scatter_tensor(grad_shard, grad_full))
    if device.type == "cuda":
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        side = torch.cuda.Stream(device)

        def queue_compute() -> None:
            torch.mm(a, b)  # ~1.5 ms on an H100: the sync below is issued behind it

        def mm_with(comm: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.mm(a, b)
                comm()
                torch.cuda.current_stream().wait_stream(side)

            return run

        ops["sync_busy"] = Op(odc.sync, before=queue_compute)
        ops["mm"] = Op(lambda: torch.mm(a, b))
        # the matmul's own timeline is measured: the side stream's events bracket only it
        ops["mm+fetch"] = Op(mm_with(lambda: odc.fetch(st, out=out)), stream=lambda: side)
        ops["mm+push"] = Op(mm_with(lambda: odc.push(st, full)), after=odc.sync, stream=lambda: side)

    def verify() -> None:
        """Check every operation's result once before timing (a fast wrong result is not a result)."""
        verify_fetch(st, full, out, nbytes)
        verify_push(st, nbytes, world, device)
        if collectives:
            all_gather_tensor(gathered, shard)
            if not torch.equal(gathered, shard.repeat(world)):
                raise SystemExit(f"comm.py: all_gather returned wrong values at {human(nbytes)}")
            reduce_scatter_tensor(grad_shard, grad_full)
            rank = dist.get_rank()
            mine = grad_full[rank * shard_numel : (rank + 1) * shard_numel] * world
            if not torch.allclose(grad_shard, mine, rtol=1e-5, atol=1e-4):
                raise SystemExit(f"comm.py: reduce_scatter returned wrong values at {human(nbytes)}")

    return st, ops, verify


def push_then_wait(st: ShardedTensor, grad: torch.Tensor) -> None:
    """Untimed part of ``sync_flush``: push, wait until this rank's push has run (GPU) and until every rank's has
    (a torch.distributed barrier), so that the timed sync measures the sync, not the skew between the pushes."""
    import torch
    import torch.distributed as dist

    import odc_runtime as odc

    odc.push(st, grad)
    if grad.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _integers(numel: int, seed: int, device: torch.device) -> torch.Tensor:
    """fp32 values that are small integers (-8..8): sums of a few hundred of them are exact in any order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (numel,), generator=gen, dtype=torch.int8).to(device=device, dtype=torch.float32)


def _first_difference(got: torch.Tensor, want: torch.Tensor, st: ShardedTensor) -> str:
    """Where ``got`` differs from ``want`` (a full tensor or one owner's range): count, first index, its owner."""
    bad = (got != want).nonzero()
    i = int(bad[0]) if len(bad) else -1
    owner = f", owner {i // st.shard_size}" if got.numel() == st.numel else ""
    return f"{len(bad)} elements differ, the first at {i}{owner}: got {got[i].item()}, expected {want[i].item()}"


def verify_fetch(st: ShardedTensor, full: torch.Tensor, out: torch.Tensor, nbytes: int) -> None:
    """``fetch`` returns the owners' values: first the sharded ones, then after each of two rounds in which every
    owner overwrites its shard and all ranks sync (in hierarchical mode: the node-mates' mirrors are refreshed at
    every sync, a stale mirror fails here). Restores the original values. SystemExit naming rank, round, owner."""
    import odc_runtime as odc

    lo, hi = st.shard_range
    for k in range(3):
        want = full if k == 0 else _integers(st.numel, nbytes + 101 * k, full.device)
        if k:  # as in training: a sync after everyone's reads, the owner's write, a sync before the next reads
            odc.sync()
            st.local.copy_(want[lo:hi])
            odc.sync()
        got = odc.fetch(st, out=out)
        if not torch_equal(got, want):
            what = "as sharded" if k == 0 else f"after the owners' write {k} and a sync"
            raise SystemExit(f"comm.py: fetch returned wrong values at {human(nbytes)} on rank {st.rank} ({what}): "
                             f"{_first_difference(got, want, st)}")
    odc.sync()
    st.local.copy_(full[lo:hi])
    odc.sync()


def verify_push(st: ShardedTensor, nbytes: int, world: int, device: torch.device) -> None:
    """Two pushes per rank into the world-sharded tensor, different on every rank (``base·(r+1)``, then
    ``base·(W−r) + 1``), then sync: every owner's accumulator must hold exactly ``base·W·(W+1) + W`` on its
    range, computed here independently of the transport. Leaves the accumulators zeroed. SystemExit if wrong."""
    import odc_runtime as odc

    rank = st.rank
    base = _integers(st.numel, nbytes + 7, device)
    st.zero_grad()
    odc.sync()
    grads = (base * (rank + 1), base * (world - rank) + 1)  # kept alive until the sync (GPU pushes are queued)
    for grad in grads:
        odc.push(st, grad)
    odc.sync()
    del grads
    lo, hi = st.shard_range
    want = base[lo:hi] * (world * (world + 1)) + world
    got = st.grad[: hi - lo]
    if not torch_equal(got, want):
        raise SystemExit(f"comm.py: push + sync left wrong sums at {human(nbytes)} on rank {rank} (owner of "
                         f"[{lo}, {hi})): {_first_difference(got, want, st)}")
    st.zero_grad()
    odc.sync()


def torch_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def _init(args: argparse.Namespace) -> tuple[int, int, torch.device, bool]:
    """(rank, world, device, collectives available)."""
    import torch
    import torch.distributed as dist

    if args.pes_per_gpu == 1:
        rank, world, device = _common.init_distributed(args.device_type)
        return rank, world, device, True
    # Several ranks per GPU: NCCL refuses duplicate GPUs, so torch.distributed runs on gloo (collectives skipped).
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local % torch.cuda.device_count())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world, torch.device("cuda", torch.cuda.current_device()), False


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import odc_runtime as odc

    rank, world, device, collectives = _init(args)
    sizes: list[int] = args.sizes
    ops: list[str] = list(args.ops)
    if device.type != "cuda":
        ops = [o for o in ops if o not in GPU_ONLY_OPS]
    if not collectives:
        ops = [o for o in ops if o not in COLLECTIVE_OPS]
    init_kwargs = {}
    if args.node_size is not None:  # hierarchical mode (issue 14); without it odc.init keeps its own default
        if "node_size" not in inspect.signature(odc.init).parameters:
            raise SystemExit("comm.py --node-size: this odc_runtime's init() has no node_size (the hierarchical "
                             "mode of issue 14); install a version that has it, or drop --node-size")
        init_kwargs["node_size"] = args.node_size
    odc.init(args.backend, heap_size=heap_size(max(sizes), world), **init_kwargs)
    node_size = odc.node_size() if hasattr(odc, "node_size") else None
    timer = Timer(device)
    collective = "nccl" if device.type == "cuda" and collectives else "gloo"
    results = []
    for nbytes in sizes:
        st, fns, verify = make_ops(nbytes, world, device, collectives)
        verify()
        reps = args.repeats or default_repeats(nbytes)
        for op in ops:  # warm-up (also faults in every page of the peers' segments)
            for _ in range(args.warmup):
                if fns[op].before is not None:
                    fns[op].before()
                fns[op].fn()
                if fns[op].after is not None:
                    fns[op].after()
        # Repeats interleave the operations, so that a slow phase of a shared machine hits all of them alike,
        # and rotate their order, so that none is always the one after a particular other.
        times: dict[str, list[float]] = {op: [] for op in ops}
        hosts: dict[str, list[float]] = {op: [] for op in ops}
        for rep in progress(range(reps), enabled=rank == 0, desc=f"comm {human(nbytes)}"):
            for op in ops[rep % len(ops):] + ops[: rep % len(ops)]:
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t, host = timer(fns[op])
                times[op].append(t)
                hosts[op].append(host)
                if fns[op].after is not None:
                    fns[op].after()
        for op in ops:
            t = torch.tensor(times[op], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a repeat lasts as long as its slowest rank
            per_rep = t.cpu().tolist()
            med = statistics.median(per_rep)
            algbw = nbytes / med / 1e9 if op not in NO_BANDWIDTH_OPS else float("nan")
            busbw = algbw * (world - 1) / world if op in BUS_FACTOR_OPS else float("nan")
            results.append({"op": op, "bytes": nbytes, "time_s": med, "times_s": per_rep, "algbw_GBps": algbw,
                            "busbw_GBps": busbw, "host_us": statistics.median(hosts[op]) * 1e6, "repeats": reps})
        st.free()
        del fns, st, verify
    if rank == 0:
        report(args, results, world, collective, device, node_size)
    odc.finalize()
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------- report


def add_ratios(results: list[dict]) -> None:
    """``vs_local``: bandwidth relative to the no-communication bound of the same bytes (fetch/all_gather vs
    copy, push/red_scatter vs add), for mm+X the matmul's slowdown (time / time alone); ``vs_collective``: fetch
    vs all_gather, push vs red_scatter; ``host_vs_copy``: host µs per call relative to copy_."""
    by = {(r["op"], r["bytes"]): r for r in results}
    for r in results:
        bound = by.get((LOCAL_BOUND.get(r["op"], ""), r["bytes"]))
        if bound is None:
            r["vs_local"] = None
        elif r["op"].startswith("mm+"):
            r["vs_local"] = r["time_s"] / bound["time_s"]
        else:
            r["vs_local"] = r["algbw_GBps"] / bound["algbw_GBps"]
        match = {"fetch": "all_gather", "push": "red_scatter"}.get(r["op"])
        coll = by.get((match, r["bytes"])) if match else None
        r["vs_collective"] = r["algbw_GBps"] / coll["algbw_GBps"] if coll else None
        copy = by.get(("copy", r["bytes"]))
        r["host_vs_copy"] = r["host_us"] / copy["host_us"] if copy and copy["host_us"] > 0 else None


def report(args: argparse.Namespace, results: list[dict], world: int, collective: str, device: torch.device,
           node_size: int | None = None) -> None:
    """Print the table (and notes), write the JSON and the plot; ``node_size``: the runtime's, where it has one."""
    add_ratios(results)
    hier = (f"; hierarchical ODC, nodes of {node_size} ranks ({world // node_size} nodes)"
            if node_size is not None and node_size < world else "")
    title = (
        f"ODC {args.backend} transport vs {collective} collectives, {world} ranks on {device.type}"
        f"{f' ({args.pes_per_gpu} per GPU)' if args.pes_per_gpu > 1 else ''}{hier}; fp32; torch {_torch_version()}"
    )
    rows = [
        [human(r["bytes"]), r["op"], r["time_s"] * 1e3, r["host_us"], r["algbw_GBps"], r["busbw_GBps"],
         r["vs_local"], r["vs_collective"], r["host_vs_copy"]]
        for r in results
    ]
    print(flush=True)
    _common.print_table(list(LEGEND), rows, LEGEND, title=title)
    all_gather_tensor, reduce_scatter_tensor = _common.tensor_collectives()
    notes = [
        f"all_gather = torch.distributed.{all_gather_tensor.__name__} ({collective}); red_scatter = "
        f"{reduce_scatter_tensor.__name__} ({collective}, SUM).",
        "push is timed until it returns; its sync (made untimed after every repeat) is the 'sync' row; sync_busy "
        "is a sync issued behind ~1.5 ms of queued matmuls; sync_flush a sync right after a push of the full tensor "
        "(hierarchical mode: the cross-node flush, the owners' fold and the mirror refresh).",
        "Every size was verified exactly before timing (fetch values before and after owners' writes, sums of "
        "rank-dependent pushes, collective results).",
    ]
    print("\n".join("  " + n for n in notes), flush=True)
    payload = {
        "results": results,
        "config": {"world_size": world, "backend": args.backend, "collective": collective,
                   "pes_per_gpu": args.pes_per_gpu, "node_size_arg": args.node_size, "node_size": node_size,
                   "sizes": args.sizes, "warmup": args.warmup, "repeats": args.repeats,
                   "dtype": "float32", "bytes": "full tensor (fetch/all_gather: received per rank; "
                   "push/reduce_scatter: sent per rank; copy/add: destination)",
                   "busbw_factor": "(W-1)/W for all_gather, fetch, red_scatter, push",
                   "timing": "max over ranks per repeat, median over repeats; host_us: median of this rank",
                   "host_chunk_bytes": os.environ.get("ODC_HOST_CHUNK_BYTES"),
                   "nvshmem_env": {k: v for k, v in os.environ.items() if k.startswith(("ODC_NVSHMEM", "NVSHMEM"))}},
        "machine": _common.machine_info(),
    }
    _common.write_outputs(
        args, "comm", payload,
        lambda plots, path: plots.plot_comm(results, path, title=f"{args.backend} vs {collective}, {world} ranks"),
    )


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # the transport: --backend, else ODC_BACKEND, else the preferred available one (as odc.init picks)
        choice = config.backend_name(args.backend)
        spec = registry.get(choice) if choice is not None else registry.auto_select()
    except OdcError as e:
        parser.error(str(e))
    args.backend, args.device_type = spec.name, spec.device_type
    args.sizes = args.sizes or sizes_type(DEFAULT_SIZES.get(spec.device_type, DEFAULT_SIZES["cpu"]))
    args.ops = args.ops or list(OPS)
    if args.pes_per_gpu < 1 or (args.pes_per_gpu > 1 and spec.device_type != "cuda"):
        parser.error(f"--pes-per-gpu must be >= 1, and > 1 only with a GPU transport ({args.backend} runs on "
                     f"{spec.device_type})")
    nproc = args.nproc
    if nproc is None:
        if spec.device_type == "cuda":
            import torch

            nproc = torch.cuda.device_count() * args.pes_per_gpu
        else:
            nproc = 4
    if args.node_size is not None:  # under torchrun odc.init checks it against the world on every rank
        world = int(os.environ["WORLD_SIZE"]) if _common.under_torchrun() else nproc
        if args.node_size < 1 or world % args.node_size:
            parser.error(f"--node-size {args.node_size} must be >= 1 and divide the number of ranks ({world})")
    launch(worker, nproc, args)


if __name__ == "__main__":
    sys.exit(main())
