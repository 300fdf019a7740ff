"""A CPU model of ``odc_runtime._C`` that moves data, for the nvshmem transport on CPU ranks in separate processes
(``run_ranks``): :func:`use` makes ``odc.init("nvshmem")`` build the real :class:`NvshmemTransport` over it, so the
core API's exact multi-process tests run through the transport's real plan building, validation and stream logic.

Memory: each PE's symmetric memory is a shared file (a page of control words, then the arena) that every PE maps;
a peer pointer is this process's mapping of the peer's arena (the near kinds), a symmetric offset indexes the
peer's arena (the far kinds). A launch runs its kernel to completion on the host (events are always complete).
What the kernels of ``csrc/`` do, step by step:

* push atomic (``peer.cu``): every element's add is one atomic at the owner, modelled by an exclusive POSIX lock
  on the owner's bytes while adding; fp32 accumulators get ``float(src) * scale`` added in fp32, int64 ones the
  exact integer sum (wrapping modulo 2**64, as two's-complement hardware adds do);
* push locked (``cells.cu``): per cell of the owner's arena (cut at symmetric offsets), the cell's ticket lock
  ``hash(cell) % nlocks`` (a POSIX lock on a byte of the owner's file past its end), get into a slot, add, put,
  release;
* barrier (``barrier.cu``): announce the epoch in every PE's epoch words, wait until every PE announced it;
* the host-side refusals of ``plan.cu`` (accumulator type, int64 mixes, scale != 1 with int64, alignment, ranges
  outside the arena), as ``RuntimeError`` (the binding's ``NvshmemError``).

Not modelled: signalled puts (the hierarchy, the gang exchange), the abort word (nothing waits on a device here:
the barrier's wait has its own deadline instead), MPS, versions.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import tempfile
import time
import types
from typing import Any

import torch

CTL = 4096  # bytes of control words (barrier epochs) before each PE's arena
NLOCKS = 64
DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16, 3: torch.int64}
PUSH_ATOMIC, PUSH_LOCKED = 3, 4


class _Mem:
    """Every PE's file mapped into this process."""

    def __init__(self, paths: list[str], size: int) -> None:
        self.size = size
        self.fds = [os.open(p, os.O_RDWR) for p in paths]
        self.maps = [mmap.mmap(fd, size) for fd in self.fds]
        self.views = [torch.frombuffer(m, dtype=torch.uint8) for m in self.maps]
        self.bases = [v.data_ptr() + CTL for v in self.views]  # each PE's arena as this process maps it

    def arena(self, pe: int, offset: int, nbytes: int) -> torch.Tensor:
        return self.views[pe][CTL + offset : CTL + offset + nbytes]

    def epochs(self, pe: int, npes: int) -> torch.Tensor:
        return self.views[pe][: 8 * npes].view(torch.int64)


