"""The one-node Triton transport on CPU ranks (``symm-cpu``): its kernels executed by the Triton interpreter across
processes, under the scenarios the host transport passes (the transport contract runs on it from
``tests/test_transport_contract.py``, which covers every registered transport).

Each test reuses a rank function of another test module unchanged: :func:`_on` runs it with ``odc.init("host")``
(or ``odc.init()``) answered by the backend under test, so the same assertions hold the same exact values. Small
tensors only: an interpreted launch costs tens of milliseconds.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from _dist import run_ranks

sys.path.insert(0, os.path.dirname(__file__))

BACKEND = "symm-cpu"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _on(rank: int, world: int, backend: str, fn: Callable, *args: Any) -> Any:
    """Run ``fn(rank, world, *args)`` with every ``odc.init("host")`` / ``odc.init()`` initialising ``backend``."""
    import odc_runtime as odc

    real = odc.init

    def init(name: str | None = None, **kwargs: Any) -> None:
        real(backend if name in (None, "host") else name, **kwargs)
        assert odc.backend() == backend

    odc.init = init
    return fn(rank, world, *args)


def run_on_symm(fn: Callable, world: int, *args: Any, **kwargs: Any) -> list[Any]:
    return run_ranks(_on, world, BACKEND, fn, *args, **kwargs)


# -- core API (tests/test_core.py) ----------------------------------------------------------------------------
def test_fetch_push_sync_all_dtypes_uneven() -> None:
    from test_core import _rank_roundtrip

    run_on_symm(_rank_roundtrip, 3, (7, 11), timeout=180)


def test_concurrent_pushes_are_exact() -> None:
    from test_core import _rank_concurrent

    run_on_symm(_rank_concurrent, 4, 4, timeout=180)


def test_misuse_raises_typed_errors_and_changes_nothing() -> None:
    from test_core import _rank_misuse

    run_on_symm(_rank_misuse, 2, timeout=120)


def test_dead_peer_is_reported_at_once_and_once(tmp_path) -> None:
    from test_core import _rank_dies

    run_on_symm(_rank_dies, 3, env={"ODC_TIMEOUT": "600", "ODC_SHM_DIR": str(tmp_path)}, expect_exit={1}, timeout=120)
    assert os.listdir(tmp_path) == [], "segments left behind after a crashed job"


def _rank_absent(rank: int, world: int) -> tuple[str, str, float]:
    """Rank 1 stays alive but never enters the sync: the others' barrier kernels must give up at ODC_TIMEOUT."""
    import torch
    import torch.distributed as dist

    import odc_runtime as odc

    odc.init()
    st = odc.shard(torch.zeros(10))
    odc.push(st, torch.ones(10))
    kind, message, waited = "no error", "", 0.0
    if rank != 1:
        start = time.monotonic()
        try:
            odc.sync()
        except odc.OdcTimeoutError as e:
            kind, message = type(e).__name__, str(e)
        waited = time.monotonic() - start
    dist.barrier()  # rank 1 leaves only after the others gave up
    if rank == 1:
        from odc_runtime import testing

        testing.abandon()
    return kind, message, waited


def test_absent_peer_times_out_naming_it() -> None:
    results = run_on_symm(_rank_absent, 3, env={"ODC_TIMEOUT": "3"}, timeout=90)
    for rank in (0, 2):
        kind, message, waited = results[rank]
        assert kind == "OdcTimeoutError", results[rank]
        assert "rank 1 (pid" in message and "timed out after 3 s" in message, message
        assert "may be waiting in a torch.distributed collective" in message, message  # rank 1 is, in dist.barrier
        assert 3 <= waited < 20, waited


# -- FSDP2 ODC mode (tests/test_fsdp.py) ----------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_fsdp_odc_mode_equal_unequal_and_zero_microbatches() -> None:
    import _fsdp_harness as h

    plan = [
        ("unequal", "scenario_vs_reference", (2, [1, 2, 3], {})),
        ("zero_clip", "scenario_vs_reference", (2, [0, 2, 1], {"clip": 0.5})),
        ("equal_vs_fsdp", "scenario_vs_fsdp", (2, 2, {})),
    ]
    suite = run_on_symm(h._with_odc, 3, h.run_suite, plan, timeout=280)
    for key in ("unequal", "zero_clip"):
        h.check_vs_reference(h.results(suite, key), 1e-5)
    for res in h.results(suite, "equal_vs_fsdp"):
        assert max(res["diff"]) < 1e-5, res


