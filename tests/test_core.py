"""Core API over the host transport, with several real processes."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal

import pytest
import torch
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import testing

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _full_value(numel: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    # Small integers are exact in every dtype, so fetched values compare exactly.
    return (torch.arange(numel) % 97 - 40).to(dtype).reshape(shape)


def _grad_value(src: int, round_: int, numel: int, shape: tuple[int, ...]) -> torch.Tensor:
    return ((torch.arange(numel) * (src + 1) + round_) % 13 - 6).reshape(shape)


def _pushes(src: int) -> int:
    return [2, 0, 3, 1][src % 4]  # differing counts, including a rank that never pushes


def _rank_roundtrip(rank: int, world: int, shape: tuple[int, ...]) -> None:
    odc.init("host")
    numel = int(torch.tensor(shape).prod())
    for dtype in DTYPES:
        full = _full_value(numel, dtype, shape)
        st = odc.shard(full, name=f"w_{dtype}")
        start, stop = st.shard_range
        assert st.local.numel() == stop - start and st.grad.dtype == torch.float32
        assert torch.equal(odc.fetch(st), full)

        # Pushes: rank s pushes _pushes(s) times with scale 0.5; exact in fp32 (integers and halves).
        for i in range(_pushes(rank)):
            odc.push(st, _grad_value(rank, i, numel, shape).to(dtype), scale=0.5)
        odc.sync()
        expected = sum(
            _grad_value(s, i, numel, shape).to(torch.float32) * 0.5 for s in range(world) for i in range(_pushes(s))
        )
        expected = torch.zeros(shape) + expected  # the sum may be the int 0 when nobody pushes
        assert torch.equal(st.grad, expected.reshape(-1)[start:stop]), (dtype, st.grad)

        # The owner updates its shard; after sync every rank fetches the new values.
        st.local.add_(1)
        st.zero_grad()
        odc.sync()
        assert torch.equal(odc.fetch(st), full + 1)

        # Async handles: fetch into a given out, push, then wait / sync.
        out = torch.empty(shape, dtype=dtype)
        handle = odc.fetch(st, out, async_op=True)
        assert handle.wait() is out and torch.equal(out, full + 1)
        handle = odc.push(st, torch.ones(shape, dtype=dtype), async_op=True)
        assert handle.wait() is None
        odc.sync()
        assert torch.equal(st.grad, torch.full((stop - start,), float(world)))
        st.free()

    # A meta tensor gives zero shards without materialising the full tensor.
    st = odc.shard(torch.empty(shape, device="meta"), name="from_meta")
    assert not st.local.any() and st.local.device.type == "cpu"
    assert torch.equal(odc.fetch(st), torch.zeros(shape))

    # A frozen tensor has no accumulator: less symmetric memory, and pushing into it is refused.
    transport = testing.transport()
    used = transport.heap_used()
    frozen = odc.shard(_full_value(numel, torch.bfloat16, shape), name="frozen", requires_grad=False)
    from odc_runtime.transport.heap import ALIGNMENT

    param_bytes = max(ALIGNMENT, -(-frozen.shard_size * 2 // ALIGNMENT) * ALIGNMENT)
    assert frozen.grad is None and transport.heap_used() - used == param_bytes  # the parameters only
    assert torch.equal(odc.fetch(frozen), _full_value(numel, torch.bfloat16, shape))
    frozen.zero_grad()  # no-op, so loops over all tensors need no special case
    with pytest.raises(odc.OdcUsageError, match="requires_grad=False"):
        odc.push(frozen, torch.ones(shape, dtype=torch.bfloat16))
    frozen.free()
    assert transport.heap_used() == used


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fetch_push_sync_all_dtypes_uneven(world: int) -> None:
    # 7 * 11 = 77 elements: not divisible by 2, 3 or 4, so the last owners hold fewer (or padded) elements.
    run_ranks(_rank_roundtrip, world, (7, 11))


def _rank_concurrent(rank: int, world: int, rounds: int) -> list[float]:
    odc.init("host")
    numel = 50_001  # spans several lock chunks (ODC_HOST_CHUNK_BYTES is small in this test)
    st = odc.shard(torch.zeros(numel))
    for r in range(rounds):
        # every rank pushes to every owner at once, many rounds, async and sync mixed
        grad = _grad_value(rank, r, numel, (numel,)).float()
        handle = odc.push(st, grad, async_op=(r % 2 == 0))
        if handle is not None:
            handle.wait()
    odc.sync()
    expected = sum(_grad_value(s, r, numel, (numel,)).float() for s in range(world) for r in range(rounds))
    start, stop = st.shard_range
    assert torch.equal(st.grad, expected[start:stop])
    return [float(st.grad.sum())]


def test_concurrent_pushes_are_exact() -> None:
    run_ranks(_rank_concurrent, 4, 30, env={"ODC_HOST_CHUNK_BYTES": "16K"})


def _rank_misuse(rank: int, world: int) -> None:
    with pytest.raises(odc.OdcNotInitializedError, match=r"before odc_runtime\.init"):
        odc.sync()
    with pytest.raises(odc.OdcUsageError, match="unknown ODC backend"):
        odc.init("tcp")
    with pytest.raises(odc.OdcUsageError, match="heap_size"):
        odc.init("host", heap_size=1.5)
    # A bad argument on one rank only: that rank gets its error, the others are told who rejected the call
    # (nobody is left waiting in the collective).
    if rank == 0:
        with pytest.raises(odc.OdcUsageError, match="unknown ODC backend"):
            odc.init("tcp")
    else:
        with pytest.raises(odc.OdcMismatchError, match=r"rank 0 rejected the call .*unknown ODC backend"):
            odc.init("host")
    assert not odc.is_initialized()
    odc.init("host", heap_size="1M")
    with pytest.raises(odc.OdcUsageError, match="called twice"):
        odc.init("host")
    st = odc.shard(torch.zeros(10, 3))
    bad_calls = [
        (lambda: odc.push(st, torch.ones(30)), "shape"),
        (lambda: odc.push(st, torch.ones(10, 3, dtype=torch.float64)), "dtype"),
        (lambda: odc.push(st, torch.ones(10, 3, dtype=torch.int32)), "dtype"),
        (lambda: odc.push(st, torch.ones(10, 3, device="meta")), "device"),
        (lambda: odc.push(st, torch.ones(10, 3), scale=float("nan")), "scale"),
        (lambda: odc.push(st, torch.ones(10, 3), scale=10**400), "scale"),
        (lambda: odc.fetch(st, torch.empty(10, 3, requires_grad=True)), "require grad"),
        (lambda: odc.push(st, [[1.0] * 3] * 10), "torch.Tensor"),
        (lambda: odc.fetch(st, torch.empty(3, 10)), "shape"),
        (lambda: odc.fetch(st, torch.empty(10, 3, dtype=torch.bfloat16)), "dtype"),
        (lambda: odc.fetch(st, torch.empty(3, 10).t()), "contiguous"),
        (lambda: odc.shard(torch.zeros(3, dtype=torch.int64)), "not supported"),
        (lambda: odc.shard(torch.zeros(3), accum_dtype=torch.bfloat16), "accum_dtype"),
    ]
    for call, match in bad_calls:
        with pytest.raises(odc.OdcUsageError, match=match):
            call()
    odc.sync()
    assert not st.grad.any(), f"a rejected push changed an accumulator {st.grad.tolist()}"
    odc.sync()  # every rank checked its accumulator before anyone pushes again
    import numpy as np

    odc.push(st, torch.ones(10, 3), scale=np.float32(0.5))  # any real scalar type is a valid scale
    odc.sync()
    assert torch.equal(st.grad, torch.full_like(st.grad, 0.5 * world))
    st.zero_grad()
    odc.sync()

    with pytest.raises(odc.OdcUsageError if rank == 0 else odc.OdcMismatchError, match="not supported"):
        odc.shard(torch.zeros(3, dtype=torch.int64 if rank == 0 else torch.float32))

    # Mismatched shard calls are detected on every rank before anything is allocated.
    used = testing.transport().heap_used()
    with pytest.raises(odc.OdcMismatchError, match=r"rank 1: .*\(4,"):
        odc.shard(torch.zeros(3 + rank))
    assert testing.transport().heap_used() == used

    # Heap exhausted: the message says how much was asked, how much is left and what raises it.
    with pytest.raises(odc.OdcMemoryError, match=r"asked for 4\.00 MiB .* free .*ODC_HEAP_SIZE"):
        odc.shard(torch.zeros(world, 1 << 20))
    assert testing.transport().heap_used() == used
    odc.sync()

    # Ranks in different collectives are told so instead of silently pairing up, under a public error class.
    transport = testing.transport()
    mismatch = r"collective mismatch.*('sync'.*'checkpoint'|'checkpoint'.*'sync')"
    with pytest.raises(odc.OdcRoundMismatchError, match=mismatch):
        odc.sync() if rank == 0 else transport.barrier("checkpoint")
    odc.sync()  # still usable afterwards

    odc.finalize()
    odc.finalize()  # idempotent
    assert not odc.is_initialized()
    with pytest.raises(odc.OdcNotInitializedError):
        odc.fetch(st)
    odc.init("host")
    with pytest.raises(odc.OdcNotInitializedError, match="finalized"):
        odc.push(st, torch.ones(10, 3))


def test_misuse_raises_typed_errors_and_changes_nothing() -> None:
    run_ranks(_rank_misuse, 2)


def _rank_dies(rank: int, world: int) -> None:
    odc.init("host")
    st = odc.shard(torch.zeros(8))
    odc.push(st, torch.ones(8))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    # Seen as soon as the process is gone (ODC_TIMEOUT is far longer than the harness allows), naming the rank.
    with pytest.raises(odc.OdcPeerLostError, match=r"odc sync: rank \d lost rank\(s\) \[1\] .* rank 1 \(pid \d+, DEAD"):
        odc.sync()
    # Once: later collectives fail at once, and finalize releases local resources without waiting again.
    with pytest.raises(odc.OdcPeerLostError, match="unusable"):
        odc.sync()
    transport = testing.transport()

    def no_more_waiting(op: str, payload: bytes) -> list[bytes]:
        raise AssertionError(f"finalize waited for peers again ({op})")

    transport.exchange = no_more_waiting
    odc.finalize()
    assert not odc.is_initialized()


def test_dead_peer_is_reported_at_once_and_once(tmp_path) -> None:
    run_ranks(
        _rank_dies, 3, env={"ODC_TIMEOUT": "600", "ODC_SHM_DIR": str(tmp_path)}, expect_exit={1}, timeout=90
    )
    assert os.listdir(tmp_path) == [], "segments left behind after a crashed job"


def _rank_stopped_lock_holder(rank: int, world: int) -> None:
    import fcntl

    from odc_runtime.transport.host import CONTROL_BYTES

    odc.init("host")
    st = odc.shard(torch.zeros(1000))
    transport = testing.transport()
    _, grad = testing.buffers(st)
    if rank == 1:
        # Lock owner 0's whole accumulator, then freeze while holding the lock (SIGSTOP: alive, not dead).
        fcntl.lockf(transport.segments.get(0).fd, fcntl.LOCK_EX, grad.nbytes, CONTROL_BYTES + grad.handle)
        transport.barrier("locked")
        os.kill(os.getpid(), signal.SIGSTOP)
    transport.barrier("locked")
    # The push to owner 1 landed before the one to owner 0 timed out: a retry would add it twice, so the error
    # says the runtime is unusable, and finalize does not wait for the stopped peer again.
    with pytest.raises(odc.OdcTimeoutError, match=r"odc push: rank 0 could not lock .* of rank 0's segment.*unusable"):
        odc.push(st, torch.ones(1000))
    with pytest.raises(odc.OdcTimeoutError, match="unusable"):
        odc.push(st, torch.ones(1000))
    os.kill(transport.control.read(1).pid, signal.SIGKILL)
    odc.finalize()


def test_stopped_lock_holder_times_out_instead_of_hanging() -> None:
    run_ranks(_rank_stopped_lock_holder, 2, env={"ODC_TIMEOUT": "2"}, expect_exit={1}, timeout=60)


def _rank_one_cannot_create(rank: int, world: int, directory: str) -> None:
    # Only rank 1 gets an unusable segment directory: every rank must fail init together, nobody may hang.
    os.environ["ODC_SHM_DIR"] = directory if rank == 0 else os.path.join(directory, "missing", "dir")
    if rank == 1:
        with pytest.raises(odc.OdcBackendError, match=r"cannot create shared-memory segment.*ODC_SHM_DIR"):
            odc.init("host")
    else:
        with pytest.raises(odc.OdcMismatchError, match=r"rank 1 rejected the call \(OdcBackendError"):
            odc.init("host")
    assert not odc.is_initialized()


def test_init_failing_on_one_rank_fails_on_all(tmp_path) -> None:
    run_ranks(_rank_one_cannot_create, 2, str(tmp_path), timeout=60)
    assert os.listdir(tmp_path) == [], "the ranks that did create a segment must remove it"


def _rank_leftovers(rank: int, world: int, directory: str) -> int:
    odc.init("host")
    st = odc.shard(torch.ones(100))
    # Segment names are unlinked once every rank mapped them; the data lives on in the mappings.
    count = len(os.listdir(directory))
    odc.push(st, torch.ones(100))
    odc.sync()
    assert torch.equal(st.grad, torch.full_like(st.grad, world))
    return count


def test_no_segments_left_and_stale_ones_removed(tmp_path) -> None:
    directory = str(tmp_path)
    # A stale segment from a dead job (pid that cannot exist) and an unrelated file that must survive.
    stale = tmp_path / "odc-deadbeef0000-r0-p4194399.heap"
    stale.write_bytes(b"\0" * 4096)
    keep = tmp_path / "not-odc.txt"
    keep.write_text("x")
    counts = run_ranks(_rank_leftovers, 2, directory, env={"ODC_SHM_DIR": directory})
    assert counts == [1, 1]  # during the run only the unrelated file is left
    assert sorted(os.listdir(directory)) == ["not-odc.txt"]


def test_segment_is_private_to_owner(tmp_path) -> None:
    from odc_runtime.transport.host import HostTransport

    t = HostTransport(0, 1, "abc123", timeout=5, heap_size=1 << 20, directory=str(tmp_path), chunk_bytes=1 << 20)
    try:
        t.create_segment()
        (path,) = tmp_path.iterdir()
        assert (path.stat().st_mode & 0o777) == 0o600
    finally:
        t.finalize()
    assert list(tmp_path.iterdir()) == []


def test_init_requires_process_group() -> None:
    with pytest.raises(odc.OdcUsageError, match="init_process_group"):
        odc.init("host")


def test_import_needs_no_torch_gpu_or_extension() -> None:
    # The package and the balancer import without torch; the core API loads torch on first use.
    import subprocess
    import sys

    code = (
        "import sys, odc_runtime, odc_runtime.balance, odc_runtime.workloads\n"
        "assert 'torch' not in sys.modules, 'torch imported eagerly'\n"
        "assert odc_runtime.fetch.__module__ == 'odc_runtime.api'\n"
        "assert 'odc_runtime._C' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_sizes_and_timeouts_parse_or_fail_clearly(monkeypatch) -> None:
    from odc_runtime import config

    assert config.parse_size(4096, what="x") == 4096
    assert config.parse_size("4G", what="x") == 4 << 30
    assert config.parse_size("512MiB", what="x") == 512 << 20
    assert config.parse_size("1.5k", what="x") == 1536
    for bad in ("", "x", "-1", 0, True, "4Q"):
        with pytest.raises(odc.OdcUsageError, match="x"):
            config.parse_size(bad, what="x")
    monkeypatch.setenv("ODC_HEAP_SIZE", "2M")
    assert config.resolve_size(None, "ODC_HEAP_SIZE", 1) == 2 << 20
    assert config.resolve_size("1M", "ODC_HEAP_SIZE", 1) == 1 << 20  # the argument wins
    monkeypatch.setenv("ODC_TIMEOUT", "2.5")
    assert config.resolve_timeout(None) == 2.5
    assert config.resolve_timeout(7) == 7.0
    for bad in ("abc", "-1", "inf"):
        monkeypatch.setenv("ODC_TIMEOUT", bad)
        with pytest.raises(odc.OdcUsageError, match=r"ODC_TIMEOUT|timeout"):
            config.resolve_timeout(None)


def _rank_views_after_finalize(rank: int, world: int) -> list[list[float]]:
    odc.init("host")
    st = odc.shard(torch.arange(8.0))
    odc.push(st, torch.ones(8))
    odc.sync()
    local, grad = st.local, st.grad
    odc.finalize()
    # Views the user still holds must stay valid memory (not unmapped underneath: that is a segfault).
    local.add_(100)
    return [local.tolist(), grad.tolist()]


def _rank_attributes_after_finalize(rank: int, world: int) -> list[str]:
    """st.local / st.grad read, and st.local updated in place, after finalize: each raises OdcNotInitializedError (a
    write would reach no peer). The values read before finalize are exact."""
    odc.init("host")
    st = odc.shard(torch.arange(8.0))
    odc.push(st, torch.ones(8))
    odc.sync()
    start, stop = st.shard_range
    assert torch.equal(st.local, torch.arange(start, stop, dtype=torch.float32))
    assert torch.equal(st.grad, torch.full((stop - start,), float(world)))
    odc.finalize()
    errors = []
    for use in (lambda: st.local, lambda: st.grad, lambda: st.local.add_(1)):
        with pytest.raises(odc.OdcNotInitializedError) as info:
            use()
        errors.append(str(info.value))
    with pytest.raises(odc.OdcNotInitializedError):
        st.local -= 1
    return errors


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
def test_shard_attributes_after_finalize_raise(backend: str) -> None:
    from test_debug import _on

    for errors in _on(backend, _rank_attributes_after_finalize, 2):
        assert "st.local after odc_runtime.finalize()" in errors[0], errors
        assert "st.grad after odc_runtime.finalize()" in errors[1], errors
        assert "st.local after odc_runtime.finalize()" in errors[2], errors


def _rank_negative_bit(rank: int, world: int) -> dict:
    """Gradients with torch's negative bit (``torch._neg_view``: values stored un-negated) pushed contiguous and
    strided, twice each (the checked path, then the cached plan's fast path after a plain push of the same key);
    a ``fetch(out=...)`` into such a tensor is refused with nothing written. Returns the exact sums."""
    odc.init("host")
    st = odc.shard(torch.arange(12.0).reshape(3, 4), name="w")
    ones = torch.ones(3, 4)
    assert torch._neg_view(ones).is_neg()
    for _ in range(2):
        odc.push(st, torch.full((3, 4), 10.0))  # a plain gradient of the key the next one shares but for the bit
        odc.push(st, torch._neg_view(ones))  # -1 per element
        odc.push(st, torch._neg_view(torch.ones(4, 3)).t())  # strided and negative: -1
    odc.sync()
    out = torch.full((3, 4), 7.0)
    odc.fetch(st, out=out)  # a plain out first: its key is cached
    view = torch._neg_view(torch.full((3, 4), 5.0))
    with pytest.raises(odc.OdcUsageError, match="negative bit"):
        odc.fetch(st, out=view)
    assert view.is_neg() and torch.equal(view.resolve_neg(), torch.full((3, 4), -5.0))  # nothing written
    start, stop = st.shard_range
    return {"grad": st.grad.tolist(), "want": [2.0 * (10 - 2) * world] * (stop - start), "fetched": out.tolist()}


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
def test_tensors_with_the_negative_bit_are_exact_or_refused(backend: str) -> None:
    from test_debug import _on

    for res in _on(backend, _rank_negative_bit, 2):
        assert res["grad"] == res["want"], res
        assert res["fetched"] == torch.arange(12.0).reshape(3, 4).tolist(), res


def _rank_init_without_room(rank: int, world: int) -> dict:
    """Rank 1's filesystem has no room for its segment (the OS's posix_fallocate says ENOSPC): init fails on every
    rank with the real error, leaves no segment file behind, and succeeds when retried once there is room."""
    import errno

    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    if rank == 1:
        os.posix_fallocate = full
    try:
        with pytest.raises(odc.OdcError) as info:
            odc.init("host")
    finally:
        os.posix_fallocate = real
    torch.distributed.barrier()  # every rank's failed init returned (the directory is shared)
    left = sorted(os.listdir(os.environ["ODC_SHM_DIR"]))
    odc.init("host")  # room again: a failed init released everything, so a retry works
    st = odc.shard(torch.zeros(4))
    odc.push(st, torch.ones(4))
    odc.sync()
    start, stop = st.shard_range
    assert torch.equal(st.grad, torch.full((stop - start,), float(world)))
    return {"error": type(info.value).__name__, "message": str(info.value), "left": left}


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
def test_a_failed_init_raises_the_real_error_and_leaves_nothing_behind(backend: str, tmp_path) -> None:
    """Issue 53: on symm-cpu the OS error turned into an AttributeError in SymmTransport.finalize, which also left
    the segment files behind until the process exited."""
    from test_debug import _on

    for rank, res in enumerate(_on(backend, _rank_init_without_room, 2, env={"ODC_SHM_DIR": str(tmp_path)})):
        assert res["error"] == "OdcMemoryError", res
        assert "rank 1 cannot reserve" in res["message"] and "No space left on device" in res["message"], res
        assert res["left"] == [], (rank, res)


def _rank_out_of_file_descriptors(rank: int, world: int) -> dict:
    """Rank 1 has used up its open files (real descriptors, under a lowered RLIMIT_NOFILE) when it calls init: its
    FileStore round cannot open the store's file. Returns the error each rank got."""
    import resource

    init = odc.init  # imported now: an import needs a descriptor too
    held: list[int] = []
    if rank == 1:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
    try:
        with pytest.raises(odc.OdcError) as info:
            init("host", timeout=8)
    finally:
        for fd in held:
            os.close(fd)
    return {"error": type(info.value).__name__, "message": str(info.value)}


