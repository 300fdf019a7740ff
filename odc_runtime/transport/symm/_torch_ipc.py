"""Everything ODC uses of PyTorch's CUDA IPC (the storage sharing behind ``torch.multiprocessing``), in one place.

The symm heap comes from CUDA IPC where ranks share a GPU (SymmetricMemory refuses that) or SymmetricMemory is
missing. Torch's own sharing is used rather than ``cudaIpcGetMemHandle`` by hand: it knows where a storage sits in
its caching-allocator block, keeps the block alive while another process maps it (a reference count in shared
memory), and orders the mapping after the work pending on the block (an IPC event).

The two storage methods are private but have kept one shape since torch 1.x (read in torch 2.9.1, 2.13.0 and
2.15.0, ``torch/multiprocessing/reductions.py``, which calls them): ``UntypedStorage._share_cuda_()`` returns
``(device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset, event_handle,
event_sync_required)``; ``UntypedStorage._new_shared_cuda(*those)`` maps it in another process. Each
``_share_cuda_`` call counts one more consumer (each mapping releases one when it is freed), so a rank exports
once per peer. ``_new_shared_cuda`` opens the memory on the device it is given: ODC gives the consumer's own GPU,
and CUDA then enables peer access to the owner's GPU where they differ (``cudaIpcMemLazyEnablePeerAccess``, which
torch passes). A missing method or another tuple is an ``OdcBackendError`` naming the torch version;
``tests/test_symm_ipc.py`` checks the shape against the installed torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from odc_runtime.errors import OdcBackendError, OdcMemoryError

__all__ = ["FIELDS", "allocate", "api_reason", "export", "open_export", "unavailable_reason"]

# _share_cuda_'s tuple, in order (the record ``export`` returns holds them, JSON-encoded)
FIELDS = (
    "device",
    "handle",
    "size_bytes",
    "offset_bytes",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
_METHODS = ("_share_cuda_", "_new_shared_cuda")


def _where() -> str:
    return f"torch {torch.__version__}"


def api_reason() -> str | None:
    """Why this torch cannot share CUDA storage between processes (``None``: it can). Never raises."""
    missing = [m for m in _METHODS if not callable(getattr(torch.UntypedStorage, m, None))]
    if missing:
        return f"{_where()} has no torch.UntypedStorage.{missing[0]} (CUDA IPC storage sharing)"
    return None


def unavailable_reason() -> str | None:
    """Why the symm heap cannot come from CUDA IPC in this process (``None``: it can). Never raises."""
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return api_reason()


def _encode(value: object) -> object:
    return {"hex": value.hex()} if isinstance(value, bytes) else value


def _decode(value: object) -> object:
    return bytes.fromhex(value["hex"]) if isinstance(value, dict) else value


def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """This rank's block: ``uint8[nbytes]`` on ``device``, a whole storage of torch's caching allocator."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError as e:
        raise OdcMemoryError(f"symm heap: {nbytes} bytes do not fit on {device}: {e}") from e


def export(local: torch.Tensor) -> list[object]:
    """One consumer's share of ``local`` (a whole CUDA storage, offset 0), as a JSON-serialisable record."""
    if local.storage_offset() != 0 or local.untyped_storage().nbytes() != local.nbytes:
        raise OdcBackendError("symm heap (CUDA IPC): the exported tensor must be its whole storage")
    try:
        fields = local.untyped_storage()._share_cuda_()
    except RuntimeError as e:
        raise OdcBackendError(
            f"symm heap (CUDA IPC): {_where()} cannot share this CUDA allocation with another process: {e} (an "
            "allocator setting such as PYTORCH_CUDA_ALLOC_CONF=expandable_segments may not support IPC; give every "
            "rank its own GPU to use SymmetricMemory instead)"
        ) from e
    if not isinstance(fields, tuple) or len(fields) != len(FIELDS):
        raise OdcBackendError(
            f"symm heap (CUDA IPC): {_where()}'s UntypedStorage._share_cuda_ returned {type(fields).__name__} of "
            f"{len(fields) if isinstance(fields, tuple) else '?'} fields, expected the {len(FIELDS)} of {FIELDS}"
        )
    return [_encode(v) for v in fields]


def open_export(record: Sequence[object], device: torch.device, nbytes: int) -> torch.Tensor:
    """Map a peer's ``export`` record in this process, on ``device`` (this rank's GPU, with its index): a
    ``uint8[nbytes]`` tensor over the peer's memory. The record arrives as a list or, through
    ``agree.gather_checked`` (which gives JSON arrays back as tuples), a tuple."""
    if not isinstance(record, (list, tuple)) or len(record) != len(FIELDS):
        raise OdcBackendError(f"symm heap (CUDA IPC): a malformed export record ({type(record).__name__})")
    fields = [_decode(v) for v in record]
    fields[0] = device.index  # opened on this rank's GPU (see the module docstring)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
    except RuntimeError as e:
        raise OdcBackendError(
            f"symm heap (CUDA IPC): cannot map a peer's heap on {device}: {e} (the ranks must run on one node, "
            "their GPUs visible to each other and reachable by P2P)"
        ) from e
    if storage.nbytes() != nbytes:
        raise OdcBackendError(
            f"symm heap (CUDA IPC): a peer's heap maps {storage.nbytes()} bytes, expected {nbytes}"
        )
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
