"""The one-node Triton transport: push, fetch, signalled puts and fences are Triton kernels over peer pointers
into a symmetric heap per rank (``PeerHeap``), so that what CI executes on CPU ranks under the Triton
interpreter is what runs on GPUs.

* ``symm-cpu`` (``cpu``): CPU ranks, the host transport's shared-memory segments as the heap, kernels under
  ``TRITON_INTERPRET=1``. Selected by ``odc.init(backend="symm-cpu")`` / ``ODC_BACKEND=symm-cpu``; never chosen
  automatically (it is the host transport, only slower, and exists to execute the GPU data plane in CI).
* ``symm`` (``cuda``): GPUs of one node, the heap from PyTorch's symmetric memory.

Protocols, ordering and deadlines: docs/design.md, "One-node Triton transport (symm, symm-cpu)".
"""

from __future__ import annotations

import importlib.util

from odc_runtime.transport import host
from odc_runtime.transport.symm.heap import PeerHeap, SegmentHeap

__all__ = ["PeerHeap", "SegmentHeap", "common_reason"]


def common_reason() -> str | None:
    """Why neither symm transport can run here, whatever the device (``None``: nothing common is missing): Triton
    and the host transport's control plane. Never raises."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'odc_runtime[triton]'; CUDA builds of torch bring it)"
    return host.unavailable_reason()
