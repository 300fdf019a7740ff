"""Deterministic accumulation (``odc.init(deterministic=True)``): the same bits whatever the arrival order, precision
against an fp64 reference, overflow refused on every rank with nothing written, misuse refused."""

from __future__ import annotations

import math
import os

import pytest
import torch
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)

SHAPES = [(37, 11), (129,), (5, 7, 3)]


def _grads(rank: int, step: int, micro: int) -> list[torch.Tensor]:
    """Gradients of mixed magnitudes (as a model's layers have), the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return [torch.randn(s, generator=g) * 10.0 ** float(torch.randint(-4, 1, (1,), generator=g)) for s in SHAPES]


def _turns(world: int, order: str) -> list[int]:
    return list(range(world)) if order == "up" else list(reversed(range(world)))


def _rank_train(rank: int, world: int, deterministic: bool, order: str, steps: int) -> list[bytes]:
    """Train a few steps with pushes forced into an arrival order: ``up``/``down`` (ranks take turns, all pushes of
    one rank landed before the next starts), or ``async`` (asynchronous pushes, owners shuffled, random delays)."""
    import random
    import time

    import torch.distributed as dist

    import odc_runtime as odc

    odc.init("host", timeout=60, deterministic=deterministic)
    assert odc.node_size() == int(os.environ.get("ODC_NODE_SIZE", world))  # the hierarchy is on where asked
    params = [torch.linspace(-1, 1, math.prod(s)).reshape(s) for s in SHAPES]
    sts = [odc.shard(p, name=f"w{i}") for i, p in enumerate(params)]
    rnd = random.Random(rank + 17 * (order == "async"))
    out = []
    for step in range(steps):
        grads = [_grads(rank, step, m) for m in range(3)]
        if order == "async":
            handles = []
            for mb in grads:
                for i in rnd.sample(range(len(sts)), len(sts)):
                    time.sleep(rnd.random() * 0.004)
                    handles.append(odc.push(sts[i], mb[i], scale=0.5, async_op=True))
            for h in handles:
                h.wait()
        else:
            for turn in _turns(world, order):
                if turn == rank:
                    for mb in grads:
                        for st, g in zip(sts, mb, strict=True):
                            odc.push(st, g, scale=0.5)
                dist.barrier()
        # gradients=False: in deterministic mode pushes staged for other nodes are delivered all the same (their
        # scale is this window's); the flat runs the hierarchical ones are compared with have nothing staged.
        odc.sync(gradients=not deterministic)
        for st in sts:
            out.append(st.grad.numpy().tobytes())
            st.local.sub_(0.1 * st.grad)  # the optimizer step reads the accumulated gradient
            st.zero_grad()
        odc.sync()
    out.extend(odc.fetch(st).numpy().tobytes() for st in sts)
    return out


# The transports the exact tests below run on: host, and the nvshmem transport (its real Python paths) over the CPU
# model of its extension (tests/_nvshmem_shm.py) on both push protocols: peer-pointer atomics and locked cells.
BACKENDS = ["host", "nvshmem-atomic", "nvshmem-locked"]


def _ranks(backend: str, fn, world: int, *args, **kwargs) -> list:
    """``run_ranks(fn, world, *args)`` with ``odc.init("host")`` answered by ``backend``."""
    if backend == "host":
        return run_ranks(fn, world, *args, **kwargs)
    import _nvshmem_shm

    return run_ranks(_nvshmem_shm.run, world, backend.removeprefix("nvshmem-"), fn, *args, **kwargs)


def test_nvshmem_model_adds_int64_exactly_and_refuses_what_the_extension_refuses(tmp_path) -> None:
    """The CPU model of the extension behind the nvshmem cases (tests/_nvshmem_shm.py) does what csrc/plan.cu,
    peer.cu and cells.cu do with an int64 accumulator: exact adds past 2**53 on both push kinds, and the refusals."""
    import _nvshmem_shm as shm

    path = tmp_path / "pe0"
    path.write_bytes(bytes(shm.CTL + (1 << 16)))
    mem = shm._Mem([str(path)], shm.CTL + (1 << 16))
    C = shm.extension(mem, 0, 1, 5.0, 4096)
    engine = C.Engine()
    q = torch.tensor([(1 << 60) + 1, -(1 << 55) - 3, 7] * 700, dtype=torch.int64)  # 2100 elements: 2 cells
    for kind, addr in ((C.PLAN_PUSH_ATOMIC, mem.bases[0] + 4000), (C.PLAN_PUSH_LOCKED, 4000)):
        acc = mem.arena(0, 4000, 8 * q.numel()).view(torch.int64)
        acc.zero_()
        plan = C.Plan(engine, kind, [addr], [0], [q.numel()], [0], C.DTYPE_INT64)
        for _ in range(3):
            plan.run(q.data_ptr(), C.DTYPE_INT64, 1.0, 0)
        assert torch.equal(acc, q * 3)
        for dtype, scale in ((C.DTYPE_FLOAT32, 1.0), (C.DTYPE_INT64, 0.5)):
            with pytest.raises(RuntimeError, match="int64"):
                plan.run(q.data_ptr(), dtype, scale, 0)
        with pytest.raises(RuntimeError, match="int64 accumulator"):
            C.Plan(engine, kind, [addr], [0], [4], [0], C.DTYPE_FLOAT32).run(q.data_ptr(), C.DTYPE_INT64, 1.0, 0)
        with pytest.raises(RuntimeError, match="8-byte aligned"):
            C.Plan(engine, kind, [addr + 4], [0], [4], [0], C.DTYPE_INT64)
        assert torch.equal(acc, q * 3)  # nothing written by a refused run
    with pytest.raises(RuntimeError, match="fp32 or int64"):
        C.Plan(engine, C.PLAN_PUSH_ATOMIC, [mem.bases[0]], [0], [4], [0], C.DTYPE_FLOAT16)


def _steps(backend: str) -> int:
    return 3 if backend == "host" else 2  # CI time: the nvshmem model is slower per push


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_bits_whatever_the_arrival_order(backend: str) -> None:
    runs = [_ranks(backend, _rank_train, 3, True, order, _steps(backend)) for order in ("up", "down", "async")]
    assert runs[0] == runs[1] == runs[2]


# With nodes smaller than the world (the hierarchy: pushes to other nodes pre-reduced in int64 staging rows, folded
# into the owners' int64 accumulators at sync), every order gives the flat mode's bits: integer sums are exact, so
# the grouping into staged sub-sums cannot change them. (nodes of 2; nodes of 1 with one inbox slot: 3 rounds)
NODES = ({"ODC_NODE_SIZE": "2"}, {"ODC_NODE_SIZE": "1", "ODC_NODE_SLOTS": "1"})


def test_nodes_give_the_flat_bits_whatever_the_arrival_order() -> None:
    flat = run_ranks(_rank_train, 4, True, "up", 2)
    for env, order in ((NODES[0], "up"), (NODES[0], "down"), (NODES[1], "async")):
        assert run_ranks(_rank_train, 4, True, order, 2, env=env) == flat, (env, order)


def test_default_mode_with_nodes_depends_on_the_arrival_order() -> None:
    """The teeth of the test above: the fp32 staging rows and accumulators of the default mode sum in arrival
    order."""
    assert run_ranks(_rank_train, 4, False, "up", 2, env=NODES[0]) != run_ranks(
        _rank_train, 4, False, "down", 2, env=NODES[0]
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_mode_depends_on_the_arrival_order(backend: str) -> None:
    """The same job in the default (fp32, arrival-order) mode: the orders above give different bits, so the test
    above would see a difference. Forced turns make each order's result itself reproducible (not flaky)."""
    up = _ranks(backend, _rank_train, 3, False, "up", _steps(backend))
    down = _ranks(backend, _rank_train, 3, False, "down", _steps(backend))
    assert up != down
    if backend == "host":
        assert up == run_ranks(_rank_train, 3, False, "up", 3)


