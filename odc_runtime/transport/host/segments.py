"""Segment files of the host transport: naming, creation, sparse sizing and reservation, mapping, removal.

Each rank creates one segment ``odc-<job>-r<rank>-p<pid>-s<start>-n<pidns>.heap`` (mode 0600; ``start`` is the
process's start time, so a later process that reuses the pid is not mistaken for the creator; ``pidns`` its pid
namespace, so segments of another container sharing the directory are never judged by pid): the control pages
(``CONTROL_BYTES``) followed by the rank's symmetric heap. The file is sparse; every allocation first
reserves its bytes with ``posix_fallocate`` (``Segments.reserve``), so a full filesystem is an
``OdcMemoryError`` and not a ``SIGBUS`` on first touch.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import mmap
import os
import re
import weakref
from collections.abc import Sequence

import torch

from odc_runtime.agree import pid_namespace, process_alive
from odc_runtime.errors import OdcBackendError, OdcMemoryError, OdcUsageError
from odc_runtime.transport.heap import human_bytes

log = logging.getLogger("odc_runtime.transport.host")

PAGE = 4096
CONTROL_BYTES = 2 * PAGE  # control pages at the start of every segment: world rounds, then group fences
_SEGMENT_RE = re.compile(
    r"^odc-(?P<job>[0-9a-f]+)-r(?P<rank>\d+)-p(?P<pid>\d+)(?:-s(?P<start>\d+))?(?:-n(?P<ns>\d+))?\.heap$"
)


def _ns_id(namespace: str) -> int:
    """The inode number in a pid namespace link such as ``pid:[4026531836]`` (0 if unknown)."""
    digits = "".join(c for c in namespace if c.isdigit())
    return int(digits) if digits else 0


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


def free_bytes(directory: str) -> int | None:
    """Bytes free for this user in ``directory``'s filesystem (``None`` if unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class Segment:
    """One rank's mapped segment: control pages + heap, with the fd used for byte-range locks."""

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path = path
        self.fd = fd
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at heap byte ``offset``."""
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


# Segment sets alive in this process; a forked child marks them all, once, instead of every operation asking the
# kernel for its pid. Weak references: the hook must not keep finalized transports alive.
_live: weakref.WeakSet[Segments] = weakref.WeakSet()


def _mark_forked() -> None:
    for segments in _live:
        segments.forked = True


os.register_at_fork(after_in_child=_mark_forked)


class Segments:
    """Every rank's segment as this rank maps it, and the lifetime of this rank's own file."""

    def __init__(self, rank: int, world_size: int, job: str, directory: str, heap_bytes: int) -> None:
        self.rank = rank
        self.job = job
        self.directory = directory
        self.size = CONTROL_BYTES + heap_bytes
        self._segments: list[Segment | None] = [None] * world_size
        self._own_path: str | None = None
        self.forked = False  # set in a forked child (which must not touch the rank's memory)
        self.owner_pid = os.getpid()
        # Peers whose pids mean something here (same pid namespace); others are never declared dead early.
        self.visible = [True] * world_size
        _live.add(self)

    def _path(self, rank: int, pid: int, start: int, namespace: str) -> str:
        return os.path.join(self.directory, f"odc-{self.job}-r{rank}-p{pid}-s{start}-n{_ns_id(namespace)}.heap")

    def get(self, peer: int) -> Segment:
        """``peer``'s mapped segment; OdcUsageError after finalize or in a forked child."""
        seg = self._segments[peer]
        if seg is None:
            raise OdcUsageError("odc host transport is finalized")
        if self.forked:
            raise OdcUsageError(
                f"odc host transport: process {os.getpid()} is a fork of rank {self.rank} (pid {self.owner_pid}) "
                "and must not use its runtime (it would write into the rank's segments and barrier state); call odc "
                "only in the process that called odc_runtime.init()"
            )
        return seg

    def create_own(self, pid: int, start: int) -> Segment:
        """Create this rank's segment (mode 0600), sized sparse, with its control pages reserved."""
        path = self._path(self.rank, pid, start, pid_namespace())
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as e:
            raise OdcBackendError(
                f"odc host transport: cannot create shared-memory segment {path}: {e}; set ODC_SHM_DIR to a "
                "writable tmpfs directory"
            ) from e
        self._own_path = path
        atexit.register(self.unlink_own)
        try:
            os.ftruncate(fd, self.size)  # sparse: pages cost memory only once reserved
        except OSError as e:
            os.close(fd)
            raise OdcBackendError(f"odc host transport: cannot size {path} to {self.size} bytes: {e}") from e
        try:
            self.reserve(fd, 0, CONTROL_BYTES, "the control page")
            seg = Segment(path, fd, self.size)
        except BaseException:
            os.close(fd)
            raise
        self._segments[self.rank] = seg
        return seg

    def map_peers(self, identities: Sequence[tuple[int, int, str]]) -> None:
        """Map every peer's segment (after all have been created); ``identities[r]`` is ``(pid, start time, pid
        namespace)`` of rank ``r``."""
        own_namespace = identities[self.rank][2]
        self.visible = [ns == own_namespace for _, _, ns in identities]
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
                self._segments[peer] = Segment(path, fd, self.size)
            except BaseException:
                os.close(fd)
                raise

    def unlink_own(self) -> None:
        """Remove this rank's file (the memory lives on in the mappings)."""
        if self._own_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._own_path)
            self._own_path = None

    def reserve(self, fd: int, start: int, length: int, what: str) -> None:
        """Back ``[start, start + length)`` of a segment file with real memory, or raise OdcMemoryError."""
        try:
            os.posix_fallocate(fd, start, length)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT):
                raise OdcBackendError(
                    f"odc host transport: rank {self.rank} cannot reserve {length} bytes in {self.directory}: {e}"
                ) from e
            free = free_bytes(self.directory)
            raise OdcMemoryError(
                f"odc host transport: rank {self.rank} cannot reserve {human_bytes(length)} ({length} bytes) for "
                f"{what} in {self.directory}: the filesystem has "
                f"{'an unknown amount' if free is None else human_bytes(free)} free ({e.strerror}). Give it more "
                "space (docker run --shm-size=..., a larger tmpfs), point ODC_SHM_DIR at a larger tmpfs, or "
                "shard less (ODC_HEAP_SIZE only caps the heap; the filesystem must hold what is allocated)"
            ) from e

    def close(self) -> None:
        """Remove this rank's file and drop every mapping this rank holds."""
        self.unlink_own()
        atexit.unregister(self.unlink_own)  # it would keep this object alive until exit
        for seg in self._segments:
            if seg is not None:
                seg.close()
        self._segments = [None] * len(self._segments)
