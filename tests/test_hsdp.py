"""FSDP2 HSDP in ODC mode: ``fully_shard(mesh=2-D (replicate, shard))`` + ``odc_runtime.fsdp.enable(model)``.

4 CPU ranks (gloo) as a 2×2 mesh: ranks {0,1} and {2,3} are the shard groups, {0,2} and {1,3} the replicate
groups. Inside the minibatch ODC fetches and pushes within each shard group; ``end_minibatch`` syncs, all-reduces
the accumulators across the replicate groups and divides like FSDP2 HSDP. The scenarios of tests/_fsdp_harness.py
run unchanged with the model sharded over the 2-D mesh (the harness's ``shard_model`` is swapped for an HSDP one
inside the rank processes).
"""

from __future__ import annotations

import _fsdp_harness as h
import pytest

FP32_TOL = 1e-5
BF16_TOL = 2e-3
TIMEOUT = 240


def shard_model_hsdp(model, mp_policy=None, reshard_after_forward=True, grouped=False):
    """The harness's ``shard_model`` over a 2-D (replicate, shard) mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    mp = mp_policy or MixedPrecisionPolicy()
    kw = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": reshard_after_forward}
    for block in model.blocks:
        fully_shard(block, **kw)
    if grouped:
        tied = model.head.weight is model.emb.weight
        fully_shard([model.emb, model.ln_f, model.head] if tied else [model.ln_f, model.head], **kw)
    fully_shard(model, **kw)
    return model


def scenario_hpz_refused(rank: int, world: int) -> str:
    """reshard_after_forward=<int> (HPZ) is refused with a message that says what to use instead."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import odc_runtime.fsdp as ofsdp
    from odc_runtime.errors import OdcUsageError

    model = h.make_model()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh, reshard_after_forward=2)
    try:
        ofsdp.enable(model)
    except OdcUsageError as e:
        return str(e)
    return "NO ERROR"


def scenario_layout(rank: int, world: int) -> dict:
    """What enable() built: buffers sharded over the shard group, FSDP's own cross-replica all-reduce off."""
    import odc_runtime.fsdp as ofsdp
    from odc_runtime.fsdp import _compat

    model = shard_model_hsdp(h.make_model())
    ofsdp.enable(model)
    units = ofsdp._STATES[model].units
    out = {
        "group_ranks": sorted({tuple(u.st_ag.group_ranks) for u in units}),
        "rows": sorted({u.rows for u in units}),
        "all_reduce_off": all(not _compat.all_reduce_grads(u.group) for u in units),
    }
    ofsdp.disable(model)
    out["all_reduce_restored"] = all(_compat.all_reduce_grads(u.group) for u in units)
    return out


def scenario_sync_on_before_backward(rank: int, world: int) -> str:
    """The head's gradient sync turned back on between its forward and its backward: FSDP would all-reduce across
    replicas after the reduce-scatter, so ODC's reduce-scatter refuses (every rank runs the same micro-batch)."""
    import odc_runtime.fsdp as ofsdp
    from odc_runtime.errors import OdcUsageError

    model = shard_model_hsdp(h.make_model(), grouped=True)
    ofsdp.enable(model)
    tokens = h.make_data(1, [1])[0][0][0]
    try:
        with ofsdp.minibatch(model):
            model.head.set_requires_gradient_sync(False, recurse=False)
            loss = h.token_loss_sum(model, tokens)
            model.head.set_requires_gradient_sync(True, recurse=False)
            loss.backward()
    except OdcUsageError as e:
        return str(e)
    return "NO ERROR"


def _rank_suite(rank: int, world: int, plan: list) -> dict:
    h.shard_model = shard_model_hsdp  # the harness scenarios shard through this name
    h.scenario_hpz_refused = scenario_hpz_refused
    h.scenario_layout = scenario_layout
    h.scenario_sync_on_before_backward = scenario_sync_on_before_backward
    return h.run_suite(rank, world, plan)


