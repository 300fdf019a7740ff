"""GPU transport on NVSHMEM (through the compiled extension ``odc_runtime._C``).

Bootstrap (:func:`create`, collective): every rank validates its side and parses its settings
(:func:`odc_runtime.config.nvshmem_settings`), the ranks agree on all of them over ``torch.distributed``
(a mismatch raises on every rank, naming the setting and the values), several PEs on one GPU without CUDA MPS are
refused, rank 0's NVSHMEM unique id reaches every rank through the bounded store exchange (``ODC_TIMEOUT``), and
every rank initialises NVSHMEM as PE ``rank`` on its current CUDA device. Importing this module never needs a
GPU or the extension.

Memory: the whole symmetric heap is allocated once at init (``heap_size`` / ``NVSHMEM_SYMMETRIC_SIZE``, default
1 GiB, plus the control buffers: barrier epochs, ticket locks, the locked protocol's scratch) and sub-allocated in
Python by :class:`~odc_runtime.transport.heap.HeapAllocator` (every rank runs the same sequence, so offsets agree).
No NVSHMEM host call happens after init: no ``nvshmem_malloc``/``free``, no host or on-stream collective, which a
dead peer could block without a deadline. ``free`` never lets a later allocation alias a live view: a freed range
is quarantined until no tensor on any rank views it (checked collectively at the next ``alloc``). ``finalize``
releases the Python state only: NVSHMEM's teardown is a collective a dead peer would hang, NVSHMEM cannot be
initialised twice in a process anyway, and views that outlive ``finalize`` stay valid; the GPU memory is returned
when the process exits.

Barrier and failure: ``barrier`` is our own kernel (``csrc/odc_nvshmem.cu``: per-peer epoch counters in symmetric
memory, release/acquire, an abort word in host-mapped memory). It is stream-ordered and does not block the host;
a watchdog thread polls its CUDA event against ``ODC_TIMEOUT``. On timeout it raises the abort word (every
waiting kernel leaves within microseconds, the CUDA context stays usable), reads which peers had not arrived,
and records an :class:`~odc_runtime.errors.OdcTimeoutError` naming them and the operation; every later call into
the transport raises it. ``barrier`` keeps at most one barrier in flight: it first waits (short polling, same
deadline) for the previous one, so a sync that times out is reported by the next sync at the latest.

Signalled puts (``put_signal`` / ``wait_signal``, the hierarchical push across nodes): own kernels too (data copy
or network puts, then quiet + fence + signal add; the wait polls the local signal word and the abort word). A
wait is stream-ordered and held by the watchdog like a barrier: past its deadline the abort releases it and the
next call raises OdcTimeoutError naming the operation, the peers and the count reached. ``node_size`` is the
block of PEs reachable by peer pointer, checked at init to be consecutive blocks of one size on every rank.

fetch (``get``): peers with a peer pointer (``nvshmem_ptr``: same node) are read by the copy engines
(``cudaMemcpyAsync``; ``ODC_NVSHMEM_FETCH=kernel`` uses an SM copy kernel instead), others (across nodes) by a
device get into the symmetric scratch, copied out by the same kernel.

push (``accumulate``): one protocol for the whole job (see ``docs/design.md``): fused cast·scale·atomic-add
through peer pointers when every PE reaches every PE with load/store atomics; otherwise (multi-node, or
``ODC_NVSHMEM_PUSH=locked``) ticket lock + get + add + put per cell, one kernel for all owners, with one scratch
slot per SM by default.

Streams: everything is ordered on the current CUDA stream. Operations that use the scratch run on one internal
stream (so two never share a slot) that waits for the current stream and is joined back into it. ``async_op=True``
runs on a side stream that first waits for the current stream; ``Work.wait()`` makes the current stream wait for
it (no host block). ``quiet``/``barrier`` join both into the current stream first.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from types import ModuleType

import torch

from odc_runtime import _nvshmem_locate as _locate
from odc_runtime import config
from odc_runtime.agree import gather_checked, require_same
from odc_runtime.errors import (
    OdcBackendError,
    OdcError,
    OdcNotInitializedError,
    OdcTimeoutError,
    OdcUsageError,
)
from odc_runtime.transport.base import (
    AccumulateRequest,
    GetRequest,
    Group,
    Piece,
    PutRequest,
    SymmetricBuffer,
    TransferPlan,
    Transport,
    Work,
)
from odc_runtime.transport.heap import ALIGNMENT as HEAP_ALIGNMENT
from odc_runtime.transport.heap import HeapAllocator

__all__ = ["NvshmemTransport", "check_version", "create", "is_available", "load_extension"]

log = logging.getLogger("odc_runtime")

DEFAULT_HEAP = 1 << 30  # heap when neither heap_size nor NVSHMEM_SYMMETRIC_SIZE is given
NLOCKS = 1024  # ticket locks per PE (two uint32 words each) guarding the locked protocol's cells
ALIGN = 512  # NVSHMEM rounds every allocation to this; used to size NVSHMEM_SYMMETRIC_SIZE
SLACK = 2 << 20  # extra NVSHMEM_SYMMETRIC_SIZE beyond our own allocations
ABORT_GRACE_S = 5.0  # how long after raising the abort we wait for our kernels to leave
WATCHDOG_PERIOD_S = 2e-3  # deadlines are seconds; a slower poll takes the GIL from the training loop less often
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


def _backend_call(op: str, fn: Callable, *args: object) -> object:
    try:
        return fn(*args)
    except RuntimeError as exc:  # odc_runtime._C.NvshmemError, CUDA errors included
        raise OdcBackendError(f"nvshmem {op}: {exc}") from exc


def _dtype_codes(ext: ModuleType) -> dict[torch.dtype, int]:
    """torch dtype -> the extension's dtype code (exported by bindings.cpp, never duplicated here)."""
    return {torch.float32: ext.DTYPE_FLOAT32, torch.bfloat16: ext.DTYPE_BFLOAT16, torch.float16: ext.DTYPE_FLOAT16}