def test_a_process_out_of_file_descriptors_is_not_told_the_store_died() -> None:
    """Issue 53: EMFILE inside the store was reported as 'the process hosting it has died'."""
    own, peer = run_ranks(_rank_out_of_file_descriptors, 2, timeout=60)[::-1]
    assert own["error"] == "OdcBackendError", own
    assert "this process hit its limit of open files" in own["message"] and "ulimit -n" in own["message"], own
    assert "has died" not in own["message"], own
    assert peer["error"] == "OdcTimeoutError" and "rank(s) [1]" in peer["message"], peer  # rank 1 never posted


def test_views_kept_after_finalize_stay_valid() -> None:
    results = run_ranks(_rank_views_after_finalize, 2, timeout=30)
    assert results == [[[100.0, 101.0, 102.0, 103.0], [2.0] * 4], [[104.0, 105.0, 106.0, 107.0], [2.0] * 4]]


def _rank_heap_mismatch(rank: int, world: int) -> None:
    # Different heaps would give different allocator offsets, and a rank with the larger heap cannot map its
    # peer's smaller segment (a bare ValueError there while the others hang): refuse at init, on every rank.
    os.environ["ODC_HEAP_SIZE"] = "1M" if rank == 0 else "2M"
    with pytest.raises(odc.OdcMismatchError, match=r"ODC_HEAP_SIZE.*rank 0: 1048576.*rank 1: 2097152"):
        odc.init("host")
    assert not odc.is_initialized()
    os.environ["ODC_HEAP_SIZE"] = "1M"
    odc.init("host")  # nothing half-initialised was left behind


