"""The per-call fast path of fetch/push (odc_runtime.api): a plan is validated and built once per
(ShardedTensor, op, tensor type/shape/dtype/device/layout, stream) and reused; it is rebuilt when any of these
changes, never used after free/finalize, and never skips the checks of values that can change between calls."""

from __future__ import annotations

import math

import pytest
import torch
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import plans, testing


def _counting(transport) -> list[str]:
    """Record every plan the transport builds (kind per call)."""
    built: list[str] = []
    original = transport.plan

    def plan(buf, kind, pieces):
        built.append(kind)
        return original(buf, kind, pieces)

    transport.plan = plan
    return built


def _rank_plan_cache(rank: int, world: int) -> None:
    odc.init("host")
    transport = testing.transport()
    built = _counting(transport)
    full = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    st = odc.shard(full, name="w")

    # Reused: the second identical call builds nothing, and both give the right values.
    assert torch.equal(odc.fetch(st), full)
    assert torch.equal(odc.fetch(st), full)
    out = torch.empty(2, 5)
    assert odc.fetch(st, out=out) is out and torch.equal(out, full)
    assert odc.fetch(st, out=out) is out
    assert built == ["fetch", "fetch"], built  # out=None and out=<fp32 2x5> are two keys
    odc.push(st, torch.ones(2, 5))
    odc.push(st, torch.ones(2, 5), scale=2.0)
    odc.push(st, torch.ones(2, 5, requires_grad=True))  # a push takes either: same key, same plan
    assert built.count("push") == 1, built
    odc.sync()
    assert torch.equal(st.grad, torch.full_like(st.grad, 4.0 * world)) and not st.grad.requires_grad
    odc.sync()  # every rank has checked before anyone pushes again

    # Invalidated on dtype and shape changes: a new key is validated (and rejected where invalid).
    odc.push(st, torch.ones(2, 5, dtype=torch.bfloat16))
    assert built.count("push") == 2, built
    with pytest.raises(odc.OdcUsageError, match="shape"):
        odc.push(st, torch.ones(10))
    with pytest.raises(odc.OdcUsageError, match="dtype"):
        odc.fetch(st, out=torch.empty(2, 5, dtype=torch.float16))
    with pytest.raises(odc.OdcUsageError, match="contiguous"):
        odc.fetch(st, out=torch.empty(5, 2).t())
    with pytest.raises(odc.OdcUsageError, match="require grad"):
        odc.fetch(st, out=torch.empty(2, 5, requires_grad=True))  # same shape/dtype as the cached out key
    with pytest.raises(odc.OdcUsageError, match=r"torch\.Tensor"):
        odc.push(st, [[1.0] * 5] * 2)  # type: ignore[arg-type]
    assert built.count("push") == 2 and built.count("fetch") == 2, built  # rejected keys were not cached

    # Values that can change between calls are checked on the fast path too, before any remote effect.
    for bad in (math.nan, math.inf, "2", True):
        with pytest.raises(odc.OdcUsageError, match="scale"):
            odc.push(st, torch.ones(2, 5), scale=bad)  # type: ignore[arg-type]
    odc.push(st, torch.ones(2, 5), scale=1)  # an int is a valid scale (converted once)
    odc.sync()
    assert torch.equal(st.grad, torch.full_like(st.grad, 6.0 * world)), st.grad
    odc.sync()

    # A new stream key (on GPU: another current stream) builds a new plan; the old one stays valid for its key.
    current = ["s1"]
    transport.stream_key = lambda: ("stream", current[0])
    before = len(built)
    odc.fetch(st)
    odc.fetch(st)
    assert len(built) == before + 1, built
    current[0] = "s2"
    odc.fetch(st)
    odc.fetch(st)
    assert len(built) == before + 2, built
    current[0] = "s1"
    odc.fetch(st)
    assert len(built) == before + 2, built
    del transport.stream_key  # back to the class's method

    # The cache per ShardedTensor is bounded.
    for i in range(2 * plans.PLAN_CACHE_SIZE):
        transport.stream_key = lambda i=i: ("bounded", i)
        odc.fetch(st)
    del transport.stream_key
    assert len(testing.plans(st)) <= plans.PLAN_CACHE_SIZE

    # Never stale after free: the freed tensor raises on the fast path's key, and a new tensor reusing the
    # same heap offset gets its own plan and its own values.
    odc.fetch(st)  # a cached key
    st.free()
    with pytest.raises(odc.OdcUsageError, match="freed"):
        odc.fetch(st)
    with pytest.raises(odc.OdcUsageError, match="freed"):
        odc.push(st, torch.ones(2, 5))
    other = odc.shard(-full, name="w2")
    assert torch.equal(odc.fetch(other), -full)

    # Never stale after finalize: a cached key of a tensor of the old runtime raises, even after a new init.
    odc.fetch(other)
    odc.finalize()
    with pytest.raises(odc.OdcNotInitializedError):
        odc.fetch(other)
    odc.init("host")
    with pytest.raises(odc.OdcNotInitializedError, match="finalized"):
        odc.fetch(other)
    with pytest.raises(odc.OdcNotInitializedError, match="finalized"):
        odc.push(other, torch.ones(2, 5))
    fresh = odc.shard(full * 3, name="w3")
    assert torch.equal(odc.fetch(fresh), full * 3)


def test_plan_cache_reuse_invalidation_and_lifetime() -> None:
    run_ranks(_rank_plan_cache, 2, timeout=90)


def _rank_async_plan(rank: int, world: int) -> None:
    odc.init("host")
    st = odc.shard(torch.arange(7, dtype=torch.float32), name="a")
    handles = [odc.push(st, torch.ones(7), async_op=True) for _ in range(3)]
    fetched = odc.fetch(st, async_op=True)
    for h in handles:
        assert h.wait() is None
    assert torch.equal(fetched.wait(), torch.arange(7, dtype=torch.float32))
    odc.sync()
    assert torch.equal(st.grad, torch.full_like(st.grad, 3.0 * world))
    odc.sync()  # every rank has checked before anyone pushes again


def test_async_ops_through_cached_plans() -> None:
    run_ranks(_rank_async_plan, 2, timeout=60)
