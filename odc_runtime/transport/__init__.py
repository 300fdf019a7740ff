"""Transports: symmetric memory with one-sided get / accumulate (see :mod:`odc_runtime.transport.base`)."""

from odc_runtime.transport.base import (
    AccumulateRequest,
    GetRequest,
    Piece,
    SymmetricBuffer,
    TransferPlan,
    Transport,
    Work,
)

__all__ = [
    "AccumulateRequest",
    "GetRequest",
    "Piece",
    "SymmetricBuffer",
    "TransferPlan",
    "Transport",
    "Work",
    "nvshmem_available",
]


def nvshmem_available() -> bool:
    """Whether the nvshmem transport can run here (CUDA device present and ``odc_runtime._C`` built)."""
    try:
        from odc_runtime.transport import nvshmem
    except ImportError:
        return False
    return nvshmem.is_available()
