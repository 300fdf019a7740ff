"""The nvshmem transport's Python paths through the public API, on CPU, with a fake extension and fake CUDA
streams/events: which extension plans are built (kinds, peer addresses, element offsets), that the fast path
reuses them, that barriers are numbered and at most one is in flight, the side/internal stream use of async and
cross-node operations, allocation offsets and the free quarantine, and the failure state after an abort; the
transport calls of the hierarchical protocol (element offsets into peers' regions, put_signal, wait_signal with
its deadline, release and error, node_size). No data moves (the fake Plan and Engine record their calls); the
GPU tests check the values. Issue 22: network plans name owners' ranges by symmetric offset, and a locked push
from two PEs whose heap bases differ is executed through the most hostile interleaving; an abort raised by the
engine's deadline thread surfaces as the late operation's timeout; finalize after a failure returns."""

from __future__ import annotations

import array
import types
import weakref

import pytest
import torch
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import testing

ARENA = 1 << 40


class FakeStream:
    def __init__(self, ptr: int) -> None:
        self.cuda_stream = ptr
        self.waits: list[object] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waits.append(other)

    def wait_event(self, event: FakeEvent) -> None:
        self.waits.append(event)


_EVENTS: weakref.WeakValueDictionary[int, FakeEvent] = weakref.WeakValueDictionary()


class FakeEvent:
    done = True

    @property
    def cuda_event(self) -> int:  # the raw handle the watchdog passes to the extension's query_event
        _EVENTS[id(self)] = self
        return id(self)

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream

    def query(self) -> bool:
        return FakeEvent.done

    def state(self) -> bool:
        """What the extension's query_event reads (torch's query() may differ: see test_nvshmem_abort.py)."""
        return self.query()


def _fake_ext(calls: list) -> types.SimpleNamespace:
    class Plan:
        def __init__(self, engine, kind, addr, rel, numel, pe, acc_dtype=None) -> None:
            self.spec = (kind, list(addr), list(rel), list(numel), list(pe))
            calls.append(("plan", self.spec))

        def run(self, base, dtype, scale, stream) -> None:
            calls.append(("run", self.spec[0], base, dtype, scale, stream))

    class Engine:
        def __init__(self) -> None:
            self.epochs: list[int] = []
            self.abort = False
            self.waits = 0
            self.watched: list[tuple[int, float]] = []

        def watch(self, stream, timeout_s) -> None:
            self.watched.append((stream, timeout_s))

        def aborted(self) -> bool:
            return self.abort

        def _refuse_after_abort(self) -> None:  # what engine.cu does for every launch once the abort is up
            if self.abort:
                raise RuntimeError("the transport was aborted after a timeout; restart the job")

        def watching(self) -> int:
            return 0

        def barrier(self, epoch, stream) -> None:
            self._refuse_after_abort()
            self.epochs.append(epoch)
            calls.append(("barrier", epoch, stream))

        def quiet(self, stream) -> None:
            calls.append(("quiet", stream))

        def set_abort(self) -> None:
            self.abort = True

        def barrier_gave_up(self) -> int:
            return self.epochs[-1] if self.abort and self.epochs else 0

        def heard(self) -> list[int]:
            return [99, 0]

        def put_signal(self, remote, local, nbytes, pe, near, sig, stream) -> None:
            self._refuse_after_abort()
            calls.append(("put_signal", list(remote), list(local), list(nbytes), list(pe), list(near), list(sig),
                          stream))

        def wait_signal(self, sig, value, stream) -> int:
            self._refuse_after_abort()
            calls.append(("wait_signal", sig, value, stream))
            self.waits += 1
            return self.waits

        def wait_gave_up(self) -> int:
            return self.waits if self.abort else 0

        def wait_seen(self) -> int:
            return 5

    def query_event(event: int) -> int:
        """The extension's query in the thread-local capture mode: the fake event's state."""
        return 20 if _EVENTS[event].state() else 21

    return types.SimpleNamespace(
        DTYPE_FLOAT32=10, DTYPE_BFLOAT16=11, DTYPE_FLOAT16=12, DTYPE_INT64=13, PLAN_FETCH_COPY=0, PLAN_FETCH_KERNEL=1,
        PLAN_FETCH_STAGED=2, PLAN_PUSH_ATOMIC=3, PLAN_PUSH_LOCKED=4, Plan=Plan, Engine=Engine,
        EVENT_DONE=20, EVENT_PENDING=21, query_event=query_event,
    )


