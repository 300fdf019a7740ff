"""Hierarchical (multi-node) push and fetch over the host transport with virtual nodes (issue 14).

``odc.init(node_size=n)`` (or ``ODC_NODE_SIZE``) declares nodes of ``n`` consecutive ranks, so 4 CPU ranks as 4
nodes of 1, 2 nodes of 2 or 1 node of 4 exercise every cross-node path of the protocol on one machine: a push into
an owner on another node is pre-reduced on the pusher's node and lands in the owner's ``st.grad`` at the next
``sync()`` with ``gradients=True``; a fetch reads other-node owners from a node-local copy refreshed at every
``sync()`` with ``parameters=True``. From the outside the contract is that of the flat runtime, so every check here
compares with an independent reference computed on every rank from the same deterministic generators: sums of small
integers (times 0.5, 1 or 2) are exact in fp32, and the values are exact in bf16 and fp16, so ``torch.equal`` holds
whatever order the protocol adds them in.

Each test is one 4-rank launch that does a lot (a launch costs seconds on a small machine).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import testing
from odc_runtime.errors import OdcMemoryError, OdcMismatchError, OdcNotInitializedError, OdcUsageError

WORLD = 4
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (shape, parameter dtype): odd numels, one smaller than the world (owners 1..3 own nothing) and a 2-D one.
TENSORS = (
    ((1,), torch.float32),
    ((7,), torch.bfloat16),
    ((1001,), torch.float16),
    ((4099,), torch.float32),
    ((33, 17), torch.bfloat16),
    ((3,), torch.float16),
)
# Micro-batches per (minibatch, rank): unequal, zeros on some ranks, a node (ranks 2 and 3 for node_size 2) that
# pushes nothing, a single pusher, and a minibatch where nobody pushes.
COUNTS = (
    (2, 0, 3, 1),
    (1, 2, 0, 0),
    (0, 1, 1, 3),
    (3, 3, 0, 2),
    (0, 0, 0, 1),
    (0, 0, 0, 0),
)
SCALES = (0.5, 2.0, 1.0)  # by micro-batch index: exact in fp32 for the small integers pushed


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _owner_range(owner: int, numel: int, world: int = WORLD) -> tuple[int, int]:
    """The flat layout, computed here independently of the runtime: shards of ceil(numel / world) elements."""
    size = -(-numel // world)
    start = min(owner * size, numel)
    return start, min(start + size, numel)


def _grad_dtype(tensor: int, round_: int) -> torch.dtype:
    return DTYPES[(tensor + round_) % len(DTYPES)]  # every (parameter dtype, gradient dtype) pair over the rounds


def _grad(src: int, round_: int, mb: int, tensor: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Gradient pushed by rank ``src`` in micro-batch ``mb`` of minibatch ``round_``: integers in [-6, 6]."""
    gen = torch.Generator().manual_seed(((src * 1009 + round_) * 1009 + mb) * 1009 + tensor)
    return torch.randint(-6, 7, shape, generator=gen).to(dtype)


def _expected_grad(
    tensor: int, shape: tuple[int, ...], rounds: list[tuple[int, tuple[int, ...]]], srcs: range | list[int]
) -> torch.Tensor:
    """Full fp32 sum of every push by ``srcs`` in the given (round, per-rank counts), as the owners must hold it."""
    total = torch.zeros(_numel(shape), dtype=torch.float32)
    for round_, counts in rounds:
        dtype = _grad_dtype(tensor, round_)
        for src in srcs:
            for mb in range(counts[src]):
                grad = _grad(src, round_, mb, tensor, shape, dtype)
                total += grad.to(torch.float32).reshape(-1) * SCALES[mb % len(SCALES)]
    return total


