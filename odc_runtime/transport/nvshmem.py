"""GPU transport on NVSHMEM (through the compiled extension ``odc_runtime._C``).

Bootstrap: rank 0 creates an NVSHMEM unique id, ``torch.distributed`` broadcasts it, every rank initialises
NVSHMEM as PE ``rank`` on the current CUDA device (one PE per GPU). Importing this module never needs a GPU or
the extension; ``_C`` is imported inside :func:`create` / :func:`is_available`.

Memory: every :meth:`NvshmemTransport.alloc` is one ``nvshmem_malloc`` (collective), zeroed; ``local`` is a
torch tensor viewing this PE's part. The heap size is ``NVSHMEM_SYMMETRIC_SIZE`` (default 1 GiB; ``heap_size``
of :func:`create` sets it); allocations are checked against it before ``nvshmem_malloc`` because NVSHMEM exits
the process when the heap is exhausted. A transport-private scratch (``ODC_NVSHMEM_SCRATCH_SLOTS`` ×
``ODC_NVSHMEM_CELL_BYTES``, default 16 × 64 KiB) and lock array (1024 ints) are allocated at start.

fetch (:meth:`get`): peers with a peer pointer (``nvshmem_ptr`` != NULL: same node, NVLink/PCIe P2P) are read
by one chunked copy kernel, peers rotated across blocks; other peers (across nodes) are read with
``nvshmemx_getmem_on_stream`` into the symmetric scratch and copied to the destination, because an IB get may
only target symmetric or registered memory and the destination is the caller's ordinary tensor.

push (:meth:`accumulate`): see ``docs/design.md`` ("GPU push protocol"). One protocol for the whole job.
When every PE reaches every PE with load/store atomics (one NVLink domain): a fused cast·scale·atomic-add kernel
writes into the owner's fp32 accumulator through the peer pointer (vector ``red.global.add.v4.f32`` on sm_90;
``ODC_NVSHMEM_VECTOR_ATOMICS=0`` forces scalar atomics). Otherwise (multi-node), every push, same-node ones
included: lock + get + add + put per 64 KiB cell of the owner's address space, with a lock word per cell stripe
on the owner (2× the bytes, no owner work, bounded scratch). ``ODC_NVSHMEM_PUSH=locked`` forces the latter.

Streams: everything is ordered on the current torch CUDA stream. Cross-node operations run on one internal
stream (they share the scratch) that waits for the current stream and is joined back into it. ``submit`` runs a
callable on a side stream that first waits for the current stream. ``quiet``/``barrier`` join both streams
into the current one first, so they cover submitted work.

Caveats: ``nvshmem_malloc``/``nvshmem_free``/init are host-blocking collectives NVSHMEM does not time out; after
a barrier timeout the GPU may still spin in the barrier kernel (the process should exit). ``local`` tensors of
freed buffers dangle: drop them before ``free``/``finalize``. NVSHMEM can be initialised once per process.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from odc_runtime import _nvshmem_locate as _locate
from odc_runtime.agree import require_same
from odc_runtime.config import parse_size
from odc_runtime.errors import (
    OdcBackendError,
    OdcMemoryError,
    OdcNotInitializedError,
    OdcTimeoutError,
    OdcUsageError,
)
from odc_runtime.transport.base import (
    AccumulateRequest,
    GetRequest,
    SymmetricBuffer,
    Transport,
    Work,
)

__all__ = ["NvshmemTransport", "check_version", "create", "is_available", "load_extension"]

DEFAULT_HEAP = 1 << 30  # NVSHMEM's default NVSHMEM_SYMMETRIC_SIZE
ALIGN = 512  # accounting granularity of one allocation (NVSHMEM aligns allocations at least this much)
_INSTALL_HINT = (
    'build it with a CUDA toolkit and an NVSHMEM wheel: pip install -e ".[cu13]" (or ".[cu12]"), '
    "or run .ci/build_ext.sh"
)

_ext: ModuleType | None = None
_ext_error: str | None = None


def _nvshmem_lib_dirs() -> list[str]:
    """Where ``libnvshmem_host.so.3`` is looked for: ``$NVSHMEM_HOME/lib``, then the installed wheel(s)."""
    return _locate.lib_dirs()


def _nvshmem_already_loaded() -> bool:
    return _locate.loaded_host_library() is not None


def load_extension() -> ModuleType:
    """Import ``odc_runtime._C``; raise :class:`OdcBackendError` saying why it is not usable.

    ``libnvshmem_host.so.3`` is preloaded from ``NVSHMEM_HOME`` or the installed ``nvidia-nvshmem`` wheel unless
    the process already has one (``import torch`` loads its own in torch CUDA builds; the same soname is then
    reused, which is why :func:`check_version` compares versions before init).
    """
    global _ext, _ext_error
    if _ext is not None:
        return _ext
    if _ext_error is not None:
        raise OdcBackendError(_ext_error)
    try:
        if not _nvshmem_already_loaded():
            for d in _nvshmem_lib_dirs():
                libs = _locate.host_libraries(d)
                if libs:
                    ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
                    break
        from odc_runtime import _C
    except (ImportError, OSError) as exc:
        _ext_error = f"the NVSHMEM extension odc_runtime._C is not usable ({exc}); {_INSTALL_HINT}"
        raise OdcBackendError(_ext_error) from exc
    _ext = _C
    return _C


def _fmt(v: Sequence[int]) -> str:
    return ".".join(str(x) for x in v)


def check_version(C: ModuleType) -> tuple[int, int, int]:
    """Return the NVSHMEM version in use; raise :class:`OdcBackendError` if it is not the one ``C`` was built for.

    ``C`` (``odc_runtime._C``) links NVSHMEM's device library statically but uses whichever
    ``libnvshmem_host.so.3`` the process loaded first (torch's, in torch CUDA builds); device and host halves of
    different releases share internal state layouts, so a mismatch is refused instead of run.
    """
    try:
        built = tuple(int(x) for x in C.nvshmem_version_compiled())
        running = tuple(int(x) for x in C.nvshmem_version_runtime())
    except AttributeError as exc:
        raise OdcBackendError(
            "odc_runtime._C has no NVSHMEM version query (it was built from an older odc_runtime): rebuild it "
            f"from this source tree; {_INSTALL_HINT}"
        ) from exc
    if built != running:
        lib = _locate.loaded_host_library() or "libnvshmem_host.so.3"
        flavors = sorted({f for f, _ in _locate.installed_wheels()})
        cu = flavors[0] if len(flavors) == 1 else "cu13"  # the wheel flavour installed here, if unambiguous
        raise OdcBackendError(
            f"odc_runtime._C was compiled against NVSHMEM {_fmt(built)}, but this process runs NVSHMEM "
            f"{_fmt(running)} ({lib}; torch CUDA builds load the NVSHMEM they pin). Device code and host library "
            f"must be the same release. Rebuild the extension against NVSHMEM {_fmt(running)}: in this environment, "
            "with nvcc available, reinstall odc_runtime from its source tree (`pip install --force-reinstall "
            f'--no-deps ".[{cu}]"`, or `pip install -e ".[{cu}]"`, or `.ci/build_ext.sh`); the build uses the NVSHMEM '
            f"wheel installed here, so make sure it is {_fmt(running)} (pip install nvidia-nvshmem-{cu}=="
            f"{_fmt(running)}), or point NVSHMEM_HOME at an NVSHMEM {_fmt(running)} install."
        )
    return running  # type: ignore[return-value]


def is_available() -> bool:
    """CUDA is present and ``odc_runtime._C`` imports. Never raises."""
    try:
        if not torch.cuda.is_available():
            return False
        load_extension()
        return True
    except Exception:
        return False


def _backend_call(op: str, fn: Callable, *args):
    try:
        return fn(*args)
    except RuntimeError as exc:  # odc_runtime._C.NvshmemError
        raise OdcBackendError(f"nvshmem {op}: {exc}") from exc


class _CudaArray:
    """Exposes raw device memory through ``__cuda_array_interface__`` (bytes) so torch can wrap it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


@dataclass
class _Handle:
    ptr: int  # symmetric address (the same on every PE)
    nbytes: int  # bytes accounted against the heap
    peer_ptrs: list[int]  # nvshmem_ptr(ptr, pe) per PE; 0 when the PE is not reachable by loads/stores


_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class _CudaWork(Work):
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self, timeout: float | None = None) -> None:
        # Stream-ordered: the caller's current stream waits; the host does not block.
        torch.cuda.current_stream().wait_event(self._event)

    def is_completed(self) -> bool:
        return self._event.query()