class _Owner:
    """What a fake symmetric view keeps alive (weakly referenced by the free quarantine)."""


def _offsets(st: odc.ShardedTensor) -> tuple[int, int]:
    """Symmetric heap offsets of ``st``'s parameter and gradient buffers (their nvshmem ``HeapBlock``)."""
    param, grad = testing.buffers(st)
    return param.handle.offset, grad.handle.offset  # type: ignore[union-attr]


def _install(
    monkeypatch, world: int, peer_bases: list[int], atomic: bool, fetch: str = "copy", node: int | str = 1,
    backed: bool = False,
):
    """A fake transport as PE 0. ``backed``: the arena is real CPU memory (views of buffers have addresses inside
    it, as on the GPU), so the heap-membership check of cross-node puts can be exercised."""
    from odc_runtime import config
    from odc_runtime.transport import nvshmem
    from odc_runtime.transport.nvshmem import memory as nv_memory
    from odc_runtime.transport.nvshmem import plans as nv_plans

    current = FakeStream(1000)
    made = iter(range(2000, 3000))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(next(made)))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(nv_plans, "raw_stream", lambda index: current.cuda_stream)

    def wrap(ptr, nbytes, device):
        # Like torch with __cuda_array_interface__: the tensor (and every view) keeps `owner` alive.
        owner = array.array("B", bytes(nbytes))
        return torch.frombuffer(owner, dtype=torch.uint8), owner

    arena = ARENA
    if backed:
        memory = torch.zeros(1 << 20, dtype=torch.uint8)
        arena = memory.data_ptr()

        def wrap(ptr, nbytes, device):  # the backed variant
            return memory[ptr - arena : ptr - arena + nbytes], _Owner()

    monkeypatch.setattr(nv_memory, "wrap", wrap)
    monkeypatch.setattr(nv_plans, "record", lambda t, stream: None)
    calls: list = []
    ext = _fake_ext(calls)
    transport = nvshmem.NvshmemTransport(
        ext, 0, world, torch.device("cpu"), 5.0, settings=config.NvshmemSettings(fetch=fetch), scratch_slots=4,
        capacity=1 << 20, arena=arena, peer_bases=peer_bases, engine=ext.Engine(), atomic_push=atomic, node=node,
    )
    testing.install(transport)
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
        offset = _offsets(st)[0]
        assert plans == [(0, [peer + offset], [0], [10], [0])], plans
        assert len(runs) == 3 and all(r[2] == out.data_ptr() and r[3] == 10 and r[5] == 1000 for r in runs), runs

        # push: atomic plan into the grad buffer; bf16 gradients give the bf16 code; scale passed through.
        calls.clear()
        odc.push(st, torch.ones(2, 5, dtype=torch.bfloat16), scale=0.5)
        odc.push(st, torch.ones(2, 5, dtype=torch.bfloat16), scale=0.25)
        plans = [c[1] for c in calls if c[0] == "plan"]
        runs = [c for c in calls if c[0] == "run"]
        assert plans == [(3, [peer + _offsets(st)[1]], [0], [10], [0])], plans
        assert [(r[1], r[3], r[4]) for r in runs] == [(3, 11, 0.5), (3, 11, 0.25)], runs
        with pytest.raises(odc.OdcUsageError, match="scale"):
            odc.push(st, torch.ones(2, 5, dtype=torch.bfloat16), scale=math.inf)

        # async: runs on the side stream (which first waits for the current one); wait() joins it back.
        calls.clear()
        handle = odc.push(st, torch.ones(2, 5), async_op=True)
        run = next(c for c in calls if c[0] == "run")
        assert run[5] == transport._streams.side.cuda_stream and current in transport._streams.side.waits
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
        old = _offsets(st)[0]
        st.free()
        st2 = odc.shard(torch.zeros(2, 5), name="w2")
        assert old not in _offsets(st2)
        with pytest.raises(odc.OdcUsageError, match="freed"):
            odc.fetch(st, out=out)
        del view, st
        st3 = odc.shard(torch.zeros(2, 5), name="w3")
        assert old in _offsets(st3)  # no view left anywhere: reused

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
        testing.uninstall()
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
        # network plans name the owner's range by its symmetric offset (the same on every PE), never an address
        assert plans[0][1] == [_offsets(st)[0]] and plans[1][1] == [_offsets(st)[1]]
        runs = [c for c in calls if c[0] == "run"]
        remote = transport._streams.remote
        assert all(r[5] == remote.cuda_stream for r in runs), runs
        assert current in remote.waits and isinstance(current.waits[-1], FakeEvent)
        assert (remote.cuda_stream, 5.0) in [(s, round(t)) for s, t in transport._engine.watched]  # C++ deadline
        assert any(p.op == "push" for p in transport._watchdog.outstanding())
        view = st.local
        odc.finalize()  # waits (bounded) for the outstanding barrier and push, then drops all state
        assert transport._finalized
        assert testing.buffers(st)[0].freed and view.numel() == 7  # the view stays valid: nothing was unmapped
        with pytest.raises(odc.OdcNotInitializedError):
            odc.fetch(st)
        with pytest.raises(odc.OdcNotInitializedError):
            transport.barrier("late")
        from odc_runtime.transport import nvshmem

        assert nvshmem.extension.started  # NVSHMEM cannot start twice in a process: create() refuses
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
        off = _offsets(st)[0]
        # owners in rotated order 1, 2, 0; near (copy engines) for 2 and 0, far (staged) for 1
        assert plans == [(0, [p2 + off, p0 + off], [8, 0], [2, 4], [2, 0]), (2, [off], [4], [4], [1])], plans
        calls.clear()
        odc.push(st, torch.ones(10))
        plans = [c[1] for c in calls if c[0] == "plan"]
        goff = _offsets(st)[1]
        # locked protocol for the whole job: every owner, those with peer pointers included, in one far plan
        assert plans == [(4, [goff] * 3, [4, 8, 0], [4, 2, 4], [1, 2, 0])], plans
        with pytest.raises(odc.OdcUsageError, match="a runtime is live"):
            testing.install(transport)
        assert testing.uninstall() is transport and not odc.is_initialized() and testing.uninstall() is None
        transport._finalized = True
    finally:
        monkeypatch.undo()


