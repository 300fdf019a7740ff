"""The nvshmem transport after an abort, on CPU (issue 33): the transport, its watchdog and the exit handler run for
real against a model of the device protocols (``tests/_nvshmem_device.py``: a barrier queued behind an abort, a
locked push waiting for a lock, a wait that returns to the host before its data) or against the fake extension of
``test_nvshmem_fake.py``.

* finding 1: a barrier queued behind work the abort cut short never releases the peers (they time out instead of
  finishing a step that misses this rank's gradient); a process that exits with operations still watched lets
  them finish (bounded by the deadline) before raising the abort;
* finding 4: after a locked push times out, the barrier queued behind it is not blamed;
* finding 3: a gang peer that never delivers is reported as the signal wait's timeout, naming the word and the
  peer, not as a plan mismatch; the hierarchy's fail-stop records that timeout, not a generic backend error;
* finding 2: the watchdog's event queries never use the calling thread's (global) capture mode, so another
  thread's CUDA graph capture is neither broken nor taken for a failure.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _dist import run_ranks

import odc_runtime as odc

TIMEOUT = 1.0  # the transports' deadline (seconds)


def _exit_with_a_push_queued(release_after: float | None) -> dict:
    """PE 0 pushes into PE 1 with the locked protocol while the owner's cell lock is held by a third party, syncs
    (its barrier is queued behind the push), then exits without finalize(). PE 1 syncs too. ``release_after``:
    seconds after which the lock holder releases (None: it died). Returns what PE 1 saw."""
    import _nvshmem_device as model

    from odc_runtime.transport.base import PushRequest
    from odc_runtime.transport.nvshmem import extension

    monkeypatch = pytest.MonkeyPatch()
    try:
        dev, (t0, t1) = model.transports(monkeypatch, 2, TIMEOUT)
        b0 = model.on(dev, 0, lambda: t0.alloc(64, torch.float32, "acc"))
        model.on(dev, 1, lambda: t1.alloc(64, torch.float32, "acc"))
        dev.lock_free = False
        model.on(dev, 0, lambda: t0.push(b0, [PushRequest(1, torch.ones(64), 0)], 1.0))
        model.on(dev, 0, lambda: t0.barrier("sync"))  # queued behind the push on PE 0's stream
        model.on(dev, 1, lambda: t1.barrier("sync"))  # PE 1 arrives and waits for PE 0's announcement
        cells = dev.pes[0].queue[0].gi_frame.f_locals["cells"]  # type: ignore[union-attr]
        if release_after is not None:
            threading.Timer(release_after, lambda: setattr(dev, "lock_free", True)).start()
        monkeypatch.setattr(extension, "_engines", [t0._engine])
        extension._abort_at_exit()  # the interpreter exits on PE 0
        assert dev.pes[0].abort, "the exit handler must still raise the abort in the end"
        seen: dict = {"pushed": dev.pes[0].cells_pushed, "cells": cells, "error": None}
        try:
            model.on(dev, 1, lambda: t1.barrier("next sync"))  # waits (bounded) for PE 1's barrier #2
        except odc.OdcTimeoutError as e:
            seen["error"] = str(e)
        seen["pe0_announced"] = dev.pes[1].epochs[0]
        for t in (t0, t1):
            t._watchdog.stop()
        return seen
    finally:
        monkeypatch.undo()


def _rank_exit_lock_released(rank: int, world: int) -> dict:
    return _exit_with_a_push_queued(release_after=0.3)


def _rank_exit_lock_holder_dead(rank: int, world: int) -> dict:
    return _exit_with_a_push_queued(release_after=None)


def test_exit_lets_watched_work_finish_before_the_abort() -> None:
    # The lock holder was only slow: the exit waits for the push, the barrier after it announces, and PE 1 finishes
    # the step with PE 0's whole gradient. (Before: the exit raised the abort at once, the push stopped with cells
    # unpushed, and the barrier queued behind it released PE 1 anyway.)
    (seen,) = run_ranks(_rank_exit_lock_released, 1, timeout=60)
    assert seen["pushed"] == seen["cells"] and seen["error"] is None, seen


def test_barrier_queued_behind_an_abort_does_not_release_the_peers() -> None:
    # The lock holder died: the deadline raises PE 0's abort, the push is cut short, and the barrier queued behind
    # it must not announce. PE 1 times out naming PE 0 instead of completing a step without PE 0's gradient.
    (seen,) = run_ranks(_rank_exit_lock_holder_dead, 1, timeout=60)
    assert seen["pushed"] < seen["cells"], seen
    assert seen["pe0_announced"] < 2, f"PE 0's barrier #2 announced after the abort cut its push short: {seen}"
    assert seen["error"] is not None and "rank(s) 0 did not arrive at barrier #2" in seen["error"], seen


def _rank_locked_push_blamed(rank: int, world: int) -> str:
    import _nvshmem_device as model

    from odc_runtime.transport.base import PushRequest

    monkeypatch = pytest.MonkeyPatch()
    try:
        dev, (t0, t1) = model.transports(monkeypatch, 2, TIMEOUT)
        b0 = model.on(dev, 0, lambda: t0.alloc(64, torch.float32, "acc"))
        model.on(dev, 1, lambda: t1.alloc(64, torch.float32, "acc"))
        dev.lock_free = False  # the lock holder died
        model.on(dev, 0, lambda: t0.push(b0, [PushRequest(1, torch.ones(64), 0)], 1.0))
        model.on(dev, 0, lambda: t0.barrier("sync"))  # starts only after the push gave up: the abort is up
        # PE 1 has not reached barrier #2 yet (a barrier that had to wait for it would record itself)
        with pytest.raises(odc.OdcTimeoutError) as e:
            model.on(dev, 0, lambda: t0.barrier("next sync"))
        assert dev.pes[0].barrier_epoch == 0, "a barrier that started with the abort up recorded itself"
        for t in (t0, t1):
            t._watchdog.stop()
        return str(e.value)
    finally:
        monkeypatch.undo()


def test_a_locked_push_that_timed_out_is_blamed_not_the_barrier_behind_it() -> None:
    (message,) = run_ranks(_rank_locked_push_blamed, 1, timeout=60)
    assert "a locked push did not complete" in message and "barrier" not in message.split(":")[1], message


# -- finding 3: wrong diagnoses of a gang or hierarchy peer that never delivers --------------------------------
def _first_wait_gives_up(monkeypatch: pytest.MonkeyPatch, transport: object) -> None:
    """From now on the fake extension's waits never see their count: the first signal wait issued (id 1) is the one
    that gives up when the abort is raised, having seen 0; every barrier so far completed. The engine's deadline
    thread raises the abort in these tests (the test sets ``engine.abort``), not the Python watchdog."""
    from test_nvshmem_fake import FakeEvent

    from odc_runtime.transport.nvshmem import watchdog

    engine = transport._engine  # type: ignore[attr-defined]

    class Released(FakeEvent):  # the wait kernels leave when the abort is raised
        def query(self) -> bool:
            return engine.abort

    monkeypatch.setattr(watchdog, "ABORT_GRACE_S", 0.05)
    monkeypatch.setattr(torch.cuda, "Event", Released)
    engine.wait_seen = lambda: 0
    engine.wait_gave_up = lambda: 1 if engine.abort else 0
    engine.barrier_gave_up = lambda: 0
    transport._watchdog.stop()  # type: ignore[attr-defined]


def _rank_gang_peer_never_delivers(rank: int, world: int) -> str:
    from test_nvshmem_fake import _install

    from odc_runtime import testing
    from odc_runtime.gang import GangExchange
    from odc_runtime.split import Chunk

    monkeypatch = pytest.MonkeyPatch()
    try:
        # PE 0 of 2; PE 1 (another node) never joins nor puts. On the GPU every wait returns to the host at once,
        # so the forward pass runs on (copying tag slots that never arrived) until the engine's deadline thread
        # raises the abort; the next put is then refused by the extension.
        transport, _, _ = _install(monkeypatch, 2, [1, 0], atomic=False, node=1, backed=True)
        engine = transport._engine
        ex = GangExchange(num_layers=2, max_chunk_tokens=8, kv_features=4, transport=transport)
        _first_wait_gives_up(monkeypatch, transport)  # the join wait: it saw no join from PE 1
        step = ex.step(Chunk(0, 0, 2, 12, 0, (0, 1)))
        k, v = torch.randn(6, 4), torch.randn(6, 4)
        with pytest.raises(odc.OdcError) as e, step:
            step._exchange(lambda: step._forward(0, k, v))
            engine.abort = True  # the deadline of the join wait passed
            step._exchange(lambda: step._forward(1, k, v))
        assert isinstance(transport.failure, odc.OdcTimeoutError), repr(transport.failure)
        testing.uninstall()
        transport._finalized = True
        return f"{type(e.value).__name__}: {e.value}"
    finally:
        monkeypatch.undo()


def test_a_gang_peer_that_never_delivers_is_a_timeout_not_a_mismatch() -> None:
    (message,) = run_ranks(_rank_gang_peer_never_delivers, 1, timeout=60)
    # signal word 2W + 1 = 5 is PE 1's join
    assert message.startswith("OdcTimeoutError") and "rank(s) 1: signal word 5 reached 0 of 1" in message, message


def _rank_hierarchy_fail_stop(rank: int, world: int) -> str:
    from test_nvshmem_fake import _install

    from odc_runtime import testing
    from odc_runtime.transport.base import PutRequest

    monkeypatch = pytest.MonkeyPatch()
    try:
        transport, _, _ = _install(monkeypatch, 4, [1, 1, 0, 0], atomic=False, node=2, backed=True)
        engine = transport._engine
        buf = transport.alloc(16, torch.float32, "inbox")
        sig = transport.alloc(4, torch.int64, "signal")
        _first_wait_gives_up(monkeypatch, transport)
        # the hierarchical flush: a wait for node 1's puts, then (after the fold) the puts of the next round
        transport.wait_signal(sig, 1, 1, "sync: staged pushes from node 1", [2])
        engine.abort = True  # its deadline passed
        src = buf.local[:4]
        with pytest.raises(odc.OdcTimeoutError):
            transport.fail_stop("sync", "the flush of staged pushes began",
                                lambda: transport.put_signal(buf, [PutRequest(2, src, 0, 3)], sig))
        testing.uninstall()
        transport._finalized = True
        return f"{type(transport.failure).__name__}: {transport.failure}"
    finally:
        monkeypatch.undo()


def test_hierarchy_fail_stop_records_the_signal_wait_timeout() -> None:
    (failure,) = run_ranks(_rank_hierarchy_fail_stop, 1, timeout=60)
    assert failure.startswith("OdcTimeoutError") and "from rank(s) 2: signal word 1 reached 0 of 1" in failure, failure


# -- finding 2: graph capture in another thread -------------------------------------------------------------------
def _rank_capture_in_another_thread(rank: int, world: int) -> str:
    from test_nvshmem_fake import FakeEvent, _install

    from odc_runtime import testing

    monkeypatch = pytest.MonkeyPatch()
    try:
        transport, _, _ = _install(monkeypatch, 2, [1 << 41, 1 << 42], atomic=True)
        capturing = threading.Event()  # a user's torch.cuda.graph(...) runs in another thread
        broken: list[str] = []

        class CaptureEvent(FakeEvent):
            """``query()`` is torch.cuda.Event.query: cudaEventQuery in the calling thread's capture mode (global
            by default), which fails while another thread captures and invalidates that capture. ``state()`` is
            what the extension's query_event (thread-local mode) reads: the event's real state."""

            def query(self) -> bool:
                if capturing.is_set():
                    broken.append(threading.current_thread().name)
                    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
                return self.state()

            def state(self) -> bool:
                return time.monotonic() > self.ready_at

            def record(self, stream=None) -> None:
                super().record(stream)
                self.ready_at = time.monotonic() + 0.2  # the barrier completes while the capture runs

        monkeypatch.setattr(torch.cuda, "Event", CaptureEvent)
        capturing.set()
        odc.sync()
        odc.sync()  # the host waits for the first barrier while the capture runs
        time.sleep(0.1)  # the watchdog thread polls meanwhile
        capturing.clear()
        assert transport.failure is None, transport.failure
        testing.uninstall()
        transport._finalized = True
        return ",".join(sorted(set(broken)))
    finally:
        FakeEvent.done = True
        monkeypatch.undo()


def test_watchdog_queries_never_break_another_threads_graph_capture() -> None:
    (broken,) = run_ranks(_rank_capture_in_another_thread, 1, timeout=60)
    assert broken == "", f"event queries in the global capture mode from threads {broken}"
