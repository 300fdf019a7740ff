"""The nvshmem transport's Python paths through the public API, on CPU, with a fake extension and fake CUDA
streams/events: which extension plans are built (kinds, peer addresses, element offsets), that the fast path
reuses them, that barriers are numbered and at most one is in flight, the side/internal stream use of async and
cross-node operations, allocation offsets and the free quarantine, and the failure state after an abort.
No data moves (the fake Plan records its calls); the GPU tests check the values."""

from __future__ import annotations

import array
import itertools
import types

import pytest
import torch
from _dist import run_ranks

import odc_runtime as odc

ARENA = 1 << 40


class FakeStream:
    def __init__(self, ptr: int) -> None:
        self.cuda_stream = ptr
        self.waits: list[object] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waits.append(other)

    def wait_event(self, event: FakeEvent) -> None:
        self.waits.append(event)


class FakeEvent:
    done = True

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream

    def query(self) -> bool:
        return FakeEvent.done


def _fake_ext(calls: list) -> types.SimpleNamespace:
    class Plan:
        def __init__(self, engine, kind, addr, rel, numel, pe) -> None:
            self.spec = (kind, list(addr), list(rel), list(numel), list(pe))
            calls.append(("plan", self.spec))

        def run(self, base, dtype, scale, stream) -> None:
            calls.append(("run", self.spec[0], base, dtype, scale, stream))

    class Engine:
        def __init__(self) -> None:
            self.epochs: list[int] = []
            self.abort = False

        def barrier(self, epoch, stream) -> None:
            self.epochs.append(epoch)
            calls.append(("barrier", epoch, stream))

        def quiet(self, stream) -> None:
            calls.append(("quiet", stream))

        def set_abort(self) -> None:
            self.abort = True

        def barrier_gave_up(self) -> bool:
            return self.abort

        def heard(self) -> list[int]:
            return [99, 0]

    return types.SimpleNamespace(
        DTYPE_FLOAT32=10, DTYPE_BFLOAT16=11, DTYPE_FLOAT16=12, PLAN_FETCH_COPY=0, PLAN_FETCH_KERNEL=1,
        PLAN_FETCH_STAGED=2, PLAN_PUSH_ATOMIC=3, PLAN_PUSH_LOCKED=4, Plan=Plan, Engine=Engine,
    )


def _install(monkeypatch, world: int, peer_bases: list[int], atomic: bool, fetch: str = "copy"):
    from odc_runtime import api, config
    from odc_runtime.transport import nvshmem

    current = FakeStream(1000)
    made = iter(range(2000, 3000))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(next(made)))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(nvshmem, "_raw_stream", lambda index: current.cuda_stream)

    def wrap(ptr, nbytes, device):
        # Like torch with __cuda_array_interface__: the tensor (and every view) keeps `owner` alive.
        owner = array.array("B", bytes(nbytes))
        return torch.frombuffer(owner, dtype=torch.uint8), owner

    monkeypatch.setattr(nvshmem, "_wrap", wrap)
    monkeypatch.setattr(nvshmem, "_record", lambda t, stream: None)
    calls: list = []
    ext = _fake_ext(calls)
    transport = nvshmem.NvshmemTransport(
        ext, 0, world, torch.device("cpu"), 5.0, settings=config.NvshmemSettings(fetch=fetch), slots=4,
        capacity=1 << 20, arena=ARENA, peer_bases=peer_bases, engine=ext.Engine(), atomic_push=atomic,
    )
    api._runtime = api._Runtime(transport=transport, generation=next(api._generations), shards=itertools.count())
    return transport, calls, current


def _rank_fake_nvshmem(rank: int, world: int) -> None:
    import math

    monkeypatch = pytest.MonkeyPatch()
    try:
        peer = 1 << 41
        transport, calls, current = _install(monkeypatch, 1, [peer], atomic=True)
        st = odc.shard(torch.zeros(2, 5), name="w")
        epochs = [c[1] for c in calls if c[0] == "barrier"]
        assert epochs == list(range(1, len(epochs) + 1)) and len(epochs) >= 2, calls  # alloc x2 + shard

        # fetch: one copy-engine plan over the peer pointer of the parameter buffer, made once, reused.
        calls.clear()
        out = torch.empty(2, 5)
        for _ in range(3):
            odc.fetch(st, out=out)
        plans = [c[1] for c in calls if c[0] == "plan"]
        runs = [c for c in calls if c[0] == "run"]
        offset = st._param.handle.offset
        assert plans == [(0, [peer + offset], [0], [10], [0])], plans
        assert len(runs) == 3 and all(r[2] == out.data_ptr() and r[3] == 10 and r[5] == 1000 for r in runs), runs

        # push: atomic plan into the grad buffer; bf16 gradients give the bf16 code; scale passed through.
        calls.clear()
        odc.push(st, torch.ones(2, 5, dtype=torch.bfloat16), scale=0.5)
        odc.push(st, torch.ones(2, 5, dtype=torch.bfloat16), scale=0.25)
        plans = [c[1] for c in calls if c[0] == "plan"]
        runs = [c for c in calls if c[0] == "run"]
        assert plans == [(3, [peer + st._grad.handle.offset], [0], [10], [0])], plans
        assert [(r[1], r[3], r[4]) for r in runs] == [(3, 11, 0.5), (3, 11, 0.25)], runs
        with pytest.raises(odc.OdcUsageError, match="scale"):
            odc.push(st, torch.ones(2, 5, dtype=torch.bfloat16), scale=math.inf)

        # async: runs on the side stream (which first waits for the current one); wait() joins it back.
        calls.clear()
        handle = odc.push(st, torch.ones(2, 5), async_op=True)
        run = next(c for c in calls if c[0] == "run")
        assert run[5] == transport._side.cuda_stream and current in transport._side.waits
        handle.wait()
        assert current.waits and isinstance(current.waits[-1], FakeEvent)

        # sync: one barrier per call, numbered on; the previous one is waited for first (FakeEvent completes).
        calls.clear()
        odc.sync()
        odc.sync()
        barrier_epochs = [c[1] for c in calls if c[0] == "barrier"]
        assert barrier_epochs[1] == barrier_epochs[0] + 1 and all(c[2] == 1000 for c in calls if c[0] == "barrier")

        # free: the range is quarantined while `view` lives, so the next shard gets a different offset.
        view = st.local
        old = st._param.handle.offset
        st.free()
        st2 = odc.shard(torch.zeros(2, 5), name="w2")
        assert old not in (st2._param.handle.offset, st2._grad.handle.offset)
        with pytest.raises(odc.OdcUsageError, match="freed"):
            odc.fetch(st, out=out)
        del view, st
        st3 = odc.shard(torch.zeros(2, 5), name="w3")
        assert old in (st3._param.handle.offset, st3._grad.handle.offset)  # no view left anywhere: reused

        # An abort (deadline passed) fails the transport; every later call raises the timeout.
        FakeEvent.done = False
        entry = transport._last_barrier
        entry.deadline = 0.0
        with pytest.raises(odc.OdcTimeoutError, match=r"rank\(s\) 1 did not arrive"):
            odc.sync()
        with pytest.raises(odc.OdcTimeoutError):
            odc.fetch(st2, out=out)
        with pytest.raises(odc.OdcTimeoutError):
            odc.push(st2, torch.ones(2, 5))
        FakeEvent.done = True
        odc.api._runtime = None
        transport._finalized = True
    finally:
        monkeypatch.undo()