# -- the gang exchange of split samples (tests/test_gang.py) --------------------------------------------------
@pytest.mark.timeout(240)
def test_split_sample_equals_unsplit() -> None:
    from test_gang import _check_against_reference, _gangs_rank

    gangs = [(17, 3, (0, 1, 2))]
    _check_against_reference(run_on_symm(_gangs_rank, 3, gangs, 1, timeout=220), gangs)


def test_gang_member_that_leaves_is_a_timeout() -> None:
    from test_gang import _faulty_rank

    results = run_on_symm(_faulty_rank, 2, "leave", timeout=90, env={"ODC_TIMEOUT": "3"}, expect_exit={1})
    kind, message = results[0]
    assert kind == "OdcTimeoutError", results[0]
    assert "odc gang 0 (sample 0) layer 0: forward K/V: join (it started the gang) from rank 1" in message


# -- the hierarchy on virtual nodes (tests/test_hierarchy.py) -------------------------------------------------
@pytest.mark.timeout(300)
def test_hierarchy_push_and_fetch_are_exact_with_virtual_nodes() -> None:
    from test_hierarchy import WORLD, _rank_exact

    run_on_symm(_rank_exact, WORLD, 2, timeout=280)


# -- deterministic mode (tests/test_deterministic.py): int64 pushes through the kernel's exact integer add ----------
def test_deterministic_same_bits_whatever_the_arrival_order() -> None:
    """Also the same bits as the host transport's: ``up``/``down`` push synchronously, through the push kernel that
    quantises in registers; ``async`` pushes go through the host-side quantiser (torch ops), as on host."""
    from test_deterministic import _rank_train

    runs = [run_on_symm(_rank_train, 3, True, order, 2, timeout=180) for order in ("up", "down", "async")]
    assert runs[0] == runs[1] == runs[2] == run_ranks(_rank_train, 3, True, "up", 2)


def test_deterministic_with_nodes_gives_the_flat_bits() -> None:
    """3 nodes of 1: int64 staging rows, int64 put-with-signal into int64 inboxes, the integer fold."""
    from test_deterministic import _rank_train

    flat = run_on_symm(_rank_train, 3, True, "up", 2, timeout=180)
    assert run_on_symm(_rank_train, 3, True, "async", 2, env={"ODC_NODE_SIZE": "1"}, timeout=180) == flat


def test_deterministic_overflow_with_nodes_is_refused_and_nothing_is_staged() -> None:
    from test_deterministic import _rank_overflow, check_overflow

    check_overflow(run_on_symm(_rank_overflow, 3, 1, timeout=180), 3)


def test_default_mode_depends_on_the_arrival_order() -> None:
    """The teeth of the test above on this transport: fp32 atomics in the two forced orders give different bits."""
    from test_deterministic import _rank_train

    assert run_on_symm(_rank_train, 3, False, "up", 2, timeout=180) != run_on_symm(
        _rank_train, 3, False, "down", 2, timeout=180
    )


def test_deterministic_precision_against_fp64_reference() -> None:
    from test_deterministic import _rank_precision

    run_on_symm(_rank_precision, 3, timeout=180)


def test_deterministic_overflow_is_refused_on_every_rank_and_nothing_is_written() -> None:
    from test_deterministic import _rank_overflow, check_overflow

    check_overflow(run_on_symm(_rank_overflow, 3, timeout=180), 3)


# -- group fences (tests/test_groups.py) ----------------------------------------------------------------------
def test_groups_shard_fetch_push_sync_exact() -> None:
    from test_groups import _rank_groups

    run_on_symm(_rank_groups, 4, [2, 2], {0: 2, 1: 3}, timeout=180)


def test_crossed_group_and_world_sync_is_a_mismatch_not_a_hang() -> None:
    from test_groups import _rank_crossed

    run_on_symm(_rank_crossed, 4, env={"ODC_TIMEOUT": "6"}, timeout=110)