def _param(tensor: int, version: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The full parameter tensor after ``version`` updates: small integers, exact in every dtype."""
    numel = _numel(shape)
    return ((torch.arange(numel) * (tensor + 3) + 7 * version) % 61 - 30).to(dtype).reshape(shape)


def _push_round(sts: list[odc.ShardedTensor], rank: int, round_: int, counts: tuple[int, ...], version: int) -> None:
    """This rank's micro-batches of one minibatch: fetch (the values of the last sync), then push every tensor."""
    for mb in range(counts[rank]):
        for i, st in enumerate(sts):
            shape, dtype = TENSORS[i] if i < len(TENSORS) else (tuple(st.shape), st.dtype)
            if mb == 0:
                assert torch.equal(odc.fetch(st), _param(i, version, shape, dtype)), (i, round_)
            grad = _grad(rank, round_, mb, i, shape, _grad_dtype(i, round_))
            scale = SCALES[mb % len(SCALES)]
            if mb % 2 == 1:
                handle = odc.push(st, grad, scale=scale, async_op=True)
                assert handle.wait() is None
            else:
                odc.push(st, grad, scale=scale)


def _check_grads(
    sts: list[odc.ShardedTensor], rank: int, rounds: list[tuple[int, tuple[int, ...]]], what: str
) -> None:
    for i, st in enumerate(sts):
        shape = tuple(st.shape)
        lo, hi = _owner_range(rank, _numel(shape))
        expected = _expected_grad(i, shape, rounds, range(WORLD))[lo:hi]
        assert st.grad.dtype == torch.float32 and st.grad.shape == (hi - lo,)
        assert torch.equal(st.grad, expected), (what, i, st.grad, expected)


def _write_params(sts: list[odc.ShardedTensor], rank: int, version: int) -> None:
    """Each owner writes version ``version`` of its shard into ``st.local`` (what an optimizer step does)."""
    for i, st in enumerate(sts):
        lo, hi = _owner_range(rank, _numel(tuple(st.shape)))
        st.local.copy_(_param(i, version, tuple(st.shape), st.dtype).reshape(-1)[lo:hi])


def _check_fetch(sts: list[odc.ShardedTensor], version: int, what: str) -> None:
    """Every rank reads every owner's latest shard: plain, into ``out=``, and asynchronously."""
    for i, st in enumerate(sts):
        expected = _param(i, version, tuple(st.shape), st.dtype)
        assert torch.equal(odc.fetch(st), expected), (what, i)
        out = torch.full(tuple(st.shape), 99.0, dtype=st.dtype)
        assert odc.fetch(st, out) is out and torch.equal(out, expected), (what, i)
        out = torch.full(tuple(st.shape), 99.0, dtype=st.dtype)
        handle = odc.fetch(st, out, async_op=True)
        assert handle.wait() is out and torch.equal(out, expected), (what, i)
        got = odc.fetch(st, async_op=True).wait()
        assert torch.equal(got, expected), (what, i)


def _rank_exact(rank: int, world: int, node_size: int, node_slots: int | None = None) -> None:
    assert world == WORLD
    odc.init("host", node_size=node_size, node_slots=node_slots)
    assert odc.node_size() == node_size
    if node_slots is not None:  # the inbox holds node_slots rows, not one per other node
        transport = testing.transport()
        before = transport.heap_used()
        probe = odc.shard(torch.zeros(65539, dtype=torch.bfloat16), name="probe")
        nodes, shard = WORLD // node_size, -(-65539 // WORLD)
        bound = _flat_bytes(65539, WORLD, torch.bfloat16) + shard * ((nodes - 1) * (4 + 2) + node_slots * 4)
        assert bound <= transport.heap_used() - before <= bound + MEMORY_SLACK, transport.heap_used() - before
        probe.free()
    sts = [
        odc.shard(_param(i, 0, shape, dtype), name=f"t{i}")
        for i, (shape, dtype) in enumerate(TENSORS)
    ]
    for i, st in enumerate(sts):
        assert st.shard_range == _owner_range(rank, _numel(TENSORS[i][0]))
        assert st.group is None and st.world_size == world and st.rank == rank
    # The initial values are readable right after shard(), before any sync.
    _check_fetch(sts, 0, "after shard")

    # 1. Minibatches with unequal micro-batch counts: after sync every owner holds exactly the sum of all pushes.
    version = 0
    for round_, counts in enumerate(COUNTS):
        _push_round(sts, rank, round_, counts, version)
        odc.sync()
        _check_grads(sts, rank, [(round_, counts)], f"round {round_}")
        # 2. The owners update their shards; after the next sync every rank fetches exactly the new values.
        version += 1
        _write_params(sts, rank, version)
        for st in sts:
            st.zero_grad()
        odc.sync()
        _check_fetch(sts, version, f"round {round_}")
        # (A push delivered again at this second sync would stay in the zeroed accumulators and fail the next
        # minibatch's check; checking them here would race with the other ranks' next pushes.)

    # 3. sync(gradients=False) keeps pushes staged (nothing lost, nothing counted twice); a later sync() lands them,
    # together with pushes issued after it. It still fences parameters: fetch is exact after it. (Owners write
    # st.local only after a sync that follows every rank's last fetch, as a training loop does.)
    base = len(COUNTS)
    staged = [(base, (1, 2, 0, 3)), (base + 1, (2, 0, 1, 1))]
    _push_round(sts, rank, *staged[0], version)
    odc.sync(gradients=False)
    version += 1
    _write_params(sts, rank, version)
    odc.sync(gradients=False)
    _check_fetch(sts, version, "after sync(gradients=False)")
    odc.sync(gradients=False, parameters=False)  # a plain fence: moves nothing, loses nothing
    _push_round(sts, rank, *staged[1], version)
    odc.sync()
    _check_grads(sts, rank, staged, "staged by sync(gradients=False), landed by sync()")
    for st in sts:
        st.zero_grad()
    odc.sync()  # a staged push delivered again here would fail the next check

    # parameters=False still lands the gradients; a later sync() makes fetch exact again (what fetch returns in
    # between is not part of the contract and not tested).
    more = [(base + 2, (0, 3, 2, 1))]
    _push_round(sts, rank, *more[0], version)
    odc.sync(parameters=False)
    _check_grads(sts, rank, more, "sync(parameters=False)")
    for st in sts:
        st.zero_grad()
    version += 1
    _write_params(sts, rank, version)
    odc.sync(parameters=False)
    odc.sync()
    _check_fetch(sts, version, "sync() after sync(parameters=False)")
    assert not any(st.grad.any() for st in sts), "a push was delivered twice"  # nobody pushes before free()

    # 6. Free a tensor and shard a new one in its place (and one more): still exact, and no memory left behind.
    transport = testing.transport()
    used = transport.heap_used()
    sts[2].free()
    sts[2] = odc.shard(_param(2, version, TENSORS[2][0], TENSORS[2][1]), name="t2_again")
    assert transport.heap_used() == used, "free() did not release everything shard() took"
    extra = odc.shard(_param(len(TENSORS), version, (5, 3), torch.float16), name="extra")
    _check_fetch([*sts, extra], version, "re-shard")
    counts = (2, 1, 0, 3)
    _push_round([*sts, extra], rank, base + 3, counts, version)
    odc.sync()
    _check_grads([*sts, extra], rank, [(base + 3, counts)], "after re-shard")
    extra.free()
    assert transport.heap_used() == used
    for st in sts:
        st.free()
    odc.finalize()
    assert not odc.is_initialized()


@pytest.mark.parametrize("node_size", [1, 2, 4], ids=["4_nodes_of_1", "2_nodes_of_2", "1_node_of_4"])
def test_push_and_fetch_are_exact_with_virtual_nodes(node_size: int) -> None:
    run_ranks(_rank_exact, WORLD, node_size, timeout=150)


@pytest.mark.parametrize("node_slots", [1, 2], ids=["3_rounds_of_1_slot", "2_rounds_of_2_slots"])
def test_fewer_inbox_slots_than_nodes_deliver_in_rounds_exactly(node_slots: int) -> None:
    # 4 nodes of 1: each owner receives from 3 other nodes through node_slots slots reused after free signals
    run_ranks(_rank_exact, WORLD, 1, node_slots, timeout=150)


# -- process groups next to hierarchical tensors; symmetric memory of the hierarchy -----------------------------
GROUP_SHAPE = (7, 5)  # 35 elements: odd, not a multiple of the group size
PARTITIONS = {"pairs": ((0, 1), (2, 3)), "interleaved": ((0, 2), (1, 3))}  # within a node / across nodes of 2
MEMORY_SLACK = 16 << 10  # allocator alignment and a few signal words; far less than one more staging slot here


def _aligned(nbytes: int) -> int:
    from odc_runtime.transport.heap import ALIGNMENT

    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


def _flat_bytes(numel: int, ranks: int, dtype: torch.dtype) -> int:
    """Symmetric bytes of a tensor without the hierarchy: its parameter shard and its fp32 accumulator."""
    shard = -(-numel // ranks)
    return _aligned(shard * dtype.itemsize) + _aligned(shard * 4)


def _hierarchy_bytes(numel: int, nodes: int, dtype: torch.dtype) -> int:
    """The stated bound of the hierarchy per tensor and rank: (M-1) * S * (staging fp32 + inbox fp32 + mirror)."""
    return (nodes - 1) * -(-numel // WORLD) * (4 + 4 + dtype.itemsize)


def _rank_groups_and_memory(rank: int, world: int) -> None:
    assert world == WORLD
    groups = {  # new_group is collective: every rank creates every group, in the same order
        name: [dist.new_group(list(part)) for part in parts] for name, parts in PARTITIONS.items()
    }
    for node_size in (1, 2, 4):
        nodes = world // node_size
        odc.init("host", node_size=node_size, heap_size="4M")
        assert odc.node_size() == node_size
        transport = testing.transport()

        # Memory: a world tensor takes its flat bytes plus (M-1)*S*(4+4+itemsize) when the hierarchy is on (up to
        # alignment), nothing extra with one node.
        numel = 4 * 16384 + 3
        used = transport.heap_used()
        big = odc.shard(torch.zeros(numel, dtype=torch.bfloat16), name="big")
        delta = transport.heap_used() - used
        low = _flat_bytes(numel, world, torch.bfloat16) + _hierarchy_bytes(numel, nodes, torch.bfloat16)
        assert low <= delta <= low + MEMORY_SLACK, (node_size, delta, low)
        # A tensor whose flat bytes fit in what is left but whose hierarchy does not is refused on every rank,
        # and nothing of it stays allocated.
        free = transport.heap_capacity() - transport.heap_used()
        shard_elems = free // 12  # flat: 6 bytes per element (bf16 + fp32) = half of what is free
        used = transport.heap_used()
        if nodes > 1:
            with pytest.raises(OdcMemoryError, match=r"ODC_HEAP_SIZE|heap_size"):
                odc.shard(torch.empty(world * shard_elems, dtype=torch.bfloat16, device="meta"), name="too_big")
            assert transport.heap_used() == used
        else:
            odc.shard(torch.empty(world * shard_elems, dtype=torch.bfloat16, device="meta"), name="fits").free()
        big.free()

        # A frozen world tensor (no accumulator) is fetched exactly, before and after its owners update it.
        frozen = odc.shard(_param(30, 0, (9, 13), torch.float16), name="frozen", requires_grad=False)
        assert frozen.grad is None
        assert torch.equal(odc.fetch(frozen), _param(30, 0, (9, 13), torch.float16))

        for pname, parts in PARTITIONS.items():
            k = next(j for j, part in enumerate(parts) if rank in part)
            group, members = groups[pname][k], list(parts[k])
            wt = odc.shard(_param(40, 0, GROUP_SHAPE, torch.bfloat16), name=f"w_{pname}")
            # A tensor sharded over a proper subgroup never uses the hierarchy: its flat bytes only.
            used = transport.heap_used()
            gt = odc.shard(_param(50 + k, 0, GROUP_SHAPE, torch.float16), group=group, name=f"g_{pname}")
            assert transport.heap_used() - used == _flat_bytes(35, len(members), torch.float16)
            assert list(gt.group_ranks) == members and gt.rank == members.index(rank)
            glo, ghi = _owner_range(gt.rank, 35, len(members))
            assert gt.shard_range == (glo, ghi)
            for round_, counts in enumerate(COUNTS[:4]):
                for mb in range(counts[rank]):
                    scale = SCALES[mb % len(SCALES)]
                    odc.push(gt, _grad(rank, round_, mb, 10, GROUP_SHAPE, _grad_dtype(10, round_)), scale=scale)
                    odc.push(wt, _grad(rank, round_, mb, 11, GROUP_SHAPE, _grad_dtype(11, round_)), scale=scale)
                odc.sync(group=group)  # the group's pushes only; the world tensor's stay pending until sync()
                expected = _expected_grad(10, GROUP_SHAPE, [(round_, counts)], members)[glo:ghi]
                assert torch.equal(gt.grad, expected), (node_size, pname, round_, gt.grad, expected)
                gt.local.copy_(_param(50 + k, round_ + 1, GROUP_SHAPE, torch.float16).reshape(-1)[glo:ghi])
                gt.zero_grad()
                odc.sync(group=group)
                assert torch.equal(odc.fetch(gt), _param(50 + k, round_ + 1, GROUP_SHAPE, torch.float16))
            # The world tensor: every rank's pushes of every round, each exactly once, after the world sync.
            odc.sync()
            lo, hi = _owner_range(rank, 35)
            expected = _expected_grad(11, GROUP_SHAPE, list(enumerate(COUNTS[:4])), range(world))[lo:hi]
            assert torch.equal(wt.grad, expected), (node_size, pname, wt.grad, expected)
            wt.local.copy_(_param(40, 1, GROUP_SHAPE, torch.bfloat16).reshape(-1)[lo:hi])
            flo, fhi = _owner_range(rank, 117)
            frozen.local.copy_(_param(30, 1, (9, 13), torch.float16).reshape(-1)[flo:fhi])
            odc.sync()
            assert torch.equal(odc.fetch(wt), _param(40, 1, GROUP_SHAPE, torch.bfloat16))
            assert torch.equal(odc.fetch(frozen), _param(30, 1, (9, 13), torch.float16))
            odc.sync()  # every rank fetched before the next partition's owners write
            gt.free()
            wt.free()
        frozen.free()
        odc.finalize()


def test_groups_next_to_hierarchy_and_its_memory_bound() -> None:
    run_ranks(_rank_groups_and_memory, WORLD, timeout=150)


# -- the setting: default, argument, environment, agreement ---------------------------------------------------
def _rank_settings(rank: int, world: int) -> None:
    with pytest.raises(OdcNotInitializedError):
        odc.node_size()
    os.environ.pop("ODC_NODE_SIZE", None)
    odc.init("host")
    assert odc.node_size() == world  # host: every rank shares one machine, one node
    odc.finalize()

    os.environ["ODC_NODE_SIZE"] = "2"  # used when the argument is None ...
    odc.init("host")
    assert odc.node_size() == 2
    odc.finalize()
    odc.init("host", node_size=1)  # ... and the argument wins over it
    assert odc.node_size() == 1
    odc.finalize()

    # Bad values, the same on every rank: OdcUsageError on every rank, nothing initialised.
    for bad, match in (("0", "ODC_NODE_SIZE"), ("abc", "ODC_NODE_SIZE"), ("", "ODC_NODE_SIZE"),
                       ("3", "ODC_NODE_SIZE|node_size"), ("8", "ODC_NODE_SIZE|node_size")):
        os.environ["ODC_NODE_SIZE"] = bad
        with pytest.raises(OdcUsageError, match=match):
            odc.init("host")
        assert not odc.is_initialized(), bad
    del os.environ["ODC_NODE_SIZE"]
    for bad in (3, 0, -1, 8):
        with pytest.raises(OdcUsageError, match="node_size"):
            odc.init("host", node_size=bad)
        assert not odc.is_initialized(), bad

    # A bad value on one rank: it raises OdcUsageError, the others are told it rejected the call.
    if rank == 0:
        with pytest.raises(OdcUsageError, match="node_size"):
            odc.init("host", node_size=3)
    else:
        with pytest.raises(OdcMismatchError, match=r"rank 0\b"):  # names the rank that rejected it
            odc.init("host", node_size=2)
    assert not odc.is_initialized()

    # Valid but different node sizes: OdcMismatchError on every rank, naming the setting.
    with pytest.raises(OdcMismatchError, match=r"(?i)node.?size"):
        odc.init("host", node_size=2 if rank < 2 else 4)
    assert not odc.is_initialized()
    os.environ["ODC_NODE_SIZE"] = "1" if rank == 3 else "2"
    with pytest.raises(OdcMismatchError, match=r"(?i)node.?size"):
        odc.init("host")
    assert not odc.is_initialized()
    del os.environ["ODC_NODE_SIZE"]

    # Nothing half-initialised was left behind: a good init works and the hierarchy is exact.
    odc.init("host", node_size=2)
    assert odc.node_size() == 2
    st = odc.shard(torch.zeros(4, 3), name="after_errors")
    odc.push(st, torch.full((4, 3), float(rank + 1)))
    odc.sync()
    assert torch.equal(st.grad, torch.full_like(st.grad, sum(r + 1 for r in range(world))))


def test_node_size_setting_is_checked_and_agreed() -> None:
    run_ranks(_rank_settings, WORLD, timeout=90)
