"""Everything ODC uses of PyTorch's SymmetricMemory (``torch.distributed._symmetric_memory``), in one place.

That module is private and marked alpha: its Python API has moved between releases, so nothing else in
odc_runtime imports it. ``detect`` reads what the running torch offers, by feature (never by version number),
into a ``SymmApi``; the helpers below take that and a rendezvous handle. A missing or changed piece is an
``OdcBackendError`` naming the torch version and the attribute, and
``tests/test_symm_torch.py`` runs the detection against a fake module of each API shape.

What ODC needs, and where it differs (read from the released sources: torch 2.9.1, 2.13.0 and 2.15.0, files
``torch/distributed/_symmetric_memory/__init__.py`` and ``torch/_C/_distributed_c10d.pyi``; the releases between
are covered by the same feature tests, and ``.ci/compat.sh`` runs ``tests/test_symm_torch.py`` on its torches):

- ``empty(*size, dtype=, device=)`` allocates the local block; same shape in 2.9-2.15. From 2.13 (not in 2.9) CUDA
  allocations come from an implicit ``MemPool`` with ``no_split=True`` (``TORCH_SYMMMEM_IMPLICIT_POOL=0`` turns it
  off), so the tensor may sit at an offset inside its allocation.
- ``rendezvous(tensor, group)``: collective; ``group`` is a group *name* or a ``ProcessGroup``, required, in
  2.9-2.15. ODC passes the group name positionally, which every shape with a group argument accepts. A
  ``rendezvous`` with no group argument (the first prototypes took the group at allocation) is refused.
- ``enable_symm_mem_for_group(group_name)``: in 2.9 a plain function that registers the group's store (its
  ``rendezvous`` calls it too; it is idempotent); in 2.13 and 2.15 a ``typing_extensions.deprecated`` no-op wrapper
  (``__deprecated__`` set) that warns. ODC calls it only where it is not marked deprecated.
- Backends: ``set_backend("CUDA" | "NVSHMEM" | "NCCL")`` / ``get_backend(device)`` in 2.9-2.15 (the env var
  ``TORCH_SYMMMEM`` picks the default). ODC wants the CUDA backend: plain ``cuMem`` allocations exchanged as
  POSIX file descriptors, peer pointers over NVLink/PCIe P2P, no NVSHMEM initialised inside torch (which would
  clash with ODC's own ``nvshmem`` transport in the same process). ``set_backend`` cannot change the backend
  after the first allocation. A torch without ``set_backend`` would have only the CUDA backend.
- The handle: ``buffer_ptrs`` (each rank's *allocation* base as mapped in this process), ``rank``,
  ``world_size``, ``get_buffer(rank, sizes, dtype, storage_offset)`` (a tensor view of a peer's allocation;
  ``storage_offset`` in elements, counted from the allocation base, not from the tensor),
  ``barrier(channel=0, timeout_ms=0)``: all in 2.9-2.15. 2.13 and 2.15 add ``buffer_size`` and ``offset``, the
  tensor's byte offset inside its allocation (their own ``_cuda_get_out`` adds it to ``storage_offset``). 2.9's
  handle has no ``offset``: its tensor starts its allocation (offset 0).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from odc_runtime.errors import OdcBackendError, OdcMemoryError

__all__ = [
    "MODULE",
    "SymmApi",
    "allocate",
    "api",
    "barrier",
    "detect",
    "handle_offset",
    "peer_addresses",
    "peer_buffer",
    "rendezvous",
    "unavailable_reason",
    "use_cuda_backend",
]

MODULE = "torch.distributed._symmetric_memory"
CUDA_BACKEND = "CUDA"


def _where() -> str:
    return f"torch {torch.__version__} ({MODULE})"


@dataclass(frozen=True)
class SymmApi:
    """The pieces of SymmetricMemory this torch offers (see the module docstring for each)."""

    empty: Callable[..., torch.Tensor]
    rendezvous: Callable[[torch.Tensor, str], Any]
    enable_group: Callable[[str], None] | None  # must run before a group's first rendezvous; None: not needed
    set_backend: Callable[[str], None] | None  # None: this torch has only the CUDA backend
    get_backend: Callable[[torch.device], str | None] | None


def _positional_params(fn: Callable[..., Any]) -> int | None:
    """How many arguments ``fn`` takes positionally (``None``: cannot tell, e.g. a C function)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def detect(module: ModuleType) -> SymmApi:
    """Read ``module`` (``torch.distributed._symmetric_memory`` or a stand-in) into a ``SymmApi``.

    Raises OdcBackendError naming what is missing.
    """
    missing = [name for name in ("empty", "rendezvous") if not callable(getattr(module, name, None))]
    if missing:
        raise OdcBackendError(
            f"symm transport: {_where()} has no {' / '.join(missing)}; this transport needs torch >= 2.9 with "
            "SymmetricMemory (use backend='nvshmem' or 'host')"
        )
    rendezvous_fn = module.rendezvous
    n = _positional_params(rendezvous_fn)
    if n is not None and n < 2:
        raise OdcBackendError(
            f"symm transport: {_where()}.rendezvous takes no group argument (a SymmetricMemory prototype); "
            "this transport needs torch >= 2.9"
        )
    enable = getattr(module, "enable_symm_mem_for_group", None)
    if enable is not None and getattr(enable, "__deprecated__", None) is not None:
        enable = None  # a deprecated no-op kept for old callers: rendezvous resolves the group itself
    return SymmApi(
        empty=module.empty,
        rendezvous=rendezvous_fn,
        enable_group=enable,
        set_backend=getattr(module, "set_backend", None),
        get_backend=getattr(module, "get_backend", None),
    )


