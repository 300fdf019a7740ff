"""``symm``: the one-node Triton transport on the GPUs of one node (heap: PyTorch symmetric memory).

The transport (:class:`~.transport.SymmTransport`) is written against any :class:`~.heap.PeerHeap`; the CUDA heap
provider over ``torch.distributed._symmetric_memory`` is built beside it. Until the two are wired together this
backend reports itself unavailable (so ``init(backend=None)`` never picks it), and selecting it by name says so.
"""

from __future__ import annotations

from typing import NoReturn

from odc_runtime.errors import OdcBackendError


def is_available() -> bool:
    """Not yet: the CUDA heap provider is not wired to the transport in this build."""
    return False


def create(*, timeout: float, heap_size: int | str | None = None) -> NoReturn:
    raise OdcBackendError(
        "odc symm: the CUDA heap provider is not wired to the one-node Triton transport in this build; use "
        "backend='nvshmem' on GPUs, or backend='symm-cpu' to run the same kernels on CPU ranks"
    )
