"""Every memory layout a caller may hand ``push``, ``fetch(out=)`` and ``shard`` is taken element by element, on every
transport: host, ``symm-cpu`` (the Triton kernels under the interpreter) and the nvshmem transport over the CPU model
of its extension (tests/_nvshmem_shm.py, both push protocols); synchronous and asynchronous, default and
deterministic mode.

The layouts that once went wrong are those ``reshape(-1)`` can still *view* (a 1-D stride, a stride of 0, a 2-D view
that collapses to one stride): a pointer-based plan read ``numel`` consecutive elements from the view's address
instead (``big[0:8]`` for ``big[::2]``; past the storage for an ``expand``). Every sum is compared exactly against a
reference computed here from the same values (small integers times 0.5: exact in fp32 in any order).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Callable

import pytest
import torch
from _dist import run_ranks

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.timeout(600)

Build = Callable[[int, int, torch.dtype], torch.Tensor]  # (rank, round, dtype) -> a tensor of the case's shape


def _ints(n: int, rank: int, round_: int, dtype: torch.dtype) -> torch.Tensor:
    """Distinct small integers (exact in bf16), different per rank and round, so a shifted read shows."""
    return ((torch.arange(n) * (rank + 2) + 7 * round_) % 61 - 30).to(dtype)


def _channels_last(rank: int, round_: int, dtype: torch.dtype) -> torch.Tensor:
    t = _ints(9, rank, round_, dtype).reshape(1, 3, 1, 3).contiguous(memory_format=torch.channels_last)
    assert not t.is_contiguous() and t.stride() == (9, 1, 9, 3)
    return t


# name -> (shape, build): each build makes its values in the dtype, then takes the named layout of them.
CASES: dict[str, tuple[tuple[int, ...], Build]] = {
    "contiguous": ((3, 5), lambda r, i, d: _ints(15, r, i, d).reshape(3, 5)),
    "strided-1d": ((9,), lambda r, i, d: _ints(18, r, i, d)[::2]),  # reshape(-1) views it (stride 2)
    "stride-0": ((9,), lambda r, i, d: torch.tensor([3 + r + i], dtype=d).expand(9)),  # one element of storage
    "strided-2d-flat": ((3, 5), lambda r, i, d: _ints(30, r, i, d)[::2].view(3, 5)),  # strides (10, 2): one stride
    "transposed": ((3, 5), lambda r, i, d: _ints(15, r, i, d).reshape(5, 3).t()),
    "storage-offset": ((3, 5), lambda r, i, d: _ints(24, r, i, d)[5:20].view(3, 5)),  # contiguous, offset 5
    "column-slice": ((3, 5), lambda r, i, d: _ints(24, r, i, d).reshape(3, 8)[:, 2:7]),
    "expand-rows": ((3, 5), lambda r, i, d: _ints(5, r, i, d).expand(3, 5)),  # strides (0, 1)
    "channels-last": ((1, 3, 1, 3), _channels_last),
}
DTYPES = (torch.float32, torch.bfloat16)
SCALE = 0.5


def _expected(build: Build, world: int, rounds: int) -> torch.Tensor:
    """The exact sum of every rank's pushes in row-major order, from contiguous copies of the values."""
    total = torch.zeros(build(0, 0, torch.float32).numel(), dtype=torch.float32)
    for r in range(world):
        for i in range(rounds):
            total += build(r, i, torch.float32).contiguous().reshape(-1) * SCALE
    return total


def _check_pushes(world: int, rank: int, async_op: bool) -> None:
    """Push every case in every dtype twice (the second push takes the cached plan), then compare every owner's
    accumulator with the reference."""
    import odc_runtime as odc

    rounds = 2
    for name, (shape, build) in CASES.items():
        for dtype in DTYPES:
            st = odc.shard(torch.zeros(shape), name=f"{name}-{dtype}-{async_op}")
            handles = []
            for i in range(rounds):
                g = build(rank, i, dtype)
                assert g.shape == shape and g.dtype == dtype
                handles.append(odc.push(st, g, scale=SCALE, async_op=async_op))
            for h in handles:
                if async_op:
                    h.wait()
            odc.sync()
            start, stop = st.shard_range
            want = _expected(build, world, rounds)[start:stop]
            assert torch.equal(st.grad, want), (name, dtype, async_op, st.grad.tolist(), want.tolist())
            st.free()


def _check_fetches() -> None:
    """``shard`` of every layout keeps its values; ``fetch(out=)`` fills a contiguous ``out`` (storage offset too)
    exactly, and refuses every other layout with nothing written."""
    import odc_runtime as odc
    from odc_runtime.errors import OdcUsageError

    for name, (shape, build) in CASES.items():
        full = build(7, 1, torch.float32)  # the same values on every rank (the documented use of shard)
        st = odc.shard(full, name=f"fetch-{name}", requires_grad=False)
        want = full.contiguous()
        assert torch.equal(odc.fetch(st), want), name
        assert torch.equal(odc.fetch(st, async_op=True).wait(), want), name
        n = math.prod(shape)
        store = torch.full((n + 9,), -99.0)
        out = store[4 : 4 + n].view(shape)  # contiguous at a storage offset
        for async_op in (False, True):
            store.fill_(-99.0)
            h = odc.fetch(st, out, async_op=async_op)
            if async_op:
                h.wait()
            assert torch.equal(out, want), (name, async_op)
            assert (store[:4] == -99).all() and (store[4 + n :] == -99).all(), name  # nothing outside out
        bad = build(0, 0, torch.float32)
        if not bad.is_contiguous():
            storage = bad.untyped_storage()
            before = bytes(storage)
            for async_op in (False, True):
                with pytest.raises(OdcUsageError, match="contiguous"):
                    odc.fetch(st, bad, async_op=async_op)
            assert bytes(storage) == before, name  # the refused fetch wrote nothing
        st.free()


def _rank_layouts(rank: int, world: int) -> None:
    import odc_runtime as odc

    torch.set_num_threads(1)
    for deterministic in (False, True):
        odc.init("host", deterministic=deterministic)
        _check_pushes(world, rank, async_op=False)
        _check_pushes(world, rank, async_op=True)
        if not deterministic:
            _check_fetches()
        odc.finalize()


BACKENDS = ["host", "symm-cpu", "nvshmem-atomic", "nvshmem-locked"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_layout_is_pushed_and_fetched_exactly(backend: str) -> None:
    if backend == "host":
        run_ranks(_rank_layouts, 2, timeout=300)
    elif backend == "symm-cpu":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        from test_symm_cpu import run_on_symm

        run_on_symm(_rank_layouts, 2, timeout=540)
    else:
        import _nvshmem_shm

        run_ranks(_nvshmem_shm.run, 2, backend.removeprefix("nvshmem-"), _rank_layouts, timeout=300)
