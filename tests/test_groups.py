"""Process groups in the core API: shard/fetch/push/sync over subgroups of 4 ranks (host transport, gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import testing
from odc_runtime.errors import OdcMismatchError, OdcTimeoutError, OdcUsageError

SHAPE = (7, 5)  # 35 elements: not a multiple of any group size used here
NUMEL = 35


def _full(tag: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers: exact in every dtype, and different per group (tag) so a read from the wrong group shows.
    return ((torch.arange(NUMEL) * (tag + 3)) % 29 - 14).to(dtype).reshape(SHAPE)


def _grad(src: int, step: int, i: int) -> torch.Tensor:
    return ((torch.arange(NUMEL) * (src + 2) + 3 * step + i) % 11 - 5).to(torch.float32).reshape(SHAPE)


def _counts(step: int) -> list[int]:
    return [[3, 0, 1, 2], [1, 2, 0, 0], [0, 4, 2, 1]][step % 3]  # unequal, with zeros, per global rank


def _groups(world: int, sizes: list[int]) -> tuple[list[dist.ProcessGroup], int]:
    """Every rank creates every group (new_group is collective); returns them and this rank's index."""
    groups, start, mine = [], 0, -1
    for k, n in enumerate(sizes):
        ranks = list(range(start, start + n))
        groups.append(dist.new_group(ranks))
        if dist.get_rank() in ranks:
            mine = k
        start += n
    assert start == world
    return groups, mine