def _rank_precision(rank: int, world: int) -> dict:
    import odc_runtime as odc
    from odc_runtime import deterministic as det

    odc.init("host", timeout=60, deterministic=True)
    sts = [odc.shard(torch.zeros(s), name=f"w{i}") for i, s in enumerate(SHAPES)]
    worst = 0.0
    for step in range(3):
        exponents = [odc.state.current.fixed.units[st.seq].exponent for st in sts]
        for m in range(4):
            for st, g in zip(sts, _grads(rank, step, m), strict=True):
                odc.push(st, g)
        odc.sync()
        p = det.fraction_bits(world)
        for st, e, i in zip(sts, exponents, range(len(sts)), strict=True):
            ref = sum(_grads(r, step, m)[i].double() for r in range(world) for m in range(4)).reshape(-1)
            lo, hi = st.shard_range
            ref = ref[lo:hi]
            got = st.grad.double()
            # Stated bound: half a quantum per contribution, then the fp32 rounding of the result.
            n = 4 * world
            quantised = n * math.ldexp(0.5, e - p)
            bound = quantised + (ref.abs() + quantised) * 2.0**-24 + 1e-45
            err = (got - ref).abs()
            assert bool((err <= bound).all()), (step, i, float((err - bound).max()))
            worst = max(worst, float((err / ref.abs().clamp_min(1e-30)).max()))
            st.zero_grad()
    return {"worst_relative": worst}


