"""Fused gradient-accumulation kernels (installed as ``odc_runtime.kernels``).

* ``accumulate_`` — ``dst += float32(src) * scale`` (src fp32/bf16/fp16, dst fp32), one pass.
* ``accumulate_slots_`` — ``dst += (slots[0] + ... + slots[K-1]) * scale`` over K staged slots in one pass,
  optionally adding ``sum(dst_new ** 2)`` into ``sumsq_out`` (for gradient-norm clipping).

The Triton implementations live in ``kernels/_triton.py`` and are imported on first use, so importing this
package never needs triton. CUDA tensors use Triton (``pip install "odc_runtime[triton]"``); CPU tensors use the
Triton interpreter when ``TRITON_INTERPRET=1`` was set before the first use, else the torch reference
(``kernels/reference.py``), which defines the exact semantics.
"""

from __future__ import annotations

import os

import torch

from .reference import accumulate_ref, accumulate_slots_ref

__all__ = [
    "accumulate_",
    "accumulate_ref",
    "accumulate_slots_",
    "accumulate_slots_ref",
    "triton_available",
]

_SRC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    """Whether triton can be imported (does not import it)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _impl():
    try:
        from . import _triton
    except ImportError as exc:
        raise ImportError(
            "odc_runtime.kernels needs triton for CUDA tensors (or TRITON_INTERPRET=1 on CPU): "
            'pip install "odc_runtime[triton]"'
        ) from exc
    return _triton


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_dst(dst: torch.Tensor) -> None:
    if dst.dtype != torch.float32:
        raise TypeError(f"dst must be float32, got {dst.dtype}")
    if not dst.is_contiguous():
        raise ValueError("dst must be contiguous")


def _check_src(name: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.dtype not in _SRC_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {src.dtype}")
    if src.device != dst.device:
        raise ValueError(f"{name} is on {src.device} but dst is on {dst.device}")
    if not src.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def accumulate_(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """In place ``dst += float32(src) * scale``; ``src`` has ``dst.numel()`` elements. Returns ``dst``."""
    _check_dst(dst)
    _check_src("src", src, dst)
    if src.numel() != dst.numel():
        raise ValueError(f"src has {src.numel()} elements, dst has {dst.numel()}")
    if not _use_triton(dst):
        return accumulate_ref(dst, src, scale)
    return _impl().accumulate_(dst, src, scale)


def accumulate_slots_(
    dst: torch.Tensor, slots: torch.Tensor, scale: float = 1.0, *, sumsq_out: torch.Tensor | None = None
) -> torch.Tensor:
    """In place ``dst += sum_k float32(slots[k]) * scale`` with ``slots`` shaped ``(K, dst.numel())``, K >= 1.

    ``sumsq_out``: optional 1-element float32 tensor; ``sum(dst_new ** 2)`` is added to it. Returns ``dst``.
    """
    _check_dst(dst)
    _check_src("slots", slots, dst)
    if slots.dim() != 2 or slots.shape[0] < 1 or slots.shape[1] != dst.numel():
        raise ValueError(f"slots must have shape (K >= 1, {dst.numel()}), got {tuple(slots.shape)}")
    if sumsq_out is not None and (
        sumsq_out.dtype != torch.float32 or sumsq_out.numel() != 1 or sumsq_out.device != dst.device
    ):
        raise ValueError("sumsq_out must be a 1-element float32 tensor on dst's device")
    if not _use_triton(dst):
        return accumulate_slots_ref(dst, slots, scale, sumsq_out=sumsq_out)
    return _impl().accumulate_slots_(dst, slots, scale, sumsq_out)
