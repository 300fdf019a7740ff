"""The first control page of every segment: the world rounds (barrier and exchange), and the failure flag.

Rank r writes, in its own page, the round number (its *epoch*), a 16-byte digest of the full operation identity
(e.g. ``free(w#3.grad)``), the operation's name for messages, a payload, its pid and start time (for liveness
checks), and its status: *failed* (its runtime is unusable) or *left* (it finalized); peers waiting for such a
rank in a later round raise at once instead of timing out.
A peer is at most one round ahead (it cannot pass the next round without us, and a mismatched round ends only
once every rank announced it), so each page keeps
the digest and name of the current and of the previous round, and payload slots alternate by epoch parity. Page
stores and loads happen under a byte-range lock of the page: lock and unlock are system calls that order memory,
so every data write a rank made before its barrier is visible to a peer that has seen its epoch.
"""

from __future__ import annotations

import struct
import threading
from typing import NamedTuple

from odc_runtime.transport.host.locks import ByteRangeLocks
from odc_runtime.transport.host.segments import PAGE, Segments

NAME_BYTES = 64  # operation name kept for messages only; the digest is what is compared
# epoch, pid, start time, digest + name of the op at `epoch`, digest + name of the op at `epoch - 1`,
# payload lengths of slot 0 and slot 1, status (HEALTHY, FAILED, LEFT, EXITED or EXITED_RAISING)
_HEADER = struct.Struct(f"<qqq16s{NAME_BYTES}s16s{NAME_BYTES}sIIq")
_SLOT_OFFSET = 256
SLOT_BYTES = (PAGE - _SLOT_OFFSET) // 2
HEALTHY, FAILED, LEFT = 0, 1, 2  # LEFT: the rank finalized its transport (it takes part in no more rounds)
# The rank's process is exiting with its runtime live (no finalize): its program ended (returned, sys.exit), or an
# uncaught exception ended it (EXITED_RAISING). Published at interpreter exit, so a peer says that, not "crashed".
EXITED, EXITED_RAISING = 3, 4


class PeerState(NamedTuple):
    """One rank's control page as read by another."""

    epoch: int
    pid: int
    start: int
    digest: bytes  # of the op at ``epoch``
    name: bytes
    prev_digest: bytes  # of the op at ``epoch - 1``
    prev_name: bytes
    status: int  # HEALTHY, FAILED, LEFT, EXITED or EXITED_RAISING
    raw: bytes  # the page up to the payloads (for ``ControlPage.payload``)


class ControlPage:
    """This rank's world-round state and access to every rank's first control page."""

    def __init__(self, segments: Segments, locks: ByteRangeLocks, rank: int, pid: int, start: int) -> None:
        self._segments = segments
        self._locks = locks
        self._rank = rank
        self._pid = pid
        self._start = start
        self.epoch = 0
        self._current = (b"", b"init")  # digest and name of the op at ``epoch``
        self._previous = (b"\0" * 16, b"")  # ... and at ``epoch - 1``
        self._slot_lengths = [0, 0]
        self._status = HEALTHY
        # POSIX locks do not exclude this process's threads: the async worker may publish FAILED while the caller
        # announces a round.
        self._mutex = threading.Lock()

    def init_own(self) -> None:
        """Write the initial header into this rank's freshly created page (nobody maps it yet)."""
        self._segments.get(self._rank).map[: _HEADER.size] = self._header()

    def announce(self, digest: bytes, name: bytes, payload: bytes) -> None:
        """Enter the next round: publish its epoch, operation and payload (one locked store)."""
        with self._mutex:
            self.epoch += 1
            self._previous, self._current = self._current, (digest, name)
            slot = self.epoch % 2
            self._slot_lengths[slot] = len(payload)
            self._store(_SLOT_OFFSET + slot * SLOT_BYTES, payload)

    def publish_status(self, status: int) -> None:
        """Publish FAILED, LEFT or an EXITED state: peers waiting for this rank in a later round raise at once
        instead of timing out. Only the first change from HEALTHY is published (a failure is never overwritten)."""
        with self._mutex:
            if self._status == HEALTHY:
                self._status = status
                self._store(0, b"")

    def _header(self) -> bytes:
        return _HEADER.pack(
            self.epoch, self._pid, self._start, *self._current, *self._previous, *self._slot_lengths,
            self._status,
        )

    def _store(self, start: int, payload: bytes) -> None:
        """Write ``payload`` at ``start`` and the header built from the current state (caller holds the mutex)."""
        seg = self._segments.get(self._rank)
        header = self._header()
        with self._locks.held(self._rank, 0, PAGE, exclusive=True, op="barrier"):
            seg.map[start : start + len(payload)] = payload
            seg.map[: _HEADER.size] = header

    def read(self, peer: int) -> PeerState:
        """``peer``'s page (its payload slots copied only when there is a payload)."""
        seg = self._segments.get(peer)
        with self._locks.held(peer, 0, PAGE, exclusive=False, op="barrier"):
            raw = bytes(seg.map[: _HEADER.size])
            lengths = _HEADER.unpack_from(raw)[7:9]
            if any(lengths):  # copy the payload slots only when there is a payload (not for plain barriers)
                raw = bytes(seg.map[: _SLOT_OFFSET + SLOT_BYTES + lengths[1]])
        epoch, pid, start, digest, name, prev_digest, prev_name, _, _, status = _HEADER.unpack_from(raw)
        return PeerState(
            epoch, pid, start, digest, name.rstrip(b"\0"), prev_digest, prev_name.rstrip(b"\0"), status, raw
        )

    @staticmethod
    def payload(state: PeerState, epoch: int) -> bytes:
        """The payload ``state``'s rank published for round ``epoch`` (its current or previous round)."""
        lengths = _HEADER.unpack_from(state.raw)[7:9]
        slot = epoch % 2
        start = _SLOT_OFFSET + slot * SLOT_BYTES
        return state.raw[start : start + lengths[slot]]