def _rank_groups(rank: int, world: int, sizes: list[int], steps: dict[int, int]) -> None:
    odc.init("host")
    groups, k = _groups(world, sizes)
    group = groups[k]
    members = list(range(sum(sizes[:k]), sum(sizes[: k + 1])))
    scale = 0.5
    for dtype in (torch.float32, torch.bfloat16):
        st = odc.shard(_full(k, dtype), group=group, name=f"g_{dtype}")
        world_st = odc.shard(_full(9, dtype), name=f"w_{dtype}")  # a world tensor alongside
        assert st.group is group and list(st.group_ranks) == members
        assert st.world_size == len(members) and st.rank == members.index(rank)
        size = -(-NUMEL // len(members))
        start = min(st.rank * size, NUMEL)
        assert st.shard_range == (start, min(start + size, NUMEL))
        assert torch.equal(odc.fetch(st), _full(k, dtype))
        assert torch.equal(odc.fetch(world_st), _full(9, dtype))
        # Each group runs its own number of minibatches with group fences, at its own pace.
        for step in range(steps[k]):
            for i in range(_counts(step)[rank]):
                odc.push(st, _grad(rank, step, i).to(dtype), scale=scale)
                odc.push(world_st, _grad(rank, step, i).to(dtype))
            odc.sync(group=group)
            # Reference: plain sums over this group's members only (every value is exact in fp32).
            expected = torch.zeros(NUMEL)
            for src in members:
                for i in range(_counts(step)[src]):
                    expected += _grad(src, step, i).to(dtype).float().reshape(-1) * scale
            lo, hi = st.shard_range
            assert torch.equal(st.grad, expected[lo:hi]), (dtype, step, st.grad, expected[lo:hi])
            st.local.add_(1)
            st.zero_grad()
            odc.sync(group=group)
            assert torch.equal(odc.fetch(st), _full(k, dtype) + step + 1)
        # World-wide: every rank's pushes into the world tensor, over every group's steps.
        odc.sync()
        expected = torch.zeros(NUMEL)
        for src in range(world):
            src_group = next(j for j in range(len(sizes)) if sum(sizes[:j]) <= src < sum(sizes[: j + 1]))
            for step in range(steps[src_group]):
                for i in range(_counts(step)[src]):
                    expected += _grad(src, step, i).to(dtype).float().reshape(-1)
        lo, hi = world_st.shard_range
        assert torch.equal(world_st.grad, expected[lo:hi])
        # Async push within the group, fenced by the group.
        odc.push(st, torch.ones(SHAPE, dtype=dtype), async_op=True).wait()
        odc.sync(group=group)
        lo, hi = st.shard_range
        assert torch.equal(st.grad, torch.full((hi - lo,), float(len(members))))
        st.free()
        world_st.free()
    odc.sync()


@pytest.mark.parametrize(
    ("sizes", "steps"),
    [([2, 2], {0: 2, 1: 3}), ([1, 3], {0: 3, 1: 1})],
    ids=["2x2", "1+3"],
)
def test_groups_shard_fetch_push_sync_exact(sizes: list[int], steps: dict[int, int]) -> None:
    run_ranks(_rank_groups, 4, sizes, steps, timeout=120)


def _rank_plans_per_group(rank: int, world: int) -> None:
    """The plan cache lives on each tensor, whose group is fixed: a world tensor and a group tensor of the same
    shape never share a plan, and each keeps addressing its own owners."""
    odc.init("host")
    groups, k = _groups(world, [2, 2])
    a = odc.shard(_full(k, torch.float32), group=groups[k], name="a")
    b = odc.shard(_full(7, torch.float32), name="b")
    for _ in range(3):  # later calls take the cached plans
        assert torch.equal(odc.fetch(a), _full(k, torch.float32))
        assert torch.equal(odc.fetch(b), _full(7, torch.float32))
    peers_a = {p.peer for plan in testing.plans(a) for p in plan.pieces}
    peers_b = {p.peer for plan in testing.plans(b) for p in plan.pieces}
    assert peers_a == set(range(2 * k, 2 * k + 2)) and peers_b == set(range(world))
    odc.sync()


def test_plan_cache_is_per_group() -> None:
    run_ranks(_rank_plans_per_group, 4, timeout=60)


def _rank_misuse(rank: int, world: int) -> None:
    odc.init("host")
    groups, k = _groups(world, [2, 2])
    a, b = groups
    everyone = dist.new_group(list(range(world)))
    odd = dist.new_group([1, 3])

    # Groups that do not partition the ranks: ranks 0,1 pass {0,1}, rank 2 passes {2,3}, rank 3 passes all ranks.
    with pytest.raises(OdcMismatchError, match="partition"):
        odc.shard(torch.zeros(SHAPE), group=[a, a, b, everyone][rank], name="bad_partition")

    # A rank that is not in the group it passes: rank 3 passes {0,1} (a placeholder for non-members).
    if rank == 3:
        with pytest.raises(OdcUsageError, match="not a member"):
            odc.shard(torch.zeros(SHAPE), group=a, name="not_member")
    else:
        with pytest.raises(OdcMismatchError, match="rank 3 rejected"):
            odc.shard(torch.zeros(SHAPE), group=groups[k], name="not_member")

    # Not a process group at all.
    with pytest.raises(OdcUsageError, match="ProcessGroup"):
        odc.shard(torch.zeros(SHAPE), group=[0, 1], name="list_group")  # type: ignore[arg-type]

    # Nothing was created above: the next well-formed call works everywhere.
    st = odc.shard(_full(k, torch.float32), group=groups[k], name="good")
    assert torch.equal(odc.fetch(st), _full(k, torch.float32))

    # sync over a group no tensor was sharded over, or one this rank is not in: local errors, nothing waits.
    if rank in (1, 3):
        with pytest.raises(OdcUsageError, match="no tensor was sharded"):
            odc.sync(group=odd)
    else:
        with pytest.raises(OdcUsageError, match="not a member"):
            odc.sync(group=odd)
    with pytest.raises(OdcUsageError, match="not a member"):
        odc.sync(group=groups[1 - k])
    odc.sync(group=groups[k])  # still aligned
    odc.sync()
    st.free()


def test_group_misuse_raises_typed_errors_on_all_ranks() -> None:
    run_ranks(_rank_misuse, 4, timeout=90)


def _rank_crossed(rank: int, world: int) -> None:
    """Rank 0 fences its group {0,1} while everybody else is in a world-wide sync: ranks 0 and 1 wait for each
    other in different collectives. Both see it and raise OdcMismatchError; ranks 2 and 3, who wait for rank 0 in
    the world sync, raise naming it (it failed, or the cycle of waits through it: whichever they read first)."""
    odc.init("host")
    groups, k = _groups(world, [2, 2])
    st = odc.shard(torch.zeros(SHAPE), group=groups[k], name="x")
    if rank == 0:
        with pytest.raises(odc.OdcCrossedCollectivesError, match="rank 1 is in the collective 'sync'"):
            odc.sync(group=groups[k])
    elif rank == 1:
        with pytest.raises(odc.OdcCrossedCollectivesError, match="rank 0 waits for it in group fence #1"):
            odc.sync()
    else:  # rank 0 seen failed (OdcPeerLostError), or first the cycle of crossed waits (OdcMismatchError)
        with pytest.raises((OdcTimeoutError, OdcMismatchError), match="rank 0"):
            odc.sync()
    # Every rank's transport is failed now: later collectives raise at once, finalize does not wait.
    with pytest.raises((OdcMismatchError, OdcTimeoutError), match="unusable"):
        odc.sync()
    del st


def test_crossed_group_and_world_sync_is_a_mismatch_not_a_hang() -> None:
    run_ranks(_rank_crossed, 4, env={"ODC_TIMEOUT": "6"}, timeout=90)


def _rank_fence_cycle(rank: int, world: int) -> None:
    """Four group fences in a cycle: rank r fences group {r, r+1 mod 4} and waits for rank r+1, which waits in its
    own fence for r+2 ... No two ranks wait for each other directly, so only the wait-for graph shows it: every rank
    raises OdcMismatchError naming the cycle instead of waiting out ODC_TIMEOUT with a message about one peer."""
    odc.init("host")
    pairs_a = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pairs_b = [dist.new_group([1, 2]), dist.new_group([0, 3])]
    a = pairs_a[rank // 2]
    b = pairs_b[0] if rank in (1, 2) else pairs_b[1]
    st_a = odc.shard(torch.zeros(SHAPE), group=a, name="a")
    st_b = odc.shard(torch.zeros(SHAPE), group=b, name="b")
    mine = {0: a, 1: b, 2: a, 3: b}[rank]  # 0: {0,1}, 1: {1,2}, 2: {2,3}, 3: {0,3}
    with pytest.raises(odc.OdcCrossedCollectivesError, match=r"cycle of ranks .*can never complete"):
        odc.sync(group=mine)
    del st_a, st_b


def test_cycle_of_crossed_group_fences_is_detected() -> None:
    run_ranks(_rank_fence_cycle, 4, env={"ODC_TIMEOUT": "20"}, timeout=60)


def test_nvshmem_refuses_group_fences_clearly() -> None:
    """No GPU needed: the nvshmem transport's group fence is a typed refusal that says what to call instead (its
    barrier kernel has no per-group counters yet), never a silent world barrier that could hang."""
    from types import SimpleNamespace

    from odc_runtime.transport.base import Group
    from odc_runtime.transport.nvshmem import NvshmemTransport

    with pytest.raises(OdcUsageError, match=r"call odc_runtime.sync\(\) without a group"):
        NvshmemTransport.group_barrier(SimpleNamespace(), "sync(group=[0, 1])", Group(0, (0, 1)))  # type: ignore[arg-type]
