"""CPU tests of the nvshmem transport's host-side logic (no GPU, no extension needed): settings parsing and
agreement across ranks, the barrier/abort state machine (watchdog, deadline, missing peers, facts only from the
kernels' records, the error), the free-quarantine that keeps symmetric offsets identical on every rank while views
are alive, an init failure agreed on every rank, and the Triton fold's fixed launch config."""

from __future__ import annotations

import time
import types
import weakref

import pytest
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import config
from odc_runtime.transport import nvshmem
from odc_runtime.transport.base import Transport
from odc_runtime.transport.nvshmem import memory, watchdog
from odc_runtime.transport.nvshmem.watchdog import Pending, Watchdog


# -- settings ------------------------------------------------------------------------------------------------
def test_settings_defaults_and_parsing() -> None:
    assert config.nvshmem_settings({}) == config.NvshmemSettings()
    s = config.nvshmem_settings(
        {
            "ODC_NVSHMEM_PUSH": "Locked",
            "ODC_NVSHMEM_FETCH": "kernel",
            "ODC_NVSHMEM_CELL_BYTES": "128K",
            "ODC_NVSHMEM_SCRATCH_SLOTS": "64",
            "ODC_NVSHMEM_VECTOR_ATOMICS": "0",
        }
    )
    assert s == config.NvshmemSettings("locked", "kernel", 128 << 10, 64, False)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("ODC_NVSHMEM_PUSH", "fast"),
        ("ODC_NVSHMEM_FETCH", "dma"),
        ("ODC_NVSHMEM_CELL_BYTES", "100"),
        ("ODC_NVSHMEM_CELL_BYTES", "-4K"),
        ("ODC_NVSHMEM_SCRATCH_SLOTS", "0"),
        ("ODC_NVSHMEM_SCRATCH_SLOTS", "many"),
        ("ODC_NVSHMEM_VECTOR_ATOMICS", "maybe"),
    ],
)
def test_bad_settings_are_typed_errors_naming_the_variable(var: str, value: str) -> None:
    with pytest.raises(odc.OdcUsageError, match=var):
        config.nvshmem_settings({var: value})


def test_agree_settings_names_the_setting_and_every_value() -> None:
    base = config.NvshmemSettings()
    ok = [(base, 1 << 30, 132), (base, 1 << 30, 108)]
    assert nvshmem.agree_settings(ok) == (base, 1 << 30, 132)  # default slots: one per SM of the largest GPU
    fixed = config.NvshmemSettings(scratch_slots=16)
    assert nvshmem.agree_settings([(fixed, 1 << 20, 132), (fixed, 1 << 20, 8)])[2] == 16
    locked = config.NvshmemSettings(push="locked")
    with pytest.raises(odc.OdcMismatchError, match=r"push \(ODC_NVSHMEM_PUSH\).*rank 0: auto; rank 1: locked"):
        nvshmem.agree_settings([(base, 1 << 30, 132), (locked, 1 << 30, 132)])
    with pytest.raises(odc.OdcMismatchError, match="heap size"):
        nvshmem.agree_settings([(base, 1 << 30, 132), (base, 1 << 29, 132)])


def _rank_settings_mismatch(rank: int, world: int) -> None:
    import os
    from dataclasses import asdict

    from odc_runtime.agree import gather_checked

    os.environ["ODC_NVSHMEM_CELL_BYTES"] = "64K" if rank == 0 else "32K"
    def local() -> tuple[dict, int, int]:
        settings, capacity = nvshmem.local_settings("1M")
        return asdict(settings), capacity, 100  # the exchange carries JSON, as in nvshmem.create

    infos = [(config.NvshmemSettings(**s), cap, sms) for s, cap, sms in gather_checked("test", local)]
    with pytest.raises(odc.OdcMismatchError, match=r"cell_bytes .*rank 0: 65536; rank 1: 32768"):
        nvshmem.agree_settings(infos)


def test_mismatched_settings_raise_on_every_rank() -> None:
    run_ranks(_rank_settings_mismatch, 2, timeout=60)


