"""Plan building and stream use of the nvshmem transport.

``PlanBuilder`` turns ``(peer, local element offset, numel, peer element offset)`` entries into extension
plans: ``near`` (peer pointers: copy engines / SM copy for fetch, fused atomics for push; runs on the caller's
stream) and ``far`` (NVSHMEM network operations: staged fetch, locked push; the scratch users). A near entry
carries the peer pointer; a far entry carries the *symmetric offset* of the peer's range in the arena, from which
the kernels derive NVSHMEM's address, cells and locks (``csrc/cells.cu``). ``Streams`` runs them: scratch
users on one internal stream (so no two ever share a scratch slot) that waits for the caller's stream and is
joined back into it; ``async_op=True`` on a side stream whose event ``CudaWork`` hands back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from odc_runtime import config
from odc_runtime.errors import OdcUsageError
from odc_runtime.transport.base import Piece, SymmetricBuffer, TransferPlan, Work, raw_stream  # noqa: F401 (a module attribute tests replace)
from odc_runtime.transport.nvshmem.extension import backend_call
from odc_runtime.transport.nvshmem.memory import HeapBlock
from odc_runtime.transport.nvshmem.watchdog import Pending

if TYPE_CHECKING:
    from odc_runtime.transport.nvshmem.transport import NvshmemTransport

Entry = tuple[int, int, int, int]  # (peer, element offset in the local tensor, numel, element offset at the peer)


def check_accumulator(acc: torch.dtype) -> None:
    """Accumulators are fp32, or ``int64`` (deterministic mode's fixed point)."""
    if acc not in (torch.float32, torch.int64):
        raise OdcUsageError(
            f"nvshmem accumulate: accumulators must be float32 (or int64 in deterministic mode), got {acc}"
        )


def check_push(acc: torch.dtype, src: torch.dtype, scale: float) -> None:
    """Refuse (OdcUsageError, before anything is issued) a push the kernels do not add exactly as asked: an fp32
    accumulator takes fp32/bf16/fp16 sources (cast, times ``scale``, fp32 add); an ``int64`` accumulator takes
    ``int64`` sources with scale 1 (deterministic mode's fixed-point push: an exact integer add). The extension
    refuses the same mixes (``csrc/plan.cu``), but a refused launch fails the transport: checked here first, misuse
    stays an ordinary usage error."""
    check_accumulator(acc)
    if acc == torch.int64 and src != torch.int64:
        raise OdcUsageError(
            f"nvshmem accumulate: an int64 accumulator (deterministic mode) takes int64 sources only, got {src}; "
            "floating-point gradients go into a float32 accumulator"
        )
    if acc == torch.float32 and src == torch.int64:
        raise OdcUsageError(
            "nvshmem accumulate: int64 sources go into an int64 accumulator only (deterministic mode), not float32; "
            "push fp32/bf16/fp16 gradients into a float32 accumulator"
        )
    if acc == torch.int64 and scale != 1.0:
        raise OdcUsageError(
            f"nvshmem accumulate: int64 pushes are exact integer adds and take scale 1, got {scale} (deterministic "
            "mode scales before quantising)"
        )


def source_codes(codes: dict[torch.dtype, int], acc: torch.dtype) -> dict[torch.dtype, int]:
    """The dtype codes of the sources a push into an ``acc`` accumulator may have (``check_push``)."""
    if acc == torch.int64:
        return {torch.int64: codes[torch.int64]}
    return {d: c for d, c in codes.items() if d != torch.int64}


def record(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator that ``t`` is used on ``stream`` (not reused before that work is done)."""
    t.record_stream(stream)


class CudaWork(Work):
    def __init__(self, transport: NvshmemTransport, event: torch.cuda.Event) -> None:
        self._transport = transport
        self._event = event

    def wait(self, timeout: float | None = None) -> None:
        # Stream-ordered: the caller's current stream waits; the host does not block.
        self._transport._raise_failure()
        torch.cuda.current_stream(self._transport.device).wait_event(self._event)

    def is_completed(self) -> bool:
        return self._transport._watchdog.done(self._event)


class PlanBuilder:
    """Validates entries and makes the extension's plans (see the module docstring)."""

    def __init__(
        self, transport: NvshmemTransport, ext: ModuleType, settings: config.NvshmemSettings, peer_bases: list[int],
        atomic_push: bool,
    ) -> None:
        self._transport = transport
        self._C = ext
        self.settings = settings
        self.peer_bases = peer_bases  # nvshmem_ptr(arena, pe) per PE; 0 = no peer pointer (other node)
        self.atomic_push = atomic_push
        self.node_atomics = 0  # node size when the hierarchy keeps accumulates inside nodes (use_nodes)

    def check_range(self, op: str, buf: SymmetricBuffer, peer: int, offset: int, numel: int) -> None:
        """``peer`` exists and ``[offset, offset + numel)`` lies inside ``buf`` (elements)."""
        world = self._transport.world_size
        if not 0 <= peer < world:
            raise OdcUsageError(f"nvshmem {op}: peer {peer} out of range [0, {world})")
        if offset < 0 or offset + numel > buf.numel:
            raise OdcUsageError(
                f"nvshmem {op}: elements [{offset}, {offset + numel}) of buffer {buf.tag!r} are out of its range "
                f"[0, {buf.numel}) (offset {offset}, {numel} elements)"
            )

    def remote(self, h: HeapBlock, peer: int, direct: bool, byte_offset: int) -> int:
        """Where ``byte_offset`` of ``peer``'s region of a buffer lies: its address through the peer pointer
        (``direct``), else its symmetric offset in the arena (the same number on every PE)."""
        return (self.peer_bases[peer] + h.offset if direct else h.offset) + byte_offset

    def build(self, buf: SymmetricBuffer, kind: str, entries: Sequence[Entry]) -> tuple[object | None, object | None]:
        """Extension plans ``(near, far)``; everything is validated before any plan is made."""
        h: HeapBlock = buf.handle  # type: ignore[assignment]
        if buf.freed:
            raise OdcUsageError(f"nvshmem {kind}: buffer {buf.tag!r} was freed")
        if kind == "push":
            check_accumulator(buf.dtype)
        near: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        far: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        item = buf.dtype.itemsize
        nodes = self.node_atomics
        rank = self._transport.rank
        for peer, rel, numel, offset in entries:
            self.check_range(kind, buf, peer, offset, numel)
            if numel == 0:
                continue
            if kind == "push" and nodes and peer // nodes != rank // nodes:
                raise OdcUsageError(
                    f"nvshmem push: rank {rank} pushes into rank {peer} on another node outside the hierarchical "
                    f"protocol (nodes of {nodes}); inside nodes pushes are NVLink atomics, which a "
                    "cross-node read-modify-write would race. Shard the tensor over all ranks or over a group "
                    "within one node, or set ODC_NODE_SIZE to the world size (the locked protocol for every push)"
                )
            direct = self.peer_bases[peer] != 0 and (kind == "fetch" or self.atomic_push or nodes > 0)
            lists = near if direct else far
            lists[0].append(self.remote(h, peer, direct, offset * item))
            lists[1].append(rel)
            lists[2].append(numel)
            lists[3].append(peer)
        C = self._C
        extra: tuple[int, ...] = ()
        if kind == "fetch":
            near_kind = C.PLAN_FETCH_COPY if self.settings.fetch == "copy" else C.PLAN_FETCH_KERNEL
            far_kind = C.PLAN_FETCH_STAGED
        else:
            near_kind, far_kind = C.PLAN_PUSH_ATOMIC, C.PLAN_PUSH_LOCKED
            extra = (self._transport._codes[buf.dtype],)  # the accumulator's element type
        engine = self._transport._engine
        return (
            backend_call("plan", C.Plan, engine, near_kind, *near, *extra) if near[0] else None,
            backend_call("plan", C.Plan, engine, far_kind, *far, *extra) if far[0] else None,
        )


class Streams:
    """The side stream (``async_op``) and the internal stream (scratch users) with their last events."""

    def __init__(self, transport: NvshmemTransport) -> None:
        self._transport = transport
        self.side = torch.cuda.Stream(transport.device)
        self.remote = torch.cuda.Stream(transport.device)
        self.side_event: torch.cuda.Event | None = None
        self.remote_event: torch.cuda.Event | None = None

    def join_into(self, stream: torch.cuda.Stream) -> None:
        for ev in (self.side_event, self.remote_event):
            if ev is not None:
                stream.wait_event(ev)

    def run(
        self, near: object | None, far: object | None, base: int, tensors: Sequence[torch.Tensor], code: int,
        scale: float, async_op: bool, kind: str,
    ) -> Work | None:
        transport = self._transport
        cur = torch.cuda.current_stream(transport.device)
        target = cur
        if async_op:
            target = self.side
            target.wait_stream(cur)
            for t in tensors:  # allocated on the caller's stream, used on the side stream
                record(t, target)
        if near is not None:
            try:
                near.run(base, code, scale, target.cuda_stream)  # type: ignore[attr-defined]
            except RuntimeError as exc:
                transport._launch_failed(kind, exc)
        if far is not None:
            # Scratch users run on the internal stream only, so no two kernels ever share a scratch slot.
            remote = self.remote
            remote.wait_stream(target)
            for t in tensors:
                record(t, remote)
            try:
                far.run(base, code, scale, remote.cuda_stream)  # type: ignore[attr-defined]
            except RuntimeError as exc:
                transport._launch_failed(kind, exc)
            ev = torch.cuda.Event()
            ev.record(remote)
            self.remote_event = ev
            target.wait_event(ev)
            if kind == "push":  # lock spins wait for other PEs: give them a deadline too
                entry = Pending(ev, time.monotonic() + transport.timeout, "push", 0)
                transport._watchdog.add(entry, remote.cuda_stream)
        if not async_op:
            return None
        ev = torch.cuda.Event()
        ev.record(target)
        self.side_event = ev
        return CudaWork(transport, ev)


class NvshmemPlan(TransferPlan):
    """Precomputed extension plans ``near`` and ``far`` with the stream handle they were made for."""

    __slots__ = ("_codes", "_far", "_fast", "_int64", "_near", "_stream_ptr")

    def __init__(
        self, transport: NvshmemTransport, buf: SymmetricBuffer, kind: str, pieces: Sequence[Piece],
        stream_key: object, near: object | None, far: object | None,
    ) -> None:
        super().__init__(transport, buf, kind, pieces, stream_key)
        self._near = near
        self._far = far
        self._stream_ptr = stream_key
        # push: only the sources this accumulator takes (check_push); a refused one leaves the fast path
        self._codes = source_codes(transport._codes, buf.dtype) if kind == "push" else transport._codes
        self._int64 = kind == "push" and buf.dtype == torch.int64  # scale must be 1
        # peer pointers only: one extension call on the caller's stream, nothing else to order
        self._fast = near.run if far is None and near is not None else None  # type: ignore[attr-defined]

    def run(self, tensor: torch.Tensor, scale: float = 1.0, *, async_op: bool = False) -> Work | None:
        # The hot path: `tensor` is contiguous (the caller's plan key says so), so its address and dtype are all
        # the kernels need: one flag for the failure state, one dict lookup, one extension call.
        transport: NvshmemTransport = self.transport  # type: ignore[assignment]
        fast = self._fast
        if transport._healthy and fast is not None and not async_op:
            code = self._codes.get(tensor.dtype)
            if code is not None and (scale == 1.0 or not self._int64):
                try:
                    fast(tensor.data_ptr(), code, scale, self._stream_ptr)
                except RuntimeError as exc:
                    transport._launch_failed(self.kind, exc)
                return None
        transport._check(self.kind)
        if self.kind == "push":
            check_push(self.buf.dtype, tensor.dtype, scale)
        code = self._codes.get(tensor.dtype)
        if code is None:
            raise OdcUsageError(f"nvshmem {self.kind}: dtype {tensor.dtype} not supported (use fp32/bf16/fp16)")
        if async_op or self._far is not None:
            return transport._streams.run(
                self._near, self._far, tensor.data_ptr(), (tensor,), code, scale, async_op, self.kind
            )
        try:
            self._near.run(tensor.data_ptr(), code, scale, self._stream_ptr)  # type: ignore[union-attr]
        except RuntimeError as exc:
            transport._launch_failed(self.kind, exc)
        return None
