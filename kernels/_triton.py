"""Triton implementations of the fused accumulation kernels. Imported lazily by ``odc_runtime.kernels``.

No autotuning: these kernels run inside the training loop (the hierarchy's fold at every ``sync``), and Triton's
autotuner benchmarks every config at the first call of each new shape, with device-wide synchronisations, i.e.
inside a step. They are memory-bound streaming kernels, so the launch config is a fixed function of the size
(``_config``): 1024-element blocks with 4 warps for small tensors, 4096 with 8 warps once there are enough
blocks to fill the GPU.

Interpreter mode (``TRITON_INTERPRET=1``, set before this module is imported) runs them on CPU tensors: every
load is upcast to fp32 right away (the interpreter's bf16 arithmetic is wrong).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_LARGE = 1 << 22  # elements from which 4096-element blocks still give >= 1024 blocks


def _config(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for ``n`` elements; the interpreter runs one block size."""
    if INTERPRET or n < _LARGE:
        return 1024, 4
    return 4096, 8


@triton.jit
def _accumulate_kernel(dst_ptr, src_ptr, n, scale, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(src_ptr + offs, mask=mask, other=0).to(tl.float32)
    d = tl.load(dst_ptr + offs, mask=mask, other=0)
    tl.store(dst_ptr + offs, d + s * scale, mask=mask)


# ``k`` (the slot count) is never specialized: Triton turns an int argument equal to 1 into a constant, making the
# slot loop a zero-trip loop that triton 3.5-3.6 cannot lower (``PassManager::run failed``); one slot is a real
# case (a fold over two virtual nodes).
@triton.jit(do_not_specialize=["k"])
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


def accumulate_(dst: torch.Tensor, src: torch.Tensor, scale: float) -> torch.Tensor:
    n = dst.numel()
    if n:
        block, warps = _config(n)
        _accumulate_kernel[(triton.cdiv(n, block),)](dst, src, n, float(scale), BLOCK=block, num_warps=warps)
    return dst


def accumulate_slots_(
    dst: torch.Tensor, slots: torch.Tensor, scale: float, sumsq_out: torch.Tensor | None
) -> torch.Tensor:
    n, k = dst.numel(), slots.shape[0]
    if n == 0:
        return dst
    block, warps = _config(n)
    grid = (triton.cdiv(n, block),)
    if sumsq_out is None:
        # sumsq_ptr is unused (WITH_SUMSQ=False) but must be a valid pointer argument
        _accumulate_slots_kernel[grid](
            dst, slots, dst, n, k, slots.stride(0), float(scale), WITH_SUMSQ=False, BLOCK=block, num_warps=warps
        )
        return dst
    # Per-block partial sums are atomically added into a zeroed scratch word, then added to sumsq_out.
    part = torch.zeros(1, dtype=torch.float32, device=dst.device)
    _accumulate_slots_kernel[grid](
        dst, slots, part, n, k, slots.stride(0), float(scale), WITH_SUMSQ=True, BLOCK=block, num_warps=warps
    )
    sumsq_out += part.reshape(sumsq_out.shape)
    return dst


# Ordered memory operations each kernel's PTX must have, checked by ``odc_runtime.kernels.ptx`` (tests/test_ptx.py)
# on sm_80/90/100: the accumulations touch only this rank's memory, so they have none; the gradient-norm partial
# sum is one atomic add into a local scratch word (Triton's default acq_rel, gpu scope).
ORDERING: dict[str, list[tuple[str, str, str]]] = {
    "_accumulate_kernel": [],
    "_accumulate_slots_kernel": [],
    "_accumulate_slots_kernel:sumsq": [("atom.add", "acq_rel", "gpu")],
}
_SLOTS = {"dst_ptr": "*fp32", "slots_ptr": "*bf16", "sumsq_ptr": "*fp32", "n": "i32", "k": "i32", "slot_stride": "i32",
          "scale": "fp32"}
PTX_ARGS: dict[str, tuple[dict[str, str], dict[str, object]]] = {
    "_accumulate_kernel": ({"dst_ptr": "*fp32", "src_ptr": "*bf16", "n": "i32", "scale": "fp32"}, {"BLOCK": 1024}),
    "_accumulate_slots_kernel": (_SLOTS, {"WITH_SUMSQ": False, "BLOCK": 1024}),
    "_accumulate_slots_kernel:sumsq": (_SLOTS, {"WITH_SUMSQ": True, "BLOCK": 1024}),
}


def launch_examples() -> list[tuple[str, str, object]]:
    """The calls the launch check (``odc_runtime.kernels.launch_check``) compiles, per ORDERING case: this module's
    launchers with CPU tensors standing for what callers pass. Triton specializes by value (an int equal to 1 is a
    constant, a multiple of 16 or a 16-byte aligned pointer gets an attribute), so each value class is here: one
    element, one slot (a fold over two virtual nodes), aligned and unaligned rows, a size that picks the large
    block. No data is read: the fake driver launches nothing."""

    def vec(n: int, dtype: torch.dtype = torch.float32, offset: int = 0) -> torch.Tensor:
        return torch.empty(n + offset, dtype=dtype)[offset:]  # offset 1: a row not 16-byte aligned

    def slots(k: int, n: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(k, n, dtype=dtype)

    norm = torch.zeros(1)
    acc, fold = accumulate_, accumulate_slots_
    return [
        ("_accumulate_kernel", "bf16, 4096 elements, aligned", lambda: acc(vec(4096), vec(4096, torch.bfloat16), 0.5)),
        ("_accumulate_kernel", "fp32, 1001 elements, unaligned rows", lambda: acc(vec(1001, offset=1),
                                                                               vec(1001, offset=1), 1.0)),
        ("_accumulate_kernel", "fp16, one element", lambda: acc(vec(1), vec(1, torch.float16), 1.0)),
        ("_accumulate_kernel", "bf16, 2**22 elements (large blocks)", lambda: acc(vec(_LARGE),
                                                                               vec(_LARGE, torch.bfloat16), 1.0)),
        ("_accumulate_slots_kernel", "one slot (two virtual nodes), 1000 elements",
         lambda: fold(vec(1000), slots(1, 1000), 1.0, None)),
        ("_accumulate_slots_kernel", "one slot of one element", lambda: fold(vec(1), slots(1, 1), 1.0, None)),
        ("_accumulate_slots_kernel", "3 fp32 slots, 4096 elements, aligned",
         lambda: fold(vec(4096), slots(3, 4096, torch.float32), 1.0, None)),
        ("_accumulate_slots_kernel", "2 slots, 1001 elements, unaligned dst",
         lambda: fold(vec(1001, offset=1), slots(2, 1001), 0.25, None)),
        ("_accumulate_slots_kernel:sumsq", "one slot, 4096 elements, with the norm",
         lambda: fold(vec(4096), slots(1, 4096), 1.0, norm)),
        ("_accumulate_slots_kernel:sumsq", "7 slots, 1001 elements, with the norm",
         lambda: fold(vec(1001), slots(7, 1001, torch.float16), 1.0, norm)),
    ]
