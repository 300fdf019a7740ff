"""Fail-stop (issue 24): an operation that fails halfway is fatal, never silent.

Each case is an interruption, pause or misuse that once left training silently wrong; each must now end in either
correct values or a typed error on every affected rank, within ODC_TIMEOUT. Interrupts are real signals (an
interval timer whose handler raises ``KeyboardInterrupt``, as Ctrl-C or a preemption handler does), delivered
while the operation waits: a peer holds a byte-range lock or stays away until the interrupted rank reports back
(a gloo barrier), so the interrupt lands mid-operation without any sleep.
"""

from __future__ import annotations

import fcntl
import signal

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import testing
from odc_runtime.transport.host import CONTROL_BYTES


def _interrupt_in(seconds: float) -> None:
    """Raise KeyboardInterrupt in the main thread after ``seconds`` (once)."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _lock_owner_bytes(st: odc.ShardedTensor, owner: int, element: int) -> tuple[int, int, int]:
    """Exclusively lock one element of ``owner``'s accumulator of ``st`` (as a pusher holding it would)."""
    transport = testing.transport()
    fd = transport.segments.get(owner).fd  # type: ignore[attr-defined]
    start = CONTROL_BYTES + testing.buffers(st)[1].handle + 4 * element  # type: ignore[union-attr,operator]
    fcntl.lockf(fd, fcntl.LOCK_EX, 4, start)
    return fd, 4, start


def _shard_with_a_held_lock(
    rank: int, world: int, n: int, locker: int, owner: int, element: int
) -> tuple[odc.ShardedTensor, tuple[int, int, int] | None]:
    """Init, shard ``world * n`` zeros, and on rank ``locker`` hold the lock of one element of ``owner``'s
    accumulator; every rank returns after a sync (the lock is held by then)."""
    odc.init("host")
    st = odc.shard(torch.zeros(world * n), name="w")
    held = _lock_owner_bytes(st, owner, element) if rank == locker else None
    odc.sync()
    return st, held


def _unlock(held: tuple[int, int, int] | None) -> None:
    assert held is not None
    fcntl.lockf(held[0], fcntl.LOCK_UN, held[1], held[2])


# -- an interrupted sync: the arrival was announced, so the rank is failed and its peers learn it -----------------
def _rank_interrupted_sync(rank: int, world: int) -> None:
    odc.init("host")
    st = odc.shard(torch.zeros(8), name="w")
    odc.sync()
    if rank == 0:
        _interrupt_in(1.0)  # rank 1 enters sync only after the interrupt: rank 0 is interrupted while waiting
        with pytest.raises(KeyboardInterrupt):
            odc.sync()
        dist.barrier()
        # Once rank 0's arrival counted for rank 1, its next push would land in rank 1's next minibatch: refused.
        with pytest.raises(odc.OdcBackendError, match="unusable"):
            odc.push(st, torch.ones(8))
        with pytest.raises(odc.OdcBackendError, match="unusable"):
            odc.sync()
    else:
        dist.barrier()
        odc.sync()  # rank 0 had arrived: this minibatch is complete and correct
        assert torch.equal(st.grad, torch.zeros_like(st.grad))
        with pytest.raises(odc.OdcPeerLostError, match=r"rank\(s\) \[0\].*FAILED"):
            odc.sync()  # the next one learns of rank 0's failure at once, not after ODC_TIMEOUT
    assert testing.failure() is not None
    odc.finalize()  # does not wait for the peers again


def test_interrupted_sync_fails_the_rank_and_its_peers() -> None:
    run_ranks(_rank_interrupted_sync, 2, env={"ODC_TIMEOUT": "30"}, timeout=25)


