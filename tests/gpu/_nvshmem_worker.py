"""Worker for the GPU tests: run under torchrun, one process per GPU, through the public API.

    torchrun --nproc-per-node N tests/gpu/_nvshmem_worker.py RESULT.json [SCENARIO ...]

Runs every scenario (NVSHMEM can be initialised once per process, so they share one ``odc.init``) and rank 0
writes ``{scenario: "ok" | error text}`` to RESULT.json, merged over ranks.
"""

from __future__ import annotations

import sys

import _worker
import torch
import torch.distributed as dist

import odc_runtime as odc
from odc_runtime.errors import OdcMemoryError

SIZES = (1, 7, 1000, 4099, 3 * 65536 + 5)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def full_tensor(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).to(dtype).cuda()


def expect_range(st, numel: int):
    world, rank = dist.get_world_size(), dist.get_rank()
    s = -(-numel // world)
    start = min(rank * s, numel)
    assert st.shard_range == (start, min(start + s, numel)), (st.shard_range, numel, world)
    return st.shard_range


def close(a: torch.Tensor, b: torch.Tensor, what: str, rtol=1e-5, atol=1e-5) -> None:
    torch.cuda.synchronize()
    if not torch.allclose(a.float().cpu(), b.float().cpu(), rtol=rtol, atol=atol):
        err = (a.float().cpu() - b.float().cpu()).abs().max().item()
        raise AssertionError(f"{what}: max abs error {err}")


def scenario_fetch():
    for dtype in DTYPES:
        for n in SIZES:
            t = full_tensor(n, dtype, seed=n)
            st = odc.shard(t.view(-1) if n % 2 else t.view(-1, 1), name=f"fetch-{dtype}-{n}")
            lo, hi = expect_range(st, n)
            assert torch.equal(st.local.cpu(), t[lo:hi].cpu())
            got = odc.fetch(st)
            torch.cuda.synchronize()
            assert got.shape == st.shape and torch.equal(got.reshape(-1).cpu(), t.cpu()), f"fetch {dtype} {n}"
            out = torch.empty_like(got)
            assert odc.fetch(st, out=out) is out
            torch.cuda.synchronize()
            assert torch.equal(out.reshape(-1).cpu(), t.cpu())
            st.free()


def scenario_push():
    world = dist.get_world_size()
    for dtype in DTYPES:
        for n in SIZES:
            base = full_tensor(n, dtype, seed=7 + n)
            st = odc.shard(torch.zeros(n, dtype=dtype, device="cuda"), name=f"push-{dtype}-{n}")
            lo, hi = expect_range(st, n)
            rank = dist.get_rank()
            odc.push(st, base * (rank + 1), scale=0.5)
            odc.sync()
            # bf16/fp16 inputs: (base * (r+1)) is rounded in the input dtype before the push, as the user sent it
            expect = sum((base[lo:hi] * (r + 1)).float() * 0.5 for r in range(world))
            close(st.grad, expect, f"push {dtype} {n}")
            st.free()


def scenario_uneven_and_sync():
    world, rank = dist.get_world_size(), dist.get_rank()
    n = 5 * world + 3
    t = full_tensor(n, torch.float32, seed=3)
    st = odc.shard(t, name="uneven")
    expect_range(st, n)
    st.local.add_(1.0 + rank)  # "optimizer step" on the owner
    odc.sync()
    got = odc.fetch(st)
    expect = t.clone()
    for r in range(world):
        s = -(-n // world)
        a, b = min(r * s, n), min((r + 1) * s, n)
        expect[a:b] += 1.0 + r
    close(got, expect, "fetch after sync sees the owners' writes", rtol=0, atol=0)
    st.free()


def scenario_async():
    world, rank = dist.get_world_size(), dist.get_rank()
    n = 4099
    t = full_tensor(n, torch.bfloat16, seed=11)
    st = odc.shard(t, name="async")
    h = odc.fetch(st, async_op=True)
    got = h.wait()
    close(got, t, "async fetch", rtol=0, atol=0)
    g = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    handles = [odc.push(st, g, scale=1.0, async_op=True) for _ in range(3)]
    for hd in handles:
        hd.wait()
    odc.sync()
    close(st.grad, torch.full_like(st.grad, 3.0 * world), "async push")
    st.zero_grad()
    odc.sync()
    odc.push(st, g, scale=2.0)
    odc.sync()
    close(st.grad, torch.full_like(st.grad, 2.0 * world), "push after zero_grad")
    del rank
    st.free()


def scenario_many_pushers():
    """Rank r pushes 2 + r micro-batches into the same shards (uneven counts, all concurrently)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = 1 << 20
    st = odc.shard(torch.zeros(n, device="cuda"), name="many")
    lo, hi = st.shard_range
    total = torch.zeros(n, dtype=torch.float32)
    for r in range(world):
        for mb in range(2 + r):
            total += full_tensor(n, torch.float32, seed=1000 * r + mb).cpu() * 0.25
    for mb in range(2 + rank):
        odc.push(st, full_tensor(n, torch.float32, seed=1000 * rank + mb), scale=0.25)
    odc.sync()
    close(st.grad, total[lo:hi], "many concurrent pushers", rtol=1e-4, atol=1e-4)
    st.free()


def scenario_heap_exhausted():
    """The test heap is 2 GiB per rank; parameter (1.2 GB) + accumulator (1.2 GB) shards cannot both fit."""
    n = 300_000_000 * dist.get_world_size()
    try:
        odc.shard(torch.empty(n, dtype=torch.float32, device="cuda"), name="huge")
    except OdcMemoryError as e:
        assert "NVSHMEM_SYMMETRIC_SIZE" in str(e), e
    else:
        raise AssertionError("no OdcMemoryError")
    torch.cuda.empty_cache()


def scenario_plan_cache():
    """The fast path: repeated calls reuse a plan; a new dtype, out tensor or stream gives a new, correct one;
    values that can change between calls (scale) are still checked."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = 3 * 65536 + 17
    t = full_tensor(n, torch.float32, seed=5)
    st = odc.shard(t, name="plans")
    out = torch.empty_like(t)
    for _ in range(3):
        assert odc.fetch(st, out=out) is out
    close(out, t, "fetch through a cached plan", rtol=0, atol=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = odc.fetch(st)  # new stream: new plan, ordered on `side`
        for dtype in DTYPES:
            for _ in range(2):
                odc.push(st, torch.ones(n, dtype=dtype, device="cuda"), scale=0.5)
    torch.cuda.current_stream().wait_stream(side)
    close(got, t, "fetch on another stream", rtol=0, atol=0)
    try:
        odc.push(st, torch.ones(n, device="cuda"), scale=float("nan"))
    except odc.OdcUsageError:
        pass
    else:
        raise AssertionError("nan scale accepted on the fast path")
    odc.sync()
    close(st.grad, torch.full_like(st.grad, 3.0 * world), "pushes through cached plans on a side stream")
    del rank
    st.free()


def scenario_free_keeps_views():
    """free() never lets a later allocation alias a view that is still alive."""
    n = 4096
    st = odc.shard(torch.full((n,), 7.0, device="cuda"), name="old")
    view = st.local
    ptr = view.data_ptr()
    st.free()
    del st
    other = odc.shard(torch.zeros(n, device="cuda"), name="new")
    assert other.local.data_ptr() != ptr and other.grad.data_ptr() != ptr, "a live view was aliased"
    other.local.fill_(1.0)
    torch.cuda.synchronize()
    assert torch.all(view == 7.0), "the freed buffer's live view was overwritten"
    other.free()


def scenario_int64_push():
    """Deterministic mode's push (issue 36): int64 sources added into an int64 accumulator by the kernels, on the
    peer path (64-bit system atomics) or, under ODC_NVSHMEM_PUSH=locked, the locked cells. Every rank pushes 3
    micro-batches into every owner (at offsets that cut cells unevenly), in two runs whose orders differ (owners and
    micro-batches reversed, ranks staggered the other way, sync vs async); both runs must equal the exact CPU
    int64 sum bit for bit (values past 2**53, both signs: any float path would round them). A float source, or a
    scale other than 1, is refused before anything is issued and leaves the transport healthy."""
    import time

    from odc_runtime import testing
    from odc_runtime.transport.base import PushRequest

    t = testing.transport()
    world, rank = dist.get_world_size(), dist.get_rank()
    n = 3 * 65536 + 5

    def value(r: int, m: int) -> torch.Tensor:
        v = torch.arange(n, dtype=torch.int64) * 7919 + (1 << 40) + (1 << 20) * r + m
        return v * (-1 if (r + m) % 2 else 1) + (1 << 55) * (m == 0)

    def offset(r: int) -> int:
        return r % 3

    expect = torch.zeros(n, dtype=torch.int64)
    for r in range(world):
        for m in range(3):
            expect[offset(r) :] += value(r, m)[: n - offset(r)]
    fixed = t.alloc(n, torch.int64, tag="int64_push")
    runs = []
    for order in ("up", "down"):
        owners = list(range(world)) if order == "up" else list(reversed(range(world)))
        mbs = [0, 1, 2] if order == "up" else [2, 1, 0]
        srcs = [value(rank, m)[: n - offset(rank)].cuda() for m in mbs]
        dist.barrier()
        time.sleep(0.002 * (rank if order == "up" else world - 1 - rank))
        handles = [t.push(fixed, [PushRequest(p, src, offset(rank)) for p in owners], 1.0, async_op=order == "down")
                   for src in srcs]
        for h in handles:
            if h is not None:
                h.wait()
        t.barrier("int64_push")
        got = fixed.local.cpu()
        wrong = int((got != expect).sum())
        assert wrong == 0, f"{order}: {wrong} of {n} elements differ from the exact int64 sum"
        runs.append(got)
        fixed.local.zero_()
        t.barrier("int64_push zeroed")
    assert torch.equal(runs[0], runs[1])
    q = value(rank, 0).cuda()
    for src, scale in ((q.float(), 1.0), (q, 0.5)):
        try:
            t.push(fixed, [PushRequest((rank + 1) % world, src)], scale)
        except odc.OdcUsageError:
            pass
        else:
            raise AssertionError(f"an int64 accumulator accepted a {src.dtype} push with scale {scale}")
    t.barrier("int64_push refusals")
    assert t.failure is None and not bool(fixed.local.any()), "a refused push changed something"
    t.free(fixed)


SCENARIOS = {name[len("scenario_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("scenario_")}


def main() -> None:
    out_path, names = sys.argv[1], sys.argv[2:] or list(SCENARIOS)
    _worker.start(heap_size="2G")
    results = {}
    for name in names:
        try:
            SCENARIOS[name]()
            results[name] = "ok"
        except Exception:
            results[name] = _worker.failure()
        dist.barrier()
    _worker.finish(out_path, results,
                   lambda gathered: {n: next((r[n] for r in gathered if r[n] != "ok"), "ok") for n in names})


if __name__ == "__main__":
    main()
