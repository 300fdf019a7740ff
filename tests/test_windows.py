"""The window rules (odc_runtime/windows.py), checked at every world sync: an owner that changes a shard a peer
fetches, or zeroes an accumulator a peer pushes into, between the same two syncs raises OdcWindowError on every
rank at the closing sync, naming the shard, the owner, the rule and the fix; updating one shard while peers fetch
another does not. The check runs with ``ODC_DEBUG=1`` (docs/core-api.md, "Why two syncs per minibatch"). And the
round-mismatch error at ``finalize`` says how to find the drifted call."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _dist import run_ranks

import odc_runtime as odc

pytestmark = pytest.mark.timeout(300)

STEPS = 3
N = 8
DEBUG = {"ODC_DEBUG": "1"}


def _on(backend: str, fn, world: int, *args, env: dict[str, str]) -> list:
    if backend == "host":
        return run_ranks(fn, world, *args, env=env, timeout=180)
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from test_symm_cpu import run_on_symm

    return run_on_symm(fn, world, *args, env=env, timeout=180)


def _rank_loop(rank: int, world: int, variant: str) -> dict:
    """The README's core-API loop, broken as ``variant`` says. Returns the step and the error each rank stopped at
    (``None``: the loop ran to its end)."""
    odc.init("host")
    w = odc.shard(torch.zeros(N), name="w")
    for step in range(STEPS):
        try:
            full = odc.fetch(w)
            odc.push(w, torch.ones(N) + full)
            odc.sync()  # closes the window of the fetches and pushes
        except odc.OdcWindowError as e:
            return {"step": step, "error": type(e).__name__, "message": str(e)}
        with torch.no_grad():
            w.local -= 0.1 * w.grad
        if variant == "dropped second sync":
            w.zero_grad()
        else:  # "zero_grad after the second sync"
            odc.sync()
            w.zero_grad()
    return {"step": None}


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
def test_dropped_second_sync_raises_on_every_rank(backend: str) -> None:
    results = _on(backend, _rank_loop, 3, "dropped second sync", env=DEBUG)
    for rank, r in enumerate(results):
        assert r["step"] == 1 and r["error"] == "OdcWindowError", (rank, r)  # at the sync that closed the race
        message = r["message"]
        assert "shard 'w': owner rank 0 changed st.local" in message, message
        assert "in the window in which ranks [1, 2] fetched it" in message, message
        assert "Fix: call odc_runtime.sync() after the optimizer step and before the next fetches" in message, message
    assert len({r["message"] for r in results}) == 1  # the same verdict everywhere


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
def test_zero_grad_after_the_second_sync_raises_on_every_rank(backend: str) -> None:
    results = _on(backend, _rank_loop, 3, "zero_grad after the second sync", env=DEBUG)
    for rank, r in enumerate(results):
        assert r["step"] == 1 and r["error"] == "OdcWindowError", (rank, r)
        message = r["message"]
        assert "shard 'w': owner rank 0 zeroed or wrote st.grad" in message, message
        assert "in the window in which ranks [1, 2] pushed into it" in message, message
        assert "odc_runtime.sync() after zero_grad() and before the next pushes" in message, message
        assert "changed st.local" not in message, message  # the optimizer's writes were fenced
    assert len({r["message"] for r in results}) == 1


def _rank_overlap(rank: int, world: int) -> list[float]:
    """Owners update shard ``a`` while peers fetch and push shard ``b`` in the same window (allowed); ``b``'s own
    update is fenced by a second sync. Every fetched value and the final values are exact."""
    odc.init("host")
    a = odc.shard(torch.zeros(N), name="a")
    b = odc.shard(torch.arange(N, dtype=torch.float32), name="b")
    seen = []
    for step in range(STEPS):
        full = odc.fetch(b)
        assert torch.equal(full, torch.arange(N, dtype=torch.float32) - step * world), (step, full)
        seen.append(full.sum().item())
        odc.push(b, torch.ones(N))
        with torch.no_grad():
            a.local += 1  # shard a: nobody fetches it in this window
        odc.sync()
        with torch.no_grad():
            b.local -= b.grad  # world per element
        b.zero_grad()
        odc.sync()
    assert torch.equal(odc.fetch(a), torch.full((N,), float(STEPS)))
    assert torch.equal(odc.fetch(b), torch.arange(N, dtype=torch.float32) - STEPS * world)
    return seen


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
def test_updating_one_shard_while_peers_fetch_another_passes(backend: str) -> None:
    results = _on(backend, _rank_overlap, 3, env=DEBUG)
    expected = [float(sum(range(N)) - N * step * 3) for step in range(STEPS)]
    assert results == [expected] * 3, results


def _rank_extra_sync_at_the_end(rank: int, world: int) -> dict:
    """Rank 0 makes one ``sync()`` more than the others; the others reach ``finalize`` at that round."""
    from odc_runtime import testing

    odc.init("host")
    w = odc.shard(torch.zeros(N), name="w")
    odc.push(w, torch.ones(N))
    odc.sync()
    try:
        if rank == 0:
            odc.sync()
        odc.finalize()
    except odc.OdcRoundMismatchError as e:
        testing.abandon()
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
def test_finalize_round_mismatch_says_how_to_find_the_drifted_call(backend: str) -> None:
    results = _on(backend, _rank_extra_sync_at_the_end, 2, env={})
    for rank, r in enumerate(results):
        assert r["error"] == "OdcRoundMismatchError", (rank, r)
        assert "'finalize'" in r["message"] and "'sync'" in r["message"], r
        assert "ODC_DEBUG=1" in r["message"], r  # how to find the call that drifted


# -- the same rules in every accumulation and layout mode ------------------------------------------------------------
def _rank_modes(rank: int, world: int, kwargs: dict, drop: bool) -> dict:
    """The core-API loop with its two syncs (``drop``: without the second) in a mode of ``init``; returns the error
    the loop stopped at, or the exact final values."""
    odc.init("host", **kwargs)
    w = odc.shard(torch.zeros(N), name="w")
    for step in range(STEPS):
        try:
            odc.push(w, torch.full((N,), 1.0 + odc.fetch(w)[0].item() * 0))
            odc.sync()
        except odc.OdcWindowError as e:
            return {"step": step, "error": str(e)}
        start, stop = w.shard_range
        assert torch.equal(w.grad, torch.full((stop - start,), float(world))), (step, w.grad)
        with torch.no_grad():
            w.local += w.grad
        w.zero_grad()
        if not drop:
            odc.sync()
    return {"step": None, "values": odc.fetch(w).tolist()}


@pytest.mark.parametrize("kwargs", [{"deterministic": True}, {"node_size": 1}], ids=["deterministic", "nodes"])
def test_the_rules_hold_in_deterministic_mode_and_across_nodes(kwargs: dict) -> None:
    good = run_ranks(_rank_modes, 2, kwargs, False, env=DEBUG, timeout=180)
    assert good == [{"step": None, "values": [float(2 * STEPS)] * N}] * 2, good
    dropped = run_ranks(_rank_modes, 2, kwargs, True, env=DEBUG, timeout=180)
    for r in dropped:
        assert r["step"] == 1 and "shard 'w': owner rank 0 changed st.local" in r["error"], r
        assert "owner rank 1 zeroed or wrote st.grad (e.g. zero_grad()) in the window in which rank 0" in r["error"]


def _rank_groups(rank: int, world: int) -> dict:
    """Ranks {0, 1} and {2, 3} shard ``w`` over their own group. Group 0 keeps the rules with group syncs (which
    close its window); group 1 drops its second sync. Only group 1's owners are named, each with its own peer."""
    import torch.distributed as dist

    odc.init("host")
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    group = groups[rank // 2]
    w = odc.shard(torch.zeros(N), name="w", group=group)
    error = None
    for step in range(STEPS):
        odc.push(w, torch.ones(N) + 0 * odc.fetch(w))
        if rank < 2:
            odc.sync(group=group)
        try:
            odc.sync()
        except odc.OdcWindowError as e:
            error = {"step": step, "message": str(e)}
            break
        with torch.no_grad():
            w.local += w.grad
        w.zero_grad()
        if rank < 2:
            odc.sync(group=group)
    return error


def test_groups_close_their_windows_and_name_their_own_owners() -> None:
    results = run_ranks(_rank_groups, 4, env=DEBUG, timeout=180)
    for rank, r in enumerate(results):
        assert r is not None and r["step"] == 1, (rank, r)  # the world sync that closed group 1's race, everywhere
        message = r["message"]
        for owner, peer in ((2, 3), (3, 2)):
            blamed = f"owner rank {owner} changed st.local (e.g. the optimizer step) in the window in which rank {peer}"
            assert f"{blamed} fetched it" in message, message
        assert "owner rank 0" not in message and "owner rank 1" not in message, message
