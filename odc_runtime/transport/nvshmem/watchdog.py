"""Deadlines, abort and failure state of the nvshmem transport.

Every operation that waits for other PEs on the GPU (a barrier, a locked push, a signal wait) is *watched*: the
engine's deadline thread (C++, ``csrc/engine.cu``, needs no Python) raises the abort word when the operation's
event is late, and ``Watchdog`` (a Python daemon thread plus the host waits of the transport) turns what the
kernels recorded into the error. On abort every waiting kernel of the engine leaves within microseconds, the CUDA
context stays usable, and the transport stays failed: every later call raises the recorded error.

State machine of one watched entry: PENDING --(event completes, no abort)--> DONE (dropped);
PENDING --(deadline passes, or the abort word is up)--> ABORTED: abort word raised, wait up to ABORT_GRACE_S
for the event (the kernels leave), record the error. Entries complete in stream order, so only the oldest is
checked. Once ABORTED the transport stays failed (abort words are never lowered).

Graph capture: every event query goes through the extension's ``query_event`` (thread-local capture mode, see
``csrc/engine.cu``), never ``torch.cuda.Event.query`` (the calling thread's mode, global by default): a query in
the global mode while another thread captures a CUDA graph invalidates that capture, and the error it returns is
not a failure of the watched work. A capture-related return reads as "not yet" (the deadline still bounds it).

Facts in the messages come from the kernels' records, never from guesses: the first barrier kernel and the
first signal wait that gave up each record who they were (epoch, wait id) and what they saw; an entry whose
record is not there never started (work queued before it kept the GPU busy).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from odc_runtime.errors import ELSEWHERE_HINT, OdcBackendError, OdcError, OdcTimeoutError
from odc_runtime.transport.nvshmem.extension import backend_call

if TYPE_CHECKING:
    from odc_runtime.transport.nvshmem.transport import NvshmemTransport

log = logging.getLogger("odc_runtime")

ABORT_GRACE_S = 5.0  # how long after raising the abort we wait for our kernels to leave
WATCHDOG_PERIOD_S = 2e-3  # deadlines are seconds; a slower poll takes the GIL from the training loop less often


@dataclass
class Pending:
    """A barrier, locked push or signal wait whose completion is checked against its deadline."""

    event: torch.cuda.Event
    deadline: float
    op: str
    epoch: int  # barrier number; 0 for a push or a signal wait
    wait: tuple[int, int, tuple[int, ...]] | None = None  # signal wait: (word index, awaited count, peers)
    wait_id: int = 0  # the engine's id of a signal wait (matches its record if it gave up)


def missing_peers(heard: Sequence[int], epoch: int) -> list[int]:
    """Peers that had not announced barrier ``epoch`` when it gave up (``heard[q]`` = last epoch from q)."""
    return [q for q, e in enumerate(heard) if e < epoch]


def _gpu_state(left: bool, what: str) -> str:
    return (
        f"{what} and the CUDA context is still usable (a checkpoint can be written)"
        if left
        else f"the GPU was still busy {ABORT_GRACE_S:g} s after the abort (user work queued on the stream)"
    )


def timeout_message(op: str, rank: int, timeout: float, epoch: int, missing: list[int] | None, left: bool) -> str:
    """Text of the OdcTimeoutError raised when a barrier (``epoch`` > 0) or a locked push times out. ``missing``:
    the peers the barrier kernel had not heard from when it gave up, ``None`` when it never started."""
    if epoch > 0 and missing is None:
        who = (
            f"barrier #{epoch} never started on this GPU (work queued before it on the stream was still running: "
            "a push waiting for a lock, a signal wait, or the caller's kernels)"
        )
    elif epoch > 0 and missing:
        who = f"rank(s) {', '.join(map(str, missing))} did not arrive at barrier #{epoch}"
    elif epoch > 0:
        who = f"barrier #{epoch} was released by the abort just as the last peers' announcements arrived"
    else:
        who = (
            "a locked push did not complete: it waited for a cell lock that was never released (the holder died "
            "or is stuck), or work queued before it was still running"
        )
    return (
        f"odc {op}: rank {rank} timed out after {timeout:g} s: {who}. A dead or stuck peer, or a peer that did not "
        f"call the same collective. {ELSEWHERE_HINT}. Raise ODC_TIMEOUT if it is merely slow. The nvshmem transport "
        f"is aborted and every later call raises this error; {_gpu_state(left, 'the GPU kernels left')}. Exit the "
        "process and restart the job."
    )


def wait_timeout_message(
    op: str, rank: int, timeout: float, index: int, value: int, seen: int | None, peers: Sequence[int], left: bool
) -> str:
    """Text of the OdcTimeoutError raised when a signal wait times out; ``seen`` is the count the wait kernel last
    read (``None`` if it never ran: work queued before it)."""
    where = (
        f"signal word {index} reached {seen} of {value}"
        if seen is not None
        else f"the wait for signal word {index} to reach {value} never started (this GPU was still busy with work "
        "queued before it)"
    )
    who = ", ".join(map(str, peers)) or "none named"
    return (
        f"odc {op}: rank {rank} timed out after {timeout:g} s waiting for signalled puts from rank(s) {who}: "
        f"{where}. A dead or stuck peer, or a peer that did not run the same step; raise ODC_TIMEOUT if it is "
        f"merely slow. The nvshmem transport is aborted and every later call raises this error; "
        f"{_gpu_state(left, 'the wait was released')}. Exit the process and restart the job."
    )


class Watchdog:
    """Watched entries of one transport, the daemon thread that checks them, and the abort/failure logic.

    The failure is stored on the transport (``transport.failure``, the transport contract's failure state)."""

    def __init__(self, transport: NvshmemTransport) -> None:
        self._transport = weakref.ref(transport)
        self._device = transport.device
        self._pending: deque[Pending] = deque()
        self._cond = threading.Condition()
        self._abort_lock = threading.Lock()
        self._stopped = False
        self._thread: threading.Thread | None = None

    # -- entries ------------------------------------------------------------------------------------------
    def done(self, event: torch.cuda.Event) -> bool:
        """Whether ``event`` completed, queried without disturbing another thread's graph capture (module
        docstring); RuntimeError on a CUDA error of the work before it."""
        transport = self._transport()
        if transport is None:
            return True
        C = transport._C
        return C.query_event(event.cuda_event) == C.EVENT_DONE  # type: ignore[attr-defined]

    def add(self, entry: Pending, stream: int) -> None:
        """Watch ``entry`` (recorded on ``stream``): the engine's deadline thread gets it too."""
        transport = self._transport()
        if transport is not None:
            timeout = max(0.0, entry.deadline - time.monotonic())
            backend_call(entry.op, transport._engine.watch, stream, timeout)  # type: ignore[attr-defined]
        with self._cond:
            self._pending.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="odc-nvshmem-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()

    def outstanding(self) -> list[Pending]:
        with self._cond:
            return list(self._pending)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def poll(self, engine: object) -> Pending | None:
        """Drop completed entries; return the oldest one that is past its deadline or released by an abort.

        The abort word is read after each event query: a completion observed while the word is up may be a kernel
        that gave up, so it is not taken as done."""
        now = time.monotonic()
        with self._cond:
            while self._pending:
                done = self.done(self._pending[0].event)
                if engine.aborted():  # type: ignore[attr-defined]
                    return self._pending[0]
                if not done:
                    break
                self._pending.popleft()
            if self._pending and now > self._pending[0].deadline:
                return self._pending[0]
        return None

    def _blame(self, engine: object, default: Pending) -> Pending:
        """After the kernels left: the entry whose kernel recorded that it gave up (the first barrier / signal wait
        that did), else ``default``. Entries that completed just before the abort may still be listed (the poll
        drops them lazily), so the records, not the list order, say which operation was waiting."""
        epoch, wait_id = engine.barrier_gave_up(), engine.wait_gave_up()  # type: ignore[attr-defined]
        with self._cond:
            for e in self._pending:
                if (e.epoch and e.epoch == epoch) or (e.wait_id and e.wait_id == wait_id):
                    return e
        return default

    # -- failure ------------------------------------------------------------------------------------------
    def fail(self, transport: NvshmemTransport, error: OdcError) -> None:
        if transport.failure is None:
            log.error("%s", error)
            transport.fail_unseen(error)  # raised to the caller by transport._raise_failure (or at finalize)

    def abort(self, transport: NvshmemTransport, entry: Pending) -> None:
        """``entry`` is late (or the abort is up): raise the abort word, let the kernels leave, record the error."""
        with self._abort_lock:
            if transport.failure is not None:
                return
            engine = transport._engine
            engine.set_abort()  # type: ignore[attr-defined]
            left = False
            end = time.monotonic() + ABORT_GRACE_S
            while time.monotonic() < end:
                try:
                    if self.done(entry.event):
                        left = True
                        break
                except RuntimeError:
                    break
                time.sleep(1e-3)
            entry = self._blame(engine, entry)
            if entry.wait is not None:
                index, value, peers = entry.wait
                mine = entry.wait_id != 0 and engine.wait_gave_up() == entry.wait_id  # type: ignore[attr-defined]
                seen = engine.wait_seen() if mine else None  # type: ignore[attr-defined]
                rank, timeout = transport.rank, transport.timeout
                text = wait_timeout_message(entry.op, rank, timeout, index, value, seen, peers, left)
                self.fail(transport, OdcTimeoutError(text))
                return
            missing: list[int] | None = None
            if entry.epoch and engine.barrier_gave_up() == entry.epoch:  # type: ignore[attr-defined]
                missing = missing_peers(engine.heard(), entry.epoch)  # type: ignore[attr-defined]
            text = timeout_message(entry.op, transport.rank, transport.timeout, entry.epoch, missing, left)
            self.fail(transport, OdcTimeoutError(text))

    def settle(self, transport: NvshmemTransport) -> None:
        """The abort word is up (raised by the engine's deadline thread): record the error of the late entry now."""
        late = self.poll(transport._engine)
        if late is not None:
            self.abort(transport, late)

    def wait(self, transport: NvshmemTransport, entry: Pending) -> None:
        """Host wait for ``entry`` with short polling (keeps the GPU fed), bounded by its deadline."""
        spins = 0
        engine = transport._engine
        while True:
            try:
                done = self.done(entry.event)
            except RuntimeError as exc:  # a CUDA error of earlier work surfaces here
                self.fail(transport, OdcBackendError(f"nvshmem {entry.op}: CUDA error: {exc}"))
                done = False
            if transport.failure is not None:
                transport._raise_failure(entry.op)
            if engine.aborted():  # type: ignore[attr-defined]
                self.abort(transport, self.poll(engine) or entry)
                transport._raise_failure(entry.op)
            if done:
                return
            if time.monotonic() > entry.deadline:
                self.abort(transport, entry)
                transport._raise_failure(entry.op)
            spins += 1
            time.sleep(0 if spins < 200 else 50e-6)

    def _loop(self) -> None:
        torch.cuda.set_device(self._device)
        while True:
            with self._cond:
                if self._stopped:
                    return
                if not self._pending:
                    self._cond.wait(0.1)
                    continue
            transport = self._transport()
            if transport is None:
                return
            try:
                late = self.poll(transport._engine)
            except RuntimeError as exc:  # a CUDA error of queued work surfaces from the event
                self.fail(transport, OdcBackendError(f"nvshmem: CUDA error while waiting for a barrier: {exc}"))
                transport._engine.set_abort()  # type: ignore[attr-defined]
                return
            if late is not None:
                self.abort(transport, late)
                return
            del transport
            time.sleep(WATCHDOG_PERIOD_S)