# -- the signalled put's ordering, where the interpreter can show it -------------------------------------------
def _rank_put_many_blocks(rank: int, world: int, numel: int) -> None:
    """Rank 0 puts rows of several kernel blocks into rank 1; rank 1 reads the data as soon as the signal counts
    it. The interpreter runs a launch's blocks one after another, so a signal issued before the last block stored
    its data is seen with data missing. The same put again (same row tensor, same signal word) makes no tensor: its
    scratch is reused, its counters zeroed (else the second round's last block would not signal)."""
    import torch

    import odc_runtime as odc
    from odc_runtime import testing
    from odc_runtime.transport.base import PutRequest

    odc.init()
    t = testing.transport()
    buf = t.alloc(numel, torch.float32, tag="rows")
    signal = t.alloc(1, torch.int64, tag="signal")
    row = torch.empty(numel, dtype=torch.float32)
    made: list[str] = []
    real = {name: getattr(torch, name) for name in ("tensor", "zeros", "empty")}

    def counting(name: str):
        def make(*args, **kwargs):
            made.append(name)
            return real[name](*args, **kwargs)
        return make

    for rnd in (1, 2, 3):
        row.copy_(torch.arange(numel, dtype=torch.float32) + 1000 * rnd)
        if rank == 0:
            if rnd > 1:
                for name in real:
                    setattr(torch, name, counting(name))
            try:
                t.put_signal(buf, [PutRequest(1, row, 0, 0)], signal)
            finally:
                for name, fn in real.items():
                    setattr(torch, name, fn)
            assert made == [], f"round {rnd}: a repeated put made tensors: {made}"
        else:
            t.wait_signal(signal, 0, rnd, "rows", [0])
            assert torch.equal(buf.local, row), f"round {rnd}: data missing after its signal"
        t.barrier(f"round {rnd}")  # the row is overwritten only after it was read
    t.free(signal)
    t.free(buf)


def test_put_signal_delivers_every_block_before_the_signal() -> None:
    run_on_symm(_rank_put_many_blocks, 2, 4 * 4096 + 1, timeout=110)  # 5 blocks of the interpreter's 4096


# -- the cached launch descriptors of a plan (odc_runtime/transport/symm/plan.py) ------------------------------------
def _rank_plan_addresses(rank: int, world: int, numel: int) -> None:
    """One plan (same shape, dtype, device) used with more caller tensors than it keeps descriptors for, in turn:
    every fetch lands in the tensor passed and every push adds the tensor passed, exactly."""
    import torch

    import odc_runtime as odc

    odc.init()
    full = torch.arange(numel, dtype=torch.float32) * 3 + 1
    st = odc.shard(full.clone(), name="plan")
    outs = [torch.full((numel,), -1.0) for _ in range(6)]  # more than a plan keeps (4)
    for rnd in range(2):
        for i, out in enumerate(outs):
            for o in outs:
                o.fill_(-1.0)
            odc.fetch(st, out=out)
            assert torch.equal(out, full), f"round {rnd}: fetch into tensor {i} landed elsewhere"
            assert all(bool((o == -1.0).all()) for o in outs if o is not out), "a fetch wrote into another tensor"
    grads = [torch.full((numel,), float(k + 1)) for k in range(6)]
    for _ in range(2):
        for g in grads:
            odc.push(st, g)
    odc.sync()
    expected = 2 * world * sum(range(1, 7))  # every rank pushed 1..6 twice
    assert torch.equal(st.grad, torch.full_like(st.grad, float(expected))), st.grad
    odc.finalize()


def test_plan_descriptors_follow_the_caller_tensor() -> None:
    run_on_symm(_rank_plan_addresses, 2, 37, timeout=120)


