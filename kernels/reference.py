"""Torch reference implementations of the fused accumulation kernels (the definition the Triton kernels match).

All arithmetic is fp32: inputs are upcast first (exact for bf16/fp16), the K slots are summed in slot order,
then ``dst += total * scale``.
"""

from __future__ import annotations

import torch


def accumulate_ref(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``dst += float32(src) * scale`` in place; returns ``dst``."""
    dst.add_(src.reshape(dst.shape).to(torch.float32) * scale)
    return dst


def accumulate_slots_ref(
    dst: torch.Tensor, slots: torch.Tensor, scale: float = 1.0, *, sumsq_out: torch.Tensor | None = None
) -> torch.Tensor:
    """``dst += (slots[0] + ... + slots[K-1]) * scale`` in place (fp32), ``slots`` shaped ``(K, dst.numel())``.

    With ``sumsq_out`` (a 1-element fp32 tensor), ``sum(dst_new ** 2)`` is *added* to it (zero it first; adding
    lets one buffer collect the squared norm of many tensors for gradient clipping). Returns ``dst``.
    """
    total = slots[0].to(torch.float32).clone()
    for k in range(1, slots.shape[0]):
        total += slots[k].to(torch.float32)
    dst.add_(total.reshape(dst.shape) * scale)
    if sumsq_out is not None:
        sumsq_out += (dst.to(torch.float32) ** 2).sum().reshape(sumsq_out.shape)
    return dst
