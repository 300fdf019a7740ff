"""The ``host`` transport: ranks on one machine share memory through files in ``/dev/shm``.

Layout. Each rank creates one segment ``odc-<job>-r<rank>-p<pid>.heap`` (mode 0600): a control page followed by
its symmetric heap. Every rank maps every segment, so a *get* is a ``memcpy`` from a peer's mapping and an
*accumulate* is an ``add_`` into it. Once all ranks have mapped all segments (end of ``create``) each rank unlinks
its own file: the memory lives exactly as long as the mappings, so a crash cannot leave segments behind except
during ``create`` itself; those stale files (their pid is dead) are removed by the next ``create``.

Exact concurrent accumulation. An accumulate holds a POSIX byte-range lock (``fcntl``) on the target bytes of the
owner's segment while it adds, in chunks of ``ODC_HOST_CHUNK_BYTES`` so pushers into different parts of one
buffer proceed in parallel. A process holds at most one lock at a time, so lock waits cannot form a cycle; the
kernel releases a dead process's locks, and a contended lock is polled until ``ODC_TIMEOUT`` so that a stopped
holder cannot hang the pusher. POSIX locks do not exclude threads of one process, so a per-peer
``threading.Lock`` serialises this process's own threads (caller and async worker) first.

Barrier. Rank r stores its barrier epoch in its control page and polls the peers' pages until every epoch has
reached its own. Epoch stores and loads happen under an ``fcntl`` lock of the control page: lock and unlock are
system calls that order memory, so every data write a rank made before its barrier (its own parameters, its
completed accumulates) is visible to a peer that has seen its epoch. A barrier that waits past the timeout names
the missing ranks and whether their processes are still alive.
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
from odc_runtime.agree import gather_checked, require_same
from odc_runtime.errors import OdcBackendError, OdcMismatchError, OdcTimeoutError, OdcUsageError
from odc_runtime.transport.base import (
    AccumulateRequest,
    GetRequest,
    SymmetricBuffer,
    Transport,
    Work,
)
from odc_runtime.transport.heap import HeapAllocator

log = logging.getLogger(__name__)

CONTROL_BYTES = 4096  # control page at the start of every segment: epoch, pid, name of the barrier's operation
_OP_BYTES = 64
_CONTROL = struct.Struct(f"<qq{_OP_BYTES}s{_OP_BYTES}s")
_SEGMENT_RE = re.compile(r"^odc-(?P<job>[0-9a-f]+)-r(?P<rank>\d+)-p(?P<pid>\d+)\.heap$")

# Transports alive in this process; a forked child marks them all, once, instead of every operation asking
# the kernel for its pid. Weak references: the hook must not keep finalized transports alive.
_live_transports: weakref.WeakSet[HostTransport] = weakref.WeakSet()


def _mark_forked() -> None:
    for transport in _live_transports:
        transport._forked = True


os.register_at_fork(after_in_child=_mark_forked)


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (killed but not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to someone else
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_segments(directory: str) -> list[str]:
    """Remove this user's ODC segments whose creating process is dead; return the removed paths."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        m = _SEGMENT_RE.match(name)
        if m is None:
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_uid == os.getuid() and not _pid_alive(int(m.group("pid"))):
                os.unlink(path)
                removed.append(path)
    if removed:
        log.info("odc host transport: removed %d stale segment(s) of dead jobs: %s", len(removed), removed)
    return removed


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
        self._last_op = b""
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._own_path: str | None = None
        self._closed = False
        self._pid = os.getpid()
        self._forked = False
        _live_transports.add(self)

    # -- setup ----------------------------------------------------------------------------------------
    def _path(self, rank: int, pid: int) -> str:
        return os.path.join(self.directory, f"odc-{self.job}-r{rank}-p{pid}.heap")

    def create_segment(self) -> int:
        """Create this rank's segment (mode 0600); return the pid that names it."""
        pid = os.getpid()
        path = self._path(self.rank, pid)
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
            os.ftruncate(fd, self._segment_bytes)  # sparse: pages cost memory only once touched
        except OSError as e:
            os.close(fd)
            raise OdcBackendError(f"odc host transport: cannot size {path} to {self._segment_bytes} bytes: {e}") from e
        seg = _Segment(path, fd, self._segment_bytes)
        seg.map[: _CONTROL.size] = _CONTROL.pack(0, pid, b"init", b"")
        self._segments[self.rank] = seg
        return pid

    def map_peers(self, pids: Sequence[int]) -> None:
        """Map every peer's segment (after all have been created)."""
        for peer, pid in enumerate(pids):
            if peer == self.rank:
                continue
            path = self._path(peer, pid)
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as e:
                raise OdcBackendError(
                    f"odc host transport: rank {self.rank} cannot open rank {peer}'s segment {path}: {e}. "
                    "All ranks must run on one machine and see the same ODC_SHM_DIR."
                ) from e
            self._segments[peer] = _Segment(path, fd, self._segment_bytes)

    def _unlink_own(self) -> None:
        if self._own_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._own_path)
            self._own_path = None

    def unlink_own(self) -> None:
        """Remove this rank's file name; the mappings keep the memory alive."""
        self._unlink_own()

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
        offset = self._allocator.alloc(numel * dtype.itemsize, what=f"'{tag or 'buffer'}'")
        local = self._seg(self.rank).view(offset, numel, dtype)
        local.zero_()
        # Nobody may accumulate into the region before its owner has zeroed it.
        self.barrier(f"alloc({tag})")
        return SymmetricBuffer(numel=numel, dtype=dtype, local=local, handle=offset, tag=tag)

    def free(self, buf: SymmetricBuffer) -> None:
        if buf.freed:
            return
        # Nobody may still read or add into the region when it is handed out again.
        self.barrier(f"free({buf.tag})")
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
        for req in requests:
            src = self._seg(req.peer).view(buf.handle, req.dst.numel(), buf.dtype)  # type: ignore[arg-type]
            req.dst.view(-1).copy_(src)

    def _accumulate_now(self, buf: SymmetricBuffer, requests: Sequence[AccumulateRequest], scale: float) -> None:
        itemsize = buf.dtype.itemsize
        chunk = max(1, self.chunk_bytes // itemsize)
        base: int = buf.handle  # type: ignore[assignment]
        for req in requests:
            seg = self._seg(req.peer)
            src = req.src.view(-1)
            with self._peer_locks[req.peer]:
                for lo in range(0, src.numel(), chunk):
                    n = min(chunk, src.numel() - lo)
                    start = CONTROL_BYTES + base + lo * itemsize
                    with self._locked(req.peer, start, n * itemsize, exclusive=True, op="push"):
                        dst = seg.view(base + lo * itemsize, n, buf.dtype)
                        if scale == 1.0:
                            dst.add_(src[lo : lo + n])
                        else:
                            dst.add_(src[lo : lo + n], alpha=scale)

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

    # -- barrier --------------------------------------------------------------------------------------
    def _read_control(self, peer: int) -> tuple[int, int, bytes, bytes]:
        """``(epoch, pid, op of barrier #epoch, op of barrier #epoch-1)`` of ``peer``."""
        seg = self._seg(peer)
        with self._locked(peer, 0, _CONTROL.size, exclusive=False, op="barrier"):
            raw = bytes(seg.map[: _CONTROL.size])
        epoch, pid, op, previous_op = _CONTROL.unpack(raw)
        return epoch, pid, op.rstrip(b"\0"), previous_op.rstrip(b"\0")

    def _write_control(self, epoch: int, op: bytes, previous_op: bytes) -> None:
        seg = self._seg(self.rank)
        with self._locked(self.rank, 0, _CONTROL.size, exclusive=True, op="barrier"):
            seg.map[: _CONTROL.size] = _CONTROL.pack(epoch, os.getpid(), op, previous_op)

    def barrier(self, op: str = "barrier") -> None:
        failed: BaseException | None = None
        try:
            self.quiet()
        except OdcTimeoutError:
            raise
        except BaseException as e:  # every operation completed, one failed: still meet the peers, then report it
            failed = e
        self._barrier(op)
        if failed is not None:
            raise failed

    def _barrier(self, op: str) -> None:
        self._epoch += 1
        tag = op.encode()[:_OP_BYTES]
        self._write_control(self._epoch, tag, self._last_op)
        self._last_op = tag
        waiting = [p for p in range(self.world_size) if p != self.rank]
        deadline = time.monotonic() + self.timeout
        spins = 0
        while waiting:
            still = []
            for p in waiting:
                epoch, _, peer_op, peer_previous_op = self._read_control(p)
                if epoch < self._epoch:
                    still.append(p)
                    continue
                # A peer is at most one barrier ahead (it cannot pass the next one without us), so the op it
                # ran at our epoch is its current or its previous one.
                theirs = peer_op if epoch == self._epoch else peer_previous_op
                if theirs != tag:
                    raise OdcMismatchError(
                        f"odc collective mismatch at barrier #{self._epoch}: rank {self.rank} is in {op!r} but rank "
                        f"{p} is in {theirs.decode(errors='replace')!r}; every rank must call the same collectives "
                        "in the same order"
                    )
            waiting = still
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise OdcTimeoutError(self._describe_missing(op, waiting))
            spins += 1
            # Spin briefly (barriers usually complete within microseconds), then back off to 1 ms.
            time.sleep(0 if spins < 50 else min(1e-3, 1e-5 * spins))

    def _describe_missing(self, op: str, missing: list[int]) -> str:
        parts = []
        for p in missing:
            epoch, pid, peer_op, _ = self._read_control(p)
            state = "alive" if _pid_alive(pid) else "DEAD"
            where = peer_op.decode(errors="replace")
            parts.append(f"rank {p} (pid {pid}, {state}, last at barrier #{epoch} in {where!r})")
        return (
            f"odc {op}: rank {self.rank} timed out after {self.timeout:g} s waiting at barrier #{self._epoch} for "
            f"{', '.join(parts)}. A dead rank means its process crashed; an alive one is stuck or did not call "
            "the same collective. Raise ODC_TIMEOUT if it is merely slow."
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

    Every step that can fail on one rank only (bad settings, a segment that cannot be created or mapped) is
    agreed on with :func:`~odc_runtime.agree.gather_checked`, so all ranks raise together instead of some of
    them waiting forever for the others.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    job = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(job, src=0)
    transport: HostTransport | None = None

    def create_own_segment() -> tuple[int, int]:
        nonlocal transport
        directory = config.shm_dir()
        heap = config.resolve_size(heap_size, "ODC_HEAP_SIZE", config.DEFAULT_HOST_HEAP_BYTES)
        chunk = config.resolve_size(None, "ODC_HOST_CHUNK_BYTES", config.DEFAULT_HOST_CHUNK_BYTES)
        remove_stale_segments(directory)
        transport = HostTransport(
            rank, world, job[0], timeout=timeout, heap_size=heap, directory=directory, chunk_bytes=chunk
        )
        return transport.create_segment(), heap

    try:
        infos = gather_checked("init (host segments)", create_own_segment)
        # Different heaps give different offsets, and a peer's smaller segment cannot be mapped.
        require_same(
            "init:", [heap for _, heap in infos],
            rule="ODC_HEAP_SIZE / init(heap_size=...) must resolve to the same number of bytes on every rank",
        )
        assert transport is not None
        # Returning from this gather also means every rank has mapped every segment.
        gather_checked("init (map peers)", lambda: transport.map_peers([pid for pid, _ in infos]))
        transport.unlink_own()
    except BaseException:
        if transport is not None:
            transport.finalize()
        raise
    log.info(
        "odc host transport: rank %d/%d, job %s, heap %d MiB per rank in %s",
        rank, world, transport.job, transport.heap_capacity() >> 20, transport.directory,
    )
    return transport
