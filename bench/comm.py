"""Bandwidth of ODC's one-sided operations against the collectives they replace.

    python bench/comm.py                        # CPU: spawns 4 ranks, host transport vs gloo
    python bench/comm.py --sizes 1M,64M --nproc 2
    torchrun --nproc-per-node 8 bench/comm.py --backend nvshmem   # GPUs: nvshmem transport vs NCCL

For every size N (bytes of the *full* fp32 tensor; binary units, 1M = 2^20 bytes) all ranks run at once:

========== =========================================================================================
copy        ``dst.copy_(src)`` of N bytes on every rank, no communication: the ceiling
add         ``dst.add_(src)`` of N bytes on every rank, no communication (what a push does, in total)
all_gather  collective ``all_gather_into_tensor`` (gloo / NCCL): every rank receives the full N-byte tensor
fetch       ``odc.fetch(st, out=...)``: every rank reads the full N-byte tensor from its owners
red_scatter collective ``reduce_scatter_tensor`` (SUM): every rank sends an N-byte gradient, keeps its shard
push        ``odc.push(st, grad)``: every rank adds its N-byte gradient into the owners' accumulators
sync        ``odc.sync()`` alone (the once-per-minibatch fence that makes pushes visible)
========== =========================================================================================

Bytes and bandwidths. For fetch / all-gather the bytes are those of the full tensor each rank receives; for
push / reduce-scatter those of the full gradient each rank sends; for copy / add the N bytes of the
destination. ``algbw = N / time`` (GB/s, 10^9 bytes/s). ``busbw = algbw · (W-1)/W`` for the gather and
scatter operations, as nccl-tests computes it (the bytes that actually cross between ranks); copy and add have
no bus. Time: all ranks start together after a barrier; each measures its own operation (CPU
``perf_counter``; GPU CUDA events, after a warm-up); a repeat takes the slowest rank; the table shows the
median over repeats. A push is timed until it returns (on the host transport the additions are then done;
the owners see them after the next ``sync``, timed separately).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import _common
from _common import format_table, launch, progress

OPS = ("copy", "add", "all_gather", "fetch", "red_scatter", "push", "sync")
BUS_FACTOR_OPS = ("all_gather", "fetch", "red_scatter", "push")


def parse_sizes(text: str) -> list[int]:
    from odc_runtime.config import parse_size

    return [parse_size(s.strip(), what="--sizes") for s in text.split(",") if s.strip()]


def human(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


DEFAULT_SIZES = {"host": "1M,4M,16M,64M,256M", "nvshmem": "1M,4M,16M,64M,256M,1G"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="processes to spawn (default 4 on CPU, all GPUs)")
    p.add_argument("--backend", choices=("host", "nvshmem"), default=None,
                   help="ODC transport (default: nvshmem when CUDA is available, else host)")
    p.add_argument("--sizes", default=None,
                   help=f"full-tensor sizes, comma separated (default {DEFAULT_SIZES['host']} on CPU, "
                        f"{DEFAULT_SIZES['nvshmem']} on GPUs)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per op and size (default by size)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)}")
    p.add_argument("--json", default=None, help="write results as JSON to this path")
    p.add_argument("--plot", default=None, help="PNG path (default bench/results/comm.png); 'none' to skip")
    return p


def default_repeats(nbytes: int) -> int:
    if nbytes <= 4 << 20:
        return 30
    if nbytes <= 64 << 20:
        return 10
    return 5


# --------------------------------------------------------------------------------------------------- worker


class Timer:
    """Times one operation per repeat on this rank: perf_counter on CPU, CUDA events on GPU."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def __call__(self, fn) -> float:
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def heap_size(backend: str, largest: int, world: int) -> int | None:
    """Symmetric heap to ask for: None (the default, 1 GiB, or what the user's env var says) unless the
    largest size's parameter shard + fp32 gradient shard would not fit in the default."""
    env = "ODC_HEAP_SIZE" if backend == "host" else "NVSHMEM_SYMMETRIC_SIZE"
    need = 2 * -(-largest // world) + (64 << 20)
    if os.environ.get(env) or need <= (1 << 30) - (64 << 20):
        return None
    return need


def make_ops(nbytes: int, world: int, device):
    """The timed operations at one size: ``{op: (fn, untimed_after_fn)}`` and the ShardedTensor."""
    import torch
    import torch.distributed as dist

    import odc_runtime as odc

    numel = nbytes // 4
    shard_numel = -(-numel // world)
    full = torch.randn(numel, device=device)
    out = torch.empty(numel, device=device)
    # the collectives need equal shards: gather / scatter world * shard_numel elements (>= numel)
    shard = torch.randn(shard_numel, device=device)
    gathered = torch.empty(world * shard_numel, device=device)
    grad_full = torch.randn(world * shard_numel, device=device)
    grad_shard = torch.empty(shard_numel, device=device)
    st = odc.shard(full, name=f"bench{nbytes}")
    return st, {
        "copy": (lambda: out.copy_(full), None),
        "add": (lambda: out.add_(full), None),
        "all_gather": (lambda: dist.all_gather_into_tensor(gathered, shard), None),
        "fetch": (lambda: odc.fetch(st, out=out), None),
        "red_scatter": (lambda: dist.reduce_scatter_tensor(grad_shard, grad_full), None),
        # untimed sync after every push: all pushes have landed before the next repeat starts
        "push": (lambda: odc.push(st, full), odc.sync),
        "sync": (odc.sync, None),
    }


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import odc_runtime as odc

    device_kind = "cuda" if args.backend == "nvshmem" else "cpu"
    rank, world, device = _common.init_distributed(device_kind)
    sizes = parse_sizes(args.sizes)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = set(ops) - set(OPS)
    if unknown:
        raise SystemExit(f"unknown ops {sorted(unknown)}; choose from {OPS}")
    odc.init(args.backend, heap_size=heap_size(args.backend, max(sizes), world))
    timer = Timer(device)
    collective = "nccl" if device_kind == "cuda" else "gloo"
    results = []
    for nbytes in sizes:
        st, fns = make_ops(nbytes, world, device)
        reps = args.repeats or default_repeats(nbytes)
        for op in ops:  # warm-up (also faults in every page of the peers' segments)
            fn, after = fns[op]
            for _ in range(args.warmup):
                fn()
                if after is not None:
                    after()
        # Repeats interleave the operations, so that a slow phase of a shared machine hits all of them alike,
        # and rotate their order, so that none is always the one after a particular other.
        times: dict[str, list[float]] = {op: [] for op in ops}
        for rep in progress(range(reps), enabled=rank == 0, desc=f"comm {human(nbytes)}"):
            for op in ops[rep % len(ops):] + ops[: rep % len(ops)]:
                fn, after = fns[op]
                dist.barrier()
                times[op].append(timer(fn))
                if after is not None:
                    after()
        for op in ops:
            t = torch.tensor(times[op], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a repeat lasts as long as its slowest rank
            per_rep = t.cpu().tolist()
            med = statistics.median(per_rep)
            algbw = nbytes / med / 1e9 if op != "sync" else float("nan")
            busbw = algbw * (world - 1) / world if op in BUS_FACTOR_OPS else float("nan")
            results.append({"op": op, "bytes": nbytes, "time_s": med, "times_s": per_rep, "algbw_GBps": algbw,
                            "busbw_GBps": busbw, "repeats": reps})
        st.free()
        del fns
    if rank == 0:
        report(args, results, world, collective, device)
    odc.finalize()
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------- report


def add_ratios(results: list[dict]) -> None:
    by = {(r["op"], r["bytes"]): r for r in results}
    for r in results:
        copy = by.get(("copy", r["bytes"]))
        r["vs_copy"] = r["algbw_GBps"] / copy["algbw_GBps"] if copy and r["op"] != "sync" else None
        match = {"fetch": "all_gather", "push": "red_scatter"}.get(r["op"])
        coll = by.get((match, r["bytes"])) if match else None
        r["vs_collective"] = r["algbw_GBps"] / coll["algbw_GBps"] if coll else None


def report(args, results: list[dict], world: int, collective: str, device) -> None:
    add_ratios(results)
    header = (
        f"ODC {args.backend} transport vs {collective} collectives, {world} ranks on {device.type}; "
        f"fp32, sizes are full-tensor bytes (1M = 2^20 B); GB/s = 1e9 B/s; median over repeats of the "
        f"slowest rank"
    )
    rows = []
    for r in results:
        rows.append([
            human(r["bytes"]), r["op"], r["time_s"] * 1e3,
            r["algbw_GBps"], r["busbw_GBps"],
            r["vs_copy"], r["vs_collective"],
        ])
    table = format_table(["size", "op", "ms", "algbw GB/s", "busbw GB/s", "/copy", "/collective"], rows)
    notes = [
        f"all_gather = torch.distributed.all_gather_into_tensor ({collective}); red_scatter = "
        f"reduce_scatter_tensor ({collective}, SUM); both are supported natively by {collective} in torch "
        f"{_torch_version()}.",
        "/copy: algbw relative to a local dst.copy_(src) of the same bytes run on all ranks at once (ceiling); "
        "/collective: fetch vs all_gather, push vs red_scatter.",
        "push is timed until it returns; its sync (made untimed after every repeat) is the 'sync' row.",
    ]
    print("\n" + header + "\n" + table + "\n" + "\n".join("  " + n for n in notes), flush=True)
    payload = {
        "results": results,
        "config": {"world_size": world, "backend": args.backend, "collective": collective,
                   "sizes": parse_sizes(args.sizes), "warmup": args.warmup, "repeats": args.repeats,
                   "dtype": "float32", "bytes": "full tensor (fetch/all_gather: received per rank; "
                   "push/reduce_scatter: sent per rank; copy/add: destination)",
                   "busbw_factor": "(W-1)/W for all_gather, fetch, red_scatter, push",
                   "timing": "max over ranks per repeat, median over repeats",
                   "host_chunk_bytes": os.environ.get("ODC_HOST_CHUNK_BYTES")},
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
    args = build_parser().parse_args(argv)
    if args.backend is None:
        import torch

        args.backend = "nvshmem" if torch.cuda.is_available() else "host"
    args.sizes = args.sizes or DEFAULT_SIZES[args.backend]
    nproc = args.nproc
    if nproc is None:
        if args.backend == "nvshmem":
            import torch

            nproc = torch.cuda.device_count()
        else:
            nproc = 4
    launch(worker, nproc, args)


if __name__ == "__main__":
    sys.exit(main())