def test_heap_size_mismatch_is_refused(tmp_path) -> None:
    run_ranks(_rank_heap_mismatch, 2, env={"ODC_SHM_DIR": str(tmp_path)}, timeout=30)
    assert os.listdir(tmp_path) == []


def _rank_async_failure(rank: int, world: int) -> None:
    import time

    odc.init("host")
    st = odc.shard(torch.zeros(4))
    transport = testing.transport()

    def fail() -> None:
        raise odc.OdcBackendError("push failed on the worker")

    def slow_push() -> None:
        time.sleep(1.0)
        odc.push(st, torch.ones(4))

    if rank == 0:
        failed = transport._run_async(fail, "test")
        while not failed.is_completed():
            time.sleep(0.01)
    transport._run_async(slow_push, "test")  # a later async operation must neither hide the failure nor be forgotten
    if rank == 0:
        with pytest.raises(odc.OdcBackendError, match="push failed on the worker"):
            odc.sync()
    else:
        odc.sync()  # the failing rank still met its peers at the barrier: nobody waits for it until the timeout
    odc.sync()  # reported once; the slow push was still waited for
    assert torch.equal(st.grad, torch.full_like(st.grad, world)), st.grad


def test_failed_async_op_is_reported_by_sync() -> None:
    run_ranks(_rank_async_failure, 2, env={"ODC_TIMEOUT": "5"}, timeout=30)


