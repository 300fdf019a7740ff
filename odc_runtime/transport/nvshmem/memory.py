"""The symmetric heap of the nvshmem transport: one arena allocated at init and sub-allocated in Python.

Every rank runs the same allocation sequence, so a buffer's *symmetric offset* in the arena is the same number on
every PE; everything shared between PEs (NVSHMEM addresses, cells, locks, signal words) is derived from it,
never from a local address (each process reserves its own virtual range for the heap, so bases differ). A freed
range is quarantined until no tensor on any rank views it (checked collectively at the next ``alloc``), so a
later allocation never aliases a live view.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from odc_runtime.agree import gather_checked
from odc_runtime.errors import OdcError
from odc_runtime.transport.base import SymmetricBuffer
from odc_runtime.transport.heap import ALIGNMENT, HeapAllocator


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
class HeapBlock:
    offset: int  # symmetric offset in the heap arena (the same on every PE)
    ptr: int  # this PE's address of the range
    views: weakref.ref  # to the _CudaArray behind `local`: dead once no tensor views the range


def wrap(ptr: int, nbytes: int, device: torch.device) -> tuple[torch.Tensor, object]:
    """A uint8 tensor over ``nbytes`` of device memory at ``ptr``, and the object torch keeps alive for it."""
    owner = _CudaArray(ptr, nbytes)
    return torch.as_tensor(owner, device=device), owner


def zero(ptr: int, nbytes: int, device: torch.device) -> None:
    wrap(ptr, nbytes, device)[0].zero_()


class SymmetricHeap:
    """Arena ``[arena, arena + capacity)`` on this PE: allocation, views, free quarantine."""

    def __init__(self, arena: int, capacity: int, device: torch.device) -> None:
        self.arena = arena
        self.device = device
        self.allocator = HeapAllocator(capacity, limit_hint="odc.init(heap_size=...) or NVSHMEM_SYMMETRIC_SIZE")
        self.buffers: list[SymmetricBuffer] = []
        self.quarantine: list[tuple[int, weakref.ref, str]] = []  # freed while viewed: (offset, views, tag)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        """Bytes of live buffers: the allocator's reserved bytes less the quarantined ranges (freed, not reusable
        yet), so that ``heap_used()`` means the same on every transport (``Transport.heap_used``)."""
        return self.allocator.used - sum(self.allocator.size(offset) for offset, _, _ in self.quarantine)

    def contains(self, ptr: int, nbytes: int) -> bool:
        """``[ptr, ptr + nbytes)`` lies inside this PE's arena (memory the network can read)."""
        return self.arena <= ptr and ptr + nbytes <= self.arena + self.allocator.capacity

    def release_quarantine(self) -> None:
        """Return freed ranges that no rank views any more to the allocator (collective; same list everywhere,
        because ``free`` is collective, so every rank takes the same decision and offsets stay symmetric)."""
        if not self.quarantine:
            return
        alive = [views() is not None for _, views, _ in self.quarantine]
        everyone = gather_checked("alloc (freed buffers)", lambda: alive)
        keep = []
        for i, entry in enumerate(self.quarantine):
            if any(flags[i] for flags in everyone):
                keep.append(entry)
            else:
                self.allocator.free(entry[0])
        self.quarantine = keep

    def allocate(self, numel: int, dtype: torch.dtype, tag: str) -> SymmetricBuffer:
        """A zeroed buffer (zeroing is stream-ordered; the caller's barrier publishes it)."""
        self.release_quarantine()
        nbytes = max(1, numel * dtype.itemsize)
        try:
            offset = self.allocator.alloc(nbytes, what=repr(tag or "buffer"))
        except OdcError as exc:
            if self.quarantine:
                held = ", ".join(repr(t) for _, _, t in self.quarantine)
                raise type(exc)(
                    f"{exc}. Freed buffers still viewed by live tensors keep their memory: {held}; drop the "
                    "references (e.g. to st.local / st.grad) before freeing"
                ) from None
            raise
        rounded = -(-nbytes // ALIGNMENT) * ALIGNMENT  # what the allocator reserved
        raw, owner = wrap(self.arena + offset, rounded, self.device)
        local = raw.view(dtype)[:numel]
        local.zero_()
        buf = SymmetricBuffer(
            numel=numel, dtype=dtype, local=local, handle=HeapBlock(offset, self.arena + offset, weakref.ref(owner)),
            tag=tag,
        )
        del owner, raw  # only the tensors view it now; the weak reference tells when the last one died
        self.buffers.append(buf)
        return buf

    def release(self, buf: SymmetricBuffer) -> None:
        """After the caller's barrier: nobody reads or pushes into ``buf`` any more; quarantine its range."""
        h: HeapBlock = buf.handle  # type: ignore[assignment]
        buf.freed = True
        buf.local = torch.empty(0, dtype=buf.dtype, device=self.device)
        self.buffers = [b for b in self.buffers if b is not buf]
        # Never reused while any rank still views it (see release_quarantine): no silent aliasing.
        self.quarantine.append((h.offset, h.views, buf.tag))

    def drop_all(self) -> None:
        """finalize: every buffer is marked freed; views stay valid (nothing is unmapped)."""
        for buf in self.buffers:
            buf.freed = True
        self.buffers = []
        self.quarantine = []
