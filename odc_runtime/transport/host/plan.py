"""The host transport's transfer plan: where each piece lives in which segment, resolved once when the plan is made.

A synchronous ``run`` then costs the copies or adds themselves plus, for a push, one lock and unlock system call per
chunk: no requests, no segment look-ups, no views of the segments per call. The byte-range locks and the fail-stop
rule of a push are exactly those of ``HostTransport.push <.transport.HostTransport.push>`` (one shared
implementation, ``add_chunks``). Whatever the fast path cannot vouch for (an
asynchronous operation; a transport that failed, was finalized or lives in a forked child) takes the generic
path, which raises the same errors as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from odc_runtime.transport.base import Piece, SymmetricBuffer, TransferPlan, Work

if TYPE_CHECKING:
    from odc_runtime.transport.host.transport import Chunk, HostTransport


class HostPlan(TransferPlan):
    """A ``TransferPlan`` whose pieces are bound to segment views (fetch) or lock ranges (push)."""

    __slots__ = ("_adds", "_reads")

    def __init__(
        self, transport: HostTransport, buf: SymmetricBuffer, kind: str, pieces: Sequence[Piece], stream_key: object
    ) -> None:
        super().__init__(transport, buf, kind, pieces, stream_key)
        # fetch: (start, stop) of the flat tensor and the owner's elements it reads
        self._reads: tuple[tuple[int, int, torch.Tensor], ...] = ()
        # push: (owner, segment fd, start and stop of the flat tensor, the chunks added under one lock each)
        self._adds: tuple[tuple[int, int, int, int, tuple[Chunk, ...]], ...] = ()
        if kind == "fetch":
            self._reads = tuple(
                (p.start, p.start + p.numel, transport.region(buf, p.peer, p.offset, p.numel)) for p in self.pieces
            )
        else:
            self._adds = tuple(
                (p.peer, transport.segments.get(p.peer).fd, p.start, p.start + p.numel,
                 transport.chunks(buf, p.peer, p.offset, p.numel))
                for p in self.pieces
            )

    def run(self, tensor: torch.Tensor, scale: float = 1.0, *, async_op: bool = False) -> Work | None:
        transport: HostTransport = self.transport  # type: ignore[assignment]
        if async_op or not transport.fast_path_ok():
            return super().run(tensor, scale, async_op=async_op)
        if tensor.requires_grad:
            tensor = tensor.detach()  # adds must not join the caller's autograd graph
        # The caller passes contiguous tensors; a view costs about two thirds of a 4 KiB copy, so none is made for
        # a tensor that is flat already, nor a slice for a piece that is the whole tensor (world 1, a group of 1).
        flat = tensor if tensor.dim() == 1 else tensor.view(-1)
        n = flat.numel()
        if self.kind == "fetch":
            for start, stop, src in self._reads:
                (flat if start == 0 and stop == n else flat[start:stop]).copy_(src)
            return None
        adds = self._adds
        if len(adds) == 1:
            peer, fd, start, stop, chunks = adds[0]
            work: Sequence = ((peer, fd, flat if start == 0 and stop == n else flat[start:stop], chunks),)
        else:
            work = [(peer, fd, flat[start:stop], chunks) for peer, fd, start, stop, chunks in adds]
        transport.add_chunks(work, scale)
        return None