# -- sync without a thread per call, and the GPU's deferred settling (symm/watch.py) ---------------------------------
def _rank_syncs_start_no_thread(rank: int, world: int, calls: int) -> int:
    """``calls`` syncs (with a push each, so every round carries data) start no thread: the one watchdog thread
    of the transport watches them all; the pushes still land exactly."""
    import threading

    import torch

    import odc_runtime as odc
    from odc_runtime import testing

    odc.init()
    st = odc.shard(torch.zeros(8), name="threads")
    odc.sync()  # anything started once (the watchdog with the transport) is started by now
    watchdog = testing.transport()._watchdog.thread  # type: ignore[attr-defined]
    assert watchdog.is_alive()
    started: list[str] = []
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        for _ in range(calls):
            odc.push(st, torch.ones(8))
            odc.sync()
    finally:
        threading.Thread.start = real_start  # type: ignore[method-assign]
    assert started == [], started
    assert torch.equal(st.grad, torch.full_like(st.grad, float(calls * world)))
    odc.finalize()
    watchdog.join(5)
    assert not watchdog.is_alive(), "finalize did not stop the watchdog"
    return len(started)


@pytest.mark.timeout(300)
def test_hundred_syncs_start_no_thread() -> None:
    assert run_on_symm(_rank_syncs_start_no_thread, 2, 100, timeout=280) == [0, 0]


def _rank_watchdog_stays_asleep(rank: int, world: int, calls: int) -> dict:
    """World 1, the kernels compiled for sm_90 with only the driver's launch stubbed (so a barrier completes at
    once, as a quick one on a GPU does): how many of ``calls`` syncs the watchdog thread watched itself."""
    import threading

    import torch

    import odc_runtime as odc
    from odc_runtime import testing
    from odc_runtime.transport import host
    from odc_runtime.transport.symm.transport import SymmTransport

    with testing.stubbed_triton_launches():
        transport = host.create(timeout=60.0, heap_size="1M", transport_class=SymmTransport)
        transport._status[0] = 1  # the stubbed barrier writes nothing: its status says "completed" (world 1)
        testing.install(transport)
        try:
            odc.shard(torch.zeros(8), name="asleep")
            odc.sync()
            watchdog = transport._watchdog.thread
            watched: list[str] = []
            real = transport._wait_for_peers

            def wait_for_peers(op: str, *args: Any, **kwargs: Any) -> None:
                if threading.current_thread() is watchdog:
                    watched.append(op)
                real(op, *args, **kwargs)

            transport._wait_for_peers = wait_for_peers
            for _ in range(calls):
                odc.sync()
            return {"watched": len(watched), "alive": watchdog.is_alive()}
        finally:
            testing.uninstall()
            transport.finalize()


def test_the_watchdog_leaves_quick_syncs_to_their_caller() -> None:
    """The watchdog thread shares the GIL with the training loop: it looks at a barrier only once it has been
    pending for its grace period, so a loop of quick syncs does not make it run per sync (it watched every one
    when every arm woke it: 144 of 200 in one run)."""
    [result] = run_ranks(_rank_watchdog_stays_asleep, 1, 200, timeout=120, env={"TRITON_INTERPRET": "0"})
    assert result["alive"] and result["watched"] < 20, result


def _rank_deferred_mismatch(rank: int, world: int) -> str:
    """With the GPU's stream-ordered barriers turned on, a round where rank 0 is in ``sync`` and rank 1 in another
    collective returns on both ranks (the kernels met); the next call that settles raises the mismatch on every
    rank, and since every rank completed the round the transport stays usable."""
    import odc_runtime as odc
    from odc_runtime import testing

    odc.init()
    t = testing.transport()
    t.ordered_barriers = True  # type: ignore[attr-defined]
    t.barrier("sync" if rank == 0 else "other")  # returns: the outcome is settled by the next call
    assert t._pending is not None  # type: ignore[attr-defined]
    with pytest.raises(odc.OdcMismatchError, match=r"rank 0 is in 'sync' but rank 1 is in 'other'|"
                                                   r"rank 1 is in 'other' but rank 0 is in 'sync'"):
        t.barrier("sync")
    assert t.failure is None
    t.barrier("sync")  # the rounds stayed aligned
    t.settle()
    odc.finalize()
    return "ok"


def test_a_mismatched_stream_ordered_sync_is_raised_by_the_next_call_on_every_rank() -> None:
    assert run_on_symm(_rank_deferred_mismatch, 2, timeout=110) == ["ok", "ok"]