@functools.cache
def api() -> SymmApi:
    """The running torch's ``SymmApi`` (imported and detected once). Raises OdcBackendError."""
    try:
        module = importlib.import_module(MODULE)
    except Exception as e:  # absent, or failing to import on a build without distributed / CUDA support
        raise OdcBackendError(
            f"symm transport: torch {torch.__version__} has no usable {MODULE} ({type(e).__name__}: {e}); this "
            "transport needs a CUDA build of torch >= 2.9"
        ) from e
    return detect(module)


def unavailable_reason() -> str | None:
    """Why SymmetricMemory's CUDA backend cannot be used in this process (``None``: it can). Never raises."""
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    try:
        api()
    except OdcBackendError as e:
        return str(e)
    return None


def use_cuda_backend(symm: SymmApi, device: torch.device) -> None:
    """Make SymmetricMemory allocate on ``device`` with its CUDA backend (peer pointers over CUDA IPC).

    Raises OdcBackendError if another backend is in force and cannot be changed (torch fixes the backend at the
    first SymmetricMemory allocation of the process, e.g. one made by ``TORCH_SYMMMEM=NVSHMEM`` code before
    ``odc.init``).
    """
    if symm.get_backend is None:
        return  # no backend selection in this torch: CUDA is the only backend
    current = _query_backend(symm, device)
    if current == CUDA_BACKEND:
        return
    if symm.set_backend is None:
        raise OdcBackendError(
            f"symm transport: {_where()} uses the {current!r} SymmetricMemory backend on {device} and offers no "
            "set_backend; unset TORCH_SYMMMEM"
        )
    try:
        symm.set_backend(CUDA_BACKEND)
    except Exception as e:
        raise OdcBackendError(
            f"symm transport: cannot switch SymmetricMemory from the {current!r} backend to {CUDA_BACKEND!r} "
            f"({type(e).__name__}: {e}); torch fixes the backend at the process's first SymmetricMemory "
            "allocation: call odc.init() before other SymmetricMemory users, or unset TORCH_SYMMMEM"
        ) from e
    after = _query_backend(symm, device)
    if after not in (CUDA_BACKEND, None):
        raise OdcBackendError(f"symm transport: set_backend('CUDA') left the backend at {after!r} on {device}")