@pytest.mark.parametrize("backend", BACKENDS)
def test_precision_against_fp64_reference(backend: str) -> None:
    _ranks(backend, _rank_precision, 3)


def _rank_overflow(rank: int, world: int, node_size: int | None = None) -> dict:
    import torch.distributed as dist

    import odc_runtime as odc

    odc.init("host", timeout=60, deterministic=True, node_size=node_size)
    st = odc.shard(torch.zeros(10), name="w")

    def clean() -> bool:
        """This rank's int64 accumulator, and with nodes its staging rows and inbox, hold nothing."""
        runtime = odc.state.current
        bufs = [runtime.fixed.units[st.seq].acc]
        if runtime.hierarchy is not None:
            nodes = runtime.hierarchy._tensors[st.seq]
            bufs += [nodes.stage, nodes.inbox]
        return all(bool((b.local == 0).all()) for b in bufs)

    odc.push(st, torch.ones(10))
    odc.sync()
    before = st.grad.clone()  # world * 1.0
    out: dict[str, object] = {}
    for what, value in (("bound", 1e6), ("nonfinite", float("nan"))):
        odc.push(st, torch.ones(10))  # lands, then is discarded with the window
        big = torch.ones(10)
        big[3] = value
        if rank == 1:
            odc.push(st, big)  # refused before any remote effect
        try:
            odc.sync()
        except odc.OdcOverflowError as e:
            out[what] = str(e)
        out[f"{what}_unchanged"] = torch.equal(st.grad, before)
        out[f"{what}_acc_zero"] = clean()
        dist.barrier()  # read before any peer pushes the next window
    # The bound was raised to what was seen: the same minibatch retried fits, and the result is exact.
    odc.push(st, torch.ones(10))
    big = torch.full((10,), 1e6)
    if rank == 1:
        odc.push(st, big)
    odc.sync()
    out["retry"] = st.grad.tolist()
    # More pushes into one tensor in one window than the headroom allows (2 here): the third is refused.
    from odc_runtime import deterministic as det

    det.PUSH_BITS = 1
    for _ in range(3 if rank == 0 else 1):
        odc.push(st, torch.ones(10))
    try:
        odc.sync()
    except odc.OdcOverflowError as e:
        out["too_many"] = str(e)
    out["too_many_unchanged"] = st.grad.tolist() == out["retry"]
    return out