def _rank_deferred_free(rank: int, world: int) -> str:
    """``free`` settles its own barrier before it frees: a free met by a sync frees nothing, even with
    stream-ordered barriers."""
    import torch

    import odc_runtime as odc
    from odc_runtime import testing

    odc.init()
    t = testing.transport()
    t.ordered_barriers = True  # type: ignore[attr-defined]
    buf = t.alloc(4, torch.float32, tag="kept")
    used = t.heap_used()
    if rank == 0:
        with pytest.raises(odc.OdcMismatchError):
            t.free(buf)
        assert not buf.freed and t.heap_used() == used
    else:
        t.barrier("sync")
        with pytest.raises(odc.OdcMismatchError):
            t.settle()
    t.free(buf)  # the retry, on both ranks
    assert buf.freed
    odc.finalize()
    return "ok"


def test_a_mismatched_free_frees_nothing_with_stream_ordered_barriers() -> None:
    assert run_on_symm(_rank_deferred_free, 2, timeout=110) == ["ok", "ok"]


def _failed_behind_an_ordered_sync(rank: int, world: int):
    """With the GPU's stream-ordered barriers turned on, the last rank dies after a sync; the others' next sync
    returns at once (its outcome is settled by the next call), and their watchdogs find the dead peer while the
    user does "an optimizer step". Returns the transport once its watchdog recorded the failure."""
    import os
    import time

    import odc_runtime as odc
    from odc_runtime import testing

    odc.init()
    t = testing.transport()
    t.ordered_barriers = True  # type: ignore[attr-defined]
    odc.sync()
    t.settle()  # type: ignore[attr-defined]
    if rank == world - 1:
        os._exit(0)
    odc.sync()  # returns after the launch: the peer that never arrives is found by the watchdog
    deadline = time.monotonic() + 60
    while t.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert t.failure is not None
    return t


def _rank_unseen_failure_at_finalize(rank: int, world: int) -> str:
    """The next call after the failure is finalize: it must raise that failure, typed, on every survivor (it only
    logged it: the job exited 0 with a wrong model)."""
    import odc_runtime as odc

    t = _failed_behind_an_ordered_sync(rank, world)
    assert t.failure_unseen
    with pytest.raises(odc.OdcPeerLostError, match=r"odc finalize: an earlier operation failed.*not trustworthy"):
        odc.finalize()
    assert not odc.is_initialized()
    odc.finalize()  # idempotent: nothing left to raise
    return "raised"


def test_finalize_raises_a_failure_no_call_raised_on_every_rank() -> None:
    results = run_on_symm(_rank_unseen_failure_at_finalize, 3, expect_exit={2}, timeout=120)
    assert results[:2] == ["raised", "raised"]


def _rank_seen_failure_at_finalize(rank: int, world: int) -> str:
    """A failure the caller was given (the next sync settled it) is only logged by finalize, as before."""
    import odc_runtime as odc

    t = _failed_behind_an_ordered_sync(rank, world)
    with pytest.raises(odc.OdcPeerLostError):
        odc.sync()
    assert not t.failure_unseen
    odc.finalize()
    return "logged"


def test_finalize_after_a_raised_failure_only_releases() -> None:
    assert run_on_symm(_rank_seen_failure_at_finalize, 2, expect_exit={1}, timeout=120)[:1] == ["logged"]


def _rank_abort_is_a_host_store(rank: int, world: int) -> str:
    """The watchdog's abort on a GPU transport: a store to the host-mapped word, with no stream (a side stream from
    torch's pool can be the very stream the barrier spins on) and no launch (the launch queue may be full). The
    transport's device reads as a GPU's; any stream or launch fails the test."""
    import torch

    import odc_runtime as odc
    from odc_runtime import testing

    odc.init()
    t = testing.transport()

    def no_stream(*args: object, **kwargs: object) -> None:
        raise AssertionError("the abort used a CUDA stream")

    torch.cuda.Stream, torch.cuda.stream = no_stream, no_stream  # type: ignore[assignment, misc]
    device, t.device = t.device, torch.device("cuda", 0)
    launches = sum(n for counts in t.kernels.launches().values() for n in counts)  # type: ignore[attr-defined]
    t._raise_abort()  # type: ignore[attr-defined]
    assert int(t._abort[0]) == 1 and t._abort.device.type == "cpu"  # type: ignore[attr-defined]
    assert sum(n for counts in t.kernels.launches().values() for n in counts) == launches  # type: ignore[attr-defined]
    t.device = device
    t.fail(odc.OdcBackendError("test: aborted"))
    odc.finalize()
    return "ok"