# -- an interrupted push: part of it landed, so the rank is failed; a sync never succeeds after it -------------------
def _rank_interrupted_push(rank: int, world: int) -> None:
    n = 1 << 14
    st, held = _shard_with_a_held_lock(rank, world, n, locker=1, owner=0, element=n // 2)  # owner 0's middle
    if rank == 0:
        # Rank 0 pushes to owner 1 (all lands) and then to owner 0, whose middle chunk is locked: interrupted there.
        _interrupt_in(1.0)
        with pytest.raises(KeyboardInterrupt):
            odc.push(st, torch.ones(world * n))
        dist.barrier()
        with pytest.raises(odc.OdcBackendError, match="KeyboardInterrupt after part of the push had landed"):
            odc.sync()  # the accumulators are torn: never a successful sync after it
        with pytest.raises(odc.OdcBackendError, match="unusable"):
            odc.push(st, torch.ones(world * n))
    else:
        dist.barrier()  # rank 0 was interrupted
        _unlock(held)
        with pytest.raises(odc.OdcPeerLostError, match="FAILED"):
            odc.sync()
    odc.finalize()


def test_interrupted_push_is_fatal_not_torn() -> None:
    run_ranks(_rank_interrupted_push, 2, env={"ODC_TIMEOUT": "30", "ODC_HOST_CHUNK_BYTES": "4K"}, timeout=25)


# -- a push that times out after part of it landed: the error says so, and a retry cannot double-count ------------
def _rank_push_timeout_retry(rank: int, world: int) -> None:
    n = 1 << 12
    # owner 0's first element, held by rank 1 past rank 0's ODC_TIMEOUT
    st, held = _shard_with_a_held_lock(rank, world, n, locker=1, owner=0, element=0)
    if rank == 0:
        with pytest.raises(odc.OdcTimeoutError, match=r"could not lock.*already landed.*unusable"):
            odc.push(st, torch.ones(world * n))  # owner 1's part landed first
        with pytest.raises(odc.OdcTimeoutError, match="unusable"):
            odc.push(st, torch.ones(world * n))  # the natural retry: refused, not counted twice
        dist.barrier()
    else:
        dist.barrier()  # rank 0 timed out
        _unlock(held)
        with pytest.raises(odc.OdcPeerLostError, match="FAILED"):
            odc.sync()
    odc.finalize()


def test_push_timed_out_after_partly_landing_cannot_be_retried() -> None:
    run_ranks(_rank_push_timeout_retry, 2, env={"ODC_TIMEOUT": "2"}, timeout=40)


def _rank_async_push_timeout(rank: int, world: int) -> None:
    n = 1 << 12
    st, held = _shard_with_a_held_lock(rank, world, n, locker=1, owner=0, element=0)
    if rank == 0:
        handle = odc.push(st, torch.ones(world * n), async_op=True)  # on the worker thread: same rule
        with pytest.raises(odc.OdcTimeoutError, match=r"already landed.*unusable"):
            handle.wait(timeout=30)  # longer than the push's own lock timeout, which is what must end it
        # The sync does not announce an arrival after a torn push (its peers must not count this minibatch).
        with pytest.raises(odc.OdcTimeoutError, match="unusable"):
            odc.sync()
        dist.barrier()
    else:
        dist.barrier()
        _unlock(held)
        with pytest.raises(odc.OdcPeerLostError, match="FAILED"):
            odc.sync()
    odc.finalize()


def test_async_push_timed_out_after_partly_landing_fails_the_sync() -> None:
    run_ranks(_rank_async_push_timeout, 2, env={"ODC_TIMEOUT": "2"}, timeout=40)


def _rank_push_timeout_before_landing(rank: int, world: int) -> None:
    n = 1 << 12
    # rank 1 pushes to owner 0 first, whose first element rank 0 holds: its very first chunk cannot land
    st, held = _shard_with_a_held_lock(rank, world, n, locker=0, owner=0, element=0)
    if rank == 1:
        with pytest.raises(odc.OdcTimeoutError, match="could not lock") as e:
            odc.push(st, torch.ones(world * n))
        assert "unusable" not in str(e.value) and testing.failure() is None  # nothing landed: an ordinary error
    dist.barrier()  # rank 1 timed out
    if rank == 0:
        _unlock(held)
    dist.barrier()
    if rank == 1:
        odc.push(st, torch.ones(world * n))  # the retry is exact
    odc.sync()
    assert torch.equal(st.grad, torch.ones_like(st.grad))
    odc.sync()


def test_push_timed_out_before_anything_landed_can_be_retried() -> None:
    run_ranks(_rank_push_timeout_before_landing, 2, env={"ODC_TIMEOUT": "2"}, timeout=40)


# -- the views cannot be rebound ------------------------------------------------------------------------------------
def _rank_rebind(rank: int, world: int) -> None:
    odc.init("host")
    st = odc.shard(torch.arange(8, dtype=torch.float32), name="w")
    local = st.local
    with pytest.raises(odc.OdcUsageError, match="cannot be rebound; update it in place"):
        st.local = st.local - 1.0
    with pytest.raises(odc.OdcUsageError, match="cannot be rebound"):
        st.grad = torch.zeros_like(st.grad)
    st.local -= 1.0  # in place, then the same tensor assigned back: allowed
    assert st.local is local
    odc.sync()
    assert torch.equal(odc.fetch(st), torch.arange(8, dtype=torch.float32) - 1.0)


def test_views_cannot_be_rebound() -> None:
    run_ranks(_rank_rebind, 2, timeout=40)


# -- DTensors and other subclasses are refused before any allocation ---------------------------------------------
def _rank_dtensor(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])
    odc.init("host")
    transport = testing.transport()
    used = transport.heap_used()
    with pytest.raises(odc.OdcUsageError, match=r"plain torch\.Tensor.*DTensor.*to_local"):
        odc.shard(dt, name="d")
    assert transport.heap_used() == used, "a refused shard() leaked heap"
    st = odc.shard(torch.zeros(4, 2), name="w")
    with pytest.raises(odc.OdcUsageError, match="DTensor"):
        odc.push(st, dt)
    with pytest.raises(odc.OdcUsageError, match="DTensor"):
        odc.fetch(st, out=dt)
    handle = odc.push(st, torch.ones(4, 2), async_op=True)
    for bad in ("x", -1, float("nan"), True):
        with pytest.raises(odc.OdcUsageError, match="timeout"):
            handle.wait(timeout=bad)
    handle.wait(timeout=10)
    odc.sync()
    start, stop = st.shard_range
    assert torch.equal(st.grad, torch.full((stop - start,), float(world)))
    odc.sync()


