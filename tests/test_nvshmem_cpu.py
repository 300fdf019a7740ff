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

    infos = [(config.NvshmemSettings(**s), c, m) for s, c, m in gather_checked("test", local)]
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