def _local(addr: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements of ``dtype`` at ``addr`` of this process (a caller's source or destination)."""
    return torch.frombuffer((ctypes.c_char * (n * dtype.itemsize)).from_address(addr), dtype=dtype)


def _add(acc: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """What the kernels add: int64 exactly (modulo 2**64), floats as fp32 ``float(src) * scale``."""
    if acc.dtype == torch.int64:
        acc.add_(src)
    else:
        acc.add_(src.to(torch.float32) * torch.tensor(scale, dtype=torch.float32))


def extension(mem: _Mem, rank: int, npes: int, timeout: float, cell: int) -> types.SimpleNamespace:
    """The fake ``_C`` of PE ``rank`` (``cell``: the locked protocol's cell bytes)."""

    class Engine:
        def __init__(self) -> None:
            self.rank, self.npes = rank, npes

        def barrier(self, epoch: int, stream: int) -> None:
            for pe in range(npes):
                mem.epochs(pe, npes)[rank] = epoch
            deadline = time.monotonic() + timeout
            mine = mem.epochs(rank, npes)
            while bool((mine < epoch).any()):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fake barrier {epoch}: PEs {(mine < epoch).nonzero().flatten().tolist()} late")
                time.sleep(1e-4)

        def quiet(self, stream: int) -> None:
            pass

        def watch(self, stream: int, timeout_s: float) -> None:
            pass

        def watching(self) -> int:
            return 0

        def aborted(self) -> bool:
            return False

        def set_abort(self) -> None:
            pass

        def deadline_passed(self) -> bool:
            return False

        def barrier_gave_up(self) -> int:
            return 0

        def heard(self) -> list[int]:
            return mem.epochs(rank, npes).tolist()

        def put_signal(self, *args: Any) -> None:
            raise RuntimeError("put_signal is not modelled by tests/_nvshmem_shm.py")

        def wait_signal(self, *args: Any) -> int:
            raise RuntimeError("wait_signal is not modelled by tests/_nvshmem_shm.py")

    class Plan:
        def __init__(self, engine: Engine, kind: int, addr, rel, numel, pe, acc_dtype: int = 0) -> None:
            self.kind, self.acc = kind, acc_dtype
            self.tasks = list(zip(addr, rel, numel, pe, strict=True))
            push = kind in (PUSH_ATOMIC, PUSH_LOCKED)
            if push and acc_dtype not in (0, 3):
                raise RuntimeError(f"Plan: accumulators are fp32 or int64, got dtype code {acc_dtype}")
            size = DTYPES[acc_dtype].itemsize if push else 1
            for a, _, n, p in self.tasks:
                if not 0 <= p < npes:
                    raise RuntimeError("Plan: peer out of range")
                if kind in (2, PUSH_LOCKED) and a + n * size > mem.size - CTL:
                    raise RuntimeError("Plan: symmetric offset range outside the heap arena")
                if push and a % size:
                    raise RuntimeError(f"Plan: accumulator address not {size}-byte aligned")

        def _owner(self, a: int, pe: int, nbytes: int) -> tuple[int, torch.Tensor]:
            """(byte offset in the owner's arena, its bytes) of a task's range: near kinds carry the peer
            pointer, far kinds the symmetric offset."""
            off = a - mem.bases[pe] if self.kind in (0, 1, PUSH_ATOMIC) else a
            return off, mem.arena(pe, off, nbytes)

        def run(self, base: int, dtype: int, scale: float, stream: int) -> None:
            src_type = DTYPES[dtype]
            if self.kind in (PUSH_ATOMIC, PUSH_LOCKED):
                if (self.acc == 3) != (dtype == 3):
                    raise RuntimeError("Plan.run: an int64 accumulator takes int64 sources only, an fp32 one floats")
                if dtype == 3 and scale != 1.0:
                    raise RuntimeError("Plan.run: int64 pushes take scale 1 (exact adds)")
            acc_type = DTYPES[self.acc]
            for a, r, n, pe in self.tasks:
                if n == 0:
                    continue
                src_addr = base + r * src_type.itemsize
                if self.kind in (0, 1, 2):  # fetch: copy the owner's bytes
                    _, owner = self._owner(a, pe, n * src_type.itemsize)
                    _local(src_addr, owner.numel(), torch.uint8).copy_(owner)
                    continue
                src = _local(src_addr, n, src_type)
                off, owner = self._owner(a, pe, n * acc_type.itemsize)
                acc = owner.view(acc_type)
                if self.kind == PUSH_ATOMIC:
                    fcntl.lockf(mem.fds[pe], fcntl.LOCK_EX, owner.numel(), CTL + off)
                    try:
                        _add(acc, src, scale)
                    finally:
                        fcntl.lockf(mem.fds[pe], fcntl.LOCK_UN, owner.numel(), CTL + off)
                    continue
                for c in range(off // cell, (off + owner.numel() - 1) // cell + 1):
                    lo, hi = max(off, c * cell), min(off + owner.numel(), (c + 1) * cell)
                    lock = mem.size + ((c * 0x9E3779B97F4A7C15) % (1 << 64) >> 17) % NLOCKS
                    fcntl.lockf(mem.fds[pe], fcntl.LOCK_EX, 1, lock)  # ticket lock of the cell at the owner
                    try:
                        slot = mem.arena(pe, lo, hi - lo).clone().view(acc_type)  # get
                        e0 = (lo - off) // acc_type.itemsize
                        _add(slot, src[e0 : e0 + slot.numel()], scale)  # add
                        mem.arena(pe, lo, hi - lo).copy_(slot.view(torch.uint8))  # put (+ quiet)
                    finally:
                        fcntl.lockf(mem.fds[pe], fcntl.LOCK_UN, 1, lock)  # release

    return types.SimpleNamespace(
        DTYPE_FLOAT32=0, DTYPE_BFLOAT16=1, DTYPE_FLOAT16=2, DTYPE_INT64=3, PLAN_FETCH_COPY=0, PLAN_FETCH_KERNEL=1,
        PLAN_FETCH_STAGED=2, PLAN_PUSH_ATOMIC=PUSH_ATOMIC, PLAN_PUSH_LOCKED=PUSH_LOCKED, Plan=Plan, Engine=Engine,
        EVENT_DONE=0, EVENT_PENDING=1, query_event=lambda event: 0,
    )


class _Stream:
    def __init__(self, ptr: int) -> None:
        self.cuda_stream = ptr

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass


class _Event:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    @property
    def cuda_event(self) -> int:
        return id(self)

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True


def use(path: str, capacity: int = 1 << 20) -> None:
    """In a rank of ``run_ranks``: make ``odc.init("nvshmem")`` create the nvshmem transport over this model.
    ``path`` names the protocol: ``"atomic"`` (one node, every PE reaches every other by peer pointer: copy
    fetches, atomic pushes) or ``"locked"`` (no peer pointer to other PEs: staged fetches, locked pushes, as
    across nodes, with the node size set to the world)."""
    import torch.distributed as dist

    from odc_runtime import config
    from odc_runtime.transport import nvshmem
    from odc_runtime.transport.nvshmem import memory as nv_memory
    from odc_runtime.transport.nvshmem import plans as nv_plans

    streams = iter(range(1000, 1 << 30))
    current = _Stream(1)
    torch.cuda.Stream = lambda device=None: _Stream(next(streams))  # type: ignore[assignment,misc]
    torch.cuda.Event = _Event  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: current  # type: ignore[assignment]
    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    nv_plans.raw_stream = lambda index: current.cuda_stream  # type: ignore[assignment]
    nv_plans.record = lambda t, stream: None  # type: ignore[assignment]

    def create(*, timeout: float, heap_size: int | str | None = None) -> nvshmem.NvshmemTransport:
        rank, world = dist.get_rank(), dist.get_world_size()
        names: list[Any] = [None] * world
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, mine = tempfile.mkstemp(prefix=f"odc-nvshm-{rank}-", dir=directory)
        size = CTL + capacity
        os.ftruncate(fd, size)
        os.close(fd)
        dist.all_gather_object(names, mine)
        mem = _Mem(names, size)
        dist.barrier()
        os.unlink(mine)  # every PE mapped it; the mapping keeps it alive
        settings = config.NvshmemSettings(cell_bytes=4096)  # small cells: a tensor spans several
        ext = extension(mem, rank, world, timeout, settings.cell_bytes)
        nv_memory.wrap = lambda ptr, n, device: (mem.views[rank][CTL + ptr - mem.bases[rank] :][:n], mem)
        atomic = path == "atomic"
        bases = [b if atomic or q == rank else 0 for q, b in enumerate(mem.bases)]
        return nvshmem.NvshmemTransport(
            ext, rank, world, torch.device("cpu"), timeout, settings=settings, scratch_slots=4, capacity=capacity,
            arena=mem.bases[rank], peer_bases=bases, engine=ext.Engine(), atomic_push=atomic, node=world,
        )

    nvshmem.create = create  # what the registry's "nvshmem" entry calls


def run(rank: int, world: int, path: str, fn: Any, *args: Any) -> Any:
    """``fn(rank, world, *args)`` with every ``odc.init("host")`` / ``odc.init()`` it makes answered by the nvshmem
    transport over this model (:func:`use`)."""
    import odc_runtime as odc

    use(path)
    real = odc.init

    def init(name: str | None = None, **kwargs: Any) -> None:
        real("nvshmem" if name in (None, "host") else name, **kwargs)
        assert odc.backend() == "nvshmem"

    odc.init = init
    return fn(rank, world, *args)