def _rank_fake_far(rank: int, world: int) -> None:
    monkeypatch = pytest.MonkeyPatch()
    try:
        # No peer pointer (another node) and the locked protocol: staged fetch and locked push, both on the
        # internal stream, joined back into the current one; locked pushes get a deadline too.
        transport, calls, current = _install(monkeypatch, 1, [0], atomic=False, fetch="kernel")
        st = odc.shard(torch.zeros(7), name="far")
        calls.clear()
        odc.fetch(st)
        odc.push(st, torch.ones(7))
        plans = [c[1] for c in calls if c[0] == "plan"]
        assert [p[0] for p in plans] == [2, 4], plans
        assert plans[0][1] == [ARENA + st._param.handle.offset] and plans[1][1] == [ARENA + st._grad.handle.offset]
        runs = [c for c in calls if c[0] == "run"]
        assert all(r[5] == transport._remote.cuda_stream for r in runs), runs
        assert current in transport._remote.waits and isinstance(current.waits[-1], FakeEvent)
        assert any(p.op == "push" for p in transport._watchdog.outstanding())
        view = st.local
        odc.finalize()  # waits (bounded) for the outstanding barrier and push, then drops all state
        assert transport._finalized
        assert st._param.freed and view.numel() == 7  # the view stays valid: nothing was unmapped
        with pytest.raises(odc.OdcNotInitializedError):
            odc.fetch(st)
        with pytest.raises(odc.OdcNotInitializedError):
            transport.barrier("late")
        from odc_runtime.transport import nvshmem

        assert nvshmem._initialized_once  # NVSHMEM cannot start twice in a process: create() refuses
    finally:
        monkeypatch.undo()


def test_nvshmem_python_paths_with_a_fake_extension() -> None:
    run_ranks(_rank_fake_nvshmem, 1, timeout=60)


def test_nvshmem_cross_node_paths_with_a_fake_extension() -> None:
    run_ranks(_rank_fake_far, 1, timeout=60)


def _rank_fake_mixed(rank: int, world: int) -> None:
    monkeypatch = pytest.MonkeyPatch()
    try:
        # A 3-PE transport seen from PE 0 (torch.distributed has 1 rank here; only the transport's view matters):
        # PEs 0 and 2 have peer pointers, PE 1 does not (another node). numel 10 -> shards of 4: [0,4) [4,8) [8,10).
        p0, p2 = 1 << 41, 1 << 42
        transport, calls, _ = _install(monkeypatch, 3, [p0, 0, p2], atomic=False)
        st = odc.shard(torch.zeros(10), name="mixed")
        calls.clear()
        odc.fetch(st)
        plans = [c[1] for c in calls if c[0] == "plan"]
        off = st._param.handle.offset
        # owners in rotated order 1, 2, 0; near (copy engines) for 2 and 0, far (staged) for 1
        assert plans == [(0, [p2 + off, p0 + off], [8, 0], [2, 4], [2, 0]), (2, [ARENA + off], [4], [4], [1])], plans
        calls.clear()
        odc.push(st, torch.ones(10))
        plans = [c[1] for c in calls if c[0] == "plan"]
        goff = st._grad.handle.offset
        # locked protocol for the whole job: every owner, those with peer pointers included, in one far plan
        assert plans == [(4, [ARENA + goff] * 3, [4, 8, 0], [4, 2, 4], [1, 2, 0])], plans
        odc.api._runtime = None
        transport._finalized = True
    finally:
        monkeypatch.undo()


def test_nvshmem_mixed_reach_and_locked_protocol_with_a_fake_extension() -> None:
    run_ranks(_rank_fake_mixed, 1, timeout=60)
