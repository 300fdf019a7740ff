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


# -- the transport's kernels (odc_runtime.kernels.peer) -----------------------------------------------------------
# How to compile each of them for the check, and the ordering of the one its ORDERING leaves out (fetch: plain loads
# and stores, ordered by the barriers around it). Used only where kernels/peer.py does not declare these itself.
PEER_PTX_ARGS = {
    "push_kernel": ({"table_ptr": "*i64", "desc_ptr": "*i64", "scale": "fp32"},
                    {"SRC": tl.bfloat16, "ACC": tl.float32, "BLOCK": 1024}),
    "fetch_kernel": ({"table_ptr": "*i64", "desc_ptr": "*i64"}, {"DT": tl.bfloat16, "BLOCK": 1024}),
    "put_signal_kernel": ({"table_ptr": "*i64", "desc_ptr": "*i64", "sig_ptr": "*i64", "count_ptr": "*i64"},
                          {"DT": tl.float32, "BLOCK": 1024}),
    "wait_kernel": ({"word_ptr": "*i64", "target": "i64", "abort_ptr": "*i64", "status_ptr": "*i64"}, {}),
    "barrier_kernel": ({"table_ptr": "*i64", "members_ptr": "*i64", "nmembers": "i32", "rank": "i32",
                        "row_offset": "i64", "epoch": "i64", "abort_ptr": "*i64", "status_ptr": "*i64"}, {}),
}
PEER_ORDERING_EXTRA = {"fetch_kernel": []}
PEER_HELPERS = ("_peer_ptr",)


def complete_peer_tables(module) -> None:
    """Give ``module`` (kernels/peer.py) the check's tables it does not declare; never overrides its own."""
    if not hasattr(module, "PTX_ARGS"):
        module.PTX_ARGS = {k: v for k, v in PEER_PTX_ARGS.items() if k in module.ORDERING or k in PEER_ORDERING_EXTRA}
    for name, table in PEER_ORDERING_EXTRA.items():
        if hasattr(module, name) and name in module.PTX_ARGS:
            module.ORDERING.setdefault(name, table)
    if not hasattr(module, "PTX_HELPERS"):
        module.PTX_HELPERS = tuple(h for h in PEER_HELPERS if hasattr(module, h))
