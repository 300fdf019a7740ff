"""Deterministic first-fit allocator for a symmetric heap.

Every rank runs the same sequence of collective allocations and frees, so every rank computes the same offsets
without communicating: an offset is a valid address of the buffer on every peer.
"""

from __future__ import annotations

import bisect

from odc_runtime.errors import OdcMemoryError

ALIGNMENT = 256  # bytes; enough for vectorised CPU copies and 128-bit GPU accesses


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units for messages (``1.50 GiB``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


class HeapAllocator:
    """First-fit allocation of byte ranges in ``[0, capacity)``, aligned to ``ALIGNMENT``."""

    def __init__(self, capacity: int, *, limit_hint: str) -> None:
        self.capacity = capacity - capacity % ALIGNMENT
        self._limit_hint = limit_hint  # how the user raises the capacity, quoted in errors
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []  # sorted (start, size)
        self._used: dict[int, int] = {}

    @property
    def used(self) -> int:
        return sum(self._used.values())

    def size(self, offset: int) -> int:
        """Bytes reserved for the live range at ``offset`` (its request rounded up to the alignment)."""
        return self._used[offset]

    def alloc(self, nbytes: int, what: str = "allocation") -> int:
        """Return the offset of a fresh range of at least ``nbytes``; raise OdcMemoryError if none fits."""
        size = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        for i, (start, free_size) in enumerate(self._free):
            if free_size >= size:
                if free_size == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free_size - size)
                self._used[start] = size
                return start
        largest = max((s for _, s in self._free), default=0)
        raise OdcMemoryError(
            f"symmetric heap exhausted: {what} asked for {human_bytes(nbytes)} ({nbytes} bytes) but only "
            f"{human_bytes(self.capacity - self.used)} of {human_bytes(self.capacity)} is free (largest free block "
            f"{human_bytes(largest)}); raise it with {self._limit_hint}"
        )

    def free(self, offset: int) -> None:
        """Return the range at ``offset`` to the free list, merging neighbours."""
        size = self._used.pop(offset)
        i = bisect.bisect(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        # merge with the right neighbour, then the left one
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]
