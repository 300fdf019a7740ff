"""The one-node Triton transport's watchdog: one persistent thread per transport that holds every waiting kernel
(barrier, group fence, signal wait) against its deadline, so that no call creates a thread.

Protocol (docs/design.md, "Stream-ordered ``sync`` with one persistent watchdog"): the caller *arms* an
``Entry`` and launches its kernel; the thread runs the host transport's bounded wait
(``HostTransport._wait_for_peers``: liveness every period, crossed collectives, ``ODC_TIMEOUT``) over the entry's
completion. An entry is *finished* exactly once, under the watchdog's lock, by whoever sees it first: the thread
(the kernel completed, or an error) or the caller (it saw the kernel complete). On an error the thread finishes the
entry with it and records the transport's failure *before* it raises the abort word, so a caller that finishes an
entry itself knows its kernel was not released by an abort. The thread never waits for a caller, and a caller
waits only for an entry to be finished, which the thread guarantees within the deadline plus ``GRACE_S`` plus one
liveness period: no cycle, so no deadlock.

The thread is lazy, because it shares the GIL with the training loop: it looks at an entry ``GRACE_S`` after it
was armed (most waiting kernels have completed by then and their caller finished them), and then polls at most
every millisecond, backing off to ``POLL_CAP_S``. An arm wakes it only when it is idle; a finish never does. So
a loop of syncs costs the thread about one wake per grace period, and no spin competes with the caller.

On a GPU the thread's only CUDA calls are event queries, made in thread-local stream-capture mode (a user's graph
capture on another thread is not disturbed); the abort is a host store (``SymmTransport._raise_abort``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from odc_runtime.errors import OdcError
from odc_runtime.transport.base import as_failure
from odc_runtime.transport.wait import Backoff

if TYPE_CHECKING:
    from odc_runtime.transport.symm.transport import SymmTransport

log = logging.getLogger("odc_runtime.transport.symm")

GRACE_S = 0.02  # an entry is first looked at this long after it was armed
POLL_STEP_S, POLL_CAP_S = 1e-3, 0.05  # then polled every step x round seconds, at most every cap


class Entry:
    """One waiting kernel: what it waits for, and how it ended (``finished``, ``error``)."""

    __slots__ = ("after", "arrived", "error", "event", "finished", "op", "peers", "watch", "what")

    def __init__(self, op: str, peers: list[int], arrived: Callable[[int], bool] | None,
                 watch: Callable[[int], None], what: str, after: Callable[[], None] | None = None) -> None:
        self.op, self.peers, self.watch, self.what, self.after = op, peers, watch, what, after
        self.arrived = arrived  # CPU: what the kernel waits for, read from the host; GPU: None (the event decides)
        self.event: Any = None  # GPU: the CUDA event recorded after the kernel
        self.finished = False
        self.error: BaseException | None = None

    def complete(self) -> bool:
        """Whether the kernel completed (GPU: its event; CPU: never known here, the caller finishes the entry)."""
        return self.event is not None and bool(self.event.query())


class Watchdog:
    """The persistent watchdog thread of one ``SymmTransport`` (see the module docstring)."""

    def __init__(self, transport: SymmTransport) -> None:
        self._transport = weakref.ref(transport)
        lock = threading.Lock()
        self._work = threading.Condition(lock)  # the thread waits here while idle (an arm or a stop wakes it)
        self._done = threading.Condition(lock)  # callers wait here for an entry to be finished
        self._stopping = threading.Event()  # cuts the thread's grace wait short
        self._queue: deque[Entry] = deque()
        self._idle = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="odc-symm-watchdog", daemon=True)
        self._thread.start()

    def arm(self, entry: Entry) -> None:
        """Watch ``entry`` from now on (its kernel is launched, or about to be)."""
        with self._work:
            while self._queue and self._queue[0].finished:
                self._queue.popleft()  # finished while the thread slept (the thread drops only its own entry)
            self._queue.append(entry)
            if self._idle:
                self._work.notify()

    def finish(self, entry: Entry, error: BaseException | None = None) -> bool:
        """Finish ``entry`` (with ``error``) unless it already is; whether this call finished it."""
        with self._done:
            if entry.finished:
                return False
            entry.finished, entry.error = True, error
            self._done.notify_all()
            return True

    def wait_finished(self, entry: Entry, poll: Callable[[], bool] | None = None) -> None:
        """Block until ``entry`` is finished. ``poll`` (GPU: the event query) may finish it from here first; the
        thread finishes it by the deadline in any case."""
        with self._done:
            while not entry.finished:
                if poll is not None and poll():
                    entry.finished = True
                    self._done.notify_all()
                    return
                self._done.wait(50e-6 if poll is not None else 0.1)

    def stop(self) -> None:
        """Stop the thread once the entries armed before are finished (finalize)."""
        with self._work:
            self._stopped = True
            self._stopping.set()
            self._work.notify_all()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def _loop(self) -> None:
        device = None
        while True:
            with self._work:
                while not self._queue and not self._stopped:
                    self._idle = True
                    self._work.wait()
                self._idle = False
                if not self._queue:
                    return
            self._stopping.wait(GRACE_S)  # most entries are finished by their caller meanwhile
            with self._work:
                while self._queue and self._queue[0].finished:
                    self._queue.popleft()
                if not self._queue:
                    continue
                entry = self._queue[0]
            transport = self._transport()
            if transport is None:
                return
            if device is None and transport.device.type == "cuda":
                import torch

                from odc_runtime.transport import cudart

                device = transport.device
                # This thread only queries events; in the default (global) capture mode a query made while the user
                # captures a CUDA graph on another thread fails and invalidates that capture.
                if not cudart.use_thread_local_capture_mode():
                    log.warning("odc symm watchdog: the CUDA runtime did not take thread-local capture mode; a "
                                "CUDA graph captured in global mode while a sync is pending may be invalidated")
                torch.cuda.set_device(device)  # event queries on the transport's GPU
            self._watch(transport, entry)
            with self._work:
                if self._queue and self._queue[0] is entry:  # an arm may have dropped it once finished
                    self._queue.popleft()
            del transport

    def _watch(self, transport: SymmTransport, entry: Entry) -> None:
        arrived = entry.arrived

        def done(p: int) -> bool:
            return entry.finished or entry.complete() or (arrived is not None and arrived(p))

        try:
            transport._wait_for_peers(entry.op, entry.peers or [transport.rank], done, entry.watch, entry.what,
                                      backoff=Backoff(spins=0, step=POLL_STEP_S, cap=POLL_CAP_S))
        except BaseException as e:  # a typed OdcError, or anything unexpected: the kernel must not spin on
            if self.finish(entry, e):
                # recorded (the wait may have recorded it already) and unseen: the caller learns it when it
                # settles the entry, or at finalize
                transport.fail_unseen(as_failure(entry.op, e, "the watchdog raised the abort word") if not
                                      isinstance(e, OdcError) else e)
                log.debug("odc symm watchdog: %s: %s", entry.op, e)
                transport._raise_abort()
            return
        self.finish(entry)