def _query_backend(symm: SymmApi, device: torch.device) -> str | None:
    assert symm.get_backend is not None
    try:
        return symm.get_backend(device)
    except Exception as e:
        raise OdcBackendError(f"symm transport: {_where()}.get_backend({device}) failed: {e}") from e


def allocate(symm: SymmApi, nbytes: int, device: torch.device) -> torch.Tensor:
    """This rank's ``uint8[nbytes]`` SymmetricMemory block on ``device`` (not yet rendezvoused; contents undefined).

    Raises OdcMemoryError when the device cannot hold it, OdcBackendError for any other failure.
    """
    try:
        return symm.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError as e:
        raise OdcMemoryError(
            f"symm transport: cannot allocate a {nbytes}-byte symmetric heap on {device}: {e}; lower "
            "init(heap_size=...) / ODC_HEAP_SIZE"
        ) from e
    except Exception as e:
        raise OdcBackendError(f"symm transport: SymmetricMemory allocation of {nbytes} bytes on {device}: {e}") from e


def rendezvous(symm: SymmApi, tensor: torch.Tensor, group_name: str) -> Any:
    """Collective over the process group named ``group_name``: map every rank's block into this process.

    Not bounded by ``ODC_TIMEOUT``: it waits on the ``torch.distributed`` store (the store's timeout). Call it
    only after every rank has agreed that its allocation succeeded. Raises OdcBackendError.
    """
    try:
        if symm.enable_group is not None:
            symm.enable_group(group_name)
        return symm.rendezvous(tensor, group_name)
    except Exception as e:
        raise OdcBackendError(
            f"symm transport: SymmetricMemory rendezvous on group {group_name!r} failed ({type(e).__name__}: {e}). "
            "Peers must be GPUs of one node that reach each other by P2P (NVLink or PCIe; `nvidia-smi topo -p2p "
            "r`), in processes that may exchange file descriptors (same container / pid namespace, or CAP_SYS_PTRACE)"
        ) from e


def handle_offset(handle: Any) -> int:
    """Byte offset of the rendezvoused tensor inside its allocation (0 on a torch whose handle has no ``offset``:
    there the tensor starts its allocation)."""
    return int(getattr(handle, "offset", 0))


def peer_addresses(handle: Any, nbytes: int) -> list[int]:
    """Each rank's block address in *this* process (allocation base + offset), indexed by rank.

    Raises OdcBackendError if the handle's allocation is too small for ``nbytes`` at that offset.
    """
    offset = handle_offset(handle)
    size = getattr(handle, "buffer_size", None)
    if size is not None and offset + nbytes > int(size):
        raise OdcBackendError(
            f"symm transport: the SymmetricMemory allocation holds {size} bytes, fewer than offset {offset} + "
            f"{nbytes}"
        )
    return [int(p) + offset for p in handle.buffer_ptrs]


def peer_buffer(handle: Any, peer: int, nbytes: int) -> torch.Tensor:
    """``uint8[nbytes]`` view, in this process, of ``peer``'s block (``get_buffer`` counts from the allocation
    base, so the tensor's offset is added here)."""
    return handle.get_buffer(peer, (nbytes,), torch.uint8, handle_offset(handle))


def barrier(handle: Any, *, channel: int = 0, timeout_s: float | None = None) -> None:
    """SymmetricMemory's own device-side barrier over the handle's group, on the current stream.

    For set-up and tear-down only: torch's CUDA backend ends a barrier that runs out of ``timeout_ms`` with a
    device trap, which kills the CUDA context, so the runtime's bounded waits live in its own kernels. A torch
    whose ``barrier`` takes no ``timeout_ms`` waits without a deadline.
    """
    if timeout_s is None:
        handle.barrier(channel=channel)
        return
    try:
        handle.barrier(channel=channel, timeout_ms=max(1, int(timeout_s * 1000)))
    except TypeError:  # pybind's answer to an unknown keyword: this torch's barrier has no timeout
        handle.barrier(channel=channel)
