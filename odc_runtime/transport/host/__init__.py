"""The ``host`` transport: ranks on one machine share memory through files in ``/dev/shm``.

Layout. Each rank creates one segment ``odc-<job>-r<rank>-p<pid>-s<start>-n<pidns>.heap`` (mode 0600; ``start`` is
the process's start time, so a later process that reuses the pid is not mistaken for the creator; ``pidns`` its pid
namespace, so segments of another container sharing the directory are never judged by pid): two control pages
(world rounds, group fences) followed by its symmetric heap. Every rank maps every segment, so a *get* is a
``memcpy`` from a peer's mapping and an *accumulate* is an ``add_`` into it. Once all ranks have mapped all
segments (end of ``create``) each rank unlinks its own file: the memory lives exactly as long as the mappings, so a
crash cannot leave segments behind except during ``create`` itself; those stale files (their process is gone) are
removed by the next ``create``.

Memory is reserved before it is touched. The segment file is sparse; every allocation first reserves its bytes
with ``posix_fallocate`` and raises :class:`~odc_runtime.errors.OdcMemoryError` (on every rank, through the
allocation's agreement step) if the filesystem is full. Without this, touching a page that tmpfs cannot back is a
``SIGBUS`` that kills the process (Docker's default ``/dev/shm`` is 64 MiB; the default heap is 1 GiB).

Exact concurrent accumulation. An accumulate holds a POSIX byte-range lock (``fcntl``) on the target bytes of the
owner's segment while it adds, in chunks of ``ODC_HOST_CHUNK_BYTES`` so pushers into different parts of one
buffer proceed in parallel. A process holds at most one lock at a time, so lock waits cannot form a cycle; the
kernel releases a dead process's locks, and a contended lock is polled until ``ODC_TIMEOUT`` so that a stopped
holder cannot hang the pusher. POSIX locks do not exclude threads of one process, so a per-peer
``threading.Lock`` serialises this process's own threads (caller and async worker) first.

Barrier and exchange. Every collective step after ``create`` (``sync``, ``shard``'s argument check, ``alloc``,
``free``, ``finalize``) is one round of :meth:`HostTransport.exchange`: rank r writes, in its control page, the
round number (its *epoch*), a 16-byte digest of the full operation identity (e.g. ``free(w#3.grad)``: the tensor's
whole name and its shard sequence number), the operation's name for messages, and a payload; then it polls the
peers' pages until every epoch has reached its own. A peer is at most one round ahead (it cannot pass the next
round without us), so each page keeps the digest and payload of the current and of the previous round (payload
slots alternate by epoch parity), and a rank compares the digest its peer had *at our epoch*: ranks in different
collectives, or freeing tensors in different orders, raise :class:`~odc_runtime.errors.OdcMismatchError` on every
rank. Page stores and loads happen under an ``fcntl`` lock of the control page: lock and unlock are system calls
that order memory, so every data write a rank made before its barrier (its own parameters, its completed
accumulates) is visible to a peer that has seen its epoch. Cannot deadlock: a rank waits only for peers' epochs to
reach its own, never while holding a lock, and gives up at ``ODC_TIMEOUT``.

Group fences (``group_barrier``, for ``sync(group=...)``). The second control page holds one int64 per group index
(this rank's last fence number in that group) and a marker (the group this rank waits in, that fence's number, a
bitmap of its ranks). A fence: quiet, bump and publish the group's number with the marker set (one locked store),
poll the members' numbers for that group until each reached ours, clear the marker. The world epoch is untouched,
so groups fence at their own pace. Two ranks waiting for each other in different collectives (one in a group fence,
the other in a world round or another group's fence, each needing the other first) see it from the peer's world
epoch or marker and raise :class:`~odc_runtime.errors.OdcMismatchError` instead of timing out. Ordering and
deadlock argument: docs/design.md, "Process groups".

Dead peers. While it waits, a rank checks every half second whether the processes it waits for still exist (pid +
start time from their control pages); a dead one raises :class:`~odc_runtime.errors.OdcPeerLostError` at once,
naming the rank and where it was. After that (or any timeout) the transport is *failed*: every later collective
raises at once, ``free`` releases locally, and ``finalize`` does not wait again.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError

import torch
import torch.distributed as dist

from odc_runtime import config
from odc_runtime.agree import (
    StoreExchange,
    gather_checked,
    op_digest,
    pid_namespace,
    process_alive,
    process_start_time,
    require_same,
    shorten,
)
from odc_runtime.errors import (
    OdcBackendError,
    OdcError,
    OdcMemoryError,
    OdcMismatchError,
    OdcPeerLostError,
    OdcTimeoutError,
    OdcUsageError,
)
from odc_runtime.transport.base import (
    AccumulateRequest,
    GetRequest,
    Group,
    PutRequest,
    SymmetricBuffer,
    Transport,
    Work,
)
from odc_runtime.transport.heap import HeapAllocator, human_bytes

log = logging.getLogger(__name__)

_PAGE = 4096
CONTROL_BYTES = 2 * _PAGE  # control pages at the start of every segment: world rounds, then group fences
_NAME_BYTES = 64  # operation name kept for messages only; the digest is what is compared
# epoch, pid, start time, digest + name of the op at `epoch`, digest + name of the op at `epoch - 1`,
# payload lengths of slot 0 and slot 1
_HEADER = struct.Struct(f"<qqq16s{_NAME_BYTES}s16s{_NAME_BYTES}sII")
_SLOT_OFFSET = 256
_SLOT_BYTES = (_PAGE - _SLOT_OFFSET) // 2
# Second page: group fences. A marker (index + 1 of the group this rank waits in, 0 if none; that fence's number;
# a bitmap of the group's ranks, for ranks below _MARKER_RANKS), then one int64 per group: its last fence number.
_MARKER = struct.Struct("<qq64s")
_MARKER_RANKS = 64 * 8
_GROUP_SLOTS_OFFSET = _PAGE + 128
MAX_GROUPS = (CONTROL_BYTES - _GROUP_SLOTS_OFFSET) // 8
_EPOCH = struct.Struct("<q")
_TOO_BIG = b"\0odc-payload-too-big"
_LIVENESS_PERIOD_S = 0.5
_SEGMENT_RE = re.compile(
    r"^odc-(?P<job>[0-9a-f]+)-r(?P<rank>\d+)-p(?P<pid>\d+)(?:-s(?P<start>\d+))?(?:-n(?P<ns>\d+))?\.heap$"
)


class _CrossedError(OdcMismatchError):
    """Two ranks wait for each other in different collectives (a group fence and another one)."""


def _ns_id(namespace: str) -> int:
    """The inode number in a pid namespace link such as ``pid:[4026531836]`` (0 if unknown)."""
    digits = "".join(c for c in namespace if c.isdigit())
    return int(digits) if digits else 0

# Transports alive in this process; a forked child marks them all, once, instead of every operation asking
# the kernel for its pid. Weak references: the hook must not keep finalized transports alive.
_live_transports: weakref.WeakSet[HostTransport] = weakref.WeakSet()


def _mark_forked() -> None:
    for transport in _live_transports:
        transport._forked = True


os.register_at_fork(after_in_child=_mark_forked)


def is_available() -> bool:
    """The host transport runs wherever POSIX shared memory and ``fcntl`` locks do (Linux, macOS)."""
    return hasattr(os, "register_at_fork") and hasattr(fcntl, "lockf")


def remove_stale_segments(directory: str) -> list[str]:
    """Remove this user's ODC segments whose creating process is gone; return the removed paths.

    A segment names its creator by pid, start time and pid namespace: a live process that reused a dead
    creator's pid does not keep the segment alive, and segments created in another pid namespace (another
    container sharing this directory), whose pids mean nothing here, are left alone.
    """
    own_ns = _ns_id(pid_namespace())
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:  # missing or unreadable: create_segment reports it
        return removed
    for name in names:
        m = _SEGMENT_RE.match(name)
        if m is None:
            continue
        path = os.path.join(directory, name)
        start = int(m.group("start")) if m.group("start") else None
        if m.group("ns") and int(m.group("ns")) != own_ns:
            continue
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_uid == os.getuid() and not process_alive(int(m.group("pid")), start):
                os.unlink(path)
                removed.append(path)
    if removed:
        log.info("odc host transport: removed %d stale segment(s) of dead jobs: %s", len(removed), removed)
    return removed


def _free_bytes(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class FutureWork(Work):
    """Handle of a function running on the transport's worker thread."""

    def __init__(self, future: Future, default_timeout: float, what: str) -> None:
        self._future = future
        self._timeout = default_timeout
        self._what = what

    def wait(self, timeout: float | None = None) -> None:
        limit = self._timeout if timeout is None else timeout
        try:
            self._future.result(timeout=limit)
        except FutureTimeoutError:
            raise OdcTimeoutError(f"odc {self._what}: async operation did not complete within {limit:g} s") from None

    def is_completed(self) -> bool:
        return self._future.done()