def check_overflow(results: list[dict], world: int) -> None:
    """What :func:`_rank_overflow` must see on every rank (shared with the other transports' tests)."""
    for r in results:
        assert "exceeded" in r["bound"] and "'w'" in r["bound"] and "[1]" in r["bound"]
        assert "exceeded" in r["nonfinite"]
        assert r["bound_unchanged"] and r["nonfinite_unchanged"]
        assert r["bound_acc_zero"] and r["nonfinite_acc_zero"]
        assert r["retry"] == [world + world + 1e6] * len(r["retry"])
        assert "[0]" in r["too_many"] and r["too_many_unchanged"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_is_refused_on_every_rank_and_nothing_is_written(backend: str) -> None:
    check_overflow(_ranks(backend, _rank_overflow, 3), 3)


def test_overflow_with_nodes_is_refused_on_every_rank_and_nothing_is_staged() -> None:
    # 3 nodes of 1: every push to another owner is staged, the refused one included; the discarded window's
    # staged rows are zeroed on every rank (no puts), so the retry's sums are exact.
    check_overflow(run_ranks(_rank_overflow, 3, 1), 3)


def _rank_nonfinite_only(rank: int, world: int, node_size: int | None) -> list:
    """A tensor whose only push of a window is not finite (no exponent seen anywhere): the meaningless integers it
    added to the accumulator (or a staging row) are discarded with the window, never carried into the next one."""
    import odc_runtime as odc

    odc.init("host", timeout=60, deterministic=True, node_size=node_size)
    a, b = odc.shard(torch.zeros(12), name="a"), odc.shard(torch.zeros(12), name="b")
    odc.push(a, torch.ones(12))
    if rank == 1:
        odc.push(b, torch.full((12,), float("inf")))  # every owner of b, staged for the other nodes' owners
    with pytest.raises(odc.OdcOverflowError, match="'b'"):
        odc.sync()
    odc.push(b, torch.ones(12))
    odc.sync()
    return [a.grad.tolist(), b.grad.tolist()]


@pytest.mark.parametrize("node_size", [None, 1])
def test_a_window_with_only_a_nonfinite_push_leaves_nothing_behind(node_size: int | None) -> None:
    for r in run_ranks(_rank_nonfinite_only, 3, node_size):
        assert r == [[0.0] * 4, [3.0] * 4], r


def _rank_misuse(rank: int, world: int, case: str) -> str:
    import torch.distributed as dist

    import odc_runtime as odc
    from odc_runtime.transport.base import Capabilities
    from odc_runtime.transport.host.transport import HostTransport

    try:
        if case == "transport":
            HostTransport.capabilities = Capabilities(signals=True, group_fences=True)
            odc.init("host", timeout=30, deterministic=True)
        elif case == "ranks_differ":
            odc.init("host", timeout=30, deterministic=rank == 0)
        elif case == "group_sync":
            odc.init("host", timeout=30, deterministic=True)
            groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            group = groups[rank // 2]
            odc.shard(torch.zeros(4), group=group)
            odc.sync(group=group)
    except odc.OdcError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "error", "needle"),
    [
        ("transport", "OdcUsageError", "cannot accumulate deterministically"),
        ("ranks_differ", "OdcMismatchError", "accumulation mode"),
        ("group_sync", "OdcUsageError", "sync(group=...) in deterministic mode"),
    ],
)
def test_misuse_is_refused_on_every_rank(case: str, error: str, needle: str) -> None:
    for r in run_ranks(_rank_misuse, 4 if case == "group_sync" else 2, case):
        assert r.startswith(error) and needle in r, r


def test_setting_is_parsed_in_config(monkeypatch) -> None:
    from odc_runtime import config
    from odc_runtime.errors import OdcUsageError

    monkeypatch.setenv("ODC_DETERMINISTIC", "1")
    assert config.deterministic(None) is True
    assert config.deterministic(False) is False
    monkeypatch.setenv("ODC_DETERMINISTIC", "maybe")
    with pytest.raises(OdcUsageError, match="ODC_DETERMINISTIC"):
        config.deterministic(None)
    with pytest.raises(OdcUsageError, match="bool"):
        config.deterministic(1)  # type: ignore[arg-type]


def _rank_fsdp(rank: int, world: int, hsdp: bool, order: str) -> list[bytes]:
    """FSDP2 in ODC mode (HSDP: a 2 x (world / 2) mesh), 3 optimizer steps; each rank's backward passes delayed so
    that pushes reach the owners in ``order``."""
    import time

    import _fsdp_harness as h
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import odc_runtime as odc
    import odc_runtime.fsdp as ofsdp

    odc.init("host", timeout=60, deterministic=True)
    assert odc.node_size() == int(os.environ.get("ODC_NODE_SIZE", world))  # the hierarchy is on where asked
    model = h.make_model()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ofsdp.enable(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = h.make_data(3, [2] * world)
    delay = 0.03 * _turns(world, order).index(rank)
    for step in range(3):
        tokens = sum(h.n_targets(mbs) for mbs in data[step])
        with ofsdp.minibatch(model, divide_factor=tokens):
            for mb in data[step][rank]:
                loss = h.token_loss_sum(model, mb)
                time.sleep(delay)
                loss.backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    return [p.full_tensor().detach().numpy().tobytes() for p in model.parameters()]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("world", "hsdp"), [(3, False), (4, True)])