class _CudaArray:
    """Exposes raw device memory through ``__cuda_array_interface__`` (bytes) so torch can wrap it.

    torch keeps this object alive as long as any tensor views the memory (the storage's deleter holds it), so a
    weak reference to it tells whether views are alive.
    """

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
    offset: int  # in the heap arena (the same on every PE)
    ptr: int  # symmetric address
    views: weakref.ref  # to the _CudaArray behind `local`: dead once no tensor views the range


@dataclass
class _Pending:
    """A barrier, locked push or signal wait whose completion the watchdog checks against its deadline."""

    event: torch.cuda.Event
    deadline: float
    op: str
    epoch: int  # barrier number; 0 for a push or a signal wait
    wait: tuple[int, int, tuple[int, ...]] | None = None  # signal wait: (word index, awaited count, peers)


# -- the barrier / abort state machine -------------------------------------------------------------------
def missing_peers(heard: Sequence[int], epoch: int) -> list[int]:
    """Peers that had not announced barrier ``epoch`` when it gave up (``heard[q]`` = last epoch from q)."""
    return [q for q, e in enumerate(heard) if e < epoch]


def timeout_message(op: str, rank: int, timeout: float, epoch: int, missing: list[int], left: bool) -> str:
    """Text of the OdcTimeoutError raised when a barrier (``epoch`` > 0) or a locked push times out."""
    if epoch > 0:
        who = (
            f"rank(s) {', '.join(map(str, missing))} did not arrive at barrier #{epoch}"
            if missing
            else f"barrier #{epoch} did not complete (every peer had arrived; this GPU was still busy with work "
            "queued before it)"
        )
    else:
        who = "a push waited for a cell lock that was never released (the holder died or is stuck)"
    gpu = (
        "the GPU kernels left and the CUDA context is still usable (a checkpoint can be written)"
        if left
        else f"the GPU was still busy {ABORT_GRACE_S:g} s after the abort (user work queued on the stream)"
    )
    return (
        f"odc {op}: rank {rank} timed out after {timeout:g} s: {who}. A dead or stuck peer, or a peer that did not "
        f"call the same collective; raise ODC_TIMEOUT if it is merely slow. The nvshmem transport is aborted and "
        f"every later call raises this error; {gpu}. Exit the process and restart the job."
    )


def wait_timeout_message(
    op: str, rank: int, timeout: float, index: int, value: int, seen: int | None, peers: Sequence[int], left: bool
) -> str:
    """Text of the OdcTimeoutError raised when a signal wait (:meth:`NvshmemTransport.wait_signal`) times out;
    ``seen`` is the count the wait kernel last read (``None`` if it never ran: work queued before it)."""
    where = (
        f"signal word {index} reached {seen} of {value}"
        if seen is not None
        else f"the wait for signal word {index} to reach {value} never started (this GPU was still busy with work "
        "queued before it)"
    )
    who = ", ".join(map(str, peers)) or "none named"
    gpu = (
        "the wait was released and the CUDA context is still usable (a checkpoint can be written)"
        if left
        else f"the GPU was still busy {ABORT_GRACE_S:g} s after the abort (user work queued on the stream)"
    )
    return (
        f"odc {op}: rank {rank} timed out after {timeout:g} s waiting for signalled puts from rank(s) {who}: "
        f"{where}. A dead or stuck peer, or a peer that did not run the same step; raise ODC_TIMEOUT if it is "
        f"merely slow. The nvshmem transport is aborted and every later call raises this error; {gpu}. Exit the "
        "process and restart the job."
    )


def node_layout(reach: Sequence[Sequence[int]]) -> int | str:
    """The node size from every rank's peer-pointer reach (``reach[r]`` = the ranks rank ``r`` reaches by
    ``nvshmem_ptr``, itself included), or the text of the error :meth:`NvshmemTransport.node_size` raises when
    the reach is not consecutive blocks of one size (the hierarchy's ``r // n`` numbering would be wrong)."""
    world = len(reach)
    n = len(reach[0]) if world else 0
    bad = []
    for r, peers in enumerate(reach):
        first = (r // n) * n if n else 0
        if n == 0 or world % n or sorted(peers) != list(range(first, first + n)):
            bad.append(f"rank {r}: {sorted(peers)}")
    if not bad:
        return n
    return (
        "nvshmem node_size: the ranks reachable by peer pointer (NVLink / same host) are not consecutive blocks of "
        f"one size, so the node cannot be derived ({'; '.join(bad[:4])}{'; ...' if len(bad) > 4 else ''}). "
        "Number the ranks node by node, or declare the node size with ODC_NODE_SIZE (or odc.init(node_size=...))"
    )


class _Watchdog:
    """Checks pending barrier events against their deadlines from a daemon thread (the caller never blocks).

    State machine of one pending entry: PENDING --(event completes)--> DONE (dropped);
    PENDING --(deadline passes)--> ABORTED: abort word raised, wait up to ABORT_GRACE_S for the event (the
    kernels leave), record the error on the transport. Entries complete in stream order, so only the oldest is
    checked. Once ABORTED the transport stays failed (abort words are never lowered).
    """

    def __init__(self, transport: NvshmemTransport) -> None:
        self._transport = weakref.ref(transport)
        self._device = transport.device
        self._pending: deque[_Pending] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, entry: _Pending) -> None:
        with self._cond:
            self._pending.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="odc-nvshmem-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()

    def outstanding(self) -> list[_Pending]:
        with self._cond:
            return list(self._pending)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def poll(self) -> _Pending | None:
        """Drop completed entries; return the oldest one past its deadline, if any."""
        now = time.monotonic()
        with self._cond:
            while self._pending and self._pending[0].event.query():
                self._pending.popleft()
            if self._pending and now > self._pending[0].deadline:
                return self._pending[0]
        return None

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
                late = self.poll()
            except RuntimeError as exc:  # a CUDA error of queued work surfaces from the event
                transport._fail(OdcBackendError(f"nvshmem: CUDA error while waiting for a barrier: {exc}"))
                transport._engine.set_abort()  # type: ignore[attr-defined]
                return
            if late is not None:
                transport._abort(late)
                return
            del transport
            time.sleep(WATCHDOG_PERIOD_S)


