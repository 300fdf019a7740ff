"""A kernel for tests/test_ptx.py's launch check: it compiles with ``k`` typed ``i32`` (its ``PTX_ARGS``, what
the PTX check compiles) but not when Triton's launch path specializes ``k == 1`` into a constant (``1 // (k - 1)``
is then a division by zero while compiling), as ``_accumulate_slots_kernel`` did on triton 3.5-3.6 with one slot.
The launch check must report the ``k == 1`` launch and pass the ``k == 2`` one.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _one_wrong_kernel(out_ptr, k):
    tl.store(out_ptr, 1 // (k - 1))


def launch_one(out: torch.Tensor, k: int) -> None:
    _one_wrong_kernel[(1,)](out, k)


ORDERING = {"_one_wrong_kernel": []}
PTX_ARGS = {"_one_wrong_kernel": ({"out_ptr": "*i32", "k": "i32"}, {})}


def launch_examples() -> list:
    out = torch.zeros(1, dtype=torch.int32)
    return [("_one_wrong_kernel", "k == 1", lambda: launch_one(out, 1)),
            ("_one_wrong_kernel", "k == 2", lambda: launch_one(out, 2))]