PLAN = [
    ("layout", "scenario_layout", ()),
    # unequal counts with a zero, different per replica and per shard group
    ("unequal", "scenario_vs_reference", (3, [2, 0, 3, 1], {})),
    ("zero_clip", "scenario_vs_reference", (3, [0, 2, 1, 0], {"clip": 0.5})),
    ("bf16_ref", "scenario_vs_reference", (2, [1, 2, 0, 1], {"bf16": True})),
    ("fsdp_fp32", "scenario_vs_fsdp", (2, 2, {})),
    ("hpz", "scenario_hpz_refused", ()),
]


@pytest.fixture(scope="module")
def suite4():
    return h.run(_rank_suite, 4, PLAN, timeout=TIMEOUT - 20)


@pytest.mark.timeout(TIMEOUT)
def test_hsdp_buffers_live_in_the_shard_groups(suite4):
    for rank, res in enumerate(h.results(suite4, "layout")):
        mine = (0, 1) if rank < 2 else (2, 3)
        assert res["group_ranks"] == [list(mine)] or res["group_ranks"] == [mine], res
        assert res["rows"] == [2] and res["all_reduce_off"] and res["all_reduce_restored"], res


@pytest.mark.timeout(TIMEOUT)
def test_hsdp_unequal_microbatches_match_single_process_reference(suite4):
    h.check_vs_reference(h.results(suite4, "unequal"), FP32_TOL)


@pytest.mark.timeout(TIMEOUT)
def test_hsdp_zero_microbatch_ranks_and_clipping(suite4):
    results = h.results(suite4, "zero_clip")
    h.check_vs_reference(results, FP32_TOL)
    for res in results:
        assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5)


@pytest.mark.timeout(TIMEOUT)
def test_hsdp_bf16_mixed_precision_matches_bf16_reference(suite4):
    h.check_vs_reference(h.results(suite4, "bf16_ref"), BF16_TOL)


@pytest.mark.timeout(TIMEOUT)
def test_hsdp_equal_counts_match_stock_fsdp2_hsdp(suite4):
    for res in h.results(suite4, "fsdp_fp32"):
        assert max(res["grad_diff"]) < FP32_TOL, res
        assert max(res["diff"]) < FP32_TOL, res


@pytest.mark.timeout(150)
def test_hsdp_chunked_loss_toggling_gradient_sync_matches_stock_fsdp2_hsdp():
    """torchtitan's chunked loss under HSDP: grouped ``[ln_f, head]``, the head's gradient sync off for every chunk
    but the last, counts 1, 3, 2, 2 against stock FSDP2 HSDP with 2 each on the same minibatches.
    ``set_requires_gradient_sync(True)`` also turns FSDP's cross-replica all-reduce back on, which ODC keeps off
    (a collective per backward, which ranks with different counts never all meet): ODC turns it off again before
    the module's next forward. Before, the all-reduce of the last chunk's backward crossed ranks (they hung). Turned
    on between a forward and its backward, it is refused at the reduce-scatter, naming the fix."""
    chunked = ("chunked", "scenario_unequal_vs_fsdp", (2, [1, 3, 2, 2], {"grouped": True, "chunks": 3, "clip": 0.3}))
    late = ("late", "scenario_sync_on_before_backward", ())  # leaves FSDP mid-backward: keep it last
    partial = h.partial_group_forward()  # the chunked loss on a grouped head (torch 2.13 runs it)
    suite = h.run(_rank_suite, 4, [chunked, late] if partial else [late], timeout=130)
    if partial:
        h.check_vs_stock(h.results(suite, "chunked"), FP32_TOL)
    for msg in h.results(suite, "late"):
        assert "cross-replica all-reduce is on for the HSDP module '[ln_f, head]'" in msg, msg
        assert "turn gradient sync back on before the forward" in msg, msg


@pytest.mark.timeout(TIMEOUT)
def test_hpz_is_refused_clearly(suite4):
    for msg in h.results(suite4, "hpz"):
        assert "reshard_after_forward=<int>" in msg and "HPZ" in msg and "reshard_after_forward=True" in msg, msg