class NvshmemTransport(Transport):
    name = "nvshmem"

    def __init__(
        self, ext: ModuleType, rank: int, world_size: int, device: torch.device, timeout: float, capacity: int
    ) -> None:
        super().__init__(rank, world_size, device, timeout)
        self._C = ext
        self._capacity = capacity
        self._used = 0
        self._buffers: list[SymmetricBuffer] = []
        self._finalized = False
        self._broken = False  # a barrier timed out: collective teardown would hang
        self._side = torch.cuda.Stream(device)
        self._remote = torch.cuda.Stream(device)
        self._side_event: torch.cuda.Event | None = None
        self._remote_event: torch.cuda.Event | None = None
        self._in_submit = False
        self._vector_atomics = os.environ.get("ODC_NVSHMEM_VECTOR_ATOMICS", "1") not in ("0", "false", "")
        self._cell_bytes = int(os.environ.get("ODC_NVSHMEM_CELL_BYTES", 64 * 1024))
        slots = int(os.environ.get("ODC_NVSHMEM_SCRATCH_SLOTS", 16))
        if self._cell_bytes <= 0 or self._cell_bytes % 16 or slots <= 0:
            raise OdcUsageError("ODC_NVSHMEM_CELL_BYTES must be a positive multiple of 16, SCRATCH_SLOTS > 0")
        self._nlocks = 1024
        mode = os.environ.get("ODC_NVSHMEM_PUSH", "auto").strip().lower()  # must be the same on every rank
        if mode not in ("auto", "locked"):
            raise OdcUsageError(f"ODC_NVSHMEM_PUSH must be 'auto' or 'locked', got {mode!r}")
        self._scratch_bytes = self._cell_bytes * slots
        self._scratch = self.alloc(self._scratch_bytes, torch.uint8, tag="odc.scratch")
        self._locks = self.alloc(self._nlocks, torch.int32, tag="odc.locks")
        # One push protocol for the whole job, never a mix: atomics through peer pointers and lock+get+add+put
        # into the same accumulator words are not atomic with respect to each other (the get/put would undo
        # atomics that land in between), and the lock AMOs themselves must all take one path. So the atomic
        # path is used only when NVSHMEM found that every PE reaches every PE with load/store atomics (its own
        # job-wide decision, identical on all PEs); otherwise (multi-node, or PCIe P2P without atomics) every
        # push, same-node and to self included, takes the locked path. ODC_NVSHMEM_PUSH=locked forces it.
        self._atomic_push = (
            mode == "auto"
            and bool(_backend_call("p2p_atomics", self._C.p2p_atomics))
            and all(self._scratch.handle.peer_ptrs)
        )
        self.barrier("init")

    # -- helpers ----------------------------------------------------------------------------------------
    def _check(self, op: str) -> None:
        if self._finalized:
            raise OdcNotInitializedError(f"nvshmem transport: {op} after finalize")

    def _stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def _wait_event(self, event: torch.cuda.Event, op: str) -> None:
        deadline = time.monotonic() + self.timeout
        pause = 20e-6
        while not event.query():
            if time.monotonic() > deadline:
                self._broken = True
                raise OdcTimeoutError(
                    f"odc_runtime {op}: rank {self.rank} waited {self.timeout:.0f}s for the NVSHMEM barrier; "
                    "some rank did not arrive (dead or stuck peer, or it did not call the same collective). "
                    "The GPU may still be blocked: restart the job (raise ODC_TIMEOUT if ranks are just slow)."
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _join_into(self, stream: torch.cuda.Stream) -> None:
        for ev in (self._side_event, self._remote_event):
            if ev is not None:
                stream.wait_event(ev)

    def _on_remote(self, issue: Callable[[int], None], tensors: Sequence[torch.Tensor]) -> None:
        """Run cross-node work on the internal stream (it owns the scratch), ordered after the current stream."""
        cur = self._stream()
        self._remote.wait_stream(cur)
        for t in tensors:
            t.record_stream(self._remote)
        issue(self._remote.cuda_stream)
        ev = torch.cuda.Event()
        ev.record(self._remote)
        self._remote_event = ev
        cur.wait_event(ev)

    def _keep_alive(self, tensors: Sequence[torch.Tensor], stream: torch.cuda.Stream) -> None:
        # Inside submit() the tensors were allocated on the caller's stream but are used on the side stream:
        # tell the caching allocator, so their memory is not reused before the side stream is done with them.
        if self._in_submit:
            for t in tensors:
                t.record_stream(stream)

    def _check_range(self, what: str, buf: SymmetricBuffer, peer: int, offset: int, n: int) -> None:
        if not 0 <= peer < self.world_size:
            raise OdcUsageError(f"nvshmem {what}: peer {peer} out of range [0, {self.world_size})")
        if offset < 0 or offset + n > buf.numel:
            raise OdcUsageError(f"nvshmem {what}: range [{offset}, {offset + n}) outside buffer of {buf.numel}")

    def _check_tensor(self, what: str, t: torch.Tensor) -> None:
        if not t.is_cuda or t.device != self.device:
            raise OdcUsageError(f"nvshmem {what}: tensor on {t.device}, expected {self.device}")
        if not t.is_contiguous():
            raise OdcUsageError(f"nvshmem {what}: tensor must be contiguous")

    # -- memory -------------------------------------------------------------------------------------------
    def heap_capacity(self) -> int:
        return self._capacity

    def heap_used(self) -> int:
        return self._used

    def alloc(self, numel: int, dtype: torch.dtype, tag: str = "") -> SymmetricBuffer:
        self._check("alloc")
        if numel < 0:
            raise OdcUsageError(f"nvshmem alloc({tag!r}): negative numel {numel}")
        nbytes = numel * dtype.itemsize
        accounted = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        left = self._capacity - self._used
        if accounted > left:
            raise OdcMemoryError(
                f"odc_runtime: symmetric heap exhausted allocating {tag or 'a buffer'!r}: asked {nbytes} bytes "
                f"({accounted} with alignment), {left} bytes left of {self._capacity}; raise "
                "NVSHMEM_SYMMETRIC_SIZE (or odc.init(heap_size=...)) before init"
            )
        ptr = _backend_call(f"alloc({tag})", self._C.malloc, accounted)
        raw = torch.as_tensor(_CudaArray(ptr, accounted), device=self.device)
        local = raw[:nbytes].view(dtype)
        local.zero_()
        peer_ptrs = [_backend_call("ptr", self._C.ptr, ptr, pe) for pe in range(self.world_size)]
        buf = SymmetricBuffer(numel=numel, dtype=dtype, local=local, handle=_Handle(ptr, accounted, peer_ptrs), tag=tag)
        self._used += accounted
        self._buffers.append(buf)
        # Every PE's zeroing is done before any peer can push into it (stream-ordered barrier, bounded wait).
        self.barrier(f"alloc({tag})")
        return buf

    def free(self, buf: SymmetricBuffer) -> None:
        if buf.freed or self._finalized:
            buf.freed = True
            return
        self.barrier(f"free({buf.tag})")  # nobody still reads or pushes into it
        torch.cuda.synchronize(self.device)
        h: _Handle = buf.handle
        _backend_call(f"free({buf.tag})", self._C.free, h.ptr)
        buf.freed = True
        self._used -= h.nbytes
        self._buffers = [b for b in self._buffers if b is not buf]

    # -- one-sided operations ---------------------------------------------------------------------------
    def get(self, buf: SymmetricBuffer, requests: Sequence[GetRequest]) -> None:
        self._check("get")
        h: _Handle = buf.handle
        item = buf.dtype.itemsize
        p2p: tuple[list[int], list[int], list[int]] = ([], [], [])
        remote: list[GetRequest] = []
        for r in requests:  # validate everything before issuing anything
            self._check_tensor("get(dst)", r.dst)
            if r.dst.dtype != buf.dtype:
                raise OdcUsageError(f"nvshmem get: dst dtype {r.dst.dtype} != buffer dtype {buf.dtype}")
            self._check_range("get", buf, r.peer, r.offset, r.dst.numel())
        for r in requests:
            n = r.dst.numel() * item
            if n == 0:
                continue
            if h.peer_ptrs[r.peer]:
                p2p[0].append(r.dst.data_ptr())
                p2p[1].append(h.peer_ptrs[r.peer] + r.offset * item)
                p2p[2].append(n)
            else:
                remote.append(r)
        stream = self._stream()
        self._keep_alive([r.dst for r in requests], stream)
        if p2p[0]:
            _backend_call("get", self._C.fetch_p2p, *p2p, stream.cuda_stream)
        if remote:

            def issue(s: int) -> None:
                for r in remote:
                    _backend_call(
                        "get",
                        self._C.get_staged,
                        r.dst.data_ptr(),
                        h.ptr + r.offset * item,
                        r.dst.numel() * item,
                        r.peer,
                        self._scratch.handle.ptr,
                        self._scratch_bytes,
                        s,
                    )

            self._on_remote(issue, [r.dst for r in remote])

    def accumulate(self, buf: SymmetricBuffer, requests: Sequence[AccumulateRequest], scale: float) -> None:
        self._check("accumulate")
        if buf.dtype != torch.float32:
            raise OdcUsageError(f"nvshmem accumulate: accumulators must be float32, got {buf.dtype}")
        h: _Handle = buf.handle
        for r in requests:
            self._check_tensor("accumulate(src)", r.src)
            if r.src.dtype not in _DTYPE_CODES:
                raise OdcUsageError(f"nvshmem accumulate: src dtype {r.src.dtype} (use fp32/bf16/fp16)")
            self._check_range("accumulate", buf, r.peer, r.offset, r.src.numel())
        p2p: dict[int, tuple[list[int], list[int], list[int]]] = {}
        remote: list[AccumulateRequest] = []
        for r in requests:
            if r.src.numel() == 0:
                continue
            if self._atomic_push and h.peer_ptrs[r.peer]:
                lists = p2p.setdefault(_DTYPE_CODES[r.src.dtype], ([], [], []))
                lists[0].append(h.peer_ptrs[r.peer] + r.offset * 4)
                lists[1].append(r.src.data_ptr())
                lists[2].append(r.src.numel())
            else:
                remote.append(r)
        stream = self._stream()
        self._keep_alive([r.src for r in requests], stream)
        for code, (dst, src, numel) in p2p.items():
            _backend_call(
                "accumulate",
                self._C.accumulate_p2p,
                dst,
                src,
                numel,
                code,
                float(scale),
                self._vector_atomics,
                stream.cuda_stream,
            )
        if remote:

            def issue(s: int) -> None:
                for r in remote:
                    _backend_call(
                        "accumulate",
                        self._C.accumulate_locked,
                        h.ptr + r.offset * 4,
                        r.src.data_ptr(),
                        r.src.numel(),
                        _DTYPE_CODES[r.src.dtype],
                        float(scale),
                        r.peer,
                        self._scratch.handle.ptr,
                        self._scratch_bytes,
                        self._cell_bytes,
                        self._locks.handle.ptr,
                        self._nlocks,
                        s,
                    )

            self._on_remote(issue, [r.src for r in remote])

    def submit(self, fn: Callable[[], None]) -> Work:
        self._check("submit")
        cur = self._stream()
        self._side.wait_stream(cur)
        self._in_submit = True
        try:
            with torch.cuda.stream(self._side):
                fn()
        finally:
            self._in_submit = False
        ev = torch.cuda.Event()
        ev.record(self._side)
        self._side_event = ev
        return _CudaWork(ev)

    def quiet(self) -> None:
        self._check("quiet")
        stream = self._stream()
        self._join_into(stream)
        _backend_call("quiet", self._C.quiet_on_stream, stream.cuda_stream)

    def barrier(self, op: str = "barrier") -> None:
        self._check(op)
        stream = self._stream()
        self._join_into(stream)
        _backend_call(op, self._C.quiet_on_stream, stream.cuda_stream)
        _backend_call(op, self._C.barrier_all_on_stream, stream.cuda_stream)
        ev = torch.cuda.Event()
        ev.record(stream)
        self._wait_event(ev, op)

    def finalize(self) -> None:
        if self._finalized:
            return
        self._finalized = True
        if self._broken:
            return  # a peer is gone: NVSHMEM's collective teardown would hang; the process should exit
        try:
            torch.cuda.synchronize(self.device)
            for buf in reversed(self._buffers):
                _backend_call("finalize", self._C.free, buf.handle.ptr)
                buf.freed = True
            self._buffers = []
            self._used = 0
            _backend_call("finalize", self._C.finalize)
        finally:
            global _initialized_once
            _initialized_once = True


_initialized_once = False


def create(*, timeout: float, heap_size: int | str | None = None) -> NvshmemTransport:
    """Initialise NVSHMEM on every rank of the default ``torch.distributed`` group; collective."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise OdcNotInitializedError("nvshmem transport: call torch.distributed.init_process_group first")
    if _initialized_once:
        raise OdcBackendError("nvshmem transport: NVSHMEM cannot be initialised twice in one process")
    rank, world = dist.get_rank(), dist.get_world_size()

    # Validate locally, then agree, so that no rank enters NVSHMEM's (non-timing-out) bootstrap alone.
    problem = None
    ext = None
    capacity = DEFAULT_HEAP
    try:
        if not torch.cuda.is_available():
            raise OdcBackendError("nvshmem transport: no CUDA device is available (use backend='host')")
        ext = load_extension()
        check_version(ext)
        if heap_size is not None:
            os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(parse_size(heap_size, what="heap_size"))
        if os.environ.get("NVSHMEM_SYMMETRIC_SIZE"):
            capacity = parse_size(os.environ["NVSHMEM_SYMMETRIC_SIZE"], what="NVSHMEM_SYMMETRIC_SIZE")
    except Exception as exc:
        problem = f"rank {rank}: {exc}"
    reports: list = [None] * world
    dist.all_gather_object(reports, (problem, capacity))
    bad = [p for p, _ in reports if p]
    if bad:
        raise OdcBackendError("nvshmem transport cannot start: " + "; ".join(bad))
    require_same(
        "init:", [c for _, c in reports],
        rule="NVSHMEM_SYMMETRIC_SIZE / init(heap_size=...) must resolve to the same number of bytes on every rank",
    )
    assert ext is not None
    device = torch.device("cuda", torch.cuda.current_device())

    uid_or_error: list = [None]
    if rank == 0:
        try:
            uid_or_error[0] = ext.get_unique_id()
        except RuntimeError as exc:
            uid_or_error[0] = f"get_unique_id failed on rank 0: {exc}"
    dist.broadcast_object_list(uid_or_error, src=0)
    if isinstance(uid_or_error[0], str):
        raise OdcBackendError(f"nvshmem transport: {uid_or_error[0]}")
    _backend_call("init", ext.init, uid_or_error[0], rank, world, device.index)
    return NvshmemTransport(ext, rank, world, device, timeout, capacity)