def test_tensor_subclasses_and_bad_wait_timeouts_are_refused_first() -> None:
    run_ranks(_rank_dtensor, 2, timeout=60)


# -- a mismatch or a finalized peer ends the next collective at once --------------------------------------------
def _rank_mismatch_then_finalize(rank: int, world: int) -> None:
    odc.init("host")
    if rank == 0:
        with pytest.raises(odc.OdcMismatchError, match="finalize"):
            odc.sync()
        # Rank 1 left in its finalize: rank 0's finalize must not wait ODC_TIMEOUT (60 s, beyond the harness) for it.
        with pytest.raises(odc.OdcPeerLostError, match="FINALIZED"):
            odc.finalize()
    else:
        with pytest.raises(odc.OdcMismatchError, match="sync"):
            odc.finalize()
    assert not odc.is_initialized()
    dist.barrier()  # rank 1 stays alive (a dead one would be seen dead): only its LEFT status can end rank 0's wait


def test_finalize_after_a_mismatch_does_not_wait_for_a_finalized_peer() -> None:
    run_ranks(_rank_mismatch_then_finalize, 2, env={"ODC_TIMEOUT": "60"}, timeout=30)


# -- an init that timed out after posting its arrival: a retry is refused clearly, the late peer fails at once ------
def _rank_init_retry(rank: int, world: int) -> None:
    if rank == 1:
        dist.barrier()  # arrives only after rank 0's init timed out
        with pytest.raises(odc.OdcMismatchError, match=r"rank 0 failed in 'init'"):
            odc.init("host")  # completes round "init" with rank 0's posted arrival, then meets its failure
    else:
        with pytest.raises(odc.OdcTimeoutError, match=r"rank\(s\) \[1\], which did not reach this collective within"):
            odc.init("host")
        with pytest.raises(odc.OdcUsageError, match="no retry can succeed; restart the job"):
            odc.init("host")
        dist.barrier()
    assert not odc.is_initialized()


def test_init_retry_after_an_init_timeout_is_refused_clearly() -> None:
    run_ranks(_rank_init_retry, 2, env={"ODC_TIMEOUT": "2"}, timeout=40)
