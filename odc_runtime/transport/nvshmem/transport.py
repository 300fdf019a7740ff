"""The nvshmem transport: the ``Transport`` contract on NVSHMEM.

It owns one helper per concern: ``SymmetricHeap`` (arena, views, free quarantine),
``PlanBuilder`` and ``Streams`` (extension plans and the streams they run on),
``Watchdog`` (deadlines, abort, failure state) and the extension's ``Engine`` (barrier, quiet,
signalled puts, the deadline thread). Bootstrap is ``create``.

Memory: the whole symmetric heap is allocated once at init and sub-allocated in Python. No NVSHMEM host call
happens after init: no ``nvshmem_malloc``/``free``, no host or on-stream collective, which a dead peer could block
without a deadline. ``finalize`` releases the Python state only: NVSHMEM's teardown is a collective a dead peer
would hang, NVSHMEM cannot be initialised twice in a process anyway, and views that outlive ``finalize`` stay
valid; the GPU memory is returned when the process exits.

Barrier and failure: ``barrier`` is our own kernel (``csrc/barrier.cu``). It is stream-ordered and does not block
the host; the engine's deadline thread and the watchdog hold its event against ``ODC_TIMEOUT``. On timeout the
abort word is raised (every waiting kernel leaves within microseconds, the CUDA context stays usable), and an
``OdcTimeoutError`` naming the operation and the peers is recorded in ``failure``; every
later call into the transport raises it. ``barrier`` keeps at most one barrier in flight: it first waits (short
polling, same deadline) for the previous one, so a sync that times out is reported by the next sync at the latest.

Signalled puts (``put_signal`` / ``wait_signal``, the hierarchical push across nodes): own kernels too
(``csrc/signal.cu``); a wait is stream-ordered and watched like a barrier. ``node_size`` is the block of PEs
reachable by peer pointer, checked at init to be consecutive blocks of one size on every rank.

fetch (``get``): peers with a peer pointer (``nvshmem_ptr``: same node) are read by the copy engines
(``cudaMemcpyAsync``; ``ODC_NVSHMEM_FETCH=kernel`` uses an SM copy kernel instead), others (across nodes) by a
device get into the symmetric scratch, copied out by the same kernel.

push (``accumulate``): one protocol for the whole job (see ``docs/design.md``): fused cast·scale·atomic-add
through peer pointers when every PE reaches every PE with load/store atomics; otherwise (multi-node, or
``ODC_NVSHMEM_PUSH=locked``) ticket lock + get + add + put per cell, cells and locks derived from symmetric
offsets, one kernel for all owners, with one scratch slot per SM by default.

Streams: everything is ordered on the current CUDA stream. Operations that use the scratch run on one internal
stream that waits for the current stream and is joined back into it. ``async_op=True`` runs on a side stream that
first waits for the current stream; ``Work.wait()`` makes the current stream wait for it (no host block).
``quiet``/``barrier`` join both into the current stream first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

import torch

from odc_runtime import config
from odc_runtime.errors import OdcBackendError, OdcError, OdcNotInitializedError, OdcUsageError
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
)
from odc_runtime.transport.nvshmem import extension, plans
from odc_runtime.transport.nvshmem.memory import HeapBlock, SymmetricHeap
from odc_runtime.transport.nvshmem.watchdog import Pending, Watchdog


class NvshmemTransport(Transport):
    """NVSHMEM symmetric heap, own barrier with abort, fetch/push plans (see the module docstring)."""

    name = "nvshmem"
    device_type = "cuda"
    # Group fences need per-group counters in the barrier kernel (not built; group_barrier refuses). Nodes: the
    # PEs that reach each other by peer pointer can be fewer than the world (a multi-node job).
    # Deterministic: int64 pushes into an int64 accumulator are exact integer adds on both push paths (csrc/peer.cu's
    # 64-bit atomics, csrc/cells.cu's locked cells).
    capabilities = Capabilities(signals=True, group_fences=False, nodes=True, deterministic=True)

    def __init__(
        self,
        ext: ModuleType,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout: float,
        *,
        settings: config.NvshmemSettings,
        scratch_slots: int,
        capacity: int,
        arena: int,
        peer_bases: list[int],
        engine: object,
        atomic_push: bool,
        node: int | str,
    ) -> None:
        """``node``: the node size derived at init (``node_layout``), or why it cannot be derived."""
        super().__init__(rank, world_size, device, timeout)
        self._C = ext
        self._codes = extension.dtype_codes(ext)
        self.settings = settings
        self.scratch_slots = scratch_slots
        self._healthy = True  # failure is None and not finalized (one flag for the hot path)
        self._device_index = device.index
        self._engine = engine
        self._node = node
        self._finalized = False
        self._epoch = 0
        self._last_barrier: Pending | None = None
        self._heap = SymmetricHeap(arena, capacity, device)
        self._plans = plans.PlanBuilder(self, ext, settings, peer_bases, atomic_push)
        self._watchdog = Watchdog(self)
        self._streams = plans.Streams(self)

    @property
    def atomic_push(self) -> bool:
        return self._plans.atomic_push

    # -- failure ----------------------------------------------------------------------------------------
    def fail(self, error: OdcError) -> OdcError:
        self._healthy = False  # the plans' fast path reads this one flag instead of failure and _finalized
        return super().fail(error)

    def _raise_failure(self, op: str = "call") -> None:
        if self.failure is not None:
            self.failure_raised()
            raise type(self.failure)(str(self.failure))
        if self._finalized:
            raise OdcNotInitializedError(f"nvshmem transport: {op} after finalize")

    def _launch_failed(self, op: str, exc: RuntimeError) -> NoReturn:
        """A launch raised. If the abort word is up (the engine's deadline thread raised it: the extension refuses
        launches from then on), the error is the timeout of the late operation, not this refusal."""
        if self._engine.aborted():  # type: ignore[attr-defined]
            self._watchdog.settle(self)
        if self.failure is not None:
            self.failure_raised()
            raise type(self.failure)(str(self.failure)) from exc
        raise OdcBackendError(f"nvshmem {op}: {exc}") from exc

    def _launch(self, op: str, fn: object, *args: object) -> object:
        """An engine launch (barrier, quiet, signalled put, signal wait): its refusal goes through
        ``_launch_failed``, so after the deadline thread's abort the caller gets the late operation's timeout
        (the signal word and the peer, or the barrier and the missing ranks), not a generic backend error."""
        try:
            return fn(*args)  # type: ignore[operator]
        except RuntimeError as exc:
            self._launch_failed(op, exc)

    def _check(self, op: str) -> None:
        if self.failure is not None or self._finalized:
            self._raise_failure(op)

    def _watch(self, op: str, stream: torch.cuda.Stream, epoch: int = 0, **extra: object) -> Pending:
        ev = torch.cuda.Event()
        ev.record(stream)
        entry = Pending(ev, time.monotonic() + self.timeout, op, epoch, **extra)  # type: ignore[arg-type]
        self._watchdog.add(entry, stream.cuda_stream)
        return entry

    # -- helpers ----------------------------------------------------------------------------------------
    def _stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def stream_key(self) -> object:
        return plans.raw_stream(self._device_index)

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

    # -- memory -------------------------------------------------------------------------------------------
    def heap_capacity(self) -> int:
        return self._heap.capacity

    def heap_used(self) -> int:
        return self._heap.used

    def alloc(self, numel: int, dtype: torch.dtype, tag: str = "") -> SymmetricBuffer:
        self._check(f"alloc({tag})")
        if numel < 0:
            raise OdcUsageError(f"nvshmem alloc({tag!r}): negative numel {numel}")
        buf = self._heap.allocate(numel, dtype, tag)
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
        self._heap.release(buf)

    # -- one-sided operations ---------------------------------------------------------------------------
    def plan(self, buf: SymmetricBuffer, kind: str, pieces: Sequence[Piece]) -> TransferPlan:
        self._check(kind)
        stream_ptr = self.stream_key()
        near, far = self._plans.build(buf, kind, [(p.peer, p.start, p.numel, p.offset) for p in pieces])
        return plans.NvshmemPlan(self, buf, kind, pieces, stream_ptr, near, far)

    def fetch(self, buf: SymmetricBuffer, requests: Sequence[FetchRequest], *, async_op: bool = False) -> Work | None:
        self._check("fetch")
        item = buf.dtype.itemsize
        entries = []
        for r in requests:  # validate everything before issuing anything
            self._check_local("fetch(dst)", r.dst, (buf.dtype,))
            # base 0 + element offset: a tensor's address is a multiple of its element size
            entries.append((r.peer, r.dst.data_ptr() // item, r.dst.numel(), r.offset))
        code = self._codes.get(buf.dtype)
        if code is None:
            raise OdcUsageError(f"nvshmem fetch: dtype {buf.dtype} not supported (use fp32/bf16/fp16)")
        near, far = self._plans.build(buf, "fetch", entries)
        return self._streams.run(near, far, 0, [r.dst for r in requests], code, 1.0, async_op, "fetch")

    def push(
        self, buf: SymmetricBuffer, requests: Sequence[PushRequest], scale: float, *, async_op: bool = False
    ) -> Work | None:
        self._check("push")
        groups: dict[torch.dtype, list[tuple[int, int, int, int]]] = {}
        for r in requests:
            self._check_local("push(src)", r.src, tuple(self._codes))
            groups.setdefault(r.src.dtype, []).append(
                (r.peer, r.src.data_ptr() // r.src.itemsize, r.src.numel(), r.offset)
            )
        for dtype in groups:  # the accumulator/source/scale mix, before anything is built or issued
            plans.check_push(buf.dtype, dtype, float(scale))
        # every group is built (and validated) before any runs: a bad request issues nothing
        built = [(self._codes[dtype], self._plans.build(buf, "push", e)) for dtype, e in groups.items()]
        srcs = [r.src for r in requests]
        if len(built) == 1:  # one launch: issued whole or not at all
            code, (near, far) = built[0]
            return self._streams.run(near, far, 0, srcs, code, float(scale), async_op, "push")

        def run_all() -> Work | None:
            work: Work | None = None
            for code, (near, far) in built:
                work = self._streams.run(near, far, 0, srcs, code, float(scale), async_op, "push")
            return work

        # several dtypes: an error after the first launch leaves part of the push issued (fail-stop)
        # one side stream: the last handle covers all groups
        return self.fail_stop("push", "part of the push was issued", run_all)

    # -- signalled puts (hierarchical push across nodes) ----------------------------------------------------
    def _check_signal(self, op: str, signal: SymmetricBuffer, index: int) -> int:
        """Validate ``signal[index]`` and return the word's symmetric offset."""
        if not isinstance(signal, SymmetricBuffer) or signal.freed:
            raise OdcUsageError(f"nvshmem {op}: the signal buffer must be a live buffer from alloc()")
        if signal.dtype != torch.int64:
            raise OdcUsageError(f"nvshmem {op}: the signal buffer must be int64, got {signal.dtype}")
        if not 0 <= index < signal.numel:
            raise OdcUsageError(f"nvshmem {op}: signal index {index} out of range [0, {signal.numel})")
        return signal.handle.offset + index * 8  # type: ignore[attr-defined]

    def put_signal(self, buf: SymmetricBuffer, requests: Sequence[PutRequest], signal: SymmetricBuffer) -> None:
        """Stream-ordered signalled puts (``csrc/signal.cu`` has the ordering argument).

        Peers with a peer pointer (same node) are written by an SM copy, the others by network puts, which read
        the source directly: for those, ``src`` must lie inside the symmetric heap (a view of a buffer from
        ``alloc``), since the network can only read registered memory. Nothing is issued unless every
        request is valid. The host does not wait."""
        self._check("put_signal")
        if buf.freed:
            raise OdcUsageError(f"nvshmem put_signal: buffer {buf.tag!r} was freed")
        h: HeapBlock = buf.handle  # type: ignore[assignment]
        item = buf.dtype.itemsize
        remote: list[int] = []
        local: list[int] = []
        nbytes: list[int] = []
        pes: list[int] = []
        near: list[bool] = []
        sigs: list[int] = []
        for r in requests:  # validate everything before issuing anything
            src = self._check_local("put_signal(src)", r.src, (buf.dtype,))
            n = src.numel()
            self._plans.check_range("put_signal", buf, r.peer, r.offset, n)
            sigs.append(self._check_signal("put_signal", signal, r.signal_index))
            direct = self._plans.peer_bases[r.peer] != 0
            if not direct and n and not self._heap.contains(src.data_ptr(), n * item):
                raise OdcUsageError(
                    f"nvshmem put_signal: the source for rank {r.peer} (another node) is not inside the symmetric "
                    "heap; the network reads registered memory only: put from a view of a buffer from alloc()"
                )
            remote.append(self._plans.remote(h, r.peer, direct, r.offset * item))
            local.append(src.data_ptr())
            nbytes.append(n * item)
            pes.append(r.peer)
            near.append(direct)
        if not remote:
            return
        stream = self._stream()
        self._streams.join_into(stream)  # after this rank's asynchronous operations, like quiet
        self._launch(
            "put_signal", self._engine.put_signal, remote, local, nbytes, pes, near, sigs,  # type: ignore[attr-defined]
            stream.cuda_stream,
        )

    def wait_signal(self, signal: SymmetricBuffer, index: int, value: int, op: str, peers: Sequence[int]) -> None:
        """The current stream waits until ``signal[index] >= value`` (acquire); the host does not block.

        The wait is watched: past ``timeout`` the abort word releases the wait kernel (and every other waiting
        kernel of this engine), and the next call into the transport raises
        ``OdcTimeoutError`` naming ``op``, ``peers`` and the count that was reached."""
        self._check(op)
        offset = self._check_signal(op, signal, index)
        if value < 0:
            raise OdcUsageError(f"nvshmem {op}: awaited count {value} is negative")
        stream = self._stream()
        wait_id = self._launch(op, self._engine.wait_signal, offset, int(value), stream.cuda_stream)  # type: ignore[attr-defined]
        self._watch(op, stream, wait=(index, int(value), tuple(peers)), wait_id=int(wait_id))  # type: ignore[call-overload]

    def use_nodes(self, node_size: int) -> None:
        """The hierarchy is on: every accumulate of a world-sharded tensor stays inside a node. In a multi-node
        job (no job-wide load/store atomics, so the locked protocol everywhere) that makes NVLink atomics safe for
        intra-node pushes, provided no push crosses a node any more: such pushes are refused from now on (mixing
        atomics with a remote get…add…put on the same words would lose updates; docs/design.md). A forced
        ``ODC_NVSHMEM_PUSH=locked`` keeps the locked protocol; a job with job-wide atomics changes nothing."""
        if self.atomic_push or self.settings.push == "locked":
            return
        first = self.rank // node_size * node_size
        unreachable = [p for p in range(first, first + node_size) if self._plans.peer_bases[p] == 0]
        if unreachable:
            raise OdcUsageError(
                f"nvshmem: node size {node_size} puts rank(s) {unreachable} on rank {self.rank}'s node, but they "
                "have no peer pointer (no NVLink / load-store path); set ODC_NODE_SIZE to the GPUs that share "
                "a node"
            )
        self._plans.node_atomics = node_size

    def node_size(self) -> int:
        """The PEs that reach each other by peer pointer (one NVLink domain / host), derived and checked at init:
        consecutive blocks of one size on every rank, else ``OdcUsageError`` asking for
        ``ODC_NODE_SIZE``."""
        if isinstance(self._node, str):
            raise OdcUsageError(self._node)
        return self._node

    def quiet(self) -> None:
        self._check("quiet")
        stream = self._stream()
        self._streams.join_into(stream)
        self._launch("quiet", self._engine.quiet, stream.cuda_stream)  # type: ignore[attr-defined]

    def barrier(self, op: str = "barrier") -> None:
        """Stream-ordered own barrier (``csrc/barrier.cu``); the host waits only for the previous one."""
        self._check(op)
        if self._last_barrier is not None:
            self._watchdog.wait(self, self._last_barrier)
        stream = self._stream()
        self._streams.join_into(stream)
        self._epoch += 1
        self._launch(op, self._engine.barrier, self._epoch, stream.cuda_stream)  # type: ignore[attr-defined]
        self._last_barrier = self._watch(op, stream, self._epoch)

    def group_barrier(self, op: str, group: Group) -> None:
        """Not supported yet: raises OdcUsageError (groups still work for ``shard``/``fetch``/``push``).

        The barrier kernel (``csrc/barrier.cu``) keeps one epoch counter per peer for the whole world; a fence
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
        if self._finalized:
            return
        error: OdcError | None = None
        try:
            if self.failure is None:
                for entry in self._watchdog.outstanding():
                    self._watchdog.wait(self, entry)
        except OdcError as exc:
            error = exc
        finally:
            self._finalized = True
            self._healthy = False
            extension.started = True
            self._watchdog.stop()
            self._heap.drop_all()
        if error is not None:
            raise error