def test_fsdp_odc_mode_same_bits_whatever_the_arrival_order(world: int, hsdp: bool) -> None:
    up = run_ranks(_rank_fsdp, world, hsdp, "up")
    down = run_ranks(_rank_fsdp, world, hsdp, "down")
    assert up == down


@pytest.mark.timeout(400)
def test_fsdp_odc_mode_with_nodes_gives_the_flat_bits_whatever_the_arrival_order() -> None:
    """FSDP2 ODC mode over 2 nodes of 2 (ODC_NODE_SIZE): the same parameters after 3 steps in both orders as the
    flat deterministic mode (the hierarchy's staged int64 sub-sums change no bit)."""
    assert run_ranks(_rank_fsdp, 4, False, "down", env=NODES[0]) == run_ranks(_rank_fsdp, 4, False, "up")


def _rank_gang(rank: int, world: int, order: str) -> list | None:
    """tests/test_hf_split.py's FSDP2 + gang-exchange training (a sample split across the ranks, Qwen2, 2 SGD steps)
    in deterministic mode, every push of this rank delayed by its place in ``order``."""
    import time

    import test_hf_split

    import odc_runtime as odc

    push, delay = odc.push, 0.02 * _turns(world, order).index(rank)

    def delayed(*args: object, **kwargs: object) -> object:
        time.sleep(delay)
        return push(*args, **kwargs)

    odc.push = delayed  # the FSDP hooks call odc.push
    try:
        return test_hf_split._fsdp_rank(rank, world, "qwen2", False)["params"]
    finally:
        odc.push = push


@pytest.mark.timeout(400)
def test_gang_split_samples_same_bits_whatever_the_arrival_order() -> None:
    pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")
    env = {"ODC_DETERMINISTIC": "1"}
    up = run_ranks(_rank_gang, 2, "up", env=env, timeout=180)
    down = run_ranks(_rank_gang, 2, "down", env=env, timeout=180)
    assert up[0] == down[0] and up[0][-1] is not None


def _rank_fsdp_overflow(rank: int, world: int) -> dict:
    """FSDP2 ODC mode, deterministic: a minibatch whose gradients exceed the first bound (16) raises
    OdcOverflowError on every rank from end_minibatch, writes no gradient, and the rerun of the same minibatch
    trains."""
    import _fsdp_harness as h

    import odc_runtime as odc
    import odc_runtime.fsdp as ofsdp

    odc.init("host", timeout=60, deterministic=True)
    model = h.shard_model(h.make_model())
    ofsdp.enable(model)
    data = h.make_data(1, [2] * world)[0]
    out: dict[str, object] = {}
    for attempt in ("first", "rerun"):
        try:
            with ofsdp.minibatch(model, divide_factor=1.0):
                for mb in data[rank]:
                    (1e4 * h.token_loss_sum(model, mb)).backward()
        except odc.OdcOverflowError as e:
            out[attempt] = type(e).__name__
        # FSDP's own reduce-scatter leaves zero gradients in ODC mode; ODC writes the real ones
        out[f"{attempt}_grads"] = [p.grad is not None and bool(p.grad.to_local().any()) for p in model.parameters()]
    return out


def test_fsdp_overflow_is_raised_everywhere_and_the_minibatch_can_be_rerun() -> None:
    for r in run_ranks(_rank_fsdp_overflow, 2):
        assert r["first"] == "OdcOverflowError" and "rerun" not in r
        assert not any(r["first_grads"]) and any(r["rerun_grads"])


