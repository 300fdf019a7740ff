"""The one-node Triton transport's data plane over peer pointers (installed as ``odc_runtime.kernels.peer``).

Every kernel reaches a peer's symmetric heap through a per-process table of peer base addresses (``int64[world]``,
each peer's heap base *in this process*) loaded in the kernel and cast to a pointer; everything two ranks agree on
is a symmetric *byte offset* into the heap, never an address. The same kernels compile for CUDA and run on CPU
ranks under the Triton interpreter (``TRITON_INTERPRET=1`` set before this module is imported), where the heaps
are shared-memory segments mapped at different addresses in each process.

Requests are described by rows of an ``int64`` descriptor tensor (one launch per operation, whatever the number of
peers); program ``(b, r)`` handles block ``b`` of request ``r``. Accumulators are fp32 (the interpreter's fp16
atomics lose updates across processes and bf16 atomics do not exist there), so sources of any float dtype are
cast in the kernel. ``ACC`` is a constexpr so that deterministic mode's ``int64`` fixed-point push (``int64``
sources, already quantised: ``odc_runtime.deterministic``) reuses the kernel as an exact integer atomic add.

The kernels use only builtins of ``triton.language``, none of its ``@triton.jit`` library functions (``tl.zeros``,
``tl.sum``, ...): those are defined when ``triton.language`` is first imported, and a process that imported it
before ``symm-cpu`` set the interpreter up (torch does, e.g. for SDPA) holds compiled ones the interpreter cannot
call.

``ORDERING`` declares, per kernel, the atomics its protocol needs as ``(op, sem, scope)``: the PTX check
compiles each kernel and asserts them; docs/design.md ("One-node Triton transport") gives the arguments.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable

import torch
import triton
import triton.language as tl

from .launch import CachedKernel

INTERPRET = bool(getattr(getattr(triton, "knobs", None), "runtime", None) and triton.knobs.runtime.interpret)

# Push and copy rows: (peer, symmetric byte offset in the peer's heap, local address, numel).
DESC_COLUMNS = 4
BLOCK = 4096 if INTERPRET else 1024  # the interpreter pays per program: fewer, larger blocks

# The memory operations each kernel's protocol needs, as ``(op, sem, scope)`` with ``op`` the PTX instruction and
# its operation (``atom.add``, ``red.max``, ``ld``; state space and type left out): what Triton 3.9 emits for sm_90
# (an atomic whose result is unused becomes ``red``; an acquire atomic add of 0 becomes an acquire load).
ORDERING: dict[str, list[tuple[str, str, str]]] = {
    # lost-update freedom across GPUs: every add one hardware atomic at system scope; no ordering needed (the
    # barrier's release/acquire publishes the sums)
    "push_kernel": [("red.add", "relaxed", "sys")],
    "push_kernel:aligned": [("red.add", "relaxed", "sys")],  # the same, 4 floats an operation (VECTOR)
    # the same for deterministic mode's int64 fixed-point push (an integer red.add: exact in any order)
    "push_kernel:int64": [("red.add", "relaxed", "sys")],
    # ... and its fused variant, quantising a float source in registers before the same integer red.add
    "push_kernel:fixed": [("red.add", "relaxed", "sys")],
    # plain loads: the barrier before the fetch orders them
    "fetch_kernel": [],
    "fetch_kernel:aligned": [],
    # data stores, a CTA barrier, then each block counts itself in (acq_rel); the last block's release add on the
    # peer's signal word makes every block's data visible to an acquire of that word
    "put_signal_kernel": [("atom.add", "acq_rel", "sys"), ("red.add", "release", "sys")],
    # a spin on volatile loads, then one acquire read of the word that ended it
    "wait_kernel": [("ld", "acquire", "sys")],
    # announce with a release max (orders this stream's earlier work), acquire read of every member's word
    "barrier_kernel": [("red.max", "release", "sys"), ("ld", "acquire", "sys")],
}

# The vector accesses the aligned variants must have, per architecture, as (op, bytes per access): ORDERING names
# operations without their vector width. 16-byte loads and stores everywhere; 16-byte fp32 reductions
# (``red.global.add.v4.f32``) on sm_90 and sm_100 only (sm_80 has no vector red, so its reductions stay scalar).
VECTOR: dict[str, dict[int, list[tuple[str, int]]]] = {
    "push_kernel:aligned": {80: [("ld", 16)], 90: [("ld", 16), ("red.add", 16)], 100: [("ld", 16), ("red.add", 16)]},
    "fetch_kernel:aligned": {arch: [("ld", 16), ("st", 16)] for arch in (80, 90, 100)},
}

# How the PTX check (``odc_runtime.kernels.ptx``, tests/test_ptx.py) compiles each kernel of ORDERING: the
# signature and constexprs the launchers below use (one representative source dtype where a kernel takes several).
_PUSH_SIG = {"table_ptr": "*i64", "desc_ptr": "*i64", "f1": "fp32", "f2": "fp32", "scale": "fp32"}
PTX_ARGS: dict[str, tuple[dict[str, str], dict[str, object]]] = {
    "push_kernel": (_PUSH_SIG, {"SRC": tl.bfloat16, "ACC": tl.float32, "BLOCK": 1024, "ALIGNED": False}),
    "push_kernel:aligned": (_PUSH_SIG, {"SRC": tl.bfloat16, "ACC": tl.float32, "BLOCK": 1024, "ALIGNED": True}),
    "push_kernel:int64": (_PUSH_SIG, {"SRC": tl.int64, "ACC": tl.int64, "BLOCK": 1024, "ALIGNED": False}),
    "push_kernel:fixed": (_PUSH_SIG, {"SRC": tl.bfloat16, "ACC": tl.int64, "BLOCK": 1024, "ALIGNED": False}),
    "fetch_kernel": ({"table_ptr": "*i64", "desc_ptr": "*i64"}, {"DT": tl.int16, "BLOCK": 1024, "ALIGNED": False}),
    "fetch_kernel:aligned": ({"table_ptr": "*i64", "desc_ptr": "*i64"},
                             {"DT": tl.int16, "BLOCK": 1024, "ALIGNED": True}),
    "put_signal_kernel": ({"table_ptr": "*i64", "desc_ptr": "*i64", "sig_ptr": "*i64", "count_ptr": "*i64"},
                          {"DT": tl.int32, "BLOCK": 1024}),
    "wait_kernel": ({"word_ptr": "*i64", "target": "i64", "abort_ptr": "*i64", "status_ptr": "*i64"}, {}),
    "barrier_kernel": ({"table_ptr": "*i64", "members_ptr": "*i32", "nmembers": "i32", "rank": "i32",
                        "row_offset": "i64", "epoch": "i64", "abort_ptr": "*i64", "status_ptr": "*i64"}, {}),
}
PTX_HELPERS = ("_peer_ptr", "_span", "_ends", "_part")  # device functions, checked inside the kernels

# The interpreter must not run launches of two threads of one process at once (the async worker and the caller).
_LAUNCH = threading.Lock() if INTERPRET else None


@triton.jit
def _peer_ptr(table_ptr, peer, offset, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer of type ``dtype`` to byte ``offset`` of ``peer``'s heap, through this process's peer table;
    ``ALIGNED``: declared 16-byte aligned (here, where the pointer is made: triton <= 3.6 drop a hint put on the
    result of a call once they inline it)."""
    base = tl.load(table_ptr + peer)
    ptr = (base + offset).to(tl.pointer_type(dtype))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _span(table_ptr, row, n, b, PEER: tl.constexpr, LOCAL: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``b`` of descriptor ``row`` (``n`` elements): the pointer into the peer's heap (type ``PEER``), the
    local pointer (type ``LOCAL``), the block's element offsets and their mask."""
    offs = b * BLOCK + tl.arange(0, BLOCK)
    peer = _peer_ptr(table_ptr, tl.load(row), tl.load(row + 1), PEER, False)
    return peer, tl.load(row + 2).to(tl.pointer_type(LOCAL)), offs, offs < n


@triton.jit
def _ends(table_ptr, row, PEER: tl.constexpr, LOCAL: tl.constexpr, ALIGNED: tl.constexpr):
    """The pointer into the peer's heap (type ``PEER``) and the local pointer (type ``LOCAL``) of descriptor
    ``row``; with ``ALIGNED`` both are declared 16-byte aligned (the launcher checked every row: ALIGN)."""
    peer = _peer_ptr(table_ptr, tl.load(row), tl.load(row + 1), PEER, ALIGNED)
    local = tl.load(row + 2).to(tl.pointer_type(LOCAL))
    if ALIGNED:
        local = tl.multiple_of(local, 16)
    return peer, local


@triton.jit
def _part(b, n, PART: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Element offsets and mask of part ``PART`` of block ``b`` of a row of ``n`` elements. Unaligned: one part,
    the block. Aligned: part 0 is the block bounded by ``n`` rounded down to a multiple of 16 elements (a mask
    constant over every 16 elements, so with 16-byte aligned pointers Triton emits 16-byte vector accesses);
    part 1 is the row's last ``n % 16`` elements, each done by the block it falls in, with scalar accesses."""
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if ALIGNED:
        main = tl.multiple_of((n // 16) * 16, 16)
        if PART == 0:
            mask = offs < main
        else:
            offs = main + tl.arange(0, 16)
            mask = (offs < n) & (offs >= b * BLOCK) & (offs < b * BLOCK + BLOCK)  # each tail element once
    return offs, mask


@triton.jit
def push_kernel(table_ptr, desc_ptr, f1, f2, scale, SRC: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr,
                ALIGNED: tl.constexpr):
    """``peer_heap[offset:][:n] += ACC(src[:n]) * scale`` for each descriptor row, with system-scope atomics.

    ``ACC`` int64 is deterministic mode's fixed point (``odc_runtime.deterministic``), an exact integer add: with
    ``SRC`` int64 the source is already quantised (``scale``, ``f1``, ``f2`` unused); with a float ``SRC`` the kernel
    quantises in registers, ``q = round_half_even(fp64(fp32(src * scale)) * f1 * f2)`` (``f1 * f2 = 2**F``, two
    powers of two that fp32 arguments can carry), bit for bit the host-side quantiser's ``q``. ``scale`` is the
    last runtime parameter: a bound launch (``bind_push``) takes it at each call. ``ALIGNED``: every row's
    addresses are 16-byte aligned (``_part``: vector loads, and vector reductions where the target has them)."""
    b = tl.program_id(0).to(tl.int64)
    row = desc_ptr + tl.program_id(1).to(tl.int64) * 4
    n = tl.load(row + 3)
    if b * BLOCK < n:
        dst, src = _ends(table_ptr, row, ACC, SRC, ALIGNED)
        for part in tl.static_range(1 + ALIGNED):
            offs, mask = _part(b, n, part, BLOCK, ALIGNED)
            if ACC == tl.int64:  # noqa: SIM300 (a constexpr parameter, not a constant)
                if SRC == tl.int64:  # noqa: SIM300
                    q = tl.load(src + offs, mask=mask, other=0)
                else:
                    v = tl.load(src + offs, mask=mask, other=0).to(tl.float32) * scale  # the default mode's fp32
                    # exact products (powers of two, |x| < 2**51 when the bound covers v), so contracting the last
                    # one with the add into an fma (the compiler does) rounds the same; adding 1.5 * 2**52
                    # (deterministic.py's _ROUNDER) rounds to an integer held in the low mantissa bits: the bit
                    # pattern minus the constant's
                    x = v.to(tl.float64) * f1 * f2 + 6755399441055744.0
                    q = x.to(tl.int64, bitcast=True) - 4843621399236968448
                tl.atomic_add(dst + offs, q, mask=mask, sem="relaxed", scope="sys")
            else:
                val = tl.load(src + offs, mask=mask, other=0).to(tl.float32) * scale
                tl.atomic_add(dst + offs, val.to(ACC), mask=mask, sem="relaxed", scope="sys")


@triton.jit
def fetch_kernel(table_ptr, desc_ptr, DT: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """``local[:n] = peer_heap[offset:][:n]`` for each descriptor row (plain loads: the barrier orders them);
    ``ALIGNED`` as ``push_kernel``'s (vector loads and stores)."""
    b = tl.program_id(0).to(tl.int64)
    row = desc_ptr + tl.program_id(1).to(tl.int64) * 4
    n = tl.load(row + 3)
    if b * BLOCK < n:
        src, dst = _ends(table_ptr, row, DT, DT, ALIGNED)
        for part in tl.static_range(1 + ALIGNED):
            offs, mask = _part(b, n, part, BLOCK, ALIGNED)
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def put_signal_kernel(table_ptr, desc_ptr, sig_ptr, count_ptr, DT: tl.constexpr, BLOCK: tl.constexpr):
    """For each row: ``peer_heap[offset:][:n] = local[:n]``, then ``+1`` on the peer's signal word (byte offset
    ``sig_ptr[r]`` of its heap) once every block of the row has stored its data.

    No block waits for another: each counts itself in ``count_ptr[r]`` (zeroed by the caller) with an acq_rel
    add after its stores; the block that counts last signals with a release add, so an acquire of the signal word
    sees all of the row's data (release sequence + causality through the counter). Each block's count is one
    thread's atomic (Triton issues a scalar atomic from one thread), and a release covers only the writes its own
    thread made or observed: the CTA barrier before it orders every thread's stores of the block before the count
    (the PTX check requires it: ``odc_runtime.kernels.ptx``, "unbarriered release")."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    row = desc_ptr + r * 4
    peer = tl.load(row)
    n = tl.load(row + 3)
    if b * BLOCK < n:
        dst, src, offs, mask = _span(table_ptr, row, n, b, DT, DT, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
    tl.debug_barrier()  # every thread's stores before this block's count (Triton <= 3.8 emits no barrier here)
    done = tl.atomic_add(count_ptr + r, 1, sem="acq_rel", scope="sys")
    if done == tl.num_programs(0) - 1:
        word = _peer_ptr(table_ptr, peer, tl.load(sig_ptr + r), tl.int64, False)
        tl.atomic_add(word, 1, sem="release", scope="sys")


@triton.jit(do_not_specialize=["target"])  # a running count: one compiled kernel for every value
def wait_kernel(word_ptr, target, abort_ptr, status_ptr):
    """Spin until the local signal word reaches ``target`` or the abort word is raised; one program.

    ``status_ptr[0]`` = 1 if the word was reached (then acquired), 2 if aborted; ``status_ptr[1]`` = last value."""
    seen = tl.load(word_ptr, volatile=True)
    abort = tl.load(abort_ptr, volatile=True)
    while (seen < target) & (abort == 0):
        seen = tl.load(word_ptr, volatile=True)
        abort = tl.load(abort_ptr, volatile=True)
    if seen >= target:
        seen = tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")
        tl.store(status_ptr, 1)
    else:
        tl.store(status_ptr, 2)
    tl.store(status_ptr + 1, seen)


# Round numbers and row offsets change from call to call: one compiled kernel for every value.
@triton.jit(do_not_specialize=["nmembers", "rank", "row_offset", "epoch"])
def barrier_kernel(table_ptr, members_ptr, nmembers, rank, row_offset, epoch, abort_ptr, status_ptr):
    """Barrier ``epoch`` among ``members`` on the words of one row (byte ``row_offset`` of every heap; word ``q``
    is the last epoch member ``q`` announced there). One program.

    Announce (release max into word ``rank`` of every member's row), then spin until every member's word in this
    rank's row reached ``epoch`` or the abort word is raised, then acquire each. ``status_ptr[0]`` = 1 done, 2
    aborted; on abort ``status_ptr[1 + i]`` is member ``i``'s word."""
    i = 0
    while i < nmembers:
        q = tl.load(members_ptr + i).to(tl.int64)
        word = _peer_ptr(table_ptr, q, row_offset + rank * 8, tl.int64, False)
        tl.atomic_max(word, epoch, sem="release", scope="sys")
        i += 1
    own = _peer_ptr(table_ptr, rank, row_offset, tl.int64, False)
    aborted = tl.load(abort_ptr, volatile=True)  # an int64 scalar (loop-carried), already raised or not
    i = 0
    while (i < nmembers) & (aborted == 0):
        q = tl.load(members_ptr + i).to(tl.int64)
        seen = tl.load(own + q, volatile=True)
        if seen >= epoch:
            # The acquire read's result decides the step (it is >= seen: words only grow), so no Triton may drop
            # it as dead code: triton <= 3.7.1 deleted an acquire atomic whose result was unused.
            acquired = tl.atomic_add(own + q, 0, sem="acquire", scope="sys")
            i += (acquired >= epoch).to(tl.int32)
        else:
            aborted = tl.load(abort_ptr, volatile=True)
    if aborted == 0:
        tl.store(status_ptr, 1)
    else:
        tl.store(status_ptr, 2)
        j = 0
        while j < nmembers:
            q = tl.load(members_ptr + j).to(tl.int64)
            tl.store(status_ptr + 1 + j, tl.load(own + q, volatile=True))
            j += 1


# -- launchers ------------------------------------------------------------------------------------------------
_FLOATS = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
           torch.int64: tl.int64}
_WORDS = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}  # copies move bits: any dtype by its item size


def tl_dtype(dtype: torch.dtype):
    """The Triton type a push reads or accumulates for a torch dtype (TypeError for one it does not)."""
    try:
        return _FLOATS[dtype]
    except KeyError:
        raise TypeError(f"odc push kernels do not read or accumulate {dtype}") from None


def word_dtype(dtype: torch.dtype):
    """The Triton integer type of a torch dtype's item size (copies move bits, so any dtype of 1-8 bytes)."""
    try:
        return _WORDS[dtype.itemsize]
    except KeyError:
        raise TypeError(f"odc copy kernels do not move {dtype}") from None


# Compiled: each kernel through its cached runner once compiled for an argument signature (kernels/launch.py).
_CACHED = {k: CachedKernel(k) for k in (push_kernel, fetch_kernel, put_signal_kernel, wait_kernel, barrier_kernel)}


def launches() -> dict[str, list[int]]:
    """Per kernel, how many launches went through Triton's binder and how many through the cached runner."""
    return {k.fn.__name__: list(c.launches) for k, c in _CACHED.items()}


def _launch(kernel, grid, *args, **kwargs) -> None:
    if _LAUNCH is None:
        _CACHED[kernel](grid, *args, **kwargs)
        return
    with _LAUNCH:
        kernel[grid](*args, **kwargs)


ALIGN = 16  # bytes: rows whose addresses are all multiples of this take the kernels' ALIGNED variant


def rows_aligned(rows: Iterable[tuple[int, int, int, int]], heaps_aligned: bool) -> bool:
    """Whether descriptor rows ``(peer, byte offset in the peer's heap, local address, numel)`` may take the
    ALIGNED variant: every peer offset and local address is a multiple of ``ALIGN``, and so are the heaps'
    bases in this process (``heaps_aligned``: the transport checked its peer table once)."""
    return heaps_aligned and all(off % ALIGN == 0 and addr % ALIGN == 0 for _, off, addr, _ in rows)


def _grid(desc: torch.Tensor, longest: int) -> tuple[int, int]:
    return (max(1, -(-longest // BLOCK)), desc.shape[0])  # not triton.cdiv: a jit function, a µs per call


def push(table: torch.Tensor, desc: torch.Tensor, longest: int, scale: float, src_dtype: torch.dtype,
         acc_dtype: torch.dtype = torch.float32, shift: int = 0, aligned: bool = False) -> None:
    """Launch ``push_kernel`` over the rows of ``desc`` (``longest`` = the largest ``numel`` of a row); into an
    int64 accumulator from a float source, each value is quantised with ``2**shift`` in the kernel. ``aligned``:
    the rows passed ``rows_aligned`` (the vector variant)."""
    half = shift // 2  # 2**shift as two fp32-representable factors (|shift| <= 200)
    _launch(push_kernel, _grid(desc, longest), table, desc, math.ldexp(1.0, half), math.ldexp(1.0, shift - half),
            float(scale), SRC=tl_dtype(src_dtype), ACC=tl_dtype(acc_dtype), BLOCK=BLOCK, ALIGNED=bool(aligned))


def fetch(table: torch.Tensor, desc: torch.Tensor, longest: int, dtype: torch.dtype, aligned: bool = False) -> None:
    """Launch ``fetch_kernel`` over the rows of ``desc`` (``aligned`` as ``push``'s)."""
    _launch(fetch_kernel, _grid(desc, longest), table, desc, DT=word_dtype(dtype), BLOCK=BLOCK, ALIGNED=bool(aligned))


def bind_fetch(table: torch.Tensor, desc: torch.Tensor, longest: int, dtype: torch.dtype, aligned: bool,
               stream: int | None) -> Callable[[], None] | None:
    """``fetch`` of these arguments made ready to repeat (``launch()``: the compiled runner, nothing else); ``None``
    where the cached launch path does not apply (then call ``fetch``), or before ``fetch`` compiled this
    signature. ``stream``: the raw stream to launch on (``None``: see ``CachedKernel.bind``)."""
    if _LAUNCH is not None:
        return None
    return _CACHED[fetch_kernel].bind(_grid(desc, longest), (table, desc), stream=stream, DT=word_dtype(dtype),
                                      BLOCK=BLOCK, ALIGNED=bool(aligned))


def bind_push(table: torch.Tensor, desc: torch.Tensor, longest: int, src_dtype: torch.dtype, aligned: bool,
              stream: int | None) -> Callable[[float], None] | None:
    """``push`` into an fp32 accumulator made ready to repeat (``launch(scale)``), as ``bind_fetch``."""
    if _LAUNCH is not None:
        return None
    # f1 = f2 = 1.0 (2**0): unused by a float accumulator
    return _CACHED[push_kernel].bind(_grid(desc, longest), (table, desc, 1.0, 1.0), (1.0,), stream,
                                     SRC=tl_dtype(src_dtype), ACC=tl.float32, BLOCK=BLOCK, ALIGNED=bool(aligned))


def put_signal(table: torch.Tensor, desc: torch.Tensor, longest: int, dtype: torch.dtype,
               signal_offsets: torch.Tensor, counters: torch.Tensor) -> None:
    """Launch ``put_signal_kernel``; ``counters`` is a zeroed ``int64[rows]`` scratch on the same device."""
    _launch(put_signal_kernel, _grid(desc, longest), table, desc, signal_offsets, counters, DT=word_dtype(dtype),
            BLOCK=BLOCK)


def wait(word: torch.Tensor, target: int, abort: torch.Tensor, status: torch.Tensor) -> None:
    """Launch ``wait_kernel`` on a local ``int64`` signal word (a 1-element view)."""
    _launch(wait_kernel, (1,), word, int(target), abort, status)


def barrier(table: torch.Tensor, members: torch.Tensor, rank: int, row_offset: int, epoch: int,
            abort: torch.Tensor, status: torch.Tensor) -> None:
    """Launch ``barrier_kernel``; ``status`` has ``1 + len(members)`` int64 words."""
    _launch(barrier_kernel, (1,), table, members, members.numel(), int(rank), int(row_offset), int(epoch), abort,
            status)


def bind_barrier(table: torch.Tensor, members: torch.Tensor, rank: int, row_offset: int, epoch: int,
                 abort: torch.Tensor, status: torch.Tensor, stream: int | None) -> Callable[[int], None] | None:
    """``barrier`` on one row made ready to repeat (``launch(epoch)``; an epoch out of the i32 range goes through
    ``barrier``'s path), as ``bind_fetch``: ``None`` before ``barrier`` compiled this signature."""
    if _LAUNCH is not None:
        return None
    return _CACHED[barrier_kernel].bind((1,), (table, members, members.numel(), int(rank), int(row_offset)),
                                        (int(epoch),), stream, after=(abort, status))


def launch_examples() -> list[tuple[str, str, object]]:
    """The calls the launch check (``odc_runtime.kernels.launch_check``) compiles, per ORDERING case: the launchers
    with CPU tensors standing for the transport's (peer table, descriptor rows, heap words), for the values Triton
    specializes on: world 1 (one member, rank 0), rank 1, epoch and target 1, words at 8-byte (unaligned) and 16-byte
    offsets; push and fetch rows with and without the ALIGNED variant. No data is read: the fake driver launches
    nothing."""

    def i64(n: int, offset: int = 0) -> torch.Tensor:
        return torch.zeros(n + offset, dtype=torch.int64)[offset:]  # offset 1: a word 8 but not 16-byte aligned

    def members(world: int) -> torch.Tensor:
        return torch.arange(world, dtype=torch.int32)

    def desc(rows: int) -> torch.Tensor:
        return torch.zeros(rows, DESC_COLUMNS, dtype=torch.int64)

    out: list[tuple[str, str, object]] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out.append(("push_kernel", f"{dtype} into fp32, world 1",
                    lambda d=dtype: push(i64(1), desc(1), 1000, 0.5, d)))
    out += [
        ("push_kernel", "bf16 into fp32, 4 peers", lambda: push(i64(4), desc(4), 4096, 1.0, torch.bfloat16)),
        ("push_kernel:int64", "int64 fixed point, world 1",
         lambda: push(i64(1), desc(1), 7, 1.0, torch.int64, torch.int64)),
        ("push_kernel:fixed", "bf16 quantised in the kernel, 3 peers",
         lambda: push(i64(3), desc(3), 1001, 0.5, torch.bfloat16, torch.int64, shift=40)),
    ]
    out += [  # the vector variant: every row's addresses 16-byte aligned (rows_aligned)
        ("push_kernel:aligned", "bf16 into fp32, aligned rows, world 1",
         lambda: push(i64(1), desc(1), 1000, 0.5, torch.bfloat16, aligned=True)),
        ("push_kernel:aligned", "fp32 into fp32, aligned rows, 4 peers",
         lambda: push(i64(4), desc(4), 4096, 1.0, torch.float32, aligned=True)),
    ]
    for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.int64):
        out.append(("fetch_kernel", f"{dtype}, world 1", lambda d=dtype: fetch(i64(1), desc(1), 1001, d)))
    for dtype in (torch.bfloat16, torch.float32, torch.int64):  # 16-byte vectors (a uint8 row gets 8-byte ones)
        out.append(("fetch_kernel:aligned", f"{dtype}, aligned rows, world 1",
                    lambda d=dtype: fetch(i64(1), desc(1), 1001, d, aligned=True)))
    out += [
        ("fetch_kernel:aligned", "fp32, aligned rows, 3 peers",
         lambda: fetch(i64(3), desc(3), 5000, torch.float32, aligned=True)),
        ("fetch_kernel", "fp32, 4 peers", lambda: fetch(i64(4), desc(4), 4096, torch.float32)),
        ("put_signal_kernel", "bf16, one row", lambda: put_signal(i64(1), desc(1), 1000, torch.bfloat16, i64(1),
                                                                   i64(1))),
        ("put_signal_kernel", "fp32, 3 rows", lambda: put_signal(i64(2), desc(3), 5000, torch.float32, i64(3),
                                                                  i64(3))),
        ("wait_kernel", "target 1, aligned word", lambda: wait(i64(1), 1, i64(1), i64(2))),
        ("wait_kernel", "target 2, word at an 8-byte offset", lambda: wait(i64(1, 1), 2, i64(1, 1), i64(2))),
        ("wait_kernel", "target 2**40", lambda: wait(i64(1), 1 << 40, i64(1), i64(2))),
        ("barrier_kernel", "world 1: one member, rank 0, epoch 1",
         lambda: barrier(i64(1), members(1), 0, 64, 1, i64(1), i64(2))),
        ("barrier_kernel", "world 2, rank 1, epoch 2, row at an 8-byte offset",
         lambda: barrier(i64(2), members(2), 1, 72, 2, i64(1, 1), i64(3))),
        ("barrier_kernel", "group of 4, rank 3, epoch 2**33",
         lambda: barrier(i64(8), members(4), 3, 4160, 1 << 33, i64(1), i64(5))),
    ]
    return out
