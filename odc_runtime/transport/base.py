"""The transport interface: symmetric memory plus one-sided get / accumulate, quiet and barrier.

The core API (``odc_runtime.api``) is written once against this interface; ``host`` (shared memory between
processes on one machine) and ``nvshmem`` (GPUs) implement it. Keep it this small.

Semantics every transport provides:

* ``alloc`` is collective: every rank calls it in the same order with the same arguments and gets a
  :class:`SymmetricBuffer` whose ``local`` tensor is this rank's region. Peers address the same buffer by
  ``(buffer, peer)``.
* ``get`` copies a range of a peer's region into a local tensor; ``accumulate`` adds ``src * scale`` (converted
  to the buffer's dtype) into a range of a peer's region. Concurrent accumulates from any number of ranks into the
  same region are exact (no lost updates). Both may complete asynchronously with respect to the host (on GPU
  they are ordered on the current CUDA stream); ``quiet`` completes every operation this rank issued.
* ``barrier`` is collective and implies ``quiet`` on every rank: after it returns, every accumulate issued by
  any rank before its barrier call is visible in the owner's region, and every write a rank made to its own
  regions before the barrier is what any later ``get`` returns.
* Blocking waits give up after ``timeout`` seconds with :class:`~odc_runtime.errors.OdcTimeoutError` naming the
  operation and the ranks that did not answer.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


class Work(abc.ABC):
    """Completion handle of an asynchronous operation (returned by ``async_op=True``)."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation completed (GPU: make the current stream wait for it).

        Re-raises any error the operation hit. ``timeout`` bounds the host-side wait in seconds.
        """

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """Whether the operation already completed (non-blocking)."""


class CompletedWork(Work):
    """A handle for work that finished synchronously."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


@dataclass(eq=False)
class SymmetricBuffer:
    """One collective allocation: ``numel`` elements of ``dtype`` on every rank.

    ``local`` is this rank's region (1-D). ``handle`` is transport-private (offset in a heap, a device address).
    """

    numel: int
    dtype: torch.dtype
    local: torch.Tensor
    handle: object
    tag: str = ""
    freed: bool = field(default=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class GetRequest:
    """Copy ``dst.numel()`` elements of ``peer``'s region of ``buf`` starting at ``offset`` into ``dst``."""

    peer: int
    dst: torch.Tensor
    offset: int = 0


@dataclass(frozen=True)
class AccumulateRequest:
    """Add ``src * scale`` into ``peer``'s region of ``buf`` at ``[offset, offset + src.numel())``."""

    peer: int
    src: torch.Tensor
    offset: int = 0


class Transport(abc.ABC):
    """Symmetric memory with one-sided get / accumulate, quiet and barrier (see module docstring)."""

    name: str = "abstract"

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout = timeout

    # -- memory ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def alloc(self, numel: int, dtype: torch.dtype, tag: str = "") -> SymmetricBuffer:
        """Collective: allocate ``numel`` zero-initialised elements of ``dtype`` on every rank.

        Raises :class:`~odc_runtime.errors.OdcMemoryError` (on every rank, before allocating anything) when the
        symmetric heap cannot hold it.
        """

    @abc.abstractmethod
    def free(self, buf: SymmetricBuffer) -> None:
        """Collective: release a buffer allocated by :meth:`alloc` (same order on all ranks)."""

    @abc.abstractmethod
    def heap_capacity(self) -> int:
        """Bytes of symmetric memory this rank may allocate in total."""

    @abc.abstractmethod
    def heap_used(self) -> int:
        """Bytes of symmetric memory currently allocated."""

    # -- one-sided operations -------------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, buf: SymmetricBuffer, requests: Sequence[GetRequest]) -> None:
        """Issue the copies in ``requests`` (from peers' regions of ``buf`` into local tensors).

        Requests are issued in the given order; the caller rotates peers so owners are not all hit at once.
        """

    @abc.abstractmethod
    def accumulate(self, buf: SymmetricBuffer, requests: Sequence[AccumulateRequest], scale: float) -> None:
        """Issue ``peer_region[offset:offset+n] += src.to(buf.dtype) * scale`` for every request."""

    @abc.abstractmethod
    def submit(self, fn: Callable[[], None]) -> Work:
        """Run ``fn`` (which issues gets/accumulates) asynchronously, in submission order; return its handle."""

    @abc.abstractmethod
    def quiet(self) -> None:
        """Complete every operation this rank issued (including submitted ones)."""

    @abc.abstractmethod
    def barrier(self, op: str = "barrier") -> None:
        """Collective fence (implies quiet everywhere). ``op`` names the caller in timeout errors."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Release every resource; idempotent; must not hang if peers are gone."""