def _rank_no_readback(rank: int, world: int) -> list[str]:
    """The ops a deterministic push dispatches: none may read a value back to the host (on a GPU, a device
    synchronisation per push, which would stall the backward pass that issues the pushes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import odc_runtime as odc

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    odc.init("host", timeout=60, deterministic=True)
    st = odc.shard(torch.zeros(64), name="w")
    g = torch.linspace(-3, 3, 64)
    odc.push(st, g)  # the plan is built (and cached) outside the recording
    with Ops() as ops:
        odc.push(st, g, scale=0.5)
        odc.push(st, g * 1e9)  # over the bound: found at sync, not by a read here
    readbacks = [n for n in ops.names if n in ("aten._local_scalar_dense", "aten.item")]
    try:
        odc.sync()
    except odc.OdcOverflowError:
        readbacks.append("overflow raised")
    return readbacks


def test_push_never_reads_a_value_back() -> None:
    for r in run_ranks(_rank_no_readback, 2):
        assert r == ["overflow raised"], r


def _rank_free_mismatch(rank: int, world: int) -> list:
    """A mismatched free in deterministic mode changes nothing (the int64 accumulator is freed, collectively, before
    its unit is forgotten), and a retried free resumes."""
    import odc_runtime as odc
    from odc_runtime import testing

    odc.init("host", timeout=20, deterministic=True)
    transport = testing.transport()
    empty = transport.heap_used()
    x = odc.shard(torch.zeros(world * 8), name="x")
    y = odc.shard(torch.zeros(world * 8), name="y")
    with pytest.raises(odc.OdcMismatchError, match="collective mismatch"):
        (y if rank == 2 else x).free()  # every rank raises at the int64 accumulator's free; nothing is freed
    assert testing.failure() is None
    for st in (x, y):
        odc.push(st, torch.ones(world * 8))
    odc.sync()
    values = [x.grad.tolist(), y.grad.tolist()]
    x.free()  # the same order on every rank: resumes where the mismatch stopped
    y.free()
    assert transport.heap_used() == empty
    return values


def test_mismatched_free_keeps_the_fixed_point_unit() -> None:
    results = run_ranks(_rank_free_mismatch, 3, timeout=60)
    assert results == [[[3.0] * 8, [3.0] * 8]] * 3


def _rank_nodes_memory(rank: int, world: int) -> None:
    import test_hierarchy as th

    import odc_runtime as odc
    from odc_runtime import testing

    # Memory with nodes (here 3 nodes of 1, 2 inbox slots): the flat tensor, the int64 accumulator, and per
    # other node an int64 staging row and a mirror row, plus K int64 inbox rows.
    odc.init("host", timeout=20, deterministic=True, node_size=1)
    transport = testing.transport()
    used = transport.heap_used()
    numel = world * 16384 + 3
    shard, nodes, slots = -(-numel // world), world, world - 1
    big = odc.shard(torch.zeros(numel, dtype=torch.bfloat16), name="big")
    delta = transport.heap_used() - used
    low = th._flat_bytes(numel, world, torch.bfloat16) + shard * (8 + (nodes - 1) * (8 + 2) + slots * 8)
    assert low <= delta <= low + th.MEMORY_SLACK, (delta, low)
    big.free()


def test_memory_with_nodes_is_the_stated_bound() -> None:
    run_ranks(_rank_nodes_memory, 3, timeout=60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3, -0.7, 0.0, 3e-39])
def test_a_push_range_is_the_range_of_the_scaled_values(dtype: torch.dtype, scale: float) -> None:
    """The window's range is taken from the unscaled source and scaled as two values (no scaled copy of the
    gradient): it must be exactly the range of the fp32 values a push quantises, or an overflow could be missed."""
    from odc_runtime.deterministic import _Unit

    g = torch.Generator().manual_seed(7)
    unit = _Unit("t", None, None)  # type: ignore[arg-type]  # the range needs no buffers
    values = []
    for i in range(3):
        src = (torch.randn(1000, generator=g) * 10.0 ** (2 * i - 2)).to(dtype)
        unit.observe(src, scale)
        values.append(src.to(torch.float32) * scale)
    lo, hi = torch.aminmax(torch.cat([torch.zeros(1), *values]))
    assert (unit.ranges[None][0].item(), unit.ranges[None][1].item()) == (lo.item(), hi.item())
    unit.observe(torch.tensor([1.0, float("nan")], dtype=dtype), scale)
    assert math.isnan(unit.ranges[None][0].item()) and math.isnan(unit.ranges[None][1].item())