def test_nvshmem_mixed_reach_and_locked_protocol_with_a_fake_extension() -> None:
    run_ranks(_rank_fake_mixed, 1, timeout=60)


def _rank_fake_hierarchy(rank: int, world: int) -> None:
    import time

    from odc_runtime.transport.base import FetchRequest, Piece, PushRequest, PutRequest

    monkeypatch = pytest.MonkeyPatch()
    try:
        # PE 0 of 4: PEs 0 and 1 share a node (peer pointers), 2 and 3 are on another one; atomic push is off
        # (multi-node job), so accumulates take the locked plan. The arena is real memory (backed).
        transport, calls, current = _install(monkeypatch, 4, [1, 1, 0, 0], atomic=False, node=2, backed=True)
        p0, p1 = transport._heap.arena + (1 << 41), transport._heap.arena + (1 << 42)
        transport._plans.peer_bases[:2] = [p0, p1]
        assert transport.node_size() == 2
        buf = transport.alloc(40, torch.float32, "staging")
        sig = transport.alloc(3, torch.int64, "signal")
        off, soff = buf.handle.offset, sig.handle.offset

        # get / accumulate with element offsets into the peer's region: near by peer pointer, far symmetric.
        calls.clear()
        dst = torch.empty(6)
        transport.fetch(buf, [FetchRequest(1, dst[:4], 30), FetchRequest(2, dst[4:], 7)])
        plans = [c[1] for c in calls if c[0] == "plan"]
        rel = dst.data_ptr() // 4
        assert plans == [(0, [p1 + off + 30 * 4], [rel], [4], [1]), (2, [off + 7 * 4], [rel + 4], [2], [2])]
        calls.clear()
        grad = torch.ones(5, dtype=torch.bfloat16)
        transport.push(buf, [PushRequest(1, grad[:3], 37), PushRequest(3, grad[3:], 0)], 0.5)
        plans = [c[1] for c in calls if c[0] == "plan"]
        grel = grad.data_ptr() // 2
        assert plans == [(4, [off + 37 * 4, off], [grel, grel + 3], [3, 2], [1, 3])], plans
        flat = torch.zeros(9)
        calls.clear()
        plan = transport.plan(buf, "fetch", [Piece(1, 0, 5, 35), Piece(2, 5, 4, 1)])
        plan.run(flat)
        plans = [c[1] for c in calls if c[0] == "plan"]
        assert plans == [(0, [p1 + off + 35 * 4], [0], [5], [1]), (2, [off + 4], [5], [4], [2])], plans
        assert [c[2] for c in calls if c[0] == "run"] == [flat.data_ptr(), flat.data_ptr()]

        # Out of range (offset + numel > numel, negative offset, bad peer): typed error, nothing issued.
        calls.clear()
        with pytest.raises(odc.OdcUsageError, match=r"\[37, 41\).*out of its range \[0, 40\)"):
            transport.fetch(buf, [FetchRequest(1, dst[:2], 0), FetchRequest(2, dst[:4], 37)])
        with pytest.raises(odc.OdcUsageError, match="out of its range"):
            transport.push(buf, [PushRequest(0, grad[:1], -1)], 1.0)
        with pytest.raises(odc.OdcUsageError, match="out of its range"):
            transport.plan(buf, "push", [Piece(0, 0, 2, 39)])
        with pytest.raises(odc.OdcUsageError, match="peer 4 out of range"):
            transport.fetch(buf, [FetchRequest(4, dst[:1], 0)])
        assert calls == [], calls

        # put_signal: same-node peer by peer pointer (any source), other node from inside the symmetric heap.
        calls.clear()
        rows = buf.local
        transport.put_signal(
            buf, [PutRequest(1, rows[:8], 16, 0), PutRequest(2, rows[8:12], 4, 2), PutRequest(3, rows[:0], 0, 1)], sig
        )
        (call,) = calls
        assert call == (
            "put_signal",
            [p1 + off + 16 * 4, off + 4 * 4, off],
            [rows.data_ptr(), rows.data_ptr() + 32, rows[:0].data_ptr()],  # (torch: 0 for an empty view)
            [32, 16, 0],
            [1, 2, 3],
            [True, False, False],
            [soff, soff + 16, soff + 8],
            current.cuda_stream,
        ), call
        calls.clear()
        outside = torch.ones(4)
        transport.put_signal(buf, [PutRequest(1, outside, 0, 0)], sig)  # same node: any device memory
        assert len(calls) == 1
        calls.clear()
        with pytest.raises(odc.OdcUsageError, match="not inside the symmetric heap"):
            transport.put_signal(buf, [PutRequest(1, outside, 0, 0), PutRequest(2, outside, 0, 0)], sig)
        with pytest.raises(odc.OdcUsageError, match="out of its range"):
            transport.put_signal(buf, [PutRequest(1, rows[:8], 33, 0)], sig)
        with pytest.raises(odc.OdcUsageError, match="signal index 3"):
            transport.put_signal(buf, [PutRequest(1, rows[:8], 0, 3)], sig)
        with pytest.raises(odc.OdcUsageError, match="int64"):
            transport.put_signal(buf, [PutRequest(1, rows[:8], 0, 0)], buf)
        with pytest.raises(odc.OdcUsageError, match="dtype"):
            transport.put_signal(buf, [PutRequest(1, grad, 0, 0)], sig)
        assert calls == [], calls

        # wait_signal: launched on the current stream, held by the watchdog with its deadline; the host returns.
        engine = transport._engine

        class PendingEvent(FakeEvent):
            """A wait kernel that only leaves when the abort is raised (the peers never put)."""

            def query(self) -> bool:
                return engine.abort

        monkeypatch.setattr(torch.cuda, "Event", PendingEvent)
        transport.wait_signal(sig, 2, 7, "sync (hierarchical push)", [2, 3])
        assert calls == [("wait_signal", soff + 16, 7, current.cuda_stream)], calls
        entry = transport._watchdog.outstanding()[-1]
        assert entry.wait == (2, 7, (2, 3)) and entry.op == "sync (hierarchical push)" and entry.wait_id == 1
        assert transport.failure is None and not engine.abort
        with pytest.raises(odc.OdcUsageError, match="negative"):
            transport.wait_signal(sig, 0, -1, "w", [])
        # Past the deadline the watchdog (its own thread) raises the abort, which releases the wait kernel, and
        # records the error; the next call into the transport raises it.
        entry.deadline = 0.0
        end = time.monotonic() + 30
        while transport.failure is None and time.monotonic() < end:
            time.sleep(0.01)
        assert engine.abort, "the wait was not released"
        pattern = r"odc sync \(hierarchical push\): rank 0 .*rank\(s\) 2, 3: signal word 2 reached 5 of 7"
        with pytest.raises(odc.OdcTimeoutError, match=pattern):
            transport.put_signal(buf, [PutRequest(1, rows[:8], 0, 0)], sig)
        with pytest.raises(odc.OdcTimeoutError, match="still usable"):
            transport.wait_signal(sig, 0, 1, "w", [])
        with pytest.raises(odc.OdcTimeoutError):
            transport.fetch(buf, [FetchRequest(1, dst, 0)])
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        testing.uninstall()
        transport._finalized = True
    finally:
        monkeypatch.undo()


