"""``symm``: the one-node Triton transport on the GPUs of one node, its heap from PyTorch's symmetric memory.

Everything but memory and streams is ``SymmTransport`` (the kernels, rounds, watchdog and
fail-stop that ``symm-cpu`` executes in CI). What differs on a GPU, and only that, is here:

* the heap is a ``CudaPeerHeap`` (``open_heap``, collective, returns zeroed): SymmetricMemory where every rank
  has a GPU of its own, CUDA IPC where ranks share one (``torch_heap.choose_provider``);
  the host segments keep only the control pages (they are sparse: the heap part is never reserved);
* buffers are views of that heap, zeroed on the device before the allocation's agreement round;
* the abort word the waiting kernels poll is page-locked host memory mapped into the device (``abort_word``), so
  the watchdog raises it with a host store, never a launch;
* kernels launch on the caller's current CUDA stream; ``async_op=True`` launches there too and returns a
  ``StreamWork`` (an event: ``wait`` orders the caller's current stream after it, the host does not block);
* a world ``barrier`` (``sync``) is stream-ordered (``ordered_barriers``): it returns after the launch and the
  next call settles it; group fences and ``wait_signal`` wait for their kernel's event under the same persistent
  watchdog (docs/design.md, "Stream-ordered ``sync`` with one persistent watchdog").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from odc_runtime.errors import OdcBackendError
from odc_runtime.transport import host
from odc_runtime.transport.base import FetchRequest, PushRequest, SymmetricBuffer, Work, raw_stream
from odc_runtime.transport.host.transport import HostTransport
from odc_runtime.transport.symm import common_reason, torch_heap
from odc_runtime.transport.symm.transport import SymmTransport


def unavailable_reason() -> str | None:
    """Why ``symm`` cannot run here (``None``: it can): it needs Triton, the host control plane, a CUDA device and
    a way to map peers' memory (PyTorch's SymmetricMemory or CUDA IPC). Never raises."""
    return common_reason() or torch_heap.unavailable_reason()


def is_available() -> bool:
    """A CUDA device, a way to map peers' memory (PyTorch's SymmetricMemory or CUDA IPC) and Triton are here."""
    return unavailable_reason() is None


def create(*, timeout: float, heap_size: int | str | None = None) -> HostTransport:
    """Collective: the host control plane over the default ``torch.distributed`` group, the heap on this rank's
    current CUDA device."""
    return host.create(timeout=timeout, heap_size=heap_size, transport_class=CudaSymmTransport)


class StreamWork(Work):
    """An operation launched on the caller's stream with ``async_op=True``; ``wait`` is stream-ordered."""

    def __init__(self, transport: CudaSymmTransport, event: torch.cuda.Event) -> None:
        self._transport = transport
        self._event = event

    def wait(self, timeout: float | None = None) -> None:
        self._transport.check_usable("wait")
        torch.cuda.current_stream(self._transport.device).wait_event(self._event)

    def is_completed(self) -> bool:
        return self._event.query()


class CudaSymmTransport(SymmTransport):
    """``SymmTransport`` over a ``CudaPeerHeap`` on this rank's GPU."""

    name = "symm"
    device_type = "cuda"
    ordered_barriers = True

    def __init__(self, rank: int, world_size: int, job: str, **kwargs: object) -> None:
        # Runs inside bootstrap's "host segments" round: a rank that cannot run symm fails every rank together.
        reason = torch_heap.unavailable_reason()
        if reason is not None:
            raise OdcBackendError(
                f"odc symm: {reason}; symm runs on the GPUs of one node (use backend='host' or 'symm-cpu' on CPU "
                "ranks, 'nvshmem' across nodes)"
            )
        super().__init__(rank, world_size, job, **kwargs)
        if self.kernels.INTERPRET:
            raise OdcBackendError(
                "odc symm: the peer kernels were defined under TRITON_INTERPRET=1 in this process, which runs them "
                "on the CPU; start GPU ranks without TRITON_INTERPRET (or use backend='symm-cpu' on CPU ranks)"
            )
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._device_index = self.device.index

    def open_heap(self) -> torch_heap.CudaPeerHeap:
        """Collective (called by every rank inside bootstrap's "map peers" round): the GPU heap.

        ``open_heap`` zeroes the heap and agrees before it returns; the words at offset 0 are zeroed again here on
        purpose (they are what every protocol starts from), and the "map peers" round that encloses this call is
        the host round after which peers may touch them."""
        heap = torch_heap.open_heap(
            self.rank, self.world_size, self._allocator.capacity, self.device, timeout=self.timeout
        )
        heap.local[self._words : self._words + self._words_bytes].zero_()
        torch.cuda.synchronize(self.device)
        return heap

    def abort_word(self) -> torch.Tensor:
        """A page-locked host int64, mapped into the GPU's address space (unified addressing: its host address is
        its device address), which the kernels poll with volatile loads: the watchdog raises it with a host store,
        no stream and no launch (``SymmTransport._raise_abort``), as nvshmem's host-mapped abort word."""
        try:
            return torch.zeros(1, dtype=torch.int64, pin_memory=True)
        except RuntimeError as e:
            raise OdcBackendError(f"odc symm: cannot allocate the page-locked abort word: {e}") from e

    def place(self, offset: int, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A view of the GPU heap, zeroed and synchronised before alloc's agreement round (no peer pushes into
        it before the zeros landed)."""
        assert self.heap is not None
        view = self.heap.local[offset : offset + numel * dtype.itemsize].view(dtype)
        view.zero_()
        torch.cuda.current_stream(self.device).synchronize()
        return view

    def stream_key(self) -> object:
        # the raw stream (no Stream object per call): plans are per stream and launch on their key (plan.py)
        return raw_stream(self._device_index)

    # -- asynchronous operations: launched on the caller's stream, not the host worker thread ------------------
    def fetch(self, buf: SymmetricBuffer, requests: Sequence[FetchRequest], *, async_op: bool = False) -> Work | None:
        return self._on_stream("fetch", lambda: self._fetch_now(buf, requests), async_op)

    def push(
        self, buf: SymmetricBuffer, requests: Sequence[PushRequest], scale: float, *, async_op: bool = False
    ) -> Work | None:
        return self._on_stream("push", lambda: self._push_now(buf, requests, scale), async_op)

    def _on_stream(self, op: str, launch: Callable[[], None], async_op: bool) -> Work | None:
        self.check_usable(op)
        launch()
        if not async_op:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return StreamWork(self, event)
