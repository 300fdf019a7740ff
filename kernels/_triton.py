"""Triton implementations of the fused accumulation kernels. Imported lazily by ``odc_runtime.kernels``.

Interpreter mode (``TRITON_INTERPRET=1``, set before this module is imported) runs them on CPU tensors:
every load is upcast to fp32 right away (the interpreter's bf16 arithmetic is wrong) and autotuning uses a
single config (the interpreter rejects several).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if INTERPRET:
    _CONFIGS = [triton.Config({"BLOCK": 1024}, num_warps=4)]
else:
    _CONFIGS = [
        triton.Config({"BLOCK": 1024}, num_warps=4),
        triton.Config({"BLOCK": 2048}, num_warps=8),
        triton.Config({"BLOCK": 4096}, num_warps=8),
    ]


# In place: autotuning benchmarks each config, so the destination is restored between trials.
@triton.autotune(configs=_CONFIGS, key=["n"], restore_value=["dst_ptr"])
@triton.jit
def _accumulate_kernel(dst_ptr, src_ptr, n, scale, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(src_ptr + offs, mask=mask, other=0).to(tl.float32)
    d = tl.load(dst_ptr + offs, mask=mask, other=0)
    tl.store(dst_ptr + offs, d + s * scale, mask=mask)


@triton.autotune(configs=_CONFIGS, key=["n", "k"], restore_value=["dst_ptr"], reset_to_zero=["sumsq_ptr"])
@triton.jit
def _accumulate_slots_kernel(
    dst_ptr, slots_ptr, sumsq_ptr, n, k, slot_stride, scale, WITH_SUMSQ: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    total = tl.load(slots_ptr + offs, mask=mask, other=0).to(tl.float32)
    # 64-bit row offset: j * slot_stride overflows int32 once K * n passes 2**31 even when n alone does not
    # (slot_stride is passed as int32 whenever it fits).
    row = tl.zeros([], dtype=tl.int64)
    # A while loop, not `for _ in range(1, k)`: the interpreter of triton 3.4-3.6 cannot use a runtime scalar
    # argument as a range() bound (it holds a 1-element array, not a 0-d one). Compiled, both lower to a loop
    # with a runtime trip count; slots are still summed in slot order, as in the reference.
    j = 1
    while j < k:
        row += slot_stride
        total += tl.load(slots_ptr + row + offs, mask=mask, other=0).to(tl.float32)
        j += 1
    d = tl.load(dst_ptr + offs, mask=mask, other=0)
    r = d + total * scale
    tl.store(dst_ptr + offs, r, mask=mask)
    if WITH_SUMSQ:
        sq = tl.where(mask, r * r, 0.0)
        tl.atomic_add(sumsq_ptr, tl.sum(sq, axis=0))


def _grid(n: int):
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


def accumulate_(dst: torch.Tensor, src: torch.Tensor, scale: float) -> torch.Tensor:
    n = dst.numel()
    if n:
        _accumulate_kernel[_grid(n)](dst, src, n, float(scale))
    return dst


def accumulate_slots_(
    dst: torch.Tensor, slots: torch.Tensor, scale: float, sumsq_out: torch.Tensor | None
) -> torch.Tensor:
    n, k = dst.numel(), slots.shape[0]
    if n == 0:
        return dst
    if sumsq_out is None:
        # sumsq_ptr is unused, but it must not alias dst: the autotuner zeroes every reset_to_zero argument
        # after benchmarking, right before the real launch, which would wipe the accumulator.
        unused = torch.empty(1, dtype=torch.float32, device=dst.device)
        _accumulate_slots_kernel[_grid(n)](dst, slots, unused, n, k, slots.stride(0), float(scale), WITH_SUMSQ=False)
        return dst
    # Per-block partial sums are atomically added into a zeroed scratch word, then added to sumsq_out
    # (autotuning may run the kernel several times; reset_to_zero keeps the scratch correct).
    part = torch.zeros(1, dtype=torch.float32, device=dst.device)
    _accumulate_slots_kernel[_grid(n)](dst, slots, part, n, k, slots.stride(0), float(scale), WITH_SUMSQ=True)
    sumsq_out += part.reshape(sumsq_out.shape)
    return dst
