"""The seam between the one-node Triton transport and whatever maps the ranks' memory: a ``PeerHeap``.

A heap provider gives every rank one symmetric heap of ``nbytes`` bytes, mapped into every peer's address space
(at a different address in each process: only symmetric *offsets* mean the same thing on every rank), and a
per-process table of peer base addresses that the kernels load and cast to pointers. Providers are duck-typed:

* ``SegmentHeap`` (here): CPU ranks, over the host transport's shared-memory segments (``symm-cpu``).
* the CUDA provider over ``torch.distributed._symmetric_memory`` (``symm``) implements the same shape.
"""

from __future__ import annotations

from typing import Protocol

import torch

from odc_runtime.transport.host.segments import CONTROL_BYTES, Segments

# A fetch piece of at least this many bytes is copied from the peer's heap view (``PeerHeap.peer_view``: the
# copy engines on a GPU, leaving the SMs to the model); smaller pieces go together in one copy-kernel launch (one
# launch costs the host less than a copy each).
COPY_MIN_BYTES = 1 << 20


class PeerHeap(Protocol):
    """One symmetric heap per rank, mapped into every peer's address space."""

    rank: int
    world: int
    nbytes: int
    device: torch.device
    local: torch.Tensor  # uint8[nbytes]: this rank's heap
    peer_bases: torch.Tensor  # int64[world] on ``device``: each rank's heap base address in this process

    def peer_view(self, peer: int) -> torch.Tensor:
        """``uint8[nbytes]`` view of ``peer``'s heap in this process."""
        ...

    def close(self) -> None:
        """Drop this process's mappings (views that outlive it keep their memory alive where the provider can)."""
        ...


class SegmentHeap:
    """``PeerHeap`` over the host transport's segments: the heap is each segment after its control pages.

    The segments are mapped with ``mmap`` in every process, so the same heap sits at a different address in each
    one; ``peer_bases`` holds this process's addresses. The segments' owner (the transport) closes them.
    """

    def __init__(self, segments: Segments, rank: int, world: int, nbytes: int) -> None:
        self.rank, self.world, self.nbytes = rank, world, nbytes
        self.device = torch.device("cpu")
        self._views = [segments.get(p).bytes[CONTROL_BYTES : CONTROL_BYTES + nbytes] for p in range(world)]
        self.local = self._views[rank]
        self.peer_bases = torch.tensor([v.data_ptr() for v in self._views], dtype=torch.int64)

    def peer_view(self, peer: int) -> torch.Tensor:
        return self._views[peer]

    def close(self) -> None:
        self._views = []
        self.local = self.local[:0]
