"""CPU tests of the nvshmem transport's host-side logic (no GPU, no extension needed): settings parsing and
agreement across ranks, the barrier/abort state machine (watchdog, deadline, missing peers, the error), and the
free-quarantine that keeps symmetric offsets identical on every rank while views are alive."""

from __future__ import annotations

import time
import weakref

import pytest
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import config
from odc_runtime.transport import nvshmem
from odc_runtime.transport.heap import HeapAllocator


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

    def query(self) -> bool:
        return self.done


class _Engine:
    """Stands for _C.Engine: the barrier kernel of ``event`` leaves when the abort is raised."""

    def __init__(self, heard: list[int], event: _Event | None, leaves: bool = True) -> None:
        self._heard = heard
        self._event = event
        self._leaves = leaves
        self.abort_raised = False

    def set_abort(self) -> None:
        self.abort_raised = True
        if self._event is not None and self._leaves:
            self._event.done = True

    def barrier_gave_up(self) -> bool:
        return self.abort_raised

    def heard(self) -> list[int]:
        return self._heard


def _fake_transport(engine: _Engine, timeout: float = 0.2) -> nvshmem.NvshmemTransport:
    import threading

    t = nvshmem.NvshmemTransport.__new__(nvshmem.NvshmemTransport)
    t.rank, t.world_size, t.timeout, t.device = 1, 4, timeout, None
    t._engine = engine
    t._failure = None
    t._finalized = False
    t._abort_lock = threading.Lock()
    return t


def test_missing_peers_and_message() -> None:
    assert nvshmem.missing_peers([5, 4, 5, 3], 5) == [1, 3]
    msg = nvshmem.timeout_message("sync", 2, 12.0, 5, [1, 3], True)
    assert "odc sync" in msg and "rank 2" in msg and "rank(s) 1, 3 did not arrive at barrier #5" in msg
    assert "still usable" in msg and "ODC_TIMEOUT" in msg
    assert "still busy" in nvshmem.timeout_message("sync", 0, 1.0, 5, [1], False)
    assert "lock" in nvshmem.timeout_message("push", 0, 1.0, 0, [], True)


def test_watchdog_drops_completed_entries_and_reports_only_a_late_head() -> None:
    transport = _fake_transport(_Engine([0, 0, 0, 0], None))
    dog = nvshmem._Watchdog(transport)
    now = time.monotonic()
    first, second = _Event(), _Event()
    dog._pending.extend(
        [nvshmem._Pending(first, now + 60, "sync", 1), nvshmem._Pending(second, now - 1, "sync", 2)]  # type: ignore[arg-type]
    )
    assert dog.poll() is None  # the head is neither complete nor late: later entries are not looked at
    first.done = True
    late = dog.poll()
    assert late is not None and late.epoch == 2 and len(dog.outstanding()) == 1
    second.done = True
    assert dog.poll() is None and dog.outstanding() == []


def test_wait_past_deadline_aborts_names_missing_ranks_and_fails_later_calls() -> None:
    event = _Event()
    engine = _Engine([3, 3, 2, 2], event)  # ranks 2 and 3 never announced barrier #3
    transport = _fake_transport(engine, timeout=0.2)
    entry = nvshmem._Pending(event, time.monotonic() + 0.2, "sync", 3)  # type: ignore[arg-type]
    start = time.monotonic()
    with pytest.raises(odc.OdcTimeoutError, match=r"odc sync: rank 1 .*rank\(s\) 2, 3 did not arrive at barrier #3"):
        transport._wait(entry)
    assert time.monotonic() - start < 0.2 + nvshmem.ABORT_GRACE_S
    assert engine.abort_raised and event.done
    # The transport stays failed: every later call raises the same error, nothing waits again.
    with pytest.raises(odc.OdcTimeoutError, match="did not arrive"):
        transport._check("push")
    transport._abort(entry)  # idempotent
    assert "barrier #3" in str(transport._failure)