def test_the_abort_is_a_host_store_without_a_stream_or_launch() -> None:
    assert run_on_symm(_rank_abort_is_a_host_store, 1, timeout=90) == ["ok"]


def _rank_watchdog_in_thread_local_capture_mode(rank: int, world: int) -> dict:
    """A user captures a CUDA graph in global mode on their thread while a stream-ordered sync is pending: the
    watchdog's event query must not be an unsafe call in that capture. The CUDA runtime is faked at its lowest
    boundary: a thread that has not taken thread-local capture mode gets the capture error from the event query
    (and would invalidate the capture), as CUDA does."""
    import threading

    import torch

    import odc_runtime as odc
    from odc_runtime import testing
    from odc_runtime.transport import cudart
    from odc_runtime.transport.symm.watch import Entry

    local: set[int] = set()

    class Runtime:
        def cudaThreadExchangeStreamCaptureMode(self, ref) -> int:
            local.add(threading.get_ident())
            return 0

        def cudaGetLastError(self) -> int:
            return 0

    class CapturedEvent:  # torch.cuda.Event while another thread captures in global mode
        def query(self) -> bool:
            if threading.get_ident() not in local:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            return True

    odc.init()
    t = testing.transport()
    cudart.loaded = lambda: Runtime()
    torch.cuda.set_device = lambda device: None
    device, t.device = t.device, torch.device("cuda", 0)
    entry = Entry("sync", [0], None, lambda p: None, "")
    entry.event = CapturedEvent()
    t._watchdog.arm(entry)  # type: ignore[attr-defined]
    t._watchdog.wait_finished(entry)  # type: ignore[attr-defined]  # the watchdog thread finishes it
    out = {"error": repr(entry.error), "failure": repr(t.failure), "watchdog_thread_local":
           t._watchdog.thread.ident in local}  # type: ignore[attr-defined]
    t.device = device
    odc.finalize()
    return out


def test_the_watchdog_queries_events_in_thread_local_capture_mode() -> None:
    [r] = run_on_symm(_rank_watchdog_in_thread_local_capture_mode, 1, timeout=90)
    assert r == {"error": "None", "failure": "None", "watchdog_thread_local": True}, r


# -- copy-engine fetch (symm/heap.py COPY_MIN_BYTES): large pieces copied from the peer's heap view ----------------
def _rank_copy_engine_fetch(rank: int, world: int, numel: int, threshold: int) -> dict[str, int]:
    """With the threshold between the two ranks' piece sizes (17 and 16 fp32 of 33), a fetch copies rank 0's piece
    from its heap view and launches the copy kernel for rank 1's only; planned (``out=``) and generic fetches
    return the exact shard values, as do fetches with every piece copied and none."""
    import torch

    import odc_runtime as odc
    from odc_runtime import testing
    from odc_runtime.transport.symm import heap as heaps

    odc.init()
    t = testing.transport()
    full = torch.arange(numel, dtype=torch.float32) * 7 - 3
    st = odc.shard(full.clone(), name="copies")
    counts = {"kernel_rows": 0, "views": 0}
    kernels, real_view = t.kernels, t.heap.peer_view  # type: ignore[attr-defined]

    class Spy:  # the kernels module, its fetch launches counted
        def __getattr__(self, name: str) -> object:
            return getattr(kernels, name)

        def fetch(self, table: torch.Tensor, desc: torch.Tensor, *rest: object) -> None:
            counts["kernel_rows"] += desc.shape[0]
            kernels.fetch(table, desc, *rest)

    def peer_view(peer: int) -> torch.Tensor:
        counts["views"] += 1
        return real_view(peer)

    t.kernels = Spy()  # type: ignore[attr-defined]
    t.heap.peer_view = peer_view  # type: ignore[attr-defined]
    result = {}
    for label, limit in (("mixed", threshold), ("all", 1), ("none", 1 << 40)):
        heaps.COPY_MIN_BYTES = limit
        st._plans = type(st._plans)()  # plans decide at creation: start from none  # type: ignore[attr-defined]
        counts.update(kernel_rows=0, views=0)
        out = torch.full((numel,), -1.0)
        odc.fetch(st, out=out)  # planned
        assert torch.equal(out, full), (label, out)
        assert torch.equal(odc.fetch(st), full), label  # generic path
        result[label] = counts["kernel_rows"]
        result[label + "_views"] = counts["views"]
    odc.finalize()
    return result