class _Segment:
    """One rank's mapped segment: control page + heap, with the fd used for byte-range locks."""

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path = path
        self.fd = fd
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start = CONTROL_BYTES + offset
        return self.bytes[start : start + numel * dtype.itemsize].view(dtype)

    def close(self) -> None:
        # Drop our references instead of calling ``map.close()``: torch.frombuffer holds no buffer export, so
        # close() would unmap memory under tensors the user still holds (st.local after finalize) and turn
        # their next access into a segfault. Every view references the mmap object, which unmaps when the
        # last of them dies (at once if none is left).
        self.bytes = None  # type: ignore[assignment]
        self.map = None  # type: ignore[assignment]
        with contextlib.suppress(OSError):
            os.close(self.fd)


class HostTransport(Transport):
    """Symmetric memory in shared-memory segments; see the module docstring for the protocol."""

    name = "host"

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
        self._segment_bytes = CONTROL_BYTES + self._allocator.capacity
        self._segments: list[_Segment | None] = [None] * world_size
        self._peer_locks = [threading.Lock() for _ in range(world_size)]
        self._epoch = 0
        self._last_digest = b"\0" * 16
        self._last_name = b""
        self._slot_lengths = [0, 0]
        self._group_epochs: dict[int, int] = {}  # group index -> number of this rank's last fence in it
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._own_path: str | None = None
        self._closed = False
        self._pid = os.getpid()
        self._start = process_start_time(self._pid) or 0
        self._forked = False
        self.failure: OdcError | None = None  # set once a collective timed out or lost a peer: the runtime is dead
        # Peers whose pids mean something here (same pid namespace); others are never declared dead early.
        self._visible = [True] * world_size
        _live_transports.add(self)

    # -- setup ----------------------------------------------------------------------------------------
    def _path(self, rank: int, pid: int, start: int, namespace: str) -> str:
        return os.path.join(self.directory, f"odc-{self.job}-r{rank}-p{pid}-s{start}-n{_ns_id(namespace)}.heap")

    def create_segment(self) -> tuple[int, int]:
        """Create this rank's segment (mode 0600); return the ``(pid, start time)`` that name it."""
        path = self._path(self.rank, self._pid, self._start, pid_namespace())
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as e:
            raise OdcBackendError(
                f"odc host transport: cannot create shared-memory segment {path}: {e}; set ODC_SHM_DIR to a "
                "writable tmpfs directory"
            ) from e
        self._own_path = path
        atexit.register(self._unlink_own)
        try:
            os.ftruncate(fd, self._segment_bytes)  # sparse: pages cost memory only once reserved
        except OSError as e:
            os.close(fd)
            raise OdcBackendError(f"odc host transport: cannot size {path} to {self._segment_bytes} bytes: {e}") from e
        try:
            self._reserve(fd, 0, CONTROL_BYTES, "the control page")
            seg = _Segment(path, fd, self._segment_bytes)
        except BaseException:
            os.close(fd)
            raise
        seg.map[: _HEADER.size] = _HEADER.pack(0, self._pid, self._start, b"", b"init", b"", b"", 0, 0)
        self._segments[self.rank] = seg
        return self._pid, self._start

    def map_peers(self, identities: Sequence[tuple[int, int, str]]) -> None:
        """Map every peer's segment (after all have been created); ``identities[r]`` is ``(pid, start time, pid
        namespace)`` of rank ``r``."""
        own_namespace = identities[self.rank][2]
        self._visible = [ns == own_namespace for _, _, ns in identities]
        for peer, (pid, start, namespace) in enumerate(identities):
            if peer == self.rank:
                continue
            path = self._path(peer, pid, start, namespace)
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as e:
                raise OdcBackendError(
                    f"odc host transport: rank {self.rank} cannot open rank {peer}'s segment {path}: {e}. "
                    "All ranks must run on one machine and see the same ODC_SHM_DIR."
                ) from e
            try:
                self._segments[peer] = _Segment(path, fd, self._segment_bytes)
            except BaseException:
                os.close(fd)
                raise

    def _unlink_own(self) -> None:
        if self._own_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._own_path)
            self._own_path = None

    def _reserve(self, fd: int, start: int, length: int, what: str) -> None:
        """Back ``[start, start + length)`` of a segment file with real memory, or raise OdcMemoryError."""
        try:
            os.posix_fallocate(fd, start, length)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT):
                raise OdcBackendError(
                    f"odc host transport: rank {self.rank} cannot reserve {length} bytes in {self.directory}: {e}"
                ) from e
            free = _free_bytes(self.directory)
            raise OdcMemoryError(
                f"odc host transport: rank {self.rank} cannot reserve {human_bytes(length)} ({length} bytes) for "
                f"{what} in {self.directory}: the filesystem has "
                f"{'an unknown amount' if free is None else human_bytes(free)} free ({e.strerror}). Give it more "
                "space (docker run --shm-size=..., a larger tmpfs), point ODC_SHM_DIR at a larger tmpfs, or "
                "shard less (ODC_HEAP_SIZE only caps the heap; the filesystem must hold what is allocated)"
            ) from e

    # -- memory ---------------------------------------------------------------------------------------
    def _seg(self, peer: int) -> _Segment:
        seg = self._segments[peer]
        if seg is None:
            raise OdcUsageError("odc host transport is finalized")
        if self._forked:
            raise OdcUsageError(
                f"odc host transport: process {os.getpid()} is a fork of rank {self.rank} (pid {self._pid}) and "
                "must not use its runtime (it would write into the rank's segments and barrier state); call odc "
                "only in the process that called odc_runtime.init()"
            )
        return seg

    def heap_capacity(self) -> int:
        return self._allocator.capacity

    def heap_used(self) -> int:
        return self._allocator.used

    def alloc(self, numel: int, dtype: torch.dtype, tag: str = "") -> SymmetricBuffer:
        nbytes = numel * dtype.itemsize
        offset: int | None = None

        def reserve_and_zero() -> int:
            nonlocal offset
            seg = self._seg(self.rank)
            offset = self._allocator.alloc(nbytes, what=f"'{tag or 'buffer'}'")
            self._reserve(seg.fd, CONTROL_BYTES + offset, max(nbytes, 1), f"'{tag or 'buffer'}'")
            seg.view(offset, numel, dtype).zero_()
            return offset

        # One agreement round: nobody accumulates into the region before its owner reserved and zeroed it, and a
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
        assert offset is not None
        local = self._seg(self.rank).view(offset, numel, dtype)
        return SymmetricBuffer(numel=numel, dtype=dtype, local=local, handle=offset, tag=tag)

    def free(self, buf: SymmetricBuffer) -> None:
        if buf.freed:
            return
        if self.failure is None:
            # Nobody may still read or add into the region when it is handed out again.
            self.barrier(f"free({buf.tag})")
        # else: the runtime is dead (a peer was lost); release locally without waiting for anyone
        self._allocator.free(buf.handle)  # type: ignore[arg-type]
        buf.freed = True

    # -- one-sided operations -------------------------------------------------------------------------
    def get(self, buf: SymmetricBuffer, requests: Sequence[GetRequest], *, async_op: bool = False) -> Work | None:
        if async_op:
            return self._run_async(lambda: self._get_now(buf, requests), "fetch")
        self._get_now(buf, requests)
        return None

    def accumulate(
        self, buf: SymmetricBuffer, requests: Sequence[AccumulateRequest], scale: float, *, async_op: bool = False
    ) -> Work | None:
        if async_op:
            return self._run_async(lambda: self._accumulate_now(buf, requests, scale), "push")
        self._accumulate_now(buf, requests, scale)
        return None

    def _get_now(self, buf: SymmetricBuffer, requests: Sequence[GetRequest]) -> None:
        base: int = buf.handle  # type: ignore[assignment]
        itemsize = buf.dtype.itemsize
        for req in requests:
            src = self._seg(req.peer).view(base + req.offset * itemsize, req.dst.numel(), buf.dtype)
            req.dst.view(-1).copy_(src)

    def _accumulate_now(self, buf: SymmetricBuffer, requests: Sequence[AccumulateRequest], scale: float) -> None:
        itemsize = buf.dtype.itemsize
        chunk = max(1, self.chunk_bytes // itemsize)
        base: int = buf.handle  # type: ignore[assignment]
        for req in requests:
            seg = self._seg(req.peer)
            src = req.src.view(-1)
            first = base + req.offset * itemsize
            with self._peer_locks[req.peer]:
                for lo in range(0, src.numel(), chunk):
                    n = min(chunk, src.numel() - lo)
                    start = CONTROL_BYTES + first + lo * itemsize
                    with self._locked(req.peer, start, n * itemsize, exclusive=True, op="push"):
                        dst = seg.view(first + lo * itemsize, n, buf.dtype)
                        if scale == 1.0:
                            dst.add_(src[lo : lo + n])
                        else:
                            dst.add_(src[lo : lo + n], alpha=scale)

    # -- signalled puts ---------------------------------------------------------------------------------
    # Ordering: the data is copied into the peer's segment before the signal word is incremented under an
    # exclusive byte-range lock on that word, and the waiter reads the word under a shared lock on it, then
    # reads the data. The lock system calls order both sides' memory accesses (the same argument as the
    # accumulate path's locks), so a waiter that sees the count sees every counted put's data. Several senders
    # into one word are exact because each increment is a read-modify-write under the exclusive lock.
    def _signal_word(self, signal: SymmetricBuffer, peer: int, index: int) -> tuple[torch.Tensor, int]:
        if signal.dtype != torch.int64 or not 0 <= index < signal.numel:
            raise OdcUsageError(
                f"host signal: word {index} of a {signal.dtype} buffer of {signal.numel}; signals are int64 words"
            )
        offset = signal.handle + index * 8  # type: ignore[operator]
        return self._seg(peer).view(offset, 1, torch.int64), CONTROL_BYTES + offset

    def put_signal(self, buf: SymmetricBuffer, requests: Sequence[PutRequest], signal: SymmetricBuffer) -> None:
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
            dst = self._seg(req.peer).view(base + req.offset * itemsize, req.src.numel(), buf.dtype)
            targets.append((req, dst, *self._signal_word(signal, req.peer, req.signal_index)))
        for req, dst, word, start in targets:
            dst.copy_(req.src.view(-1))
            with self._locked(req.peer, start, 8, exclusive=True, op="put_signal"):
                word += 1

    def wait_signal(self, signal: SymmetricBuffer, index: int, value: int, op: str, peers: Sequence[int]) -> None:
        word, start = self._signal_word(signal, self.rank, index)

        def reached(_: int) -> bool:
            with self._locked(self.rank, start, 8, exclusive=False, op=op):
                return int(word.item()) >= value

        self._wait_for_peers(
            op, list(peers) or [self.rank], reached, lambda _: None,
            what=f" (their puts did not arrive: signal word {index} stayed below {value})",
        )

    def _run_async(self, fn: Callable[[], None], what: str) -> Work:
        """Run ``fn`` on the worker thread (FIFO: asynchronous operations complete in issue order)."""
        self._seg(self.rank)  # finalized / forked: raise here, in the caller, not later in the worker
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="odc-host")
        future = self._executor.submit(fn)
        # Keep failed operations until quiet() reports them: a failed push must not vanish silently.
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(future)
        return FutureWork(future, self.timeout, f"async {what}")

    def quiet(self) -> None:
        """Wait for every submitted operation; then re-raise the first error of one that failed since the last
        quiet (so ``sync`` cannot report success after a lost push)."""
        pending, self._pending = self._pending, []
        deadline = time.monotonic() + self.timeout
        error: BaseException | None = None
        for i, future in enumerate(pending):
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeoutError:
                self._pending = pending[i:] + self._pending  # still running: the next quiet waits for them
                raise OdcTimeoutError(
                    f"odc quiet on rank {self.rank}: async operations still running after {self.timeout:g} s"
                ) from None
            except BaseException as e:  # re-raised below, after the others completed
                error = error or e
        if error is not None:
            raise error

    @contextlib.contextmanager
    def _locked(self, peer: int, start: int, length: int, *, exclusive: bool, op: str) -> Iterator[None]:
        """Hold a POSIX lock on bytes ``[start, start+length)`` of ``peer``'s segment.

        Uncontended, this is one system call. Contended, it polls instead of blocking in the kernel, so that a
        holder that is stopped (not dead: the kernel releases a dead process's locks) cannot hang us forever.
        """
        fd = self._seg(peer).fd
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = None
        spins = 0
        while True:
            try:
                fcntl.lockf(fd, mode | fcntl.LOCK_NB, length, start)
                break
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
            deadline = deadline or time.monotonic() + self.timeout
            if time.monotonic() > deadline:
                raise OdcTimeoutError(
                    f"odc {op}: rank {self.rank} could not lock bytes [{start}, {start + length}) of rank {peer}'s "
                    f"segment within {self.timeout:g} s; a process holding it is stopped or stuck"
                )
            spins += 1
            time.sleep(0 if spins < 20 else min(2e-4, 1e-5 * spins))
        try:
            yield
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, length, start)

    # -- barrier and exchange -----------------------------------------------------------------------
    def _read_control(self, peer: int) -> tuple[int, int, int, bytes, bytes, bytes, bytes, bytes]:
        """``(epoch, pid, start, digest@epoch, name@epoch, digest@epoch-1, name@epoch-1, control page)``."""
        seg = self._seg(peer)
        with self._locked(peer, 0, _PAGE, exclusive=False, op="barrier"):
            raw = bytes(seg.map[: _HEADER.size])
            lengths = _HEADER.unpack_from(raw)[-2:]
            if any(lengths):  # copy the payload slots only when there is a payload (not for plain barriers)
                raw = bytes(seg.map[: _SLOT_OFFSET + _SLOT_BYTES + lengths[1]])
        epoch, pid, start, digest, name, prev_digest, prev_name, _, _ = _HEADER.unpack_from(raw)
        return epoch, pid, start, digest, name.rstrip(b"\0"), prev_digest, prev_name.rstrip(b"\0"), raw

    @staticmethod
    def _payload(raw: bytes, epoch: int) -> bytes:
        lengths = _HEADER.unpack_from(raw)[-2:]
        slot = epoch % 2
        start = _SLOT_OFFSET + slot * _SLOT_BYTES
        return raw[start : start + lengths[slot]]

    def _write_control(self, digest: bytes, name: bytes, payload: bytes) -> None:
        seg = self._seg(self.rank)
        slot = self._epoch % 2
        self._slot_lengths[slot] = len(payload)
        header = _HEADER.pack(
            self._epoch, self._pid, self._start, digest, name, self._last_digest, self._last_name,
            *self._slot_lengths,
        )
        start = _SLOT_OFFSET + slot * _SLOT_BYTES
        with self._locked(self.rank, 0, _PAGE, exclusive=True, op="barrier"):
            seg.map[start : start + len(payload)] = payload
            seg.map[: _HEADER.size] = header

    def _quiet_then_meet(self, meet: Callable[[], None]) -> None:
        """``quiet()``, then ``meet()`` the peers even if one of this rank's operations failed (so they do not wait
        out the timeout for it), then report that failure. A quiet that timed out is raised at once."""
        failed: BaseException | None = None
        try:
            self.quiet()
        except OdcTimeoutError:
            raise
        except BaseException as e:  # every operation completed, one failed: still meet the peers, then report it
            failed = e
        meet()
        if failed is not None:
            raise failed

    def barrier(self, op: str = "barrier") -> None:
        self._quiet_then_meet(lambda: self.exchange(op, b""))

    def exchange(self, op: str, payload: bytes) -> list[bytes]:
        """Collective: one barrier round that also carries ``payload`` (at most about 1.9 KB) from every rank.

        Returns every rank's payload. See the module docstring for the protocol. Raises OdcMismatchError if a
        peer is in another collective, OdcPeerLostError if a peer died, OdcTimeoutError after ``timeout``.
        """
        if self.failure is not None:
            raise type(self.failure)(
                f"odc {shorten(op)}: the runtime is unusable since an earlier collective failed ({self.failure}); "
                "call odc_runtime.finalize() and restart the job"
            )
        too_big = len(payload) > _SLOT_BYTES
        if too_big:
            payload = _TOO_BIG
        digest = op_digest(op)
        name = op.encode()[:_NAME_BYTES]
        self._epoch += 1
        self._write_control(digest, name, payload)
        self._last_digest, self._last_name = digest, name
        payloads: list[bytes] = [b""] * self.world_size
        payloads[self.rank] = payload

        def arrived(p: int) -> bool:
            epoch, _, _, peer_digest, peer_name, prev_digest, prev_name, raw = self._read_control(p)
            if epoch < self._epoch:
                return False
            # A peer is at most one round ahead (it cannot pass the next one without us), so what it did at our
            # epoch is its current or its previous round.
            theirs, their_name = (peer_digest, peer_name) if epoch == self._epoch else (prev_digest, prev_name)
            if theirs != digest:
                raise OdcMismatchError(
                    f"odc collective mismatch at barrier #{self._epoch}: rank {self.rank} is in "
                    f"{shorten(op)!r} but rank {p} is in {their_name.decode(errors='replace')!r}"
                    f"{'…' if len(their_name) == _NAME_BYTES else ''}; every rank must call the same "
                    "collectives (shard, free, sync, finalize) in the same order"
                )
            payloads[p] = self._payload(raw, self._epoch)
            return True

        peers = [p for p in range(self.world_size) if p != self.rank]
        self._wait_for_peers(op, peers, arrived, lambda p: self._check_not_waiting_for_us(op, p))
        if _TOO_BIG in payloads:
            big = [r for r, p in enumerate(payloads) if p == _TOO_BIG]
            raise OdcUsageError(f"odc {shorten(op)}: the arguments of rank(s) {big} are too large to compare")
        return payloads

    # -- group fences -------------------------------------------------------------------------------
    def _read_marker(self, peer: int) -> tuple[int, int, bytes]:
        """``(group index or -1, fence number, member bitmap)`` of the group fence ``peer`` waits in."""
        seg = self._seg(peer)
        with self._locked(peer, _PAGE, _MARKER.size, exclusive=False, op="group barrier"):
            plus1, epoch, bitmap = _MARKER.unpack_from(seg.map, _PAGE)
        return plus1 - 1, epoch, bitmap

    def _read_group_epoch(self, peer: int, index: int) -> int:
        seg = self._seg(peer)
        at = _GROUP_SLOTS_OFFSET + 8 * index
        with self._locked(peer, at, 8, exclusive=False, op="group barrier"):
            return _EPOCH.unpack_from(seg.map, at)[0]

    def _write_group(self, group: Group, epoch: int, waiting: bool) -> None:
        """Publish ``epoch`` as this rank's last fence in ``group``, with the marker set (``waiting``) or
        cleared. One exclusive lock over both: a peer sees the marker and the number change together."""
        seg = self._seg(self.rank)
        bitmap = bytearray(64)
        for r in group.ranks:
            if r < _MARKER_RANKS:
                bitmap[r // 8] |= 1 << (r % 8)
        at = _GROUP_SLOTS_OFFSET + 8 * group.index
        with self._locked(self.rank, _PAGE, CONTROL_BYTES - _PAGE, exclusive=True, op="group barrier"):
            _EPOCH.pack_into(seg.map, at, epoch)
            _MARKER.pack_into(seg.map, _PAGE, group.index + 1 if waiting else 0, epoch, bytes(bitmap))

    def _check_not_waiting_for_us(self, op: str, peer: int) -> None:
        """Raise (crossed collectives) if ``peer``, which we wait for, waits in a group fence for *us*.

        ``peer`` is in fence #k of group g, g contains this rank and this rank's last fence in g is below k: the
        peer cannot leave before we enter g's fence #k, and we are in another collective that waits for it, so
        neither can move. Both sides see it (each checks the rank it waits for) and raise."""
        index, epoch, bitmap = self._read_marker(peer)
        if index < 0 or self.rank >= _MARKER_RANKS or not bitmap[self.rank // 8] >> (self.rank % 8) & 1:
            return
        if self._group_epochs.get(index, 0) < epoch:
            raise _CrossedError(
                f"odc collective mismatch: rank {self.rank} is in {shorten(op)!r} but rank {peer} waits for it in "
                f"group fence #{epoch} (sync(group=...), group index {index}) that rank {self.rank} has not reached; "
                "ranks must call sync(group=...) and the collectives they share with other ranks in the same order"
            )

    def group_barrier(self, op: str, group: Group) -> None:
        """Fence among ``group.ranks`` only (see the module docstring, "Group fences")."""
        if self.failure is not None:
            raise type(self.failure)(
                f"odc {shorten(op)}: the runtime is unusable since an earlier collective failed ({self.failure}); "
                "call odc_runtime.finalize() and restart the job"
            )
        if not 0 <= group.index < MAX_GROUPS:
            raise OdcUsageError(
                f"odc {shorten(op)}: the host transport fences at most {MAX_GROUPS} distinct groups (this is group "
                f"#{group.index}); shard over fewer distinct groups"
            )
        if self.rank not in group.ranks:
            raise OdcUsageError(f"odc {shorten(op)}: rank {self.rank} is not in the group {list(group.ranks)}")
        self._quiet_then_meet(lambda: self._group_fence(op, group))

    def _group_fence(self, op: str, group: Group) -> None:
        epoch = self._group_epochs.get(group.index, 0) + 1
        self._group_epochs[group.index] = epoch
        self._write_group(group, epoch, waiting=True)
        # On a timeout or a crossed collective the marker stays set: a peer that waits for us in another
        # collective still sees why (it raises the same mismatch instead of timing out).
        self._wait_for_peers(
            op,
            [p for p in group.ranks if p != self.rank],
            lambda p: self._read_group_epoch(p, group.index) >= epoch,
            lambda p: self._check_not_crossed(op, p),
            what=f" (group fence #{epoch} of ranks {list(group.ranks)})",
        )
        self._write_group(group, epoch, waiting=False)

    def _check_not_crossed(self, op: str, peer: int) -> None:
        """Raise if ``peer``, whom this group fence waits for, waits itself in a collective that needs us first."""
        peer_epoch, *_, peer_name, _, _, _ = self._read_control(peer)
        if peer_epoch > self._epoch:  # it waits in a world collective that needs us first
            raise _CrossedError(
                f"odc collective mismatch: rank {self.rank} is in {shorten(op)!r} but rank {peer} is "
                f"in the collective {peer_name.decode(errors='replace')!r} (barrier #{peer_epoch}) "
                f"that rank {self.rank} has not reached; ranks must call sync(group=...) and the "
                "collectives they share with other ranks in the same order"
            )
        self._check_not_waiting_for_us(op, peer)

    def _wait_for_peers(
        self,
        op: str,
        waiting: list[int],
        arrived: Callable[[int], bool],
        watch: Callable[[int], None],
        what: str = "",
    ) -> None:
        """Poll until ``arrived(p)`` for every rank ``p`` in ``waiting`` (spinning briefly, then backing off to
        1 ms). Every liveness period a dead waited-for rank raises OdcPeerLostError and ``watch(p)`` may raise a
        crossed-collective error; past ``timeout`` OdcTimeoutError names the missing ranks (``what`` is appended).
        Either marks this transport failed: the ranks' rounds are no longer aligned, so every later collective
        raises at once."""
        start = time.monotonic()
        deadline = start + self.timeout
        next_liveness = start + _LIVENESS_PERIOD_S
        spins = 0
        try:
            while True:
                waiting = [p for p in waiting if not arrived(p)]
                if not waiting:
                    return
                now = time.monotonic()
                if now >= next_liveness:
                    next_liveness = now + _LIVENESS_PERIOD_S
                    dead = [p for p in waiting if not self._peer_alive(p)]
                    if dead:
                        raise OdcPeerLostError(self._describe_missing(op, waiting, lost=dead, waited=now - start))
                    for p in waiting:
                        watch(p)
                if now > deadline:
                    raise OdcTimeoutError(self._describe_missing(op, waiting, lost=[], waited=now - start) + what)
                spins += 1
                # Spin briefly (barriers usually complete within microseconds), then back off to 1 ms.
                time.sleep(0 if spins < 50 else min(1e-3, 1e-5 * spins))
        except (OdcTimeoutError, _CrossedError) as e:  # timeouts include OdcPeerLostError
            self.failure = e
            raise

    def _peer_alive(self, peer: int) -> bool:
        if not self._visible[peer]:
            return True  # another pid namespace: its pid cannot be checked from here; the timeout decides
        _, pid, start, *_ = self._read_control(peer)
        return process_alive(pid, start or None)

    def _describe_missing(self, op: str, missing: list[int], *, lost: list[int], waited: float) -> str:
        parts = []
        for p in missing:
            epoch, pid, start, _, name, *_ = self._read_control(p)
            if p in lost:
                state = "DEAD"
            elif not self._visible[p]:
                state = "in another pid namespace"
            else:
                state = "alive" if process_alive(pid, start or None) else "DEAD"
            where = name.decode(errors="replace")
            parts.append(f"rank {p} (pid {pid}, {state}, last at barrier #{epoch} in {where!r})")
        if lost:
            return (
                f"odc {shorten(op)}: rank {self.rank} lost rank(s) {lost} after {waited:.1f} s at barrier "
                f"#{self._epoch}: {', '.join(parts)}. A dead rank's process crashed or was killed; the runtime is "
                "unusable now (finalize() releases local resources without waiting)."
            )
        return (
            f"odc {shorten(op)}: rank {self.rank} timed out after {self.timeout:g} s waiting at barrier "
            f"#{self._epoch} for {', '.join(parts)}. An alive rank is stuck or did not call the same collective. "
            "Raise ODC_TIMEOUT if it is merely slow."
        )

    # -- teardown -------------------------------------------------------------------------------------
    def finalize(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=False)
        finally:
            self._unlink_own()
            atexit.unregister(self._unlink_own)  # it would keep this transport alive until exit
            for seg in self._segments:
                if seg is not None:
                    seg.close()
            self._segments = [None] * self.world_size


def create(*, timeout: float, heap_size: int | str | None = None) -> HostTransport:
    """Collective: build the host transport over the default ``torch.distributed`` group.

    Every step is one bounded agreement round (:func:`~odc_runtime.agree.gather_checked` over the store, with
    ``timeout``): any local failure (bad settings, a segment that cannot be created, sized or mapped, an OS
    error) makes every rank raise together instead of some waiting for the others, and every rank removes the
    segment it created.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    exchange = StoreExchange(timeout)
    transport: HostTransport | None = None

    def settings() -> tuple[str, int, int, str]:
        directory = config.shm_dir()
        heap = config.host_heap_bytes(heap_size)
        chunk = config.host_chunk_bytes()
        return uuid.uuid4().hex[:12], heap, chunk, directory

    def create_own_segment() -> tuple[int, int, str]:
        nonlocal transport
        remove_stale_segments(directory)
        transport = HostTransport(
            rank, world, job, timeout=timeout, heap_size=heap, directory=directory, chunk_bytes=chunk
        )
        return (*transport.create_segment(), pid_namespace())

    try:
        chosen = gather_checked("init (host settings)", settings, exchange=exchange)
        job = chosen[0][0]  # rank 0's job id names every segment of this job
        _, heap, chunk, directory = chosen[rank]
        # Different heaps give different offsets, and a peer's smaller segment cannot be mapped.
        require_same(
            "init:", [c[1] for c in chosen],
            rule="ODC_HEAP_SIZE / init(heap_size=...) must resolve to the same number of bytes on every rank",
        )
        identities = gather_checked("init (host segments)", create_own_segment, exchange=exchange)
        assert transport is not None
        # Returning from this round also means every rank has mapped every segment.
        gather_checked("init (map peers)", lambda: transport.map_peers(identities), exchange=exchange)
        transport._unlink_own()
    except BaseException:
        if transport is not None:
            transport.finalize()
        raise
    free = _free_bytes(directory)
    if free is not None and free < heap:
        log.warning(
            "odc host transport: %s has %s free, less than the %s heap of this rank; allocations beyond that "
            "raise OdcMemoryError (give the filesystem more space, e.g. docker --shm-size, or set ODC_SHM_DIR)",
            directory, human_bytes(free), human_bytes(heap),
        )
    log.info(
        "odc host transport: rank %d/%d, job %s, heap %d MiB per rank in %s",
        rank, world, transport.job, transport.heap_capacity() >> 20, transport.directory,
    )
    return transport
