"""The transport contract, run unchanged against every registered transport that is available here.

What the core API relies on (``odc_runtime.transport.base``): collective ``alloc`` of zeroed symmetric memory and
``free`` with heap accounting; ``fetch`` of a peer's region; ``push`` (with scale, from lower-precision
sources, from every rank at once) that loses no update; ``barrier`` that makes earlier writes and pushes
visible; the declared state (``failure``, ``device_type``, ``capabilities``) and ``exchange``;
``OdcMemoryError`` on every rank when the heap is full; an idempotent ``finalize``. Then the public API
(``shard``/``fetch``/``push``/``sync``) on top of it. A new transport registered in
``odc_runtime.transport`` is tested here without editing this file; one that is not available on this machine
(``nvshmem`` without GPUs) is skipped with the reason.

Only ``fetch(buf, requests)`` and ``push(buf, requests, scale)`` are called positionally, so the suite holds
before and after their ``async_op`` keyword.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import testing
from odc_runtime import transport as registry
from odc_runtime.transport.base import Capabilities, FetchRequest, PushRequest, PutRequest

WORLD = 3  # odd, so uneven shards appear; 3 ranks fit one machine's CPUs and any host with 3+ GPUs


def _world_for(spec: registry.TransportSpec) -> int:
    if spec.device_type == "cuda":
        return max(1, min(WORLD, torch.cuda.device_count()))
    return WORLD


def _setup(name: str, rank: int) -> torch.device:
    spec = registry.get(name)
    if spec.device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(spec.device_type)


def test_device_type_before_init_says_so() -> None:
    with pytest.raises(odc.OdcNotInitializedError, match=r"device_type"):
        odc.device_type()


def _rank_contract(rank: int, world: int, name: str) -> dict[str, object]:
    device = _setup(name, rank)
    odc.init(name, heap_size="8M")
    assert odc.backend() == name and odc.world_size() == world and odc.rank() == rank
    t = testing.transport()
    assert t.device.type == device.type == t.device_type == registry.get(name).device_type == odc.device_type()
    # the declared contract: failure state, capabilities, exchange
    assert t.failure is None
    assert isinstance(t.capabilities, Capabilities)
    assert t.exchange("contract.exchange", bytes([rank])) == [bytes([r]) for r in range(world)]
    capacity, used0 = t.heap_capacity(), t.heap_used()
    assert capacity >= 8 << 20 or name != "host"

    # alloc: zeroed, right size and dtype, accounted; free gives it back
    n = 1000
    buf = t.alloc(n, torch.float32, tag="contract.f32")
    assert buf.local.numel() == n and buf.local.dtype == torch.float32 and buf.local.device.type == device.type
    assert not buf.local.any(), "alloc must zero the region"
    assert t.heap_used() >= used0 + n * 4
    lp = t.alloc(n, torch.bfloat16, tag="contract.bf16")

    # barrier publishes local writes: every rank gets every peer's region
    buf.local.copy_(torch.arange(n, dtype=torch.float32, device=device) + 1000 * rank)
    t.barrier("contract.published")
    for peer in range(world):
        dst = torch.empty(n, dtype=torch.float32, device=device)
        t.fetch(buf, [FetchRequest(peer, dst)])
        t.quiet()
        assert torch.equal(dst, torch.arange(n, dtype=torch.float32, device=device) + 1000 * peer), peer
    half = torch.empty(n // 2, dtype=torch.float32, device=device)
    t.fetch(buf, [FetchRequest((rank + 1) % world, half)])  # a shorter dst reads the region's first dst.numel()
    t.quiet()
    assert torch.equal(half, torch.arange(n // 2, dtype=torch.float32, device=device) + 1000 * ((rank + 1) % world))
    t.barrier("contract.read")

    # accumulate: from every rank into every peer, with a scale, from fp32 and bf16 sources; exact on integers
    buf.local.zero_()
    t.barrier("contract.zeroed")
    rounds = 5
    for r in range(rounds):
        src = torch.full((n,), float(rank + 1), device=device)
        reqs = [PushRequest(peer, src) for peer in range(world)]
        t.push(buf, reqs, 2.0)
        t.push(buf, [PushRequest((rank + r) % world, src.to(torch.bfloat16)[: n // 2])], 1.0)
    t.barrier("contract.accumulated")
    expected = torch.full((n,), float(2 * rounds * sum(range(1, world + 1))), device=device)
    extra = torch.zeros(n, device=device)
    for r in range(rounds):
        for src_rank in range(world):
            if (src_rank + r) % world == rank:
                extra[: n // 2] += src_rank + 1
    assert torch.equal(buf.local, expected + extra), "lost or misplaced accumulate"

    # element offsets into the peer's region: get a window, accumulate into a window
    k = 10
    window = torch.empty(k, dtype=torch.float32, device=device)
    buf.local.zero_()
    t.barrier("contract.zeroed_for_offsets")
    t.push(buf, [PushRequest(peer, torch.full((k,), float(rank + 1), device=device), offset=k * rank)
                       for peer in range(world)], 1.0)
    t.barrier("contract.offset_accumulated")
    want = torch.zeros(n, device=device)
    for src_rank in range(world):
        want[k * src_rank : k * (src_rank + 1)] = src_rank + 1
    assert torch.equal(buf.local, want), "accumulate with an offset landed in the wrong place"
    peer = (rank + 1) % world
    t.fetch(buf, [FetchRequest(peer, window, offset=k * peer)])
    t.quiet()
    assert torch.equal(window, torch.full((k,), float(peer + 1), device=device)), "get with an offset"
    t.barrier("contract.offsets_done")

    # put-with-signal: every rank writes its own row of every peer's region and counts it in word `rank`;
    # signal words only grow, so the second round waits for 2
    if t.capabilities.signals:
        signal = t.alloc(world, torch.int64, tag="contract.signal")
        for rnd in (1, 2):
            row = torch.full((k,), float(100 * rnd + rank), device=device)
            t.put_signal(buf, [PutRequest(peer, row, k * rank, rank) for peer in range(world)], signal)
            for src_rank in range(world):
                t.wait_signal(signal, src_rank, rnd, "contract.wait_signal", [src_rank])
                assert torch.equal(
                    buf.local[k * src_rank : k * (src_rank + 1)], torch.full((k,), float(100 * rnd + src_rank),
                                                                             device=device)
                ), (rnd, src_rank)
            t.barrier(f"contract.signal_round{rnd}")  # nobody overwrites a row before its owner read it
        assert signal.local.tolist() == [2] * world
        t.free(signal)
        buf.local.zero_()
        t.barrier("contract.signals_done")

    # deterministic mode's push: int64 sources added exactly into an int64 buffer (values of more than 24 and 53
    # bits, both signs: no float path may carry them), from every rank into every peer, sync and async
    if t.capabilities.deterministic:
        fixed = t.alloc(n, torch.int64, tag="contract.fixed")

        def value(src_rank: int, r: int) -> torch.Tensor:
            base = torch.arange(n, dtype=torch.int64, device=device) * 7 + (1 << 40) + (1 << 20) * src_rank + r
            return base * (-1 if (src_rank + r) % 2 else 1) + (1 << 55) * (r == 0)

        handles = [t.push(fixed, [PushRequest(peer, value(rank, r)) for peer in range(world)], 1.0,
                          async_op=r % 2 == 1) for r in range(3)]
        for h in handles:
            if h is not None:
                h.wait()
        t.barrier("contract.fixed_accumulated")
        assert torch.equal(fixed.local, sum(value(s, r) for s in range(world) for r in range(3))), "inexact int64"
        t.free(fixed)

    # heap exhaustion: OdcMemoryError on every rank, nothing allocated
    used = t.heap_used()
    with pytest.raises(odc.OdcMemoryError):
        t.alloc(capacity, torch.float32, tag="contract.too_big")
    assert t.heap_used() == used
    t.free(lp)
    t.free(buf)
    assert t.heap_used() == used0

    # the public API over it: uneven shards, differing push counts, async handles
    shape = (7, 11)
    full = (torch.arange(77, dtype=torch.float32) % 13).reshape(shape).to(device)
    st = odc.shard(full, name="contract.st")
    assert torch.equal(odc.fetch(st), full)
    for _ in range(rank):  # rank 0 never pushes
        odc.push(st, torch.ones(shape, device=device), scale=0.5)
    handle = odc.push(st, torch.ones(shape, device=device, dtype=torch.bfloat16), async_op=True)
    handle.wait()
    odc.sync()
    start, stop = st.shard_range
    expected_grad = 0.5 * sum(range(world)) + world
    assert torch.equal(st.grad, torch.full((stop - start,), expected_grad, device=device))
    st.local.add_(1)
    st.zero_grad()
    odc.sync()
    out = torch.empty(shape, device=device)
    assert odc.fetch(st, out, async_op=True).wait() is out and torch.equal(out, full + 1)
    st.free()
    odc.sync()

    odc.finalize()
    odc.finalize()  # idempotent
    t.finalize()  # the transport's finalize is idempotent too
    return {"rank": rank}


@pytest.mark.parametrize("name", registry.names())
def test_transport_contract(name: str) -> None:
    spec = registry.get(name)
    if not spec.is_available():
        pytest.skip(f"transport {name!r} is not available on this machine")
    world = _world_for(spec)
    results = run_ranks(_rank_contract, world, name, timeout=180)
    assert results == [{"rank": r} for r in range(world)]


def test_registry_lists_every_transport_and_refuses_unknown_names() -> None:
    assert set(registry.names()) >= {"host", "nvshmem"}
    assert registry.names()[:2] == ("nvshmem", "symm")  # preferred when available (docs/gpu.md: the faster one)
    assert "host" in registry.available()
    assert registry.auto_select().name in registry.available()
    with pytest.raises(odc.OdcUsageError, match=r"unknown ODC backend 'tcp'; choose one of .*host"):
        registry.get("tcp")
    spec = registry.get("host")
    assert spec.device_type == "cpu"


def test_registry_imports_transports_lazily() -> None:
    import subprocess
    import sys

    code = (
        "import sys, odc_runtime.transport as t\n"
        "assert 'odc_runtime.transport.nvshmem' not in sys.modules\n"
        "assert 'odc_runtime.transport.host' not in sys.modules\n"
        "assert t.names()\n"
        "assert 'odc_runtime.transport.nvshmem' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_new_transport_is_one_registry_line() -> None:
    # A transport module registered under a new name is selectable (and would be tested above).
    spec = registry.TransportSpec("host-alias", "odc_runtime.transport.host", device_type="cpu", priority=-1)
    registry.register(spec)
    try:
        assert "host-alias" in registry.names() and registry.get("host-alias").is_available()
        order = registry.names()
        assert order.index("host") < order.index("host-alias") < order.index("symm-cpu")  # by priority
    finally:
        registry._REGISTRY.pop("host-alias")


def _rank_heap_used(rank: int, world: int) -> list[int]:
    """``heap_used()``'s promise (``Transport.heap_used``) where a transport keeps freed ranges from reuse."""
    odc.init("nvshmem", timeout=20)
    t = testing.transport()
    used0 = t.heap_used()
    a = t.alloc(1000, torch.float32, tag="heap.a")
    view = a.local[:10]  # a live view: nvshmem quarantines the range at free
    b = t.alloc(3000, torch.float32, tag="heap.b")
    assert t.heap_used() >= used0 + 4000 * 4
    t.free(a)
    after_free = t.heap_used()
    with pytest.raises(odc.OdcMemoryError):
        t.alloc(t.heap_capacity(), torch.float32, tag="heap.too_big")  # reclaims what it can first, then refuses
    after_refusal = t.heap_used()
    del view
    t.free(b)
    return [after_free - used0, after_refusal - used0, t.heap_used() - used0]


@pytest.mark.parametrize("path", ["atomic", "locked"])
def test_heap_used_counts_live_buffers_on_the_nvshmem_model(path: str) -> None:
    """On the nvshmem transport (its real heap over the CPU model of its extension, tests/_nvshmem_shm.py): a free
    lowers ``heap_used()`` at once even while a view keeps the range quarantined, and a refused allocation changes
    nothing (the first GPU run saw it drop there: the allocation reclaims the quarantine before refusing)."""
    import _nvshmem_shm

    from odc_runtime.transport.heap import ALIGNMENT

    b_bytes = -(-3000 * 4 // ALIGNMENT) * ALIGNMENT  # what the allocator reserves
    assert run_ranks(_nvshmem_shm.run, 2, path, _rank_heap_used, timeout=120) == [[b_bytes, b_bytes, 0]] * 2