def test_abort_when_the_gpu_stays_busy_says_so() -> None:
    event = _Event()
    engine = _Engine([1, 0], event, leaves=False)  # the kernel does not leave (user work queued before it)
    transport = _fake_transport(engine)
    old = nvshmem.ABORT_GRACE_S
    nvshmem.ABORT_GRACE_S = 0.05
    try:
        transport._abort(nvshmem._Pending(event, 0.0, "sync", 1))  # type: ignore[arg-type]
    finally:
        nvshmem.ABORT_GRACE_S = old
    assert isinstance(transport._failure, odc.OdcTimeoutError)
    assert "still busy" in str(transport._failure) and "rank(s) 1" in str(transport._failure)


def test_wait_returns_when_the_barrier_completes_in_time() -> None:
    event = _Event(done=True)
    transport = _fake_transport(_Engine([1, 1], event))
    transport._wait(nvshmem._Pending(event, time.monotonic() + 5, "sync", 1))  # type: ignore[arg-type]
    assert transport._failure is None


# -- free quarantine: no aliasing, offsets stay symmetric ----------------------------------------------------
class _Views:
    """Stands for the _CudaArray that torch keeps alive while a tensor views the range."""


def _rank_quarantine(rank: int, world: int) -> None:
    t = nvshmem.NvshmemTransport.__new__(nvshmem.NvshmemTransport)
    t._allocator = HeapAllocator(4096, limit_hint="test")
    first = t._allocator.alloc(1024)
    views = _Views()
    t._quarantine = [(first, weakref.ref(views), "w.param")]
    if rank == 1:
        del views  # only rank 0 still holds a view of the freed range
    t._release_quarantine()
    assert len(t._quarantine) == 1, "a range viewed on any rank must not be reused on any rank"
    second = t._allocator.alloc(1024)
    assert second != first  # the live view does not alias the new allocation
    if rank == 0:
        del views
    t._release_quarantine()
    assert t._quarantine == []
    third = t._allocator.alloc(1024)
    assert third == first  # released everywhere at the same call: offsets stay identical on every rank
    return [first, second, third]


def test_freed_ranges_are_reused_only_when_no_rank_views_them() -> None:
    results = run_ranks(_rank_quarantine, 2, timeout=60)
    assert results[0] == results[1]


# -- signal waits, node layout, GPU sharing (hierarchical protocol, issue 14; MPS refusal, issue 12) -----------
class _WaitEngine(_Engine):
    """Stands for _C.Engine with a signal wait that saw ``seen`` when the abort released it (None: never ran)."""

    def __init__(self, event: _Event, seen: int | None) -> None:
        super().__init__([], event)
        self._seen = seen

    def wait_gave_up(self) -> bool:
        return self.abort_raised and self._seen is not None

    def wait_seen(self) -> int:
        assert self._seen is not None
        return self._seen


def test_signal_wait_past_deadline_is_released_and_names_the_peers_and_the_count() -> None:
    event = _Event()
    engine = _WaitEngine(event, seen=3)
    transport = _fake_transport(engine, timeout=0.2)
    entry = nvshmem._Pending(event, time.monotonic() + 0.2, "sync (push)", 0, wait=(1, 4, (0, 2)))  # type: ignore[arg-type]
    pattern = r"odc sync \(push\): rank 1 .*rank\(s\) 0, 2: signal word 1 reached 3 of 4"
    with pytest.raises(odc.OdcTimeoutError, match=pattern):
        transport._wait(entry)
    assert engine.abort_raised and event.done  # released: the stream is not left blocked
    with pytest.raises(odc.OdcTimeoutError, match="still usable"):
        transport._check("fetch")


def test_signal_wait_that_never_started_says_so() -> None:
    event = _Event()
    transport = _fake_transport(_WaitEngine(event, seen=None))
    transport._abort(nvshmem._Pending(event, 0.0, "sync", 0, wait=(0, 2, (3,))))  # type: ignore[arg-type]
    msg = str(transport._failure)
    assert "rank(s) 3" in msg and "never started" in msg and "reach 2" in msg


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
