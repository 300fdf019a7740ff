"""The one-node Triton transport's transfer plan: the launch descriptor of a fetch or push, built once per caller
tensor instead of once per call.

A descriptor row is ``(peer, byte offset in the peer's heap, local address, numel)``: everything but the local
address is fixed by the plan, and the local address is the caller tensor's ``data_ptr`` plus the piece's start, so
a descriptor is exact for every tensor at that address (the numel and dtype are the plan's). A plan keeps the
descriptors of the last few addresses (a training loop passes the same few buffers, or the caching allocator
hands back the same address). From an address's second call on, the plan launches through the kernel's bound launch
(``kernels/launch.py``, ``CachedKernel.bind``: the compiled runner with the descriptor, the peer table, the constexprs
and the plan's stream bound; a push passes its scale), so a steady-state call is a dict lookup, the health check and
one runner call. Errors and fail-stop are those of the generic path: the same kernel, the same checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from odc_runtime.transport.base import Piece, SymmetricBuffer, TransferPlan, Work, as_failure
from odc_runtime.transport.symm import heap as heaps

if TYPE_CHECKING:
    from odc_runtime.transport.symm.transport import SymmTransport

_KEEP = 4  # descriptors per plan (one per caller address), the oldest dropped first


class SymmPlan(TransferPlan):
    """A ``TransferPlan`` that launches the kernel with a cached descriptor (see the module docstring)."""

    __slots__ = ("_copies", "_descs", "_fast", "_launches", "_longest", "_rows", "_stream")

    def __init__(
        self, transport: SymmTransport, buf: SymmetricBuffer, kind: str, pieces: Sequence[Piece], stream_key: object
    ) -> None:
        super().__init__(transport, buf, kind, pieces, stream_key)
        live = [p for p in self.pieces if p.numel]
        # Fetch pieces of COPY_MIN_BYTES or more are copied by the copy engines from the peer's heap view (their
        # sources resolved here, once); the rest go in one kernel launch.
        self._copies: list[tuple[int, int, torch.Tensor]] = []  # (start in the caller's tensor, numel, source)
        if kind == "fetch":
            big = [p for p in live if p.numel * buf.dtype.itemsize >= heaps.COPY_MIN_BYTES]
            self._copies = [(p.start, p.numel, transport.peer_region(buf, p.peer, p.offset, p.numel)) for p in big]
            live = [p for p in live if p.numel * buf.dtype.itemsize < heaps.COPY_MIN_BYTES]
        # (peer, byte offset at the peer, element offset in the caller's flat tensor, numel)
        self._rows = [(p.peer, buf.handle + p.offset * buf.dtype.itemsize, p.start, p.numel) for p in live]  # type: ignore[operator]
        self._longest = max((p.numel for p in live), default=0)
        # The caller's tensors have one dtype, shape and device per plan (the plan cache's key); a push into a
        # non-fp32 buffer takes the generic path, which refuses it.
        self._fast = bool(live or self._copies) and (kind == "fetch" or buf.dtype == torch.float32)
        self._descs: dict[int, tuple[torch.Tensor, bool]] = {}  # caller's data_ptr -> (descriptor, aligned rows)
        # caller's data_ptr -> the bound launch of its descriptor (kernels/launch.py: the compiled runner, every
        # argument fixed but a push's scale), from the second launch on where the cached launch path applies
        self._launches: dict[int, Callable[..., None]] = {}
        # The stream the plan launches on: its key, the raw stream on a GPU (None: a transport without streams,
        # the driver's current stream when the launch is bound)
        self._stream = stream_key if isinstance(stream_key, int) else None

    def _desc(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        transport: SymmTransport = self.transport  # type: ignore[assignment]
        base, size = tensor.data_ptr(), tensor.dtype.itemsize
        rows = [(peer, off, base + start * size, n) for peer, off, start, n in self._rows]
        desc = torch.tensor(rows, dtype=torch.int64, device=transport.device).reshape(-1, 4)
        if len(self._descs) >= _KEEP:
            oldest = next(iter(self._descs))
            del self._descs[oldest]
            self._launches.pop(oldest, None)  # a launch holds its descriptor's address: never outlives it
        self._descs[base] = entry = (desc, transport.kernels.rows_aligned(rows, transport._heaps_aligned))
        return entry

    def run(self, tensor: torch.Tensor, scale: float = 1.0, *, async_op: bool = False) -> Work | None:
        transport: SymmTransport = self.transport  # type: ignore[assignment]
        launch = self._launches.get(tensor.data_ptr())
        # The steady state: the runner alone, while the transport is usable (HostTransport.fast_path_ok, inlined:
        # this is the per-call path, and a method call costs about 0.1 µs here; else the generic path raises)
        if (
            launch is not None and not async_op
            and transport.failure is None and not transport._closed and not transport.segments.forked
        ):
            if self.kind == "push":
                try:  # fail-stop as the generic push (Transport.fail_stop, inlined: this is the per-call path)
                    launch(scale)
                except BaseException as e:
                    transport.fail(as_failure("push", e, "part of the push may have landed"))
                    raise
            else:
                launch()
            return None
        if async_op or not self._fast or not transport.fast_path_ok():
            return super().run(tensor, scale, async_op=async_op)  # the generic path raises what it must
        if self.kind == "fetch":
            if self._copies:
                flat = tensor.view(-1)
                for start, n, source in self._copies:
                    flat[start : start + n].copy_(source)
            if self._rows:
                desc, aligned = self._desc_of(tensor)
                transport.kernels.fetch(transport._table, desc, self._longest, self.buf.dtype, aligned)
                if not self._copies:  # a bound launch is the kernel alone
                    self._bind(tensor, transport.kernels.bind_fetch(
                        transport._table, desc, self._longest, self.buf.dtype, aligned, self._stream))
            return None
        desc, aligned = self._push(tensor, scale, torch.float32, 0)
        self._bind(tensor, transport.kernels.bind_push(
            transport._table, desc, self._longest, tensor.dtype, aligned, self._stream))
        return None

    def _bind(self, tensor: torch.Tensor, launch: Callable[..., None] | None) -> None:
        """Keep ``launch`` (the cached runner, every argument bound but the scale) for ``tensor``'s address, as
        long as its descriptor is kept."""
        if launch is not None and tensor.data_ptr() in self._descs:
            self._launches[tensor.data_ptr()] = launch

    def run_fixed(self, tensor: torch.Tensor, scale: float, shift: int) -> bool:
        """The push kernel quantises a float ``tensor`` into this plan's ``int64`` buffer in registers (no
        ``int64`` copy of the gradient, no extra passes); ``False`` where the generic path must run instead."""
        transport: SymmTransport = self.transport  # type: ignore[assignment]
        if self.kind != "push" or self.buf.dtype != torch.int64 or not transport.fast_path_ok():
            return False
        if self._rows:
            self._push(tensor, scale, torch.int64, shift)
        return True

    def _desc_of(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The descriptor for ``tensor``'s address and whether its rows take the vector variant (made once)."""
        entry = self._descs.get(tensor.data_ptr())
        return self._desc(tensor) if entry is None else entry

    def _push(self, tensor: torch.Tensor, scale: float, acc: torch.dtype, shift: int) -> tuple[torch.Tensor, bool]:
        transport: SymmTransport = self.transport  # type: ignore[assignment]
        desc, aligned = entry = self._desc_of(tensor)
        try:  # fail-stop as the generic push (Transport.fail_stop, inlined)
            transport.kernels.push(transport._table, desc, self._longest, scale, tensor.dtype, acc, shift, aligned)
        except BaseException as e:
            transport.fail(as_failure("push", e, "part of the push may have landed"))
            raise
        return entry
