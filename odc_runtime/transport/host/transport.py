"""The host transport object: symmetric memory, fetch / push / signalled puts, barriers, fail-stop.

Its helpers, each owned by one transport: ``Segments`` (files and mappings),
``ByteRangeLocks``, ``ControlPage`` (world rounds, failure flag),
``GroupFences``, ``AsyncWorker``. Every wait goes through
``odc_runtime.transport.wait.wait_for``.

Fail-stop (docs/design.md, "Fail-stop"): an exception that escapes a step after it changed shared state (a world
round or group fence after this rank announced its arrival, a push after a chunk of it landed, a signalled put)
marks the transport failed and sets the failed flag in its control page; every later operation on this rank
raises at once and every peer waiting for this rank raises OdcPeerLostError within a liveness period.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import sys
import weakref
from collections.abc import Callable, Sequence

import torch

from odc_runtime.agree import gather_checked, op_digest, process_alive, process_start_time, require_same, shorten
from odc_runtime.errors import (
    DRIFT_HINT,
    ELSEWHERE_HINT,
    OdcCrossedCollectivesError,
    OdcError,
    OdcPeerLostError,
    OdcRoundMismatchError,
    OdcTimeoutError,
    OdcUsageError,
)
from odc_runtime.transport.base import (
    Capabilities,
    FetchRequest,
    Group,
    Piece,
    PushRequest,
    PutRequest,
    SymmetricBuffer,
    TransferPlan,
    Transport,
    Work,
    as_failure,
)
from odc_runtime.transport.heap import HeapAllocator
from odc_runtime.transport.host.control import (
    EXITED,
    EXITED_RAISING,
    FAILED,
    HEALTHY,
    LEFT,
    NAME_BYTES,
    SLOT_BYTES,
    ControlPage,
)
from odc_runtime.transport.host.fences import MAX_GROUPS, GroupFences, find_cycle
from odc_runtime.transport.host.locks import ByteRangeLocks
from odc_runtime.transport.host.plan import HostPlan
from odc_runtime.transport.host.segments import CONTROL_BYTES, Segments
from odc_runtime.transport.host.worker import AsyncWorker
from odc_runtime.transport.wait import Backoff, wait_for

log = logging.getLogger("odc_runtime.transport.host")

_TOO_BIG = b"\0odc-payload-too-big"

# One chunk of a push: (lo, hi) of the pushed elements, the locked byte range (start, length) in the owner's segment
# file, and the owner's elements it adds into.
Chunk = tuple[int, int, int, int, torch.Tensor]


class HostTransport(Transport):
    """Symmetric memory in shared-memory segments; see the package docstring for the protocol."""

    name = "host"
    device_type = "cpu"
    capabilities = Capabilities(signals=True, group_fences=True, nodes=False, deterministic=True)

    def __init__(
        self,
        rank: int,
        world_size: int,
        job: str,
        *,
        timeout: float,
        heap_size: int,
        directory: str,
        chunk_bytes: int,
    ) -> None:
        super().__init__(rank, world_size, torch.device("cpu"), timeout)
        self.job = job
        self.directory = directory
        self.chunk_bytes = chunk_bytes
        self._allocator = HeapAllocator(heap_size, limit_hint="ODC_HEAP_SIZE or odc.init(heap_size=...)")
        self._pid = os.getpid()
        self._start = process_start_time(self._pid) or 0
        self.segments = Segments(rank, world_size, job, directory, self._allocator.capacity)
        self.locks = ByteRangeLocks(self.segments, rank, world_size, timeout)
        self.control = ControlPage(self.segments, self.locks, rank, self._pid, self._start)
        self.fences = GroupFences(self.segments, self.locks, rank)
        self.worker = AsyncWorker(rank, timeout)
        self._closed = False

    # -- setup ----------------------------------------------------------------------------------------
    def create_segment(self) -> tuple[int, int]:
        """Create this rank's segment (mode 0600); return the ``(pid, start time)`` that name it."""
        self.segments.create_own(self._pid, self._start)
        self.control.init_own()
        # After the segment's own unlink hook: at exit this runs first (atexit is last in, first out).
        self._exit_hook = functools.partial(_publish_exit, weakref.ref(self))
        atexit.register(self._exit_hook)
        return self._pid, self._start

    def map_peers(self, identities: Sequence[tuple[int, int, str]]) -> None:
        """Map every peer's segment; ``identities[r]`` is ``(pid, start time, pid namespace)`` of rank ``r``."""
        self.segments.map_peers(identities)

    # -- failure ----------------------------------------------------------------------------------------
    def fail(self, error: OdcError) -> OdcError:
        """Record the failure and publish it in the control page (best effort: the page may be gone)."""
        failure = super().fail(error)
        with contextlib.suppress(Exception):
            self.control.publish_status(FAILED)
        return failure

    # -- memory ---------------------------------------------------------------------------------------
    def heap_capacity(self) -> int:
        return self._allocator.capacity

    def heap_used(self) -> int:
        return self._allocator.used

    def alloc(self, numel: int, dtype: torch.dtype, tag: str = "") -> SymmetricBuffer:
        nbytes = numel * dtype.itemsize
        offset: int | None = None
        local: torch.Tensor | None = None

        def reserve_and_zero() -> int:
            nonlocal offset, local
            offset = self._allocator.alloc(nbytes, what=f"'{tag or 'buffer'}'")
            local = self.place(offset, numel, dtype, f"'{tag or 'buffer'}'")
            return offset

        # One agreement round: nobody pushes into the region before its owner reserved and zeroed it, and a
        # rank whose filesystem is full fails every rank instead of crashing on a page fault later.
        try:
            offsets = gather_checked(f"alloc({tag})", reserve_and_zero, exchange=self)
            require_same(
                f"alloc({tag})", offsets,
                rule="got different heap offsets on different ranks (the ranks' allocation histories differ)",
            )
        except BaseException:
            if offset is not None:
                self._allocator.free(offset)
            raise
        assert offset is not None and local is not None
        return SymmetricBuffer(numel=numel, dtype=dtype, local=local, handle=offset, tag=tag)

    def place(self, offset: int, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """Back ``numel`` ``dtype`` elements at heap byte ``offset`` with memory, zero them, and return this rank's
        view (a subclass with its heap elsewhere overrides this; ``alloc`` agrees on the result)."""
        seg = self.segments.get(self.rank)
        self.segments.reserve(seg.fd, CONTROL_BYTES + offset, max(numel * dtype.itemsize, 1), what)
        view = seg.view(offset, numel, dtype)
        view.zero_()
        return view

    def free(self, buf: SymmetricBuffer) -> None:
        if buf.freed:
            return
        if self.failure is None:
            # Nobody may still read or add into the region when it is handed out again.
            self.barrier(f"free({buf.tag})")
            self.settle()  # its outcome (a mismatch) before anything is freed
        # else: the runtime is dead (a peer was lost); release locally without waiting for anyone
        self._allocator.free(buf.handle)  # type: ignore[arg-type]
        buf.freed = True

    # -- one-sided operations -------------------------------------------------------------------------
    def fetch(self, buf: SymmetricBuffer, requests: Sequence[FetchRequest], *, async_op: bool = False) -> Work | None:
        self.check_usable("fetch")
        if async_op:
            return self._run_async(lambda: self._fetch_now(buf, requests), "fetch")
        self._fetch_now(buf, requests)
        return None

    def push(
        self, buf: SymmetricBuffer, requests: Sequence[PushRequest], scale: float, *, async_op: bool = False
    ) -> Work | None:
        self.check_usable("push")
        if async_op:
            return self._run_async(lambda: self._push_now(buf, requests, scale), "push")
        self._push_now(buf, requests, scale)
        return None

    def plan(self, buf: SymmetricBuffer, kind: str, pieces: Sequence[Piece]) -> TransferPlan:
        return HostPlan(self, buf, kind, pieces, self.stream_key())

    def fast_path_ok(self) -> bool:
        """Whether a plan may run on its resolved views: not failed, not finalized, not in a forked child (else
        it takes the generic path, which raises the right error). ``SymmPlan.run``'s steady state inlines it."""
        return self.failure is None and not self._closed and not self.segments.forked

    def region(self, buf: SymmetricBuffer, peer: int, offset: int, numel: int) -> torch.Tensor:
        """Elements ``[offset, offset + numel)`` of ``peer``'s part of ``buf`` (a view of its segment)."""
        return self.segments.get(peer).view(buf.handle + offset * buf.dtype.itemsize, numel, buf.dtype)  # type: ignore[operator]

    def chunks(self, buf: SymmetricBuffer, peer: int, offset: int, numel: int) -> tuple[Chunk, ...]:
        """A push of ``numel`` elements at element ``offset`` of ``peer``'s part of ``buf``, cut into chunks of at
        most ``chunk_bytes``: ``(lo, hi, lock start, lock length, destination view)``, ``lo``/``hi`` relative to
        the pushed elements, each chunk added under its own byte-range lock."""
        itemsize = buf.dtype.itemsize
        step = max(1, self.chunk_bytes // itemsize)
        first = buf.handle + offset * itemsize  # type: ignore[operator]
        seg = self.segments.get(peer)
        out = []
        for lo in range(0, numel, step):
            n = min(step, numel - lo)
            at = first + lo * itemsize
            out.append((lo, lo + n, CONTROL_BYTES + at, n * itemsize, seg.view(at, n, buf.dtype)))
        return tuple(out)

    def _fetch_now(self, buf: SymmetricBuffer, requests: Sequence[FetchRequest]) -> None:
        for req in requests:
            req.dst.view(-1).copy_(self.region(buf, req.peer, req.offset, req.dst.numel()))

    def _push_now(self, buf: SymmetricBuffer, requests: Sequence[PushRequest], scale: float) -> None:
        self.check_usable("push")  # an asynchronous push queued before another one failed the transport
        work = [
            (req.peer, self.segments.get(req.peer).fd, req.src.view(-1),
             self.chunks(buf, req.peer, req.offset, req.src.numel()))
            for req in requests
        ]
        self.add_chunks(work, scale)

    def add_chunks(self, work: Sequence[tuple[int, int, torch.Tensor, Sequence[Chunk]]], scale: float) -> None:
        """Add each ``(peer, segment fd, flat source, chunks)`` of ``work`` into its peer's segment, every chunk
        under an exclusive byte-range lock (one lock held at a time), this process's threads serialised per peer.

        All-or-nothing only up to its first chunk: an exception after any chunk landed is fail-stop (a retry
        would add the landed chunks twice); before that, nothing changed and the error is an ordinary one."""
        locks = self.locks
        landed = False
        try:
            for peer, fd, src, chunks in work:
                whole = len(chunks) == 1
                with locks.thread_lock(peer):
                    for lo, hi, start, length, dst in chunks:
                        part = src if whole else src[lo:hi]
                        try:  # lock inside the try: an interrupt between the lock and the try would leak it
                            locks.lock(peer, fd, start, length, exclusive=True, op="push")
                            landed = True  # conservative: an interrupt inside add_ may have changed dst
                            if scale == 1.0:
                                dst.add_(part)
                            else:
                                dst.add_(part, alpha=scale)
                        finally:
                            locks.unlock(fd, start, length)
        except BaseException as e:
            if not landed:
                raise
            if isinstance(e, OdcError):
                fatal = type(e)(
                    f"{e}. Part of this push had already landed at other owners or chunks, so the runtime is "
                    "unusable (a retry would add that part twice): call odc_runtime.finalize() and restart the job"
                )
                self.fail(fatal)
                raise fatal from e
            self.fail(as_failure("push", e, "part of the push had landed"))
            raise

    # -- signalled puts ---------------------------------------------------------------------------------
    # Ordering: the data is copied into the peer's segment before the signal word is incremented under an
    # exclusive byte-range lock on that word, and the waiter reads the word under a shared lock on it, then
    # reads the data. The lock system calls order both sides' memory accesses (the same argument as the
    # push path's locks), so a waiter that sees the count sees every counted put's data. Several senders
    # into one word are exact because each increment is a read-modify-write under the exclusive lock.
    def _signal_word(self, signal: SymmetricBuffer, peer: int, index: int) -> tuple[torch.Tensor, int]:
        if signal.dtype != torch.int64 or not 0 <= index < signal.numel:
            raise OdcUsageError(
                f"host signal: word {index} of a {signal.dtype} buffer of {signal.numel}; signals are int64 words"
            )
        offset = signal.handle + index * 8  # type: ignore[operator]
        return self.segments.get(peer).view(offset, 1, torch.int64), CONTROL_BYTES + offset

    def put_signal(self, buf: SymmetricBuffer, requests: Sequence[PutRequest], signal: SymmetricBuffer) -> None:
        self.check_usable("put_signal")
        self.quiet()  # asynchronous operations issued before come first, as on a stream
        base: int = buf.handle  # type: ignore[assignment]
        itemsize = buf.dtype.itemsize
        targets = []
        for req in requests:  # validate everything before writing anything
            if req.src.dtype != buf.dtype or req.offset < 0 or req.offset + req.src.numel() > buf.numel:
                raise OdcUsageError(
                    f"host put_signal: {req.src.numel()} {req.src.dtype} elements at offset {req.offset} do not fit "
                    f"buffer {buf.tag!r} ({buf.numel} {buf.dtype})"
                )
            dst = self.segments.get(req.peer).view(base + req.offset * itemsize, req.src.numel(), buf.dtype)
            targets.append((req, dst, *self._signal_word(signal, req.peer, req.signal_index)))

        def put_all() -> None:
            for req, dst, word, start in targets:
                dst.copy_(req.src.view(-1))
                with self.locks.held(req.peer, start, 8, exclusive=True, op="put_signal"):
                    word += 1

        self.fail_stop("put_signal", "some of its puts were delivered", put_all)

    def wait_signal(self, signal: SymmetricBuffer, index: int, value: int, op: str, peers: Sequence[int]) -> None:
        self.check_usable(shorten(op))
        word, start = self._signal_word(signal, self.rank, index)

        def reached(_: int) -> bool:
            with self.locks.held(self.rank, start, 8, exclusive=False, op=op):
                return int(word.item()) >= value

        self._wait_for_peers(
            op, list(peers) or [self.rank], reached, lambda _: None,
            what=f" (their puts did not arrive: signal word {index} stayed below {value})",
        )

    def _run_async(self, fn: Callable[[], None], what: str) -> Work:
        """Run ``fn`` on the worker thread (FIFO: asynchronous operations complete in issue order)."""
        self.segments.get(self.rank)  # finalized / forked: raise here, in the caller, not later in the worker
        return self.worker.submit(fn, what)

    def quiet(self) -> None:
        """Wait for every submitted operation; then re-raise the first error of one that failed since the last
        quiet (so ``sync`` cannot report success after a lost push)."""
        self.worker.quiet()

    # -- barrier and exchange -----------------------------------------------------------------------
    def _quiet_then_meet(self, meet: Callable[[], None]) -> None:
        """``quiet()``, then ``meet()`` the peers even if one of this rank's operations failed (so they do not wait
        out the timeout for it), then report that failure. A failure that made the transport unusable (a torn push)
        or a timed-out operation is not met: the peers learn it from the failed flag, or the error is an ordinary
        one before this rank announced anything. An interrupt of the wait itself (or this wait's own timeout)
        propagates before anything is announced, and the operations still running stay pending, so a retry waits
        for them (docs/design.md, "Fail-stop")."""
        failed = self.worker.wait_all()
        if failed is not None and (
            self.failure is not None or not isinstance(failed, Exception) or isinstance(failed, OdcTimeoutError)
        ):
            raise failed
        meet()
        if failed is not None:
            raise failed

    def barrier(self, op: str = "barrier") -> None:
        self._quiet_then_meet(lambda: self.exchange(op, b""))

    def settle(self) -> None:
        """Complete the outcome of a barrier that returned before its round completed (a stream-ordered one, see
        the symm transport); this transport's barriers are synchronous, so there is nothing to do."""

    def exchange(self, op: str, payload: bytes, *, label: str | None = None) -> list[bytes]:
        """Collective: one barrier round that also carries ``payload`` (at most about 1.9 KB) from every rank.

        Returns every rank's payload. Raises OdcMismatchError if a peer is in another collective, OdcPeerLostError
        if a peer died or failed, OdcTimeoutError after ``timeout``. Once this rank announced its arrival, any
        exception escaping the round is fail-stop (a peer may already have counted the arrival and moved on).
        ``label`` (default ``op``) names the round in messages, here and on the peers; ``op`` alone is compared.
        """
        digest = op_digest(op)
        op = op if label is None else label  # from here on: what messages say
        self.check_usable(shorten(op))
        too_big = len(payload) > SLOT_BYTES
        if too_big:
            payload = _TOO_BIG
        name = op.encode()[:NAME_BYTES]
        payloads: list[bytes] = [b""] * self.world_size
        payloads[self.rank] = payload

        mismatch: list[str] = []  # the first peer seen in another collective at this epoch

        def arrived(p: int) -> bool:
            state = self.control.read(p)
            if state.epoch < self.control.epoch:
                if state.status != HEALTHY:  # failed or finalized: it will never reach this round
                    self._check_not_crossed(op, p)  # a crossed collective is the better explanation
                    raise OdcPeerLostError(self._describe_missing(op, [p], lost=[], failed=[p]))
                return False
            # A peer is at most one round ahead (it cannot pass the next one without us, and a mismatched round
            # ends only once every rank announced it: below), so what it did at our epoch is its current or its
            # previous round.
            at_ours = state.epoch == self.control.epoch
            theirs, their_name = (state.digest, state.name) if at_ours else (state.prev_digest, state.prev_name)
            if theirs != digest and not mismatch:
                mismatch.append(
                    f"odc collective mismatch at barrier #{self.control.epoch}: rank {self.rank} is in "
                    f"{shorten(op)!r} but rank {p} is in {their_name.decode(errors='replace')!r}"
                    f"{'…' if len(their_name) == NAME_BYTES else ''}; every rank must call the same "
                    f"collectives (shard, free, sync, finalize) in the same order; {DRIFT_HINT}"
                )
            payloads[p] = ControlPage.payload(state, self.control.epoch)
            return True

        def meet() -> None:
            self.control.announce(digest, name, payload)
            peers = [p for p in range(self.world_size) if p != self.rank]
            self._wait_for_peers(op, peers, arrived, lambda p: self._check_not_crossed(op, p))
            # A mismatch is raised only once every rank announced this epoch: every rank then sees every rank's
            # operation at it, so every rank raises, and none can run ahead into the next round while a rank still
            # waits in this one (which would break "at most one round ahead" for that rank).
            if mismatch:
                raise OdcRoundMismatchError(mismatch[0])

        self.fail_stop(shorten(op), "this rank announced its arrival", meet, aligned=(OdcRoundMismatchError,))
        if _TOO_BIG in payloads:
            big = [r for r, p in enumerate(payloads) if p == _TOO_BIG]
            raise OdcUsageError(f"odc {shorten(op)}: the arguments of rank(s) {big} are too large to compare")
        return payloads

    # -- group fences -------------------------------------------------------------------------------
    def group_barrier(self, op: str, group: Group) -> None:
        """Fence among ``group.ranks`` only (see ``fences``)."""
        self.check_usable(shorten(op))
        if not 0 <= group.index < MAX_GROUPS:
            raise OdcUsageError(
                f"odc {shorten(op)}: the host transport fences at most {MAX_GROUPS} distinct groups (this is group "
                f"#{group.index}); shard over fewer distinct groups"
            )
        if self.rank not in group.ranks:
            raise OdcUsageError(f"odc {shorten(op)}: rank {self.rank} is not in the group {list(group.ranks)}")
        entered = "this rank entered the fence"
        self._quiet_then_meet(lambda: self.fail_stop(shorten(op), entered, lambda: self._fence(op, group),
                                                     aligned=(OdcRoundMismatchError,)))

    def _fence(self, op: str, group: Group) -> None:
        epoch = self.fences.enter(group, op)
        # On a timeout or a crossed collective the marker stays set: a peer that waits for us in another
        # collective still sees why (it raises the same mismatch instead of timing out).
        self._wait_for_peers(
            op,
            [p for p in group.ranks if p != self.rank],
            lambda p: self.fences.reached(p, group.index, epoch),
            lambda p: self._check_not_crossed(op, p),
            what=f" (group fence #{epoch} of ranks {list(group.ranks)})",
        )
        self.fences.leave(group, epoch)  # every member completed the fence: a drift raises on all of them alike

    def _check_not_crossed(self, op: str, peer: int) -> None:
        """Raise if ``peer``, whom we wait for, waits itself in a collective that needs us first."""
        state = self.control.read(peer)
        if state.epoch > self.control.epoch:  # it waits in a world collective that needs us first
            raise OdcCrossedCollectivesError(
                f"odc collective mismatch: rank {self.rank} is in {shorten(op)!r} but rank {peer} is "
                f"in the collective {state.name.decode(errors='replace')!r} (barrier #{state.epoch}) "
                f"that rank {self.rank} has not reached; ranks must call sync(group=...) and the "
                "collectives they share with other ranks in the same order"
            )
        self.fences.check_not_waiting_for_us(op, peer)

    # -- waits ------------------------------------------------------------------------------------------
    def _wait_for_peers(
        self,
        op: str,
        waiting: list[int],
        arrived: Callable[[int], bool],
        watch: Callable[[int], None],
        what: str = "",
        backoff: Backoff | None = None,
    ) -> None:
        """Wait until ``arrived(p)`` for every rank ``p`` in ``waiting`` (polled with ``backoff``, default
        ``wait.Backoff()``). Every liveness period a dead or failed
        waited-for rank raises OdcPeerLostError and ``watch(p)`` may raise a crossed-collective error; past
        ``timeout`` OdcTimeoutError names the missing ranks (``what`` is appended). Any of these marks the
        transport failed."""

        previous: list[tuple] = []

        def check(missing: list[int], waited: float) -> None:
            dead = [p for p in missing if not self._peer_alive(p)]
            if dead:
                raise OdcPeerLostError(self._describe_missing(op, missing, lost=dead, waited=waited))
            for p in missing:
                watch(p)  # crossed collectives first: the better explanation of a peer that failed on them
            self._check_no_cycle(op, previous)
            failed = [p for p in missing if self.control.read(p).status != HEALTHY]
            if failed:
                raise OdcPeerLostError(self._describe_missing(op, missing, lost=[], failed=failed, waited=waited))

        try:
            wait_for(
                waiting, arrived, timeout=self.timeout, check=check, backoff=backoff,
                on_timeout=lambda missing, waited: OdcTimeoutError(
                    self._describe_missing(op, missing, lost=[], waited=waited) + what
                ),
            )
        except (OdcTimeoutError, OdcCrossedCollectivesError) as e:  # timeouts include OdcPeerLostError
            self.fail(e)  # the ranks' rounds are no longer aligned: every later operation raises at once
            raise

    def _check_no_cycle(self, op: str, previous: list[tuple]) -> None:
        """Raise OdcCrossedCollectivesError if this rank waits (directly or through others) on a cycle of ranks that
        each wait for the next in different collectives, seen unchanged in two reads (``previous`` holds the last
        one)."""
        state, edges, where = self.fences.wait_graph(self.world_size, lambda q: self.control.read(q).epoch)
        seen_before = bool(previous) and previous[0] == state
        previous[:] = [state]
        if not seen_before:
            return
        cycle = find_cycle(edges, self.rank)
        if cycle is None:
            return
        steps = "; ".join(f"rank {q} in {where[q]} waits for rank {cycle[(i + 1) % len(cycle)]}"
                          for i, q in enumerate(cycle))
        raise OdcCrossedCollectivesError(
            f"odc collective mismatch: rank {self.rank} in {shorten(op)!r} waits on a cycle of ranks in different "
            f"collectives that can never complete ({steps}); ranks must call sync(group=...) and the collectives "
            "they share with other ranks in the same order"
        )

    def _peer_alive(self, peer: int) -> bool:
        if not self.segments.visible[peer]:
            return True  # another pid namespace: its pid cannot be checked from here; the timeout decides
        state = self.control.read(peer)
        return process_alive(state.pid, state.start or None)

    def _describe_missing(
        self, op: str, missing: list[int], *, lost: list[int], failed: Sequence[int] = (), waited: float = 0.0
    ) -> str:
        parts = []
        exited = []  # of the lost or failed ranks, those whose process exited without finalize (not a crash)
        for p in missing:
            state = self.control.read(p)
            if state.status in (EXITED, EXITED_RAISING) and (p in lost or p in failed):
                exited.append(p)
                how = "on an uncaught exception" if state.status == EXITED_RAISING else "normally"
                status = f"EXITED {how} without odc_runtime.finalize()"
            elif p in lost:
                status = "DEAD"
            elif p in failed:
                status = "FINALIZED" if state.status == LEFT else "FAILED"
            elif not self.segments.visible[p]:
                status = "in another pid namespace"
            else:
                status = "alive" if process_alive(state.pid, state.start or None) else "DEAD"
            where = f"last at barrier #{state.epoch} in {state.name.decode(errors='replace')!r}"
            fence = self.fences.position(p)
            if fence is not None:  # a rank in (or failed in) a group fence is there, not at its last world barrier
                where = fence[1] if fence[0] else f"{where}; {fence[1]}"
            parts.append(f"rank {p} (pid {state.pid}, {status}, {where})")
        if exited and set(exited) == set(lost) | set(failed):
            return (
                f"odc {shorten(op)}: rank {self.rank} waits for rank(s) {exited}, whose program ended without calling "
                f"odc_runtime.finalize() while this rank waits in {shorten(op)!r}: {', '.join(parts)}. The ranks "
                "did not make the same collective calls (e.g. fewer sync() calls or steps on those ranks, an early "
                "return or sys.exit, or an exception there: see its log); ODC_DEBUG=1 names the first call that "
                "differs. The runtime is unusable now (finalize() releases local resources without waiting)."
            )
        if failed and not lost:
            return (
                f"odc {shorten(op)}: rank {self.rank} waits for rank(s) {list(failed)}, which will not come: their "
                "runtime failed (an operation there was interrupted, timed out or mismatched after it changed "
                f"shared state) or was finalized: {', '.join(parts)}. "
                "The runtime is unusable now (finalize() releases local resources without waiting)."
            )
        if lost:
            return (
                f"odc {shorten(op)}: rank {self.rank} lost rank(s) {lost} after {waited:.1f} s at barrier "
                f"#{self.control.epoch}: {', '.join(parts)}. A dead rank's process crashed or was killed; the "
                "runtime is unusable now (finalize() releases local resources without waiting)."
            )
        return (
            f"odc {shorten(op)}: rank {self.rank} timed out after {self.timeout:g} s waiting at barrier "
            f"#{self.control.epoch} for {', '.join(parts)}. An alive rank is stuck or did not call the same "
            f"collective. {ELSEWHERE_HINT}. Raise ODC_TIMEOUT if it is merely slow."
        )

    # -- teardown -------------------------------------------------------------------------------------
    def finalize(self) -> None:
        if self._closed:
            return
        self._closed = True
        hook = getattr(self, "_exit_hook", None)
        if hook is not None:
            atexit.unregister(hook)
        with contextlib.suppress(Exception):  # peers waiting for this rank in a later round stop waiting
            self.control.publish_status(LEFT)
        try:
            self.worker.shutdown()
        finally:
            self.segments.close()


def _publish_exit(ref: weakref.ReferenceType[HostTransport]) -> None:
    """At interpreter exit of a rank whose transport was not finalized: publish that its process is exiting, and
    whether an uncaught exception ended it, so a peer waiting for it says so instead of "crashed or was killed".
    Not in a forked child (it inherits the hook but is not the rank); never raises (the page may be gone)."""
    transport = ref()
    if transport is None or transport._closed or os.getpid() != transport._pid:
        return
    raised = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # set by an uncaught exception
    with contextlib.suppress(Exception):
        transport.control.publish_status(EXITED_RAISING if raised is not None else EXITED)