# -- barrier / abort state machine ------------------------------------------------------------------------------
class _Event:
    """Stands for a CUDA event: completes when ``done`` is set (e.g. by the fake abort)."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        _EVENTS[id(self)] = self

    @property
    def cuda_event(self) -> int:  # the handle the watchdog passes to the extension's query_event
        return id(self)

    def query(self) -> bool:
        return self.done


_EVENTS: weakref.WeakValueDictionary[int, _Event] = weakref.WeakValueDictionary()
# What the watchdog uses of odc_runtime._C: the event query (thread-local capture mode on the GPU)
_C = types.SimpleNamespace(EVENT_DONE=0, EVENT_PENDING=1, query_event=lambda h: 0 if _EVENTS[h].query() else 1)


class _Engine:
    """Stands for _C.Engine: the barrier kernel of ``event`` (barrier ``epoch``; 0: it never started) leaves when
    the abort is raised and records its epoch."""

    def __init__(self, heard: list[int], event: _Event | None, leaves: bool = True, epoch: int | None = None) -> None:
        self._heard = heard
        self._event = event
        self._leaves = leaves
        self._epoch = epoch
        self.abort_raised = False

    def watch(self, stream: int, timeout_s: float) -> None:
        pass

    def set_abort(self) -> None:
        self.abort_raised = True
        if self._event is not None and self._leaves:
            self._event.done = True

    def aborted(self) -> bool:
        return self.abort_raised

    def barrier_gave_up(self) -> int:
        return (self._epoch or 0) if self.abort_raised else 0

    def wait_gave_up(self) -> int:
        return 0

    def heard(self) -> list[int]:
        return self._heard


class _Transport:
    """What the watchdog needs of the transport: rank, timeout, engine and the failure state."""

    def __init__(self, engine: _Engine, timeout: float) -> None:
        self.rank, self.world_size, self.timeout, self.device = 1, 4, timeout, None
        self._engine = engine
        self._C = _C
        self.failure: odc.OdcError | None = None
        self.failure_unseen = False
        self._finalized = False

    fail = Transport.fail  # the contract's failure recording (NvshmemTransport.fail adds its hot-path flag)
    fail_unseen = Transport.fail_unseen  # the watchdog records what it finds away from the caller
    failure_raised = Transport.failure_raised
    _raise_failure = nvshmem.NvshmemTransport._raise_failure
    _check = nvshmem.NvshmemTransport._check


def _fake_transport(engine: _Engine, timeout: float = 0.2) -> tuple[_Transport, Watchdog]:
    t = _Transport(engine, timeout)
    return t, Watchdog(t)  # type: ignore[arg-type]


def test_missing_peers_and_message() -> None:
    assert nvshmem.missing_peers([5, 4, 5, 3], 5) == [1, 3]
    msg = nvshmem.timeout_message("sync", 2, 12.0, 5, [1, 3], True)
    assert "odc sync" in msg and "rank 2" in msg and "rank(s) 1, 3 did not arrive at barrier #5" in msg
    assert "still usable" in msg and "ODC_TIMEOUT" in msg
    assert "still busy" in nvshmem.timeout_message("sync", 0, 1.0, 5, [1], False)
    assert "lock" in nvshmem.timeout_message("push", 0, 1.0, 0, [], True)
    # A barrier kernel that never ran says so and claims nothing about the peers (issue 22, finding 5).
    never = nvshmem.timeout_message("sync", 0, 1.0, 5, None, True)
    assert "never started" in never and "arrived" not in never and "rank(s)" not in never


def test_watchdog_drops_completed_entries_and_reports_only_a_late_head() -> None:
    engine = _Engine([0, 0, 0, 0], None)
    _, dog = _fake_transport(engine)
    now = time.monotonic()
    first, second = _Event(), _Event()
    dog._pending.extend(
        [Pending(first, now + 60, "sync", 1), Pending(second, now - 1, "sync", 2)]  # type: ignore[arg-type]
    )
    assert dog.poll(engine) is None  # the head is neither complete nor late: later entries are not looked at
    first.done = True
    late = dog.poll(engine)
    assert late is not None and late.epoch == 2 and len(dog.outstanding()) == 1
    second.done = True
    assert dog.poll(engine) is None and dog.outstanding() == []


def test_a_completion_seen_after_the_abort_is_not_taken_as_done() -> None:
    # The engine's deadline thread (C++) raised the abort: the barrier kernel left, so its event completed, but
    # the barrier did not happen; the watchdog must report it, not drop it.
    event = _Event(done=True)
    engine = _Engine([2, 1], event, epoch=2)
    engine.abort_raised = True
    transport, dog = _fake_transport(engine)
    entry = Pending(event, time.monotonic() + 60, "sync", 2)  # type: ignore[arg-type]
    dog._pending.append(entry)
    assert dog.poll(engine) is entry
    with pytest.raises(odc.OdcTimeoutError, match=r"rank\(s\) 1 did not arrive at barrier #2"):
        dog.wait(transport, entry)  # type: ignore[arg-type]


def test_wait_past_deadline_aborts_names_missing_ranks_and_fails_later_calls() -> None:
    event = _Event()
    engine = _Engine([3, 3, 2, 2], event, epoch=3)  # ranks 2 and 3 never announced barrier #3
    transport, dog = _fake_transport(engine, timeout=0.2)
    entry = Pending(event, time.monotonic() + 0.2, "sync", 3)  # type: ignore[arg-type]
    start = time.monotonic()
    with pytest.raises(odc.OdcTimeoutError, match=r"odc sync: rank 1 .*rank\(s\) 2, 3 did not arrive at barrier #3"):
        dog.wait(transport, entry)  # type: ignore[arg-type]
    assert time.monotonic() - start < 0.2 + watchdog.ABORT_GRACE_S
    assert engine.abort_raised and event.done
    # The transport stays failed: every later call raises the same error, nothing waits again.
    with pytest.raises(odc.OdcTimeoutError, match="did not arrive"):
        transport._check("push")
    dog.abort(transport, entry)  # type: ignore[arg-type]  # idempotent
    assert "barrier #3" in str(transport.failure)


def test_barrier_that_never_started_names_no_peers() -> None:
    # Work queued before barrier #4 kept the GPU busy: the barrier kernel never ran, so its record (the epoch of the
    # first barrier kernel that gave up) is not #4, and the peers' old announcements prove nothing.
    event = _Event()
    engine = _Engine([3, 3, 3, 3], event, epoch=None)
    transport, dog = _fake_transport(engine)
    dog.abort(transport, Pending(event, 0.0, "sync", 4))  # type: ignore[arg-type]
    msg = str(transport.failure)
    assert "barrier #4 never started" in msg and "did not arrive" not in msg and "every peer" not in msg
    # found by the watchdog, not by a call: unseen (finalize would raise it) until a call raises it
    assert transport.failure_unseen
    with pytest.raises(odc.OdcTimeoutError, match="never started"):
        transport._check("push")
    assert not transport.failure_unseen


def test_abort_when_the_gpu_stays_busy_says_so() -> None:
    event = _Event()
    engine = _Engine([1, 0], event, leaves=False, epoch=1)  # the kernel does not leave (user work queued before it)
    transport, dog = _fake_transport(engine)
    old = watchdog.ABORT_GRACE_S
    watchdog.ABORT_GRACE_S = 0.05
    try:
        dog.abort(transport, Pending(event, 0.0, "sync", 1))  # type: ignore[arg-type]
    finally:
        watchdog.ABORT_GRACE_S = old
    assert isinstance(transport.failure, odc.OdcTimeoutError)
    assert "still busy" in str(transport.failure) and "rank(s) 1" in str(transport.failure)


def test_wait_returns_when_the_barrier_completes_in_time() -> None:
    event = _Event(done=True)
    transport, dog = _fake_transport(_Engine([1, 1], event))
    dog.wait(transport, Pending(event, time.monotonic() + 5, "sync", 1))  # type: ignore[arg-type]
    assert transport.failure is None


# -- free quarantine: no aliasing, offsets stay symmetric ----------------------------------------------------
class _Views:
    """Stands for the _CudaArray that torch keeps alive while a tensor views the range."""


def _rank_quarantine(rank: int, world: int) -> None:
    t = memory.SymmetricHeap(0, 4096, None)  # type: ignore[arg-type]
    first = t.allocator.alloc(1024)
    views = _Views()
    t.quarantine = [(first, weakref.ref(views), "w.param")]
    if rank == 1:
        del views  # only rank 0 still holds a view of the freed range
    t.release_quarantine()
    assert len(t.quarantine) == 1, "a range viewed on any rank must not be reused on any rank"
    second = t.allocator.alloc(1024)
    assert second != first  # the live view does not alias the new allocation
    if rank == 0:
        del views
    t.release_quarantine()
    assert t.quarantine == []
    third = t.allocator.alloc(1024)
    assert third == first  # released everywhere at the same call: offsets stay identical on every rank
    return [first, second, third]


def test_freed_ranges_are_reused_only_when_no_rank_views_them() -> None:
    results = run_ranks(_rank_quarantine, 2, timeout=60)
    assert results[0] == results[1]


# -- signal waits, node layout, GPU sharing (hierarchical protocol, issue 14; MPS refusal, issue 12) -----------
class _WaitEngine(_Engine):
    """Stands for _C.Engine whose first signal wait to give up was wait ``first`` (0: none) and saw ``seen``."""

    def __init__(self, event: _Event, seen: int | None, first: int = 1) -> None:
        super().__init__([], event)
        self._seen = seen
        self._first = first if seen is not None else 0

    def wait_gave_up(self) -> int:
        return self._first if self.abort_raised else 0

    def wait_seen(self) -> int:
        assert self._seen is not None
        return self._seen


def test_signal_wait_past_deadline_is_released_and_names_the_peers_and_the_count() -> None:
    event = _Event()
    engine = _WaitEngine(event, seen=3)
    transport, dog = _fake_transport(engine, timeout=0.2)
    entry = Pending(event, time.monotonic() + 0.2, "sync (push)", 0, wait=(1, 4, (0, 2)), wait_id=1)  # type: ignore[arg-type]
    pattern = r"odc sync \(push\): rank 1 .*rank\(s\) 0, 2: signal word 1 reached 3 of 4"
    with pytest.raises(odc.OdcTimeoutError, match=pattern):
        dog.wait(transport, entry)  # type: ignore[arg-type]
    assert engine.abort_raised and event.done  # released: the stream is not left blocked
    with pytest.raises(odc.OdcTimeoutError, match="still usable"):
        transport._check("fetch")


def test_signal_wait_that_never_started_says_so() -> None:
    event = _Event()
    transport, dog = _fake_transport(_WaitEngine(event, seen=None))
    dog.abort(transport, Pending(event, 0.0, "sync", 0, wait=(0, 2, (3,)), wait_id=1))  # type: ignore[arg-type]
    msg = str(transport.failure)
    assert "rank(s) 3" in msg and "never started" in msg and "reach 2" in msg


def test_the_first_signal_wait_that_gave_up_keeps_its_record() -> None:
    # Waits 1 and 2 were queued; the abort released wait 1 (it saw 5 of 9), then wait 2 ran and left at once.
    # Wait 1 is the late one: its facts are reported, not wait 2's (issue 22, finding 5: first record wins).
    event = _Event()
    transport, dog = _fake_transport(_WaitEngine(event, seen=5, first=1))
    dog.abort(transport, Pending(event, 0.0, "sync", 0, wait=(0, 9, (3,)), wait_id=1))  # type: ignore[arg-type]
    assert "signal word 0 reached 5 of 9" in str(transport.failure)
    # ... and a wait whose id is not the recorded one never started (work queued before it).
    transport, dog = _fake_transport(_WaitEngine(_Event(), seen=5, first=1))
    dog.abort(transport, Pending(_Event(), 0.0, "sync", 0, wait=(0, 9, (3,)), wait_id=2))  # type: ignore[arg-type]
    assert "never started" in str(transport.failure) and "reached 5" not in str(transport.failure)


def test_wait_timeout_message() -> None:
    msg = nvshmem.wait_timeout_message("sync", 2, 12.0, 4, 9, 7, [5, 6], True)
    assert "odc sync: rank 2 timed out after 12 s" in msg and "rank(s) 5, 6" in msg
    assert "signal word 4 reached 7 of 9" in msg and "ODC_TIMEOUT" in msg and "still usable" in msg
    assert "still busy" in nvshmem.wait_timeout_message("sync", 0, 1.0, 0, 1, 0, [1], False)


@pytest.mark.parametrize(
    ("reach", "expected"),
    [
        ([[0, 1], [0, 1], [2, 3], [2, 3]], 2),
        ([[0], [1], [2]], 1),
        ([[0, 1, 2, 3]] * 4, 4),
        ([[1, 0], [0, 1]], 2),  # order does not matter
    ],
)
def test_node_layout_from_peer_pointer_reach(reach: list[list[int]], expected: int) -> None:
    assert nvshmem.node_layout(reach) == expected


@pytest.mark.parametrize(
    "reach",
    [
        [[0, 2], [1, 3], [0, 2], [1, 3]],  # interleaved: rank r's node is not r // n
        [[0, 1], [0, 1], [2], [3]],  # different sizes
        [[0, 1], [0, 1], [2]],  # 2 does not divide 3
        [[0, 1, 2], [0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5], [3, 4]],  # a rank sees less of its node
    ],
)
def test_node_layout_that_cannot_be_derived_asks_for_odc_node_size(reach: list[list[int]]) -> None:
    msg = nvshmem.node_layout(reach)
    assert isinstance(msg, str) and "ODC_NODE_SIZE" in msg and "not consecutive blocks" in msg


def test_several_pes_on_one_gpu_without_mps_are_refused(caplog) -> None:
    sharing = {("h", "gpu0"): [0, 1], ("h", "gpu1"): [2]}
    nvshmem.check_gpu_sharing(sharing, {0: 1, 1: 1, 2: 0})  # MPS on where shared; a GPU of its own needs none
    with pytest.raises(odc.OdcUsageError, match=r"ranks \[0, 1\] share GPU gpu0 on h without CUDA MPS.*"
                       r"nvidia-cuda-mps-control -d"):
        nvshmem.check_gpu_sharing(sharing, {0: 1, 1: 0, 2: 1})
    with caplog.at_level("WARNING", logger="odc_runtime"):
        nvshmem.check_gpu_sharing(sharing, {0: -1, 1: 1, 2: 0})  # the runtime cannot tell: allowed, warned
    assert "cannot tell whether MPS is on" in caplog.text


# -- init failure (issue 22, finding 3) -------------------------------------------------------------------------
def _rank_init_fails_on_one_rank(rank: int, world: int) -> None:
    import types

    import torch

    from odc_runtime.transport.nvshmem import bootstrap, extension

    entered: list[int] = []

    def init(uid: bytes, r: int, n: int, device: int) -> None:
        if r == 1:  # what _C.init raises when nvshmemx_init_status() says the common init failed
            raise RuntimeError("init: NVSHMEM did not finish initialising (nvshmemx_init_status() = 1, expected >= "
                               "NVSHMEM_STATUS_IS_INITIALIZED)")

    def malloc(nbytes: int) -> int:  # a collective: on a GPU, a rank whose init failed never enters it (a hang)
        entered.append(nbytes)
        raise RuntimeError("nvshmem_malloc entered although a rank's init failed")

    ext = types.SimpleNamespace(
        nvshmem_version_compiled=lambda: (3, 8, 0), nvshmem_version_runtime=lambda: (3, 8, 0),
        mps_enabled=lambda index: 1, get_unique_id=lambda: b"u" * 16, init=init, malloc=malloc,
    )
    monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.setattr(extension, "load_extension", lambda: ext)
        monkeypatch.setattr(extension, "started", False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(
            torch.cuda, "get_device_properties",
            lambda index: types.SimpleNamespace(multi_processor_count=8, uuid=f"gpu{rank}"),
        )
        # Every rank raises OdcBackendError carrying rank 1's cause, and no rank enters the next collective.
        with pytest.raises(odc.OdcBackendError, match=r"nvshmemx_init_status\(\) = 1"):
            bootstrap.create(timeout=10.0)
        assert entered == [], "a rank went on into nvshmem_malloc after another rank's init failed"
    finally:
        monkeypatch.undo()


def test_init_failure_on_one_rank_raises_backend_error_on_every_rank() -> None:
    run_ranks(_rank_init_fails_on_one_rank, 2, timeout=60)


# -- hot path (issue 22, finding 8) -------------------------------------------------------------------------------
def test_triton_fold_does_not_autotune_inside_the_training_loop() -> None:
    # Triton's autotuner benchmarks every config (device-wide synchronisations) at the first call of each shape,
    # i.e. at the first sync of each shard size, inside a training step: the fold kernels take a fixed config.
    pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner

    from odc_runtime.kernels import _triton

    for kernel in (_triton._accumulate_kernel, _triton._accumulate_slots_kernel):
        assert not isinstance(kernel, Autotuner), kernel
    assert _triton._config(1000) == (1024, 4) and _triton._config(1 << 24)[0] >= 1024


def test_pcie_node_without_nvlink_or_network_is_refused_naming_what_works(tmp_path) -> None:
    # Issue 33, finding 5: GPUs of one node that reach each other by peer pointer but without load/store atomics
    # (PCIe, no NVLink) leave NVSHMEM no path for its atomics unless the node has a network transport.
    from odc_runtime.transport.nvshmem import settings

    one_node = [[0, 1], [0, 1]]
    with pytest.raises(odc.OdcUsageError, match=r"ranks \[0, 1\] share a node .*one rank per node.*NVLink"):
        nvshmem.check_atomics_path(False, one_node, [False, False])
    nvshmem.check_atomics_path(True, one_node, [False, False])  # NVLink (or PCIe with atomics): load/store atomics
    nvshmem.check_atomics_path(False, one_node, [True, True])  # an IB/RoCE NIC or UCX carries the atomics
    nvshmem.check_atomics_path(False, [[0], [1]], [False, False])  # one rank per node: nothing shares a node
    # the network transport on this host: NVSHMEM_REMOTE_TRANSPORT, else an InfiniBand device
    ib = tmp_path / "infiniband"
    ib.mkdir()
    assert not settings.network_transport({}, str(ib)) and not settings.network_transport({}, str(tmp_path / "no"))
    (ib / "mlx5_0").mkdir()
    assert settings.network_transport({}, str(ib))
    assert not settings.network_transport({"NVSHMEM_REMOTE_TRANSPORT": "none"}, str(ib))
    assert settings.network_transport({"NVSHMEM_REMOTE_TRANSPORT": "UCX"}, str(tmp_path / "no"))