def test_nvshmem_hierarchy_calls_with_a_fake_extension() -> None:
    run_ranks(_rank_fake_hierarchy, 1, timeout=120)


def _rank_fake_node_unknown(rank: int, world: int) -> None:
    monkeypatch = pytest.MonkeyPatch()
    try:
        transport, _, _ = _install(monkeypatch, 2, [1, 0], atomic=False, node="why it cannot be derived")
        with pytest.raises(odc.OdcUsageError, match="why it cannot be derived"):
            transport.node_size()
        testing.uninstall()
        transport._finalized = True
    finally:
        monkeypatch.undo()


def test_nvshmem_node_size_not_derivable_raises_with_a_fake_extension() -> None:
    run_ranks(_rank_fake_node_unknown, 1, timeout=60)


def _rank_fake_node_atomics(rank: int, world: int) -> None:
    from odc_runtime.transport.base import PushRequest

    monkeypatch = pytest.MonkeyPatch()
    try:
        # PE 0 of 4 in a multi-node job (no job-wide atomics): PEs 0, 1 share a node. Before use_nodes every push
        # is locked; after it, pushes inside the node are atomics through the peer pointer and a push across
        # nodes is refused before anything is issued (mixing the protocols on the same words loses updates).
        transport, calls, _ = _install(monkeypatch, 4, [1, 1, 0, 0], atomic=False, node=2, backed=True)
        p1 = transport._heap.arena + (1 << 42)
        transport._plans.peer_bases[:2] = [transport._heap.arena + (1 << 41), p1]
        buf = transport.alloc(8, torch.float32, "acc")
        src = torch.ones(4)
        calls.clear()
        transport.push(buf, [PushRequest(1, src)], 1.0)
        assert [c[1][0] for c in calls if c[0] == "plan"] == [4], "locked protocol before use_nodes"
        transport.use_nodes(2)
        calls.clear()
        transport.push(buf, [PushRequest(1, src)], 1.0)
        plans = [c[1] for c in calls if c[0] == "plan"]
        assert plans == [(3, [p1 + buf.handle.offset], [src.data_ptr() // 4], [4], [1])], plans
        calls.clear()
        with pytest.raises(odc.OdcUsageError, match="on another node outside the hierarchical protocol"):
            transport.push(buf, [PushRequest(1, src), PushRequest(2, src)], 1.0)
        assert calls == []
        testing.uninstall()
        transport._finalized = True
    finally:
        monkeypatch.undo()


def test_nvshmem_intra_node_atomics_once_the_hierarchy_is_on() -> None:
    run_ranks(_rank_fake_node_atomics, 1, timeout=60)


# -- issue 36: deterministic mode's int64 push; every other mix with an int64 accumulator refused --------------
def _rank_fake_int64_push(rank: int, world: int, atomic: bool) -> None:
    from odc_runtime.transport.base import Piece, PushRequest

    monkeypatch = pytest.MonkeyPatch()
    try:
        # PE 0 of 2 with peer pointers: atomic plans, or (atomic=False) the locked protocol.
        transport, calls, _ = _install(monkeypatch, 2, [1 << 41, 1 << 42], atomic=atomic)
        assert transport.capabilities.deterministic
        kind = 3 if atomic else 4
        fixed = transport.alloc(8, torch.int64, "fixed")
        acc = transport.alloc(8, torch.float32, "acc")
        q = torch.arange(8, dtype=torch.int64) * (1 << 40)
        calls.clear()
        transport.push(fixed, [PushRequest(1, q[:4], 4)], 1.0)
        plan = transport.plan(fixed, "push", [Piece(0, 0, 8, 0)])
        plan.run(q)
        # the int64 code (13) to the kernels; the plan names the accumulator's element type too
        assert [(c[1], c[3], c[4]) for c in calls if c[0] == "run"] == [(kind, 13, 1.0)] * 2, calls
        assert [c[1][0] for c in calls if c[0] == "plan"] == [kind, kind]
        calls.clear()
        only_int64, only_fp32 = "an int64 accumulator .* takes int64 sources only", "int64 sources go into an int64"
        refused = [
            (only_int64, lambda: transport.push(fixed, [PushRequest(1, q[:4].float())], 1.0)),
            (only_int64, lambda: plan.run(q.to(torch.bfloat16))),
            ("take scale 1, got 0.5", lambda: transport.push(fixed, [PushRequest(1, q[:4])], 0.5)),
            ("take scale 1, got 0.5", lambda: plan.run(q, 0.5)),
            ("take scale 1, got 0.5", lambda: plan.run(q, 0.5, async_op=True)),
            (only_fp32, lambda: transport.push(acc, [PushRequest(1, q[:4])], 1.0)),
            (only_fp32, lambda: transport.plan(acc, "push", [Piece(0, 0, 8, 0)]).run(q)),
            # several dtypes in one push: refused whole, before the fp32 group is issued
            (only_fp32, lambda: transport.push(acc, [PushRequest(1, torch.ones(4)), PushRequest(0, q[:4])], 1.0)),
        ]
        for pattern, call in refused:
            with pytest.raises(odc.OdcUsageError, match=pattern):
                call()
        assert not [c for c in calls if c[0] == "run"], calls  # nothing issued
        with pytest.raises(odc.OdcUsageError, match=r"accumulators must be float32 \(or int64"):
            transport.push(transport.alloc(8, torch.float16, "half"), [PushRequest(1, torch.ones(4))], 1.0)
        assert transport.failure is None  # misuse never fails the transport
        testing.uninstall()
        transport._finalized = True
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("atomic", [True, False])
def test_int64_push_and_its_refusals_with_a_fake_extension(atomic: bool) -> None:
    run_ranks(_rank_fake_int64_push, 1, atomic, timeout=60)


# -- issue 22: the locked push with PEs whose heap bases differ; finalize after a failure ---------------------
def _run_locked_kernel(runs: list, owner: torch.Tensor, cell_bytes: int) -> None:
    """Executes queued locked-push launches the way ``csrc/cells.cu`` does, one step of each launch in turn (the
    most hostile interleaving of two pushers): per cell of the owner's arena, taken from the numbers the plan was
    given, lock -> get -> add -> put -> release. ``owner`` is PE 2's arena (fp32); a plan's ``addr`` is the
    symmetric offset of the owner's range, the kernel's only input for cells and locks."""
    import ctypes

    held: dict[int, object] = {}

    def launch(spec: tuple, base: int, scale: float):
        _, addr, rel, numel, _ = spec
        for a, r, n in zip(addr, rel, numel, strict=True):
            src = torch.frombuffer((ctypes.c_float * n).from_address(base + r * 4), dtype=torch.float32)
            begin, end = a, a + 4 * n
            for cell in range(begin // cell_bytes, (end - 1) // cell_bytes + 1):  # the kernel's cells
                lo, hi = max(begin, cell * cell_bytes), min(end, (cell + 1) * cell_bytes)
                while held.setdefault(cell, spec) is not spec:  # ticket lock of this cell (lock ~ cell)
                    yield
                yield
                slot = owner[lo // 4 : hi // 4].clone()  # get
                yield
                slot += src[(lo - begin) // 4 : (hi - begin) // 4] * scale  # add
                yield
                owner[lo // 4 : hi // 4] = slot  # put
                yield
                del held[cell]  # release

    steps = [launch(spec, base, scale) for spec, base, scale in runs]
    while steps:
        for s in list(steps):
            if next(s, StopIteration) is StopIteration:
                steps.remove(s)


def _rank_locked_push_different_heap_bases(rank: int, world: int) -> None:
    from odc_runtime import config
    from odc_runtime.transport import nvshmem
    from odc_runtime.transport.base import PushRequest

    monkeypatch = pytest.MonkeyPatch()
    try:
        # PEs 0 and 1 push into PE 2 over the network (no peer pointers: the locked protocol). Each process reserved
        # its own virtual range for the heap, so the arenas of PE 0 and PE 1 start at different addresses.
        transport0, _, _ = _install(monkeypatch, 3, [0, 0, 0], atomic=False, backed=True)
        runs: list = []

        class Plan:
            def __init__(self, engine, kind, addr, rel, numel, pe, acc_dtype=None) -> None:
                self.spec = (kind, list(addr), list(rel), list(numel), list(pe))

            def run(self, base, dtype, scale, stream) -> None:
                runs.append((self.spec, base, scale))

        transport0._C.Plan = Plan
        other = torch.zeros(1 << 20, dtype=torch.uint8)  # PE 1's arena: another base address
        transport1 = nvshmem.NvshmemTransport(
            transport0._C, 1, 3, torch.device("cpu"), 5.0, settings=config.NvshmemSettings(), scratch_slots=4,
            capacity=1 << 20, arena=other.data_ptr(), peer_bases=[0, 0, 0], engine=transport0._C.Engine(),
            atomic_push=False, node=1,
        )
        assert transport0._heap.arena != transport1._heap.arena
        cell = transport0.settings.cell_bytes
        bufs = []
        for t in (transport0, transport1):
            t.alloc(cell // 4 - 3, torch.float32, "pad")  # the accumulator below straddles a cell boundary
            bufs.append(t.alloc(64, torch.float32, "acc"))
        assert bufs[0].handle.offset == bufs[1].handle.offset  # same allocation sequence: same symmetric offset
        grads = [torch.full((64,), 1.0), torch.full((64,), 2.0)]
        for t, buf, g in zip((transport0, transport1), bufs, grads, strict=True):
            t.push(buf, [PushRequest(2, g, 0)], 1.0)
        (spec0, _, _), (spec1, _, _) = runs
        assert spec0[0] == spec1[0] == 4, "locked plans"
        # The kernels derive the owner's cells and ticket locks from what the plan gives them: both pushers must
        # name PE 2's range by the same number, or they take different locks for the same cell.
        assert spec0[1] == spec1[1], f"PE 0 and PE 1 name PE 2's accumulator differently: {spec0[1]} vs {spec1[1]}"
        owner = torch.zeros((1 << 20) // 4)
        _run_locked_kernel(runs, owner, cell)
        off = bufs[0].handle.offset // 4
        assert torch.equal(owner[off : off + 64], torch.full((64,), 3.0)), "an update was lost"
        testing.uninstall()
        transport0._finalized = transport1._finalized = True
    finally:
        monkeypatch.undo()


def test_locked_push_from_pes_with_different_heap_bases_loses_no_update() -> None:
    run_ranks(_rank_locked_push_different_heap_bases, 1, timeout=60)


def _rank_finalize_after_failure(rank: int, world: int) -> None:
    from odc_runtime.transport.nvshmem import watchdog

    monkeypatch = pytest.MonkeyPatch()
    try:
        transport, calls, _ = _install(monkeypatch, 2, [1 << 41, 1 << 42], atomic=True)
        monkeypatch.setattr(watchdog, "ABORT_GRACE_S", 0.05)
        st = odc.shard(torch.zeros(4), name="w")
        odc.sync()
        FakeEvent.done = False  # a peer never arrived at that barrier: it is late when the next sync waits for it
        transport._last_barrier.deadline = 0.0
        with pytest.raises(odc.OdcTimeoutError):
            odc.sync()
        assert isinstance(transport.failure, odc.OdcTimeoutError)  # the contract's failure state
        calls.clear()
        odc.finalize()  # documented: after a failure it releases the local state and returns
        assert transport._finalized and testing.buffers(st)[0].freed
        assert not [c for c in calls if c[0] == "barrier"], "finalize must not wait for the peers again"
        assert not odc.is_initialized()
    finally:
        FakeEvent.done = True
        monkeypatch.undo()


def test_finalize_after_a_failure_releases_and_returns() -> None:
    run_ranks(_rank_finalize_after_failure, 1, timeout=60)


def _rank_deadline_thread_abort(rank: int, world: int) -> None:
    from odc_runtime.transport.nvshmem import watchdog

    monkeypatch = pytest.MonkeyPatch()
    try:
        transport, _, _ = _install(monkeypatch, 2, [1 << 41, 1 << 42], atomic=True)
        monkeypatch.setattr(watchdog, "ABORT_GRACE_S", 0.05)
        engine = transport._engine
        st = odc.shard(torch.zeros(4), name="w")
        odc.sync()
        transport._watchdog.stop()  # this test plays the Python watchdog's part itself

        def refuse(self, *args) -> None:  # _C.Plan.run once the abort word is up
            if engine.abort:
                raise RuntimeError("the transport was aborted after a timeout; restart the job")

        monkeypatch.setattr(transport._C.Plan, "run", refuse)
        FakeEvent.done = False  # rank 1 died: the barrier just issued waits for it on the stream ...
        engine.abort = True  # ... and the engine's deadline thread (C++, no Python) raised the abort word
        # The next launch is refused by the extension; the caller gets the timeout naming the dead rank (the late
        # barrier), not a backend error about a refused launch.
        with pytest.raises(odc.OdcTimeoutError, match=r"rank\(s\) 1 did not arrive at barrier"):
            odc.push(st, torch.ones(4))
        with pytest.raises(odc.OdcTimeoutError, match="did not arrive"):
            odc.fetch(st)
        FakeEvent.done = True
        testing.uninstall()
        transport._finalized = True
    finally:
        FakeEvent.done = True
        monkeypatch.undo()


def test_abort_raised_by_the_deadline_thread_surfaces_as_the_timeout() -> None:
    run_ranks(_rank_deadline_thread_abort, 1, timeout=60)


def _rank_fake_gang_far(rank: int, world: int) -> str:
    from odc_runtime.errors import OdcMismatchError
    from odc_runtime.gang import GangExchange
    from odc_runtime.split import Chunk

    monkeypatch = pytest.MonkeyPatch()
    try:
        # PE 0 of 2; PE 1 is on another node (no peer pointer): the network reads registered memory only, so every
        # put of the gang exchange (K/V rows, tags, credits) must read its source from inside the symmetric heap.
        transport, calls, current = _install(monkeypatch, 2, [1, 0], atomic=False, node=1, backed=True)
        ex = GangExchange(num_layers=2, max_chunk_tokens=8, kv_features=4, transport=transport)
        heap = transport._heap
        calls.clear()
        k, v = torch.randn(6, 4), torch.randn(6, 4)
        ex.signal.local.fill_(1 << 20)  # every count arrived (the fake moves no data: the tag slots hold zeros)
        step = ex.step(Chunk(0, 0, 2, 12, 0, (0, 1)))
        with pytest.raises(OdcMismatchError, match="layer 0: forward K/V from rank 1") as e, step:
            step._forward(0, k, v)
            # the fake moves no data: the tag slot holds zeros, which is only reported when the pass ends
            step._forward(1, k, v)
        assert "it sent (gang 0, sample 0 of 0 tokens, layer 0, forward K/V, chunk 0 of the gang of ranks (0, 0))" in (
            str(e.value))
        puts = [c for c in calls if c[0] == "put_signal"]
        # the join, then per layer: K/V, its tag, the credit for PE 1's slot
        assert [c[4] for c in puts] == [[1]] * 7 and all(c[5] == [False] for c in puts), puts
        assert all(heap.contains(ptr, n) for c in puts for ptr, n in zip(c[2], c[3], strict=True)), puts
        assert [c[3] for c in puts[:4]] == [[8], [2 * 6 * 4 * 4], [(6 + 2) * 8], [8]], puts  # tag: 6 words + members
        waits = [c for c in calls if c[0] == "wait_signal"]
        assert len(waits) == 3 and all(c[3] == current.cuda_stream for c in waits), waits
        testing.uninstall()
        transport._finalized = True
        return "ok"
    finally:
        monkeypatch.undo()


def test_gang_exchange_puts_from_the_symmetric_heap_to_a_peer_on_another_node() -> None:
    assert run_ranks(_rank_fake_gang_far, 1, timeout=60) == ["ok"]
