"""Byte-range locks on the segments: what makes concurrent pushes exact and control-page reads consistent.

A push holds a POSIX byte-range lock (``fcntl``) on the target bytes of the owner's segment while it adds, one
chunk at a time. A process holds at most one lock at a time, so lock waits cannot form a cycle; the kernel releases
a dead process's locks, and a contended lock is polled until ``ODC_TIMEOUT`` so that a stopped holder cannot hang
the caller. POSIX locks do not exclude threads of one process, so a per-peer ``threading.Lock``
(``ByteRangeLocks.thread_lock``) serialises this process's own threads (caller and async worker) first. Lock
and unlock are system calls that order memory: what a holder wrote is seen by the next holder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import threading
from collections.abc import Iterator

from odc_runtime.errors import OdcTimeoutError
from odc_runtime.transport.host.segments import Segments
from odc_runtime.transport.wait import Backoff, Deadline


class ByteRangeLocks:
    """Polled ``fcntl`` locks on byte ranges of any rank's segment."""

    def __init__(self, segments: Segments, rank: int, world_size: int, timeout: float) -> None:
        self._segments = segments
        self._rank = rank
        self._timeout = timeout
        self._threads = [threading.Lock() for _ in range(world_size)]

    def thread_lock(self, peer: int) -> threading.Lock:
        """The lock that serialises this process's threads on ``peer``'s segment."""
        return self._threads[peer]

    def lock(self, peer: int, fd: int, start: int, length: int, *, exclusive: bool, op: str) -> None:
        """Take a POSIX lock on bytes ``[start, start+length)`` of ``peer``'s segment (``fd``); release it with
        ``unlock``. Uncontended, this is one system call. Contended, it polls instead of blocking in the
        kernel, so that a holder that is stopped (not dead: the kernel releases a dead process's locks) cannot
        hang us forever."""
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline: Deadline | None = None  # made only when contended: the uncontended call is one system call
        backoff: Backoff | None = None
        while True:
            try:
                fcntl.lockf(fd, mode, length, start)
                return
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
            except BaseException:
                # An interrupt (KeyboardInterrupt from a signal handler) raised as the call returned: the lock may
                # be held, and no caller's finally would release it, so a peer would wait for it until its timeout.
                # Unlocking a range this process does not hold changes nothing.
                self.unlock(fd, start, length)
                raise
            if deadline is None or backoff is None:
                deadline, backoff = Deadline(self._timeout), Backoff(spins=20, step=1e-5, cap=2e-4)
            if deadline.passed():
                raise OdcTimeoutError(
                    f"odc {op}: rank {self._rank} could not lock bytes [{start}, {start + length}) of rank {peer}'s "
                    f"segment within {self._timeout:g} s; a process holding it is stopped or stuck"
                )
            backoff.pause()

    @staticmethod
    def unlock(fd: int, start: int, length: int) -> None:
        fcntl.lockf(fd, fcntl.LOCK_UN, length, start)

    @contextlib.contextmanager
    def held(self, peer: int, start: int, length: int, *, exclusive: bool, op: str) -> Iterator[None]:
        """Hold ``lock`` on bytes ``[start, start+length)`` of ``peer``'s segment for the ``with`` block."""
        fd = self._segments.get(peer).fd
        try:  # lock inside the try: an interrupt between the lock and the try would leak it
            self.lock(peer, fd, start, length, exclusive=exclusive, op=op)
            yield
        finally:
            self.unlock(fd, start, length)
