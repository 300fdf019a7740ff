"""The per-call fast path: package names bound once, plan keys as plain tuples, and the host transport's plans
(segment views and lock ranges resolved when the plan is made) adding exactly, under the same locks and the same
fail-stop rule as the generic path."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import plans, testing
from odc_runtime.transport.host.plan import HostPlan


def test_api_names_are_bound_on_first_use() -> None:
    from odc_runtime import api

    assert odc.fetch is api.fetch
    # Later accesses are plain module attributes, not a call of the package's __getattr__ per call.
    assert vars(odc)["fetch"] is api.fetch and vars(odc)["push"] is api.push and vars(odc)["sync"] is api.sync


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_plain_tuple_keys_equal_the_named_keys() -> None:
    t = torch.empty(2, 3)
    key = plans.tensor_key("push", t, ("stream", 7))
    named = plans.PlanKey.for_tensor("push", t, ("stream", 7))
    assert key == named and hash(key) == hash(named) and key[plans.CONTIGUOUS] is True
    assert plans.tensor_key("push", t.t(), None)[plans.CONTIGUOUS] is False  # type: ignore[index]
    assert plans.output_key("fetch", None) == plans.PlanKey.for_output("fetch", None)
    assert plans.tensor_key("push", t.to_sparse(), None) is None
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert plans.tensor_key("push", nested, None) is None
    cache = plans.PlanCache()
    assert cache.get(None) is None and cache.get(key) is None


def _rank_exact_pushes(rank: int, world: int) -> None:
    odc.init("host")
    numel = 50  # owners hold 17/17/16 elements: several 16-byte chunks each, pieces that are slices of the tensor
    st = odc.shard(torch.zeros(5, 10), name="g")
    grads = [
        (torch.full((5, 10), float(rank + 1)), 1.0),
        (torch.full((10, 5), 2.0).t(), 1.0),  # not contiguous: flattened by the API, same key every call
        (torch.full((5, 10), 3.0, dtype=torch.bfloat16), 1.0),
        (torch.full((5, 10), 4.0, requires_grad=True), 0.5),  # must not join an autograd graph
    ]
    rounds = 25
    for _ in range(rounds):
        for g, scale in grads:
            odc.push(st, g, scale=scale)
    built = testing.plans(st)
    # one plan per key: requires_grad is not part of a push's key (the fp32 gradients share a plan)
    assert len(built) == len(grads) - 1 and all(isinstance(p, HostPlan) for p in built), built
    odc.sync()
    per_rank = sum(r + 1 for r in range(world)) + world * (2.0 + 3.0 + 2.0)
    start, stop = st.shard_range
    assert stop - start in (16, 17) and numel == 50
    assert torch.equal(st.grad, torch.full((stop - start,), rounds * per_rank)), st.grad
    assert not st.grad.requires_grad
    # Fetch through a cached plan after the owners changed their shards: every owner's new values.
    st.local.copy_(torch.arange(start, stop, dtype=torch.float32) * 10)
    odc.sync()
    out = torch.empty(5, 10)
    for _ in range(3):
        assert odc.fetch(st, out=out) is out
        assert torch.equal(out, torch.arange(50, dtype=torch.float32).reshape(5, 10) * 10)
        assert torch.equal(odc.fetch(st), out)
    odc.sync()
    odc.finalize()


def test_concurrent_pushes_through_host_plans_are_exact() -> None:
    run_ranks(_rank_exact_pushes, 3, env={"ODC_HOST_CHUNK_BYTES": "16"}, timeout=90)


def _rank_failed_fast_path(rank: int, world: int) -> None:
    odc.init("host")
    st = odc.shard(torch.arange(8, dtype=torch.float32), name="f")
    out, grad = torch.empty(8), torch.ones(8)
    odc.fetch(st, out=out)
    odc.push(st, grad)
    odc.sync()
    before = st.grad.clone()
    testing.transport().fail(odc.OdcPeerLostError("rank 1 was lost (injected)"))
    with pytest.raises(odc.OdcPeerLostError, match="unusable"):
        odc.push(st, grad)  # a cached key: the plan must not add into the segment
    with pytest.raises(odc.OdcPeerLostError, match="unusable"):
        odc.fetch(st, out=out)
    assert torch.equal(st.grad, before)
    odc.finalize()


def test_a_failed_transport_refuses_cached_plans() -> None:
    run_ranks(_rank_failed_fast_path, 1, timeout=60)