def _rank_reinit(rank: int, world: int) -> None:
    import gc
    import threading

    from odc_runtime.transport.host import HostTransport

    def odc_maps() -> int:
        with open("/proc/self/maps") as f:
            return sum(".heap" in line for line in f)

    fds = len(os.listdir("/proc/self/fd"))
    for i in range(3):
        odc.init("host")
        st = odc.shard(torch.zeros(6))
        odc.push(st, torch.full((6,), float(i)), async_op=True).wait()
        odc.sync()
        assert torch.equal(st.grad, torch.full_like(st.grad, i * world))
        odc.finalize()
    del st
    gc.collect()
    assert [o for o in gc.get_objects() if isinstance(o, HostTransport)] == [], "transports kept alive"
    assert [t.name for t in threading.enumerate() if t.name.startswith("odc-host")] == []
    assert odc_maps() == 0, "segments still mapped"
    assert len(os.listdir("/proc/self/fd")) <= fds, "file descriptors leaked"


def test_init_finalize_cycles_leak_nothing() -> None:
    run_ranks(_rank_reinit, 2, timeout=30)


def _rank_fork(rank: int, world: int) -> None:
    odc.init("host")
    st = odc.shard(torch.zeros(4))
    pid = os.fork()
    if pid == 0:  # the child shares the parent's segments but is not a rank: it must not touch them
        code = 1
        try:
            odc.sync()
        except odc.OdcUsageError as e:
            code = 0 if "fork" in str(e) else 2
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    odc.push(st, torch.ones(4))
    odc.sync()
    assert torch.equal(st.grad, torch.full_like(st.grad, world))


def test_forked_child_cannot_use_parents_runtime() -> None:
    run_ranks(_rank_fork, 2, env={"ODC_TIMEOUT": "3"}, timeout=40)


def test_kernels_import_from_a_source_checkout(tmp_path) -> None:
    """``PYTHONPATH=<checkout>`` without an install: ``odc_runtime.kernels`` is the top-level ``kernels/`` folder, so
    the hierarchy (which imports it) imports too. The editable install of this venv is hidden from the child."""
    import shutil
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    for folder in ("odc_runtime", "kernels"):
        shutil.copytree(root / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(getattr(f, '__module__', ''))]\n"
        "import odc_runtime.hierarchy, odc_runtime.kernels as k\n"
        f"assert k.__file__.startswith({str(tmp_path)!r}), k.__file__\n"
        "assert odc_runtime.__file__.startswith(k.__file__.rsplit('/kernels/', 1)[0]), odc_runtime.__file__\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr
