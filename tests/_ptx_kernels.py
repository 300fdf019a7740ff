"""Small peer-memory kernels for tests/test_ptx.py: the protocol shapes the one-node transport needs (push into a
peer through a table of peer base addresses, signal after data, acquire wait that also watches an abort word), each
written right, and two written wrong on purpose with the right requirement declared: the check must fail those.
"""

import triton
import triton.language as tl


@triton.jit
def _push_kernel(bases_ptr, peer, offset, src_ptr, n, scale, BLOCK: tl.constexpr):
    # The peer's heap address in this process, as an int64 in the table, cast to a pointer.
    base = tl.load(bases_ptr + peer).to(tl.pointer_type(tl.float32))
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask, other=0).to(tl.float32) * scale
    tl.atomic_add(base + offset + offs, x, mask=mask, sem="relaxed", scope="sys")


@triton.jit
def _signal_kernel(data_ptr, value, flag_ptr):
    tl.store(data_ptr, value)
    tl.atomic_add(flag_ptr, 1, sem="release", scope="sys")  # the data is visible before the flag


@triton.jit
def _wait_kernel(flag_ptr, abort_ptr, target, out_ptr):
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    aborted = tl.load(abort_ptr, volatile=True)
    while (seen < target) & (aborted == 0):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        aborted = tl.load(abort_ptr, volatile=True)
    tl.store(out_ptr, aborted)


@triton.jit
def _signal_wrong_sem_kernel(data_ptr, value, flag_ptr):
    tl.store(data_ptr, value)
    tl.atomic_add(flag_ptr, 1, sem="relaxed", scope="sys")  # WRONG: a peer may see the flag before the data


@triton.jit
def _push_wrong_scope_kernel(bases_ptr, peer, src_ptr):
    dst = tl.load(bases_ptr + peer).to(tl.pointer_type(tl.float32))
    tl.atomic_add(dst, tl.load(src_ptr), sem="relaxed", scope="gpu")  # WRONG: other GPUs add to the same word


PUSH = [("atom.add", "relaxed", "sys")]
SIGNAL = [("atom.add", "release", "sys")]
WAIT = [("ld", "acquire", "sys"), ("ld", "volatile", "sys")]
ORDERING = {
    "_push_kernel": PUSH,
    "_signal_kernel": SIGNAL,
    "_wait_kernel": WAIT,
    "_signal_wrong_sem_kernel": SIGNAL,
    "_push_wrong_scope_kernel": PUSH,
}
_PUSH_ARGS = ({"bases_ptr": "*i64", "peer": "i32", "offset": "i64", "src_ptr": "*bf16", "n": "i64", "scale": "fp32"},
              {"BLOCK": 1024})
_SIGNAL_ARGS = ({"data_ptr": "*fp32", "value": "fp32", "flag_ptr": "*i32"}, {})
PTX_ARGS = {
    "_push_kernel": _PUSH_ARGS,
    "_signal_kernel": _SIGNAL_ARGS,
    "_wait_kernel": ({"flag_ptr": "*i32", "abort_ptr": "*i32", "target": "i32", "out_ptr": "*i32"}, {}),
    "_signal_wrong_sem_kernel": _SIGNAL_ARGS,
    "_push_wrong_scope_kernel": ({"bases_ptr": "*i64", "peer": "i32", "src_ptr": "*fp32"}, {}),
}

