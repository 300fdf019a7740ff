"""``symm``: the one-node Triton transport on the GPUs of one node (heap: PyTorch symmetric memory).

The transport (:class:`~.transport.SymmTransport`) is written against any :class:`~.heap.PeerHeap`; the CUDA heap
provider lives beside it (``odc_runtime.transport.symm.torch_heap``, ``open_heap(rank, world, nbytes, device)``).
Until that provider is installed this backend reports itself unavailable, and selecting it says so.
"""

from __future__ import annotations

import importlib.util
from typing import NoReturn

from odc_runtime.errors import OdcBackendError

PROVIDER = "odc_runtime.transport.symm.torch_heap"


def is_available() -> bool:
    import torch

    return (
        torch.cuda.is_available()
        and importlib.util.find_spec("triton") is not None
        and importlib.util.find_spec(PROVIDER) is not None
    )


def create(*, timeout: float, heap_size: int | str | None = None) -> NoReturn:
    raise OdcBackendError(
        "odc symm: the CUDA heap provider (odc_runtime.transport.symm.torch_heap) is not wired to the transport in "
        "this build; use backend='nvshmem' on GPUs, or backend='symm-cpu' to run the same kernels on CPU ranks"
    )
