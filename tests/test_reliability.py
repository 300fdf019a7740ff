"""Reliability, round 3 (issue 34): every sum is exact, or the runtime reports failure on every rank.

Each test failed on the code before its fix (the issue's item number is in its name). The probes (interrupts at a
chosen moment, held locks, mismatched collectives) come from ``_probe``; ``test_randomized_stress`` interleaves
them at random with pushes and checks every sum.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from _probe import (
    HeldLock,
    Preempted,
    cancel_interrupt,
    collective,
    die,
    interrupt_in,
    pause_after_next_announce,
    raise_in,
    random_interrupt,
    stop_for,
)

import odc_runtime as odc
from odc_runtime import testing


# -- 1. an interrupt during sync()'s wait for a pending async push ---------------------------------------------------
def _rank_interrupt_in_quiet(rank: int, world: int, error: type[BaseException]) -> list[float]:
    n = 1 << 12
    odc.init("host")
    st = odc.shard(torch.zeros(world * n), name="w")
    # Rank 1 holds the last element of its own accumulator: rank 0's async push (owner 1 first) stays unfinished.
    held = HeldLock(st, owner=1, element=n - 1) if rank == 1 else None
    odc.sync()
    if rank == 0:
        handle = odc.push(st, torch.ones(world * n), async_op=True)
        interrupt_in(0.3, error)  # lands while sync() waits for the push (quiet): nothing announced yet
        with pytest.raises(error):
            odc.sync()
        cancel_interrupt()
        assert testing.failure() is None  # an interrupt before announcing is an ordinary error
        odc.sync()  # the documented retry: waits for the push, then meets rank 1
        assert handle.is_completed()
    else:
        assert held is not None
        held.release_after(1.5)  # well after rank 0's interrupt
        odc.sync()  # returns only once rank 0's push is complete
    values = st.grad.tolist()
    dist.barrier()  # both read before anyone pushes again
    odc.push(st, torch.ones(world * n))  # still healthy and exact: 1 + one push per rank
    odc.sync()
    assert torch.equal(st.grad, torch.full_like(st.grad, 1.0 + world))
    return values


@pytest.mark.parametrize("error", [KeyboardInterrupt, Preempted], ids=["KeyboardInterrupt", "exception"])
def test_1_interrupt_while_sync_waits_for_an_async_push_loses_nothing(error: type[BaseException]) -> None:
    n = 1 << 12
    results = run_ranks(
        _rank_interrupt_in_quiet, 2, error, env={"ODC_TIMEOUT": "20", "ODC_HOST_CHUNK_BYTES": "4K"}, timeout=40
    )
    assert results == [[1.0] * n, [1.0] * n]


# -- 5. a mismatch among some ranks must not run ahead of a rank still in the previous round --------------------------
def _rank_mismatch_ahead(rank: int, world: int) -> list[float]:
    odc.init("host")
    x = odc.shard(torch.zeros(world * 4), name="x")
    y = odc.shard(torch.zeros(world * 4), name="y")
    if rank == 0:
        pause_after_next_announce(2.0)  # rank 0 announces the sync below, then is descheduled
    odc.sync()  # a correct collective: must succeed on every rank, rank 0 included
    # Rank 2 frees in the other order: a mismatch on every rank, at the same round, and nothing is freed.
    with pytest.raises(odc.OdcMismatchError, match="collective mismatch"):
        (y if rank == 2 else x).free()
    assert testing.failure() is None
    x.free()
    for _ in range(2):
        odc.push(y, torch.ones(world * 4))
        odc.sync()
    values = y.grad.tolist()
    y.free()
    return values


def test_5_a_mismatch_does_not_fail_a_rank_still_in_the_previous_round() -> None:
    results = run_ranks(_rank_mismatch_ahead, 3, env={"ODC_TIMEOUT": "20"}, timeout=60)
    assert results == [[6.0] * 4] * 3


# -- 2. under the hierarchy, a mismatched free changes nothing ------------------------------------------------------
def _rank_hierarchy_free_mismatch(rank: int, world: int) -> list[list[float]]:
    odc.init("host", node_size=2)
    x = odc.shard(torch.zeros(world * 8), name="x")
    y = odc.shard(torch.zeros(world * 8), name="y")
    with pytest.raises(odc.OdcMismatchError, match="collective mismatch"):
        (x if rank < 2 else y).free()  # node 0 frees x first, node 1 y: every rank raises, nothing is freed
    assert testing.failure() is None
    for st in (x, y):
        odc.push(st, torch.ones(world * 8))  # half of it crosses nodes, through the staging rows
    odc.sync()
    values = [x.grad.tolist(), y.grad.tolist()]
    x.free()
    y.free()
    assert testing.transport().heap_used() > 0  # the node signal words stay for the runtime's life
    return values


def test_2_mismatched_free_under_the_hierarchy_loses_no_gradient() -> None:
    results = run_ranks(_rank_hierarchy_free_mismatch, 4, env={"ODC_TIMEOUT": "20"}, timeout=60)
    assert results == [[[4.0] * 8, [4.0] * 8]] * 4


# -- 10. an empty tensor under the hierarchy ---------------------------------------------------------------------
def _rank_hierarchy_empty(rank: int, world: int) -> list[float]:
    odc.init("host", node_size=1)
    empty = odc.shard(torch.zeros(0), name="empty")
    w = odc.shard(torch.zeros(world * 2), name="w")
    assert odc.fetch(empty).shape == (0,)
    odc.push(empty, torch.zeros(0))
    odc.push(w, torch.ones(world * 2))
    odc.push(empty, torch.zeros(0), async_op=True).wait()
    assert odc.fetch(empty, async_op=True).wait().shape == (0,)
    odc.sync()
    return w.grad.tolist()


def test_10_empty_tensor_under_the_hierarchy() -> None:
    assert run_ranks(_rank_hierarchy_empty, 2, env={"ODC_TIMEOUT": "20"}, timeout=60) == [[2.0, 2.0]] * 2


# -- 7. an interrupt inside shard() is re-raised as it is, and fail-stops instead of blaming a peer -------------------
def _rank_interrupted_shard(rank: int, world: int, point: str, hierarchy: bool) -> None:
    odc.init("host", node_size=1 if hierarchy else None)
    transport = testing.transport()
    if rank == 0:
        # The interrupt lands between shard's collective steps, before this rank announced the next one: in the
        # accumulator's allocation (its local step), or just before a barrier (after the allocations; with nodes,
        # after the mirrors' allocations and refresh too).
        if point == "alloc":
            raise_in(transport.segments, "reserve", KeyboardInterrupt, after_calls=1)
        else:
            raise_in(transport, "barrier", KeyboardInterrupt, after_calls=1 if hierarchy else 0)
        with pytest.raises(KeyboardInterrupt):
            odc.shard(torch.zeros(world * 8), name="w")
        assert testing.failure() is not None
        # released locally, without waiting for anyone (with nodes, the runtime's node signal words stay)
        assert transport.heap_used() == (256 if hierarchy and point == "barrier" else 0)
    else:
        with pytest.raises(odc.OdcPeerLostError, match=r"rank\(s\) \[0\].*FAILED"):
            odc.shard(torch.zeros(world * 8), name="w")


@pytest.mark.parametrize(("point", "hierarchy"), [("alloc", False), ("barrier", False), ("barrier", True)],
                         ids=["in-alloc", "before-barrier", "before-barrier-nodes"])
def test_7_interrupt_inside_shard_is_reraised_and_fail_stops(point: str, hierarchy: bool) -> None:
    run_ranks(_rank_interrupted_shard, 2, point, hierarchy, env={"ODC_TIMEOUT": "20"}, timeout=60)


# -- 8. Handle.wait(timeout=) gives up on the wait, not on the push ---------------------------------------------------
def _rank_handle_timeout(rank: int, world: int) -> list[float]:
    n = 1 << 10
    odc.init("host")
    st = odc.shard(torch.zeros(world * n), name="w")
    held = HeldLock(st, owner=0, element=0) if rank == 1 else None  # rank 0's push to owner 0 waits for it
    odc.sync()
    if rank == 0:
        handle = odc.push(st, torch.ones(world * n), async_op=True)
        with pytest.raises(odc.OdcTimeoutError, match=r"still running.*not failed.*Do not issue it again"):
            handle.wait(timeout=0.2)
        assert testing.failure() is None and not handle.is_completed()
        dist.barrier()  # rank 1 releases the lock
        handle.wait()  # the same push completes; it is not issued again
    else:
        assert held is not None
        dist.barrier()
        held.release()
    odc.sync()
    return st.grad.tolist()


def test_8_handle_wait_timeout_leaves_the_push_running_and_counted_once() -> None:
    results = run_ranks(_rank_handle_timeout, 2, env={"ODC_TIMEOUT": "20"}, timeout=60)
    assert results == [[1.0] * (1 << 10)] * 2


# -- 9. ODC_TIMEOUT is bounded where it is parsed ----------------------------------------------------------------
def test_9_timeouts_beyond_a_year_are_refused_where_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    from odc_runtime import checks, config

    for bad in ("1e10", "1e300", "3.2e7"):  # 1e10 and more made every wait raise OverflowError
        monkeypatch.setenv("ODC_TIMEOUT", bad)
        with pytest.raises(odc.OdcUsageError, match="ODC_TIMEOUT must be at most"):
            config.resolve_timeout(None)
    with pytest.raises(odc.OdcUsageError, match="timeout must be at most"):
        config.resolve_timeout(1e10)
    with pytest.raises(odc.OdcUsageError, match=r"Handle.wait\(timeout=...\)"):
        checks.wait_timeout(1e10)
    monkeypatch.setenv("ODC_TIMEOUT", str(config.MAX_TIMEOUT_S))
    limit = config.resolve_timeout(None)
    # The largest accepted value works in every kind of wait the runtime makes (a thread wait, a deadline).
    from concurrent.futures import ThreadPoolExecutor

    from odc_runtime.transport.host.worker import FutureWork
    from odc_runtime.transport.wait import wait_for

    with ThreadPoolExecutor(1) as pool:
        FutureWork(pool.submit(lambda: None), limit, "probe").wait()
    wait_for([0], lambda _: True, timeout=limit, check=None, on_timeout=lambda m, w: AssertionError())
    assert checks.wait_timeout(limit) == limit


# -- randomized stress: interrupts interleaved with pushes; every sum exact, or failure reported on every rank -------
STRESS_SEED = int(os.environ.get("ODC_STRESS_SEED", "20260534"))
STRESS_ITERATIONS = int(os.environ.get("ODC_STRESS_ITERATIONS", "24"))


def _stress_sync(rng: random.Random) -> str:
    """One interruptible ``sync()`` and its documented retries: ``"done"``, or ``"failed"`` when the runtime
    failed on this rank (an interrupt after it announced its arrival) or reports a failed peer."""
    control = testing.transport().control  # type: ignore[attr-defined]
    interrupt = rng.random() < 0.6
    while True:
        epoch = control.epoch
        try:
            if interrupt:
                random_interrupt(rng, 0.008)
                interrupt = False  # a retry runs without one
            odc.sync()
            cancel_interrupt()
            return "done"
        except (KeyboardInterrupt, Preempted):
            cancel_interrupt()
            if testing.failure() is not None:
                return "failed"  # fail-stop: the peers must learn it (checked by the caller's next rounds)
            if control.epoch != epoch:
                return "done"  # the signal landed after the round completed, outside the runtime
            # an ordinary error (nothing announced): the documented retry
        except odc.OdcPeerLostError:
            cancel_interrupt()
            assert testing.failure() is not None
            return "failed"


def _rank_stress(rank: int, world: int, seed: int, iterations: int) -> dict[str, int]:
    n = world * (1 << 17)
    own = random.Random(seed * 1000 + rank)  # this rank's interrupts
    stats = {"syncs": 0, "checked": 0, "restarts": 0, "interrupted_waits": 0}
    odc.init("host")
    st = odc.shard(torch.zeros(n), name="s0")
    expected = 0.0
    for i in range(iterations):
        plan = random.Random(seed * 7919 + i)  # what every rank pushes in iteration i: known to all
        values = [[float(plan.randint(1, 8)) for _ in range(plan.randint(1, 3))] for _ in range(world)]
        handles = []
        for v in values[rank]:
            if own.random() < 0.7:
                handles.append(odc.push(st, torch.full((n,), v), async_op=True))
            else:
                odc.push(st, torch.full((n,), v))
        if handles and own.random() < 0.3:  # a wait given up by an interrupt: the push goes on, never re-issued
            try:
                random_interrupt(own, 0.004, (KeyboardInterrupt,))
                handles[-1].wait()
                cancel_interrupt()
            except KeyboardInterrupt:
                cancel_interrupt()
                stats["interrupted_waits"] += 1
        outcome = _stress_sync(own)
        if outcome == "done":
            stats["syncs"] += 1
            expected += sum(sum(v) for v in values)
            got = st.grad
            if not torch.equal(got, torch.full_like(got, expected)):
                bad = (got != expected).nonzero().flatten()
                raise AssertionError(
                    f"seed {seed} iteration {i} rank {rank}: {bad.numel()} of {got.numel()} elements wrong "
                    f"(first {got[bad[0]].item()} where {expected} is due) after a successful sync"
                )
            stats["checked"] += 1
            try:
                odc.sync()  # nobody pushes the next iteration before every rank checked this one
                continue
            except odc.OdcPeerLostError:
                assert testing.failure() is not None
        # The runtime failed on this rank or a peer in iteration i: every rank learns it in this iteration (its
        # sync or the fence needs the failed rank), so every rank restarts here, together.
        stats["restarts"] += 1
        odc.finalize()  # local release, no waiting
        odc.init("host")
        st = odc.shard(torch.zeros(n), name=f"s{stats['restarts']}")
        expected = 0.0
    return stats


def test_randomized_stress_interrupts_and_pushes_every_sum_exact() -> None:
    world = 2
    results = run_ranks(
        _rank_stress, world, STRESS_SEED, STRESS_ITERATIONS,
        env={"ODC_TIMEOUT": "20", "ODC_HOST_CHUNK_BYTES": "4K", "ODC_HEAP_SIZE": "64M"}, timeout=150,
    )
    restarts = {r["restarts"] for r in results}
    assert len(restarts) == 1, f"seed {STRESS_SEED}: ranks restarted different numbers of times: {results}"
    assert all(r["checked"] == r["syncs"] for r in results)
    assert sum(r["checked"] for r in results) > 0, f"seed {STRESS_SEED}: no sum was checked: {results}"
    print(f"stress seed {STRESS_SEED}: {results}")


# -- the probe families end typed or exact: kill a rank, stop a rank, mismatch a collective ---------------------------
def _rank_probe(rank: int, world: int, probe: str) -> list[float] | None:
    odc.init("host")
    st = odc.shard(torch.zeros(world * 4), name="w")
    odc.push(st, torch.ones(world * 4))
    if probe == "kill" and rank == world - 1:
        die()  # after a push, before the sync: the others must not wait out ODC_TIMEOUT
    if probe == "stop" and rank == world - 1:
        stop_for(1.0)  # shorter than ODC_TIMEOUT: only slow, so the sums stay exact
    if probe == "mismatch":
        kinds = ["sync"] * (world - 1) + ["shard:z"]  # the last rank is in another collective
        with pytest.raises(odc.OdcMismatchError, match="collective mismatch"):
            collective(kinds[rank], {"w": st})()
        assert testing.failure() is None  # nothing changed: the runtime stays usable
    if probe == "kill":
        with pytest.raises(odc.OdcPeerLostError, match=rf"lost rank\(s\) \[{world - 1}\].*DEAD"):
            odc.sync()
        return None
    odc.sync()
    return st.grad.tolist()


@pytest.mark.parametrize("probe", ["kill", "stop", "mismatch"])
def test_probe_families_end_exact_or_typed(probe: str) -> None:
    world = 3
    results = run_ranks(
        _rank_probe, world, probe, env={"ODC_TIMEOUT": "60"}, timeout=45,
        expect_exit={world - 1} if probe == "kill" else frozenset(),
    )
    if probe != "kill":
        assert results == [[3.0] * 4] * world