def test_copy_engine_fetch_for_large_pieces_a_kernel_for_the_rest() -> None:
    results = run_on_symm(_rank_copy_engine_fetch, 2, 33, 17 * 4, timeout=120)
    for r in results:
        # mixed: one kernel row per fetch (rank 1's 16 elements), both fetches; all: none; none: two per fetch
        assert (r["mixed"], r["all"], r["none"]) == (1 * 2, 0, 2 * 2), r
        assert r["none_views"] == 0 and r["all_views"] >= 2 and r["mixed_views"] >= 1, r


# -- the kernels' vector variant (kernels/peer.py ALIGNED) ----------------------------------------------------------
def _rank_vector_variants(rank: int, world: int, numel: int) -> list[tuple[str, bool]]:
    """Fetches and pushes through caller tensors 16-byte aligned and 4 bytes off: the launches take the ALIGNED
    variant exactly for the former, and both land exact values, the rows' last ``n % 16`` elements included."""
    import torch

    import odc_runtime as odc
    from odc_runtime import testing

    odc.init()
    t = testing.transport()
    kernels, seen = t.kernels, []  # type: ignore[attr-defined]

    class Spy:  # the kernels module, the variant of each fetch/push launch recorded
        def __getattr__(self, name: str) -> object:
            return getattr(kernels, name)

        def fetch(self, table: torch.Tensor, desc: torch.Tensor, longest: int, dtype: torch.dtype,
                  aligned: bool = False) -> None:
            seen.append(("fetch", aligned))
            kernels.fetch(table, desc, longest, dtype, aligned)

        def push(self, *args: object, aligned: bool = False) -> None:
            aligned = bool(args[7]) if len(args) > 7 else aligned
            seen.append(("push", aligned))
            kernels.push(*args[:7], aligned=aligned)

    t.kernels = Spy()  # type: ignore[attr-defined]
    full = torch.arange(numel, dtype=torch.float32) * 3 - 5
    st = odc.shard(full.clone(), name="vector")
    space = torch.full((numel + 4,), -1.0)  # a fresh allocation: 16-byte aligned
    grads = torch.zeros(numel + 4)
    expected = torch.zeros(numel)
    for off, k in ((0, 1.0), (1, 2.0), (0, 5.0)):  # aligned, 4 bytes off, aligned again (the plan's kept entry)
        out = space[off : off + numel]
        space.fill_(-1.0)
        odc.fetch(st, out=out)
        assert torch.equal(out, full), f"fetch at element offset {off}"
        grad = grads[off : off + numel]
        grad.copy_(torch.arange(numel, dtype=torch.float32) * k + rank)
        odc.push(st, grad)
        expected += torch.arange(numel, dtype=torch.float32) * k * world + sum(range(world))
    odd = torch.zeros(numel + 1)[1:]
    odd.copy_(torch.arange(numel, dtype=torch.float32) * 7 + rank)
    odc.push(st, odd, async_op=True).wait()  # the generic path chooses too
    expected += torch.arange(numel, dtype=torch.float32) * 7 * world + sum(range(world))
    odc.sync()
    lo, hi = st.shard_range
    assert torch.equal(st.grad, expected[lo:hi]), (st.grad, expected[lo:hi])
    odc.finalize()
    return seen


def test_vector_variant_exactly_for_aligned_rows_with_exact_sums() -> None:
    # 8232 = 2 * 4116 elements: rows longer than the interpreter's block (4096) with 4 elements past a multiple of 16
    seen = run_on_symm(_rank_vector_variants, 2, 8232, timeout=240)
    for rank_seen in seen:
        assert rank_seen == [("fetch", True), ("push", True), ("fetch", False), ("push", False), ("fetch", True),
                             ("push", True), ("push", False)], rank_seen