class _CudaWork(Work):
    def __init__(self, transport: NvshmemTransport, event: torch.cuda.Event) -> None:
        self._transport = transport
        self._event = event

    def wait(self, timeout: float | None = None) -> None:
        # Stream-ordered: the caller's current stream waits; the host does not block.
        self._transport._raise_failure()
        torch.cuda.current_stream(self._transport.device).wait_event(self._event)

    def is_completed(self) -> bool:
        return self._event.query()


class _NvshmemPlan(TransferPlan):
    """Precomputed extension plans: ``near`` (peer pointers, current stream) and ``far`` (scratch users, the
    internal stream), with the stream handle they were made for."""

    __slots__ = ("_far", "_near", "_stream_ptr")

    def __init__(
        self,
        transport: NvshmemTransport,
        buf: SymmetricBuffer,
        kind: str,
        pieces: Sequence[Piece],
        stream_key: object,
        near: object | None,
        far: object | None,
        stream_ptr: int,
    ) -> None:
        super().__init__(transport, buf, kind, pieces, stream_key)
        self._near = near
        self._far = far
        self._stream_ptr = stream_ptr

    def run(self, tensor: torch.Tensor, scale: float = 1.0, *, async_op: bool = False) -> Work | None:
        # `tensor` is contiguous (the caller's plan key says so): its address and dtype are all the kernels need.
        transport: NvshmemTransport = self.transport  # type: ignore[assignment]
        if transport._failure is not None or transport._finalized:
            transport._raise_failure()
        code = transport._codes.get(tensor.dtype)
        if code is None:
            raise OdcUsageError(f"nvshmem {self.kind}: dtype {tensor.dtype} not supported (use fp32/bf16/fp16)")
        if async_op or self._far is not None:
            return transport._run_on_streams(
                self._near, self._far, tensor.data_ptr(), (tensor,), code, scale, async_op, self.kind
            )
        _backend_call(self.kind, self._near.run, tensor.data_ptr(), code, scale, self._stream_ptr)  # type: ignore[union-attr]
        return None


def _raw_stream(device_index: int) -> int:
    """The current CUDA stream of ``device_index`` as a ``cudaStream_t`` integer (cheap where torch allows)."""
    return torch.cuda.current_stream(device_index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # what torch's own generated code uses: no Stream object
    _raw_stream = torch._C._cuda_getCurrentRawStream  # type: ignore[assignment]


class NvshmemTransport(Transport):
    """NVSHMEM symmetric heap, own barrier with abort, fetch/push plans (see the module docstring)."""

    name = "nvshmem"

    def __init__(
        self,
        ext: ModuleType,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout: float,
        *,
        settings: config.NvshmemSettings,
        slots: int,
        capacity: int,
        arena: int,
        peer_bases: list[int],
        engine: object,
        atomic_push: bool,
        node: int | str,
    ) -> None:
        """``node``: the node size derived at init (:func:`node_layout`), or why it cannot be derived."""
        super().__init__(rank, world_size, device, timeout)
        self._C = ext
        self._codes = _dtype_codes(ext)
        self.settings = settings
        self.slots = slots
        self.atomic_push = atomic_push
        self._node_atomics = 0  # node size when the hierarchy keeps accumulates inside nodes (see use_nodes)
        self._allocator = HeapAllocator(capacity, limit_hint="odc.init(heap_size=...) or NVSHMEM_SYMMETRIC_SIZE")
        self._arena = arena
        self._peer_bases = peer_bases  # nvshmem_ptr(arena, pe) per PE; 0 = no peer pointer (other node)
        self._node = node
        self._engine = engine
        self._buffers: list[SymmetricBuffer] = []
        self._quarantine: list[tuple[int, weakref.ref, str]] = []  # freed while viewed: (offset, views, tag)
        self._finalized = False
        self._failure: OdcError | None = None
        self._abort_lock = threading.Lock()
        self._epoch = 0
        self._last_barrier: _Pending | None = None
        self._watchdog = _Watchdog(self)
        self._side = torch.cuda.Stream(device)
        self._remote = torch.cuda.Stream(device)
        self._side_event: torch.cuda.Event | None = None
        self._remote_event: torch.cuda.Event | None = None

    # -- failure ----------------------------------------------------------------------------------------
    def _raise_failure(self, op: str = "call") -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))
        if self._finalized:
            raise OdcNotInitializedError(f"nvshmem transport: {op} after finalize")

    def _fail(self, error: OdcError) -> None:
        if self._failure is None:
            log.error("%s", error)
            self._failure = error

    def _abort(self, entry: _Pending) -> None:
        """Deadline of ``entry`` passed: raise the abort word, let the kernels leave, record the error."""
        with self._abort_lock:
            if self._failure is not None:
                return
            self._engine.set_abort()  # type: ignore[attr-defined]
            left = False
            end = time.monotonic() + ABORT_GRACE_S
            while time.monotonic() < end:
                try:
                    if entry.event.query():
                        left = True
                        break
                except RuntimeError:
                    break
                time.sleep(1e-3)
            if entry.wait is not None:
                index, value, peers = entry.wait
                seen = self._engine.wait_seen() if self._engine.wait_gave_up() else None  # type: ignore[attr-defined]
                self._fail(
                    OdcTimeoutError(
                        wait_timeout_message(entry.op, self.rank, self.timeout, index, value, seen, peers, left)
                    )
                )
                return
            missing: list[int] = []
            if entry.epoch and self._engine.barrier_gave_up():  # type: ignore[attr-defined]
                missing = missing_peers(self._engine.heard(), entry.epoch)  # type: ignore[attr-defined]
            self._fail(OdcTimeoutError(timeout_message(entry.op, self.rank, self.timeout, entry.epoch, missing, left)))

    def _wait(self, entry: _Pending) -> None:
        """Host wait for ``entry`` with short polling (keeps the GPU fed), bounded by its deadline."""
        spins = 0
        while True:
            try:
                if entry.event.query():
                    return
            except RuntimeError as exc:  # a CUDA error of earlier work surfaces here
                self._fail(OdcBackendError(f"nvshmem {entry.op}: CUDA error: {exc}"))
            if self._failure is not None:
                self._raise_failure(entry.op)
            if time.monotonic() > entry.deadline:
                self._abort(entry)
                self._raise_failure(entry.op)
            spins += 1
            time.sleep(0 if spins < 200 else 50e-6)

    # -- helpers ----------------------------------------------------------------------------------------
    def _check(self, op: str) -> None:
        if self._failure is not None or self._finalized:
            self._raise_failure(op)

    def _stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def stream_key(self) -> object:
        return _raw_stream(self.device.index)

    def _join_into(self, stream: torch.cuda.Stream) -> None:
        for ev in (self._side_event, self._remote_event):
            if ev is not None:
                stream.wait_event(ev)

    def _check_local(self, what: str, t: object, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise OdcUsageError(f"nvshmem {what}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise OdcUsageError(f"nvshmem {what}: tensor on {t.device}, expected {self.device}")
        if not t.is_contiguous():
            raise OdcUsageError(f"nvshmem {what}: tensor must be contiguous")
        if t.dtype not in dtypes:
            raise OdcUsageError(f"nvshmem {what}: dtype {t.dtype} not allowed; use one of {tuple(dtypes)}")
        return t

    def _build(self, buf: SymmetricBuffer, kind: str, entries: Sequence[tuple[int, int, int, int]]) -> tuple:
        """Extension plans ``(near, far)`` for ``(peer, element offset in the local tensor, numel, element offset
        in the peer's region)`` entries. Everything is validated before any plan is made."""
        h: _Handle = buf.handle  # type: ignore[assignment]
        if buf.freed:
            raise OdcUsageError(f"nvshmem {kind}: buffer {buf.tag!r} was freed")
        if kind == "accumulate" and buf.dtype != torch.float32:
            raise OdcUsageError(f"nvshmem accumulate: accumulators must be float32, got {buf.dtype}")
        near: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        far: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        item = buf.dtype.itemsize
        nodes = self._node_atomics
        for peer, rel, numel, offset in entries:
            self._check_range(kind, buf, peer, offset, numel)
            if numel == 0:
                continue
            if kind == "accumulate" and nodes and peer // nodes != self.rank // nodes:
                raise OdcUsageError(
                    f"nvshmem push: rank {self.rank} pushes into rank {peer} on another node outside the hierarchical "
                    f"protocol (nodes of {nodes}); inside nodes pushes are NVLink atomics, which a "
                    "cross-node read-modify-write would race. Shard the tensor over all ranks or over a group "
                    "within one node, or set ODC_NODE_SIZE to the world size (the locked protocol for every push)"
                )
            direct = self._peer_bases[peer] != 0 and (kind == "get" or self.atomic_push or nodes > 0)
            lists = near if direct else far
            lists[0].append(self._remote_address(h, peer, direct, offset * item))
            lists[1].append(rel)
            lists[2].append(numel)
            lists[3].append(peer)
        C = self._C
        if kind == "get":
            near_kind = C.PLAN_FETCH_COPY if self.settings.fetch == "copy" else C.PLAN_FETCH_KERNEL
            far_kind = C.PLAN_FETCH_STAGED
        else:
            near_kind, far_kind = C.PLAN_PUSH_ATOMIC, C.PLAN_PUSH_LOCKED
        make = C.Plan
        return (
            _backend_call("plan", make, self._engine, near_kind, *near) if near[0] else None,
            _backend_call("plan", make, self._engine, far_kind, *far) if far[0] else None,
        )

    def _remote_address(self, h: _Handle, peer: int, direct: bool, byte_offset: int) -> int:
        """Where ``byte_offset`` of ``peer``'s region of a buffer lies: through the peer pointer (``direct``), else
        the symmetric address (the same on every PE), which NVSHMEM's network operations take."""
        return (self._peer_bases[peer] + h.offset if direct else h.ptr) + byte_offset

    def _check_range(self, op: str, buf: SymmetricBuffer, peer: int, offset: int, numel: int) -> None:
        """``peer`` exists and ``[offset, offset + numel)`` lies inside ``buf`` (elements)."""
        if not 0 <= peer < self.world_size:
            raise OdcUsageError(f"nvshmem {op}: peer {peer} out of range [0, {self.world_size})")
        if offset < 0 or offset + numel > buf.numel:
            raise OdcUsageError(
                f"nvshmem {op}: elements [{offset}, {offset + numel}) of buffer {buf.tag!r} are out of its range "
                f"[0, {buf.numel}) (offset {offset}, {numel} elements)"
            )

    def _run_on_streams(
        self,
        near: object | None,
        far: object | None,
        base: int,
        tensors: Sequence[torch.Tensor],
        code: int,
        scale: float,
        async_op: bool,
        kind: str,
    ) -> Work | None:
        cur = self._stream()
        target = cur
        if async_op:
            target = self._side
            target.wait_stream(cur)
            for t in tensors:  # allocated on the caller's stream, used on the side stream
                _record(t, target)
        if near is not None:
            _backend_call(kind, near.run, base, code, scale, target.cuda_stream)  # type: ignore[attr-defined]
        if far is not None:
            # Scratch users run on the internal stream only, so no two kernels ever share a scratch slot.
            remote = self._remote
            remote.wait_stream(target)
            for t in tensors:
                _record(t, remote)
            _backend_call(kind, far.run, base, code, scale, remote.cuda_stream)  # type: ignore[attr-defined]
            ev = torch.cuda.Event()
            ev.record(remote)
            self._remote_event = ev
            target.wait_event(ev)
            if kind == "accumulate":  # lock spins wait for other PEs: give them a deadline too
                self._watchdog.add(_Pending(ev, time.monotonic() + self.timeout, "push", 0))
        if not async_op:
            return None
        ev = torch.cuda.Event()
        ev.record(target)
        self._side_event = ev
        return _CudaWork(self, ev)

    # -- memory -------------------------------------------------------------------------------------------
    def heap_capacity(self) -> int:
        return self._allocator.capacity

    def heap_used(self) -> int:
        return self._allocator.used

    def _release_quarantine(self) -> None:
        """Return freed ranges that no rank views any more to the allocator (collective; same list everywhere,
        because ``free`` is collective, so every rank takes the same decision and offsets stay symmetric)."""
        if not self._quarantine:
            return
        alive = [views() is not None for _, views, _ in self._quarantine]
        everyone = gather_checked("alloc (freed buffers)", lambda: alive)
        keep = []
        for i, entry in enumerate(self._quarantine):
            if any(flags[i] for flags in everyone):
                keep.append(entry)
            else:
                self._allocator.free(entry[0])
        self._quarantine = keep

    def alloc(self, numel: int, dtype: torch.dtype, tag: str = "") -> SymmetricBuffer:
        self._check(f"alloc({tag})")
        if numel < 0:
            raise OdcUsageError(f"nvshmem alloc({tag!r}): negative numel {numel}")
        self._release_quarantine()
        nbytes = max(1, numel * dtype.itemsize)
        try:
            offset = self._allocator.alloc(nbytes, what=repr(tag or "buffer"))
        except OdcError as exc:
            if self._quarantine:
                held = ", ".join(repr(t) for _, _, t in self._quarantine)
                raise type(exc)(
                    f"{exc}. Freed buffers still viewed by live tensors keep their memory: {held}; drop the "
                    "references (e.g. to st.local / st.grad) before freeing"
                ) from None
            raise
        rounded = -(-nbytes // HEAP_ALIGNMENT) * HEAP_ALIGNMENT  # what the allocator reserved
        raw, owner = _wrap(self._arena + offset, rounded, self.device)
        local = raw.view(dtype)[:numel]
        local.zero_()
        buf = SymmetricBuffer(
            numel=numel, dtype=dtype, local=local, handle=_Handle(offset, self._arena + offset, weakref.ref(owner)),
            tag=tag,
        )
        del owner, raw  # only the tensors view it now; the weak reference tells when the last one died
        self._buffers.append(buf)
        # Stream-ordered: a peer pushes into this range only after its own barrier, which needs our arrival,
        # which follows our zeroing on our stream.
        self.barrier(f"alloc({tag})")
        return buf

    def free(self, buf: SymmetricBuffer) -> None:
        if buf.freed:
            return
        self._check(f"free({buf.tag})")
        # Nobody still reads or pushes into it once this barrier completes (stream order covers reuse: the next
        # allocation zeroes the range on the stream after it).
        self.barrier(f"free({buf.tag})")
        h: _Handle = buf.handle  # type: ignore[assignment]
        buf.freed = True
        buf.local = torch.empty(0, dtype=buf.dtype, device=self.device)
        self._buffers = [b for b in self._buffers if b is not buf]
        # Never reused while any rank still views it (see _release_quarantine): no silent aliasing.
        self._quarantine.append((h.offset, h.views, buf.tag))

    # -- one-sided operations ---------------------------------------------------------------------------
    def plan(self, buf: SymmetricBuffer, kind: str, pieces: Sequence[Piece]) -> TransferPlan:
        self._check(kind)
        stream_ptr = self.stream_key()
        near, far = self._build(buf, kind, [(p.peer, p.start, p.numel, p.offset) for p in pieces])
        return _NvshmemPlan(self, buf, kind, pieces, stream_ptr, near, far, stream_ptr)  # type: ignore[arg-type]

    def get(self, buf: SymmetricBuffer, requests: Sequence[GetRequest], *, async_op: bool = False) -> Work | None:
        self._check("get")
        item = buf.dtype.itemsize
        entries = []
        for r in requests:  # validate everything before issuing anything
            self._check_local("get(dst)", r.dst, (buf.dtype,))
            # base 0 + element offset: a tensor's address is a multiple of its element size
            entries.append((r.peer, r.dst.data_ptr() // item, r.dst.numel(), r.offset))
        code = self._codes.get(buf.dtype)
        if code is None:
            raise OdcUsageError(f"nvshmem get: dtype {buf.dtype} not supported (use fp32/bf16/fp16)")
        near, far = self._build(buf, "get", entries)
        return self._run_on_streams(near, far, 0, [r.dst for r in requests], code, 1.0, async_op, "get")

    def accumulate(
        self, buf: SymmetricBuffer, requests: Sequence[AccumulateRequest], scale: float, *, async_op: bool = False
    ) -> Work | None:
        self._check("accumulate")
        groups: dict[torch.dtype, list[tuple[int, int, int]]] = {}
        for r in requests:
            self._check_local("accumulate(src)", r.src, tuple(self._codes))
            groups.setdefault(r.src.dtype, []).append(
                (r.peer, r.src.data_ptr() // r.src.itemsize, r.src.numel(), r.offset)
            )
        # every group is built (and validated) before any runs: a bad request issues nothing
        built = [(self._codes[dtype], self._build(buf, "accumulate", entries)) for dtype, entries in groups.items()]
        srcs = [r.src for r in requests]
        work: Work | None = None
        for code, (near, far) in built:
            work = self._run_on_streams(near, far, 0, srcs, code, float(scale), async_op, "accumulate")
        return work  # all groups ran on the same side stream in order: the last handle covers them all

    # -- signalled puts (hierarchical push across nodes) ----------------------------------------------------
    def _check_signal(self, op: str, signal: SymmetricBuffer, index: int) -> int:
        """Validate ``signal[index]`` and return the word's symmetric address."""
        if not isinstance(signal, SymmetricBuffer) or signal.freed:
            raise OdcUsageError(f"nvshmem {op}: the signal buffer must be a live buffer from alloc()")
        if signal.dtype != torch.int64:
            raise OdcUsageError(f"nvshmem {op}: the signal buffer must be int64, got {signal.dtype}")
        if not 0 <= index < signal.numel:
            raise OdcUsageError(f"nvshmem {op}: signal index {index} out of range [0, {signal.numel})")
        return signal.handle.ptr + index * 8  # type: ignore[attr-defined]

    def put_signal(self, buf: SymmetricBuffer, requests: Sequence[PutRequest], signal: SymmetricBuffer) -> None:
        """Stream-ordered signalled puts (``csrc/odc_nvshmem.cu``, ``signal_kernel``, has the ordering argument).

        Peers with a peer pointer (same node) are written by an SM copy, the others by network puts, which read
        the source directly: for those, ``src`` must lie inside the symmetric heap (a view of a buffer from
        :meth:`alloc`), since the network can only read registered memory. Nothing is issued unless every
        request is valid. The host does not wait."""
        self._check("put_signal")
        if buf.freed:
            raise OdcUsageError(f"nvshmem put_signal: buffer {buf.tag!r} was freed")
        h: _Handle = buf.handle  # type: ignore[assignment]
        item = buf.dtype.itemsize
        heap_end = self._arena + self._allocator.capacity
        remote: list[int] = []
        local: list[int] = []
        nbytes: list[int] = []
        pes: list[int] = []
        near: list[bool] = []
        sigs: list[int] = []
        for r in requests:  # validate everything before issuing anything
            src = self._check_local("put_signal(src)", r.src, (buf.dtype,))
            n = src.numel()
            self._check_range("put_signal", buf, r.peer, r.offset, n)
            sigs.append(self._check_signal("put_signal", signal, r.signal_index))
            direct = self._peer_bases[r.peer] != 0
            if not direct and n and not (self._arena <= src.data_ptr() and src.data_ptr() + n * item <= heap_end):
                raise OdcUsageError(
                    f"nvshmem put_signal: the source for rank {r.peer} (another node) is not inside the symmetric "
                    "heap; the network reads registered memory only: put from a view of a buffer from alloc()"
                )
            remote.append(self._remote_address(h, r.peer, direct, r.offset * item))
            local.append(src.data_ptr())
            nbytes.append(n * item)
            pes.append(r.peer)
            near.append(direct)
        if not remote:
            return
        stream = self._stream()
        self._join_into(stream)  # after this rank's asynchronous operations, like quiet
        _backend_call(
            "put_signal", self._engine.put_signal, remote, local, nbytes, pes, near, sigs,  # type: ignore[attr-defined]
            stream.cuda_stream,
        )

    def wait_signal(self, signal: SymmetricBuffer, index: int, value: int, op: str, peers: Sequence[int]) -> None:
        """The current stream waits until ``signal[index] >= value`` (acquire); the host does not block.

        The watchdog holds the wait's event against ``timeout``: past it, the abort word releases the wait
        kernel (and every other waiting kernel of this engine), and the next call into the transport raises
        :class:`~odc_runtime.errors.OdcTimeoutError` naming ``op``, ``peers`` and the count that was reached."""
        self._check(op)
        addr = self._check_signal(op, signal, index)
        if value < 0:
            raise OdcUsageError(f"nvshmem {op}: awaited count {value} is negative")
        stream = self._stream()
        _backend_call(op, self._engine.wait_signal, addr, int(value), stream.cuda_stream)  # type: ignore[attr-defined]
        ev = torch.cuda.Event()
        ev.record(stream)
        entry = _Pending(ev, time.monotonic() + self.timeout, op, 0, wait=(index, int(value), tuple(peers)))
        self._watchdog.add(entry)

    def use_nodes(self, node_size: int) -> None:
        """The hierarchy is on: every accumulate of a world-sharded tensor stays inside a node. In a multi-node
        job (no job-wide load/store atomics, so the locked protocol everywhere) that makes NVLink atomics safe for
        intra-node pushes, provided no push crosses a node any more: such pushes are refused from now on (mixing
        atomics with a remote get…add…put on the same words would lose updates; docs/design.md). A forced
        ``ODC_NVSHMEM_PUSH=locked`` keeps the locked protocol; a job with job-wide atomics changes nothing."""
        if self.atomic_push or self.settings.push == "locked":
            return
        first = self.rank // node_size * node_size
        unreachable = [p for p in range(first, first + node_size) if self._peer_bases[p] == 0]
        if unreachable:
            raise OdcUsageError(
                f"nvshmem: node size {node_size} puts rank(s) {unreachable} on rank {self.rank}'s node, but they "
                "have no peer pointer (no NVLink / load-store path); set ODC_NODE_SIZE to the GPUs that share "
                "a node"
            )
        self._node_atomics = node_size

    def node_size(self) -> int:
        """The PEs that reach each other by peer pointer (one NVLink domain / host), derived and checked at init:
        consecutive blocks of one size on every rank, else :class:`~odc_runtime.errors.OdcUsageError` asking for
        ``ODC_NODE_SIZE``."""
        if isinstance(self._node, str):
            raise OdcUsageError(self._node)
        return self._node

    def quiet(self) -> None:
        self._check("quiet")
        stream = self._stream()
        self._join_into(stream)
        _backend_call("quiet", self._engine.quiet, stream.cuda_stream)  # type: ignore[attr-defined]

    def barrier(self, op: str = "barrier") -> None:
        """Stream-ordered own barrier (see ``csrc/odc_nvshmem.cu``); the host waits only for the previous one."""
        self._check(op)
        if self._last_barrier is not None:
            self._wait(self._last_barrier)
        stream = self._stream()
        self._join_into(stream)
        self._epoch += 1
        _backend_call(op, self._engine.barrier, self._epoch, stream.cuda_stream)  # type: ignore[attr-defined]
        ev = torch.cuda.Event()
        ev.record(stream)
        entry = _Pending(ev, time.monotonic() + self.timeout, op, self._epoch)
        self._last_barrier = entry
        self._watchdog.add(entry)

    def group_barrier(self, op: str, group: Group) -> None:
        """Not supported yet: raises OdcUsageError (groups still work for ``shard``/``fetch``/``push``).

        The barrier kernel (``csrc/odc_nvshmem.cu``) keeps one epoch counter per peer for the whole world; a fence
        among a subset needs per-group counters in symmetric memory and a kernel that waits on the members only,
        which has not been built and run on a GPU. Falling back to the world barrier would be correct only when
        every group fences at the same point, and would otherwise hang until ``ODC_TIMEOUT``, so it is refused.
        """
        raise OdcUsageError(
            f"nvshmem {op}: group-scoped sync is not supported by the nvshmem transport yet; call odc_runtime.sync() "
            "without a group (every rank fences; in HSDP every shard group syncs at the end of the minibatch anyway)"
        )

    def finalize(self) -> None:
        """Wait (bounded) for outstanding barriers, then drop all state. Raises their timeout, if any.

        NVSHMEM itself is not torn down (its teardown is a collective that a dead peer would hang, and it cannot
        be initialised again in this process); views of symmetric memory stay valid until the process exits.
        """
        global _initialized_once
        if self._finalized:
            return
        error: OdcError | None = None
        try:
            if self._failure is None:
                for entry in self._watchdog.outstanding():
                    self._wait(entry)
        except OdcError as exc:
            error = exc
        finally:
            self._finalized = True
            _initialized_once = True
            self._watchdog.stop()
            for buf in self._buffers:
                buf.freed = True
            self._buffers = []
            self._quarantine = []
        if error is not None:
            raise error


_initialized_once = False
_engines: list[object] = []  # live for the process: NVSHMEM is never torn down (see finalize)


@atexit.register
def _abort_at_exit() -> None:
    """At interpreter exit nothing will wait for our kernels any more: raise every abort word, so that a barrier or
    lock spin still waiting for a dead peer leaves and the CUDA teardown does not wait for it. Our announcements
    were made before waiting, so peers are not affected."""
    for engine in _engines:
        engine.set_abort()  # type: ignore[attr-defined]


def _wrap(ptr: int, nbytes: int, device: torch.device) -> tuple[torch.Tensor, _CudaArray]:
    """A uint8 tensor over ``nbytes`` of device memory at ``ptr``, and the object torch keeps alive for it."""
    owner = _CudaArray(ptr, nbytes)
    return torch.as_tensor(owner, device=device), owner


def _record(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator that ``t`` is used on ``stream`` (not reused before that work is done)."""
    t.record_stream(stream)


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _zero(ptr: int, nbytes: int, device: torch.device) -> None:
    _wrap(ptr, nbytes, device)[0].zero_()


def local_settings(heap_size: int | str | None) -> tuple[config.NvshmemSettings, int]:
    """This rank's protocol settings and heap bytes (``heap_size``, else ``NVSHMEM_SYMMETRIC_SIZE``, else 1 GiB)."""
    settings = config.nvshmem_settings()
    if heap_size is not None:
        capacity = config.parse_size(heap_size, what="heap_size")
    elif os.environ.get("NVSHMEM_SYMMETRIC_SIZE"):
        capacity = config.parse_size(os.environ["NVSHMEM_SYMMETRIC_SIZE"], what="NVSHMEM_SYMMETRIC_SIZE")
    else:
        capacity = DEFAULT_HEAP
    return settings, capacity


def agree_settings(infos: Sequence[tuple[config.NvshmemSettings, int, int]]) -> tuple[config.NvshmemSettings, int, int]:
    """From every rank's ``(settings, heap bytes, SM count)`` (indexed by rank, the same list on every rank):
    raise :class:`~odc_runtime.errors.OdcMismatchError` naming the first setting that differs and every rank's
    value, else return ``(settings, heap bytes, scratch slots)``. Mixed push protocols would lose updates and the
    scratch and heap are symmetric allocations, so nothing here may differ; the default slot count is one per SM
    of the largest GPU."""
    for f in fields(config.NvshmemSettings):
        require_same(
            "init:", [getattr(info[0], f.name) for info in infos],
            rule=f"setting {f.name} ({_SETTING_ENV[f.name]}) must resolve to the same value on every rank",
        )
    require_same(
        "init:", [info[1] for info in infos],
        rule="the heap size (init(heap_size=...) / NVSHMEM_SYMMETRIC_SIZE) must resolve to the same bytes everywhere",
    )
    settings, capacity = infos[0][0], infos[0][1]
    return settings, capacity, settings.scratch_slots or max(info[2] for info in infos)


def check_gpu_sharing(sharing: dict[tuple[str, str], list[int]], mps: dict[int, int]) -> None:
    """Refuse several PEs on one GPU without CUDA MPS (``sharing``: (host, GPU uuid) -> ranks; ``mps[r]``: 1
    on, 0 off, -1 unknown). Every rank sees the same data, so every rank raises together, before NVSHMEM starts.

    Without MPS the contexts of the PEs time-slice the GPU: a PE's waiting kernel (barrier, lock, signal wait)
    holds its time slice while the PE it waits for cannot run, so every wait costs scheduler slices and progress
    rests on the driver's time-slicing policy. When the runtime cannot tell (``-1``, an old driver), the job is
    allowed with a warning."""
    for (host, uuid), ranks in sorted(sharing.items()):
        if len(ranks) < 2:
            continue
        states = {mps[r] for r in ranks}
        if 0 in states:
            raise OdcUsageError(
                f"nvshmem transport: ranks {ranks} share GPU {uuid} on {host} without CUDA MPS; several NVSHMEM PEs "
                "on one GPU need MPS (their waiting kernels would otherwise time-slice the GPU). Start the MPS "
                "daemon before the job (`nvidia-cuda-mps-control -d`; stop it with `echo quit | "
                "nvidia-cuda-mps-control`), or give every rank its own GPU"
            )
        if states != {1}:
            log.warning(
                "odc nvshmem: ranks %s share GPU %s on %s and this CUDA runtime cannot tell whether MPS is on; "
                "without MPS (nvidia-cuda-mps-control -d) their kernels time-slice (slow).", ranks, uuid, host,
            )


def create(*, timeout: float, heap_size: int | str | None = None) -> NvshmemTransport:
    """Initialise NVSHMEM on every rank of the default ``torch.distributed`` group; collective.

    Every rank validates its side and parses its settings first; the ranks agree on all of them before anyone
    enters NVSHMEM's bootstrap, which has no timeout. NVSHMEM's init and the init-time allocations (control
    buffers and the heap arena, each a collective ending in a barrier) are the only NVSHMEM collectives of the
    job; a rank that dies inside them hangs the others (torch.distributed's own timeout applies to the steps
    before).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise OdcNotInitializedError("nvshmem transport: call torch.distributed.init_process_group first")
    rank, world = dist.get_rank(), dist.get_world_size()
    ext_box: list[ModuleType] = []

    def local_checks() -> tuple[dict, int, int, str, str, int]:
        if _initialized_once:
            raise OdcBackendError(
                "nvshmem transport: NVSHMEM cannot be initialised twice in one process; start a new process"
            )
        if not torch.cuda.is_available():
            raise OdcBackendError("nvshmem transport: no CUDA device is available (use backend='host')")
        ext = load_extension()
        check_version(ext)  # before NVSHMEM is touched: a mismatch fails on every rank, not inside init
        ext_box.append(ext)
        settings, capacity = local_settings(heap_size)
        try:
            index = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            mps = int(ext.mps_enabled(index))
        except RuntimeError as exc:
            raise OdcBackendError(f"nvshmem transport: cannot query the current CUDA device: {exc}") from exc
        uuid = str(getattr(props, "uuid", index))  # older torch: no uuid, the index then stands for the GPU
        # The exchange carries JSON: the settings travel as a dict and are rebuilt below.
        return asdict(settings), capacity, props.multi_processor_count, socket.gethostname(), uuid, mps

    infos = [
        (config.NvshmemSettings(**info[0]), *info[1:])
        for info in gather_checked("init (nvshmem)", local_checks, timeout=timeout)
    ]
    settings, capacity, slots = agree_settings([info[:3] for info in infos])
    sharing: dict[tuple[str, str], list[int]] = {}
    for r, info in enumerate(infos):
        sharing.setdefault((info[3], info[4]), []).append(r)
    check_gpu_sharing(sharing, {r: info[5] for r, info in enumerate(infos)})
    ext = ext_box[0]
    device = torch.device("cuda", torch.cuda.current_device())
    epochs_bytes, locks_bytes, scratch_bytes = world * 8, 2 * NLOCKS * 4, slots * settings.cell_bytes
    # NVSHMEM's heap must hold our control buffers and the arena (its internal buffers come on top of it).
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(
        _round(epochs_bytes) + _round(locks_bytes) + _round(scratch_bytes) + _round(capacity) + SLACK
    )

    # Rank 0's unique id reaches every rank through the bounded store exchange (ODC_TIMEOUT, a dead rank named);
    # a failure on rank 0 raises on every rank.
    def unique_id() -> str | None:
        return bytes(_backend_call("get_unique_id", ext.get_unique_id)).hex() if rank == 0 else None  # type: ignore[arg-type]

    uid = bytes.fromhex(gather_checked("init (nvshmem unique id)", unique_id, timeout=timeout)[0])  # type: ignore[arg-type]
    _backend_call("init", ext.init, uid, rank, world, device.index)
    global _initialized_once
    _initialized_once = True

    # Each nvshmem_malloc ends in a barrier: the zeroing of one buffer is complete on every PE before any PE
    # returns from the next malloc, so no PE announces a barrier epoch or takes a ticket into unzeroed words.
    epochs = int(_backend_call("malloc", ext.malloc, epochs_bytes))  # type: ignore[call-overload]
    _zero(epochs, epochs_bytes, device)
    locks = int(_backend_call("malloc", ext.malloc, locks_bytes))  # type: ignore[call-overload]
    _zero(locks, locks_bytes, device)
    torch.cuda.synchronize(device)
    scratch = int(_backend_call("malloc", ext.malloc, scratch_bytes))  # type: ignore[call-overload]
    arena = int(_backend_call("malloc", ext.malloc, capacity))  # type: ignore[call-overload]
    peer_bases = [int(_backend_call("ptr", ext.ptr, arena, pe)) for pe in range(world)]  # type: ignore[call-overload]
    # One push protocol for the whole job, never a mix (see docs/design.md): atomics through peer pointers only
    # when NVSHMEM found that every PE reaches every PE with load/store atomics; otherwise the locked protocol.
    atomic = settings.push == "auto" and bool(_backend_call("p2p_atomics", ext.p2p_atomics)) and all(peer_bases)
    reach = [q for q, base in enumerate(peer_bases) if base]
    layout = gather_checked("init (push protocol, node layout)", lambda: (atomic, reach))
    require_same(
        "init:", [a for a, _ in layout],
        rule="push protocol (atomic through peer pointers vs locked) must be the same on every rank",
    )
    node = node_layout([r for _, r in layout])  # the same on every rank: computed from the same exchanged lists
    engine = _backend_call(
        "init", ext.Engine, rank, world, epochs, locks, NLOCKS, scratch, slots, settings.cell_bytes,
        settings.vector_atomics,
    )
    _engines.append(engine)
    transport = NvshmemTransport(
        ext, rank, world, device, timeout, settings=settings, slots=slots, capacity=capacity, arena=arena,
        peer_bases=peer_bases, engine=engine, atomic_push=atomic, node=node,
    )
    log.info(
        "odc nvshmem transport: rank %d/%d on %s, heap %d MiB, push=%s, fetch=%s, scratch %d x %d KiB, node=%s",
        rank, world, device, capacity >> 20, "atomic" if atomic else "locked", settings.fetch, slots,
        settings.cell_bytes >> 10, node if isinstance(node, int) else "not derivable (set ODC_NODE_SIZE)",
    )
    return transport


_SETTING_ENV = {
    "push": "ODC_NVSHMEM_PUSH",
    "fetch": "ODC_NVSHMEM_FETCH",
    "cell_bytes": "ODC_NVSHMEM_CELL_BYTES",
    "scratch_slots": "ODC_NVSHMEM_SCRATCH_SLOTS",
    "vector_atomics": "ODC_NVSHMEM_VECTOR_ATOMICS",
}
