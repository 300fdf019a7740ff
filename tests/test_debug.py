"""``ODC_DEBUG=1`` (odc_runtime/debug.py): a drifted collective raises OdcRoundMismatchError on every rank at the first
call that differs, naming every rank's call site; without it the same program pairs collectives by count and its
sums are silently wrong. And in every mode: a peer whose program ended without ``odc.finalize()`` is reported as
that, not as a crash."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime.launch import free_port

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.timeout(300)

STEPS = 3
DEBUG = {"ODC_DEBUG": "1"}


def _line(marker: str) -> int:
    """The line of this file that carries ``# <marker>`` (the call sites the messages must name)."""
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}"))


def _rank_drift(rank: int, world: int) -> dict:
    """The README's core-API loop, with one extra ``sync()`` on rank 0 in every step (its pushes then land in a
    window the others already closed). Returns what each rank saw: the gradients it summed, and the error that
    stopped it (where: in the loop or at finalize)."""
    from odc_runtime import testing

    odc.init("host")
    w = odc.shard(torch.zeros(6), name="w")
    grads: list[float] = []
    where = "loop"
    try:
        for step in range(STEPS):
            odc.push(w, torch.full((6,), float(1 + rank + 10 * step)))
            if rank == 0:
                odc.sync()  # extra sync
            odc.sync()  # step sync
            grads.append(w.grad[0].item())
            w.zero_grad()
            odc.sync()  # zero sync
        where = "finalize"
        odc.finalize()
    except odc.OdcMismatchError as e:
        testing.abandon()  # the ranks are out of step: release locally
        return {"error": type(e).__name__, "message": str(e), "where": where, "grads": grads}
    return {"error": None, "grads": grads}


def _expected_grads(world: int) -> list[float]:
    return [float(sum(1 + r + 10 * step for r in range(world))) for step in range(STEPS)]


def test_drifted_sync_is_silent_without_debug() -> None:
    """The hazard the setting exists for: without ODC_DEBUG the same program sums wrong on every step, and only
    its end (rank 0 still in its syncs while the others finalize) shows that the ranks were out of step."""
    results = run_ranks(_rank_drift, 3)
    for rank, r in enumerate(results):
        assert r["error"] == "OdcRoundMismatchError", (rank, r)
        if rank > 0:
            assert r["where"] == "finalize" and len(r["grads"]) == STEPS, r
            assert r["grads"] != _expected_grads(3), r  # summed, silently wrong


@pytest.mark.parametrize("backend", ["host", "symm-cpu", "nvshmem-atomic"])
def test_drifted_sync_raises_on_every_rank_naming_both_call_sites(backend: str) -> None:
    results = _on(backend, _rank_drift, 3, env=DEBUG)
    extra, step_sync = _line("extra sync"), _line("step sync")
    for rank, r in enumerate(results):
        assert r["error"] == "OdcRoundMismatchError", (rank, r)
        assert r["where"] == "loop" and r["grads"] == [], (rank, r)  # at the first differing call: nothing summed
        message = r["message"]
        assert "ODC_DEBUG=1" in message and "collective call #2" in message, message  # shard, then this sync
        assert f"rank 0 called sync() at test_debug.py:{extra} in _rank_drift" in message, message
        assert f"ranks [1, 2] called sync() at test_debug.py:{step_sync} in _rank_drift" in message, message
    assert len({r["message"] for r in results}) == 1  # the same report everywhere


def _rank_group_drift(rank: int, world: int) -> dict:
    """Ranks 0 and 1 share a group, rank 2 has its own; rank 0 makes one extra ``sync(group=...)``. Returns the error
    each rank saw at its group sync, then checks that the runtime stays usable: a world sync and a group sync from
    the same places, with the sums of the pushes made before the drift exact."""
    import torch.distributed as dist

    odc.init("host")
    pair, alone = dist.new_group([0, 1]), dist.new_group([2])  # every rank creates every group
    group = pair if rank < 2 else alone
    st = odc.shard(torch.zeros(6), group=group, name="w")
    odc.push(st, torch.ones(6))
    error = None
    try:
        if rank == 0:
            odc.sync(group=group)  # extra group sync
        odc.sync(group=group)  # group sync
    except odc.OdcError as e:
        error = {"error": type(e).__name__, "message": str(e)}
    odc.sync()
    odc.sync(group=group)
    start, stop = st.shard_range
    assert torch.equal(st.grad, torch.full((stop - start,), 2.0 if rank < 2 else 1.0)), st.grad
    odc.finalize()
    return error


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
def test_drifted_group_sync_raises_on_every_member_naming_both_call_sites(backend: str) -> None:
    results = _on(backend, _rank_group_drift, 3, env=DEBUG)
    extra, group_sync = _line("extra group sync"), _line("group sync")
    for rank in (0, 1):
        assert results[rank] is not None and results[rank]["error"] == "OdcRoundMismatchError", (rank, results)
        message = results[rank]["message"]
        assert "group fence #1 of ranks [0, 1]" in message, message
        assert f"test_debug.py:{extra} in _rank_group_drift" in message, message
        assert f"test_debug.py:{group_sync} in _rank_group_drift" in message, message
    assert results[0]["message"] == results[1]["message"]  # the same report on both members
    assert results[2] is None  # its own group, alone: nothing drifted


def _rank_group_crossed_with_world(rank: int, world: int) -> dict:
    """Ranks 0 and 1 share a group, rank 2 has its own; rank 0 makes a group sync while rank 1 makes a world sync:
    both raise OdcCrossedCollectivesError, and rank 2 (a bystander in the world sync) OdcPeerLostError."""
    import torch.distributed as dist

    odc.init("host")
    pair, alone = dist.new_group([0, 1]), dist.new_group([2])  # every rank creates every group
    group = pair if rank < 2 else alone
    odc.shard(torch.zeros(6), group=group, name="w")
    odc.sync()
    with pytest.raises(odc.OdcError) as info:
        if rank == 0:
            odc.sync(group=group)  # crossed group sync
        else:
            odc.sync()  # crossed world sync
    return {"error": type(info.value).__name__, "message": str(info.value)}


@pytest.mark.parametrize("backend, mode", [("host", "debug"), ("host", "plain"), ("symm-cpu", "debug")])
def test_a_crossed_group_sync_names_the_users_calls_and_where_the_broken_ranks_are(backend: str, mode: str) -> None:
    """Issue 53: messages name user-facing operations. The debug round's internal name ('odc debug: collective
    fingerprint') was what peers saw of a world sync, and a bystander was told of a failed peer's last *world*
    barrier (a stale 'shard(w#0)') instead of the group fence it broke in."""
    results = _on(backend, _rank_group_crossed_with_world, 3, env=DEBUG if mode == "debug" else {})
    group_sync, world_sync = _line("crossed group sync"), _line("crossed world sync")
    here = "at test_debug.py:{} in _rank_group_crossed_with_world"
    group_call = "'sync(group=[0, 1])" + (f" {here.format(group_sync)}'" if mode == "debug" else "'")
    world_call = f"'sync() {here.format(world_sync)}'" if mode == "debug" else "'sync'"
    assert [r["error"] for r in results] == ["OdcCrossedCollectivesError"] * 2 + ["OdcPeerLostError"], results
    for r in results:
        assert "fingerprint" not in r["message"] and "odc odc" not in r["message"], r
    assert f"rank 0 is in {group_call} but rank 1 is in the collective {world_call}" in results[0]["message"], results
    assert f"rank 1 is in {world_call} but rank 0 waits for it in group fence #1" in results[1]["message"], results
    bystander = results[2]["message"]
    assert bystander.startswith(f"odc {world_call[1:-1]}: rank 2 waits for rank(s) [0]"), bystander
    assert "FAILED, in group fence #1 of ranks [0, 1], '" in bystander, bystander
    assert f"{group_call[-40:]})" in bystander, bystander  # a fence keeps its call's last 64 bytes
    assert "shard(w" not in bystander, bystander  # not its stale last world barrier


def _rank_crossed(rank: int, world: int) -> list[str]:
    """Rank 0 shards while rank 1 syncs: both raise at once; nothing changed (rank 0's shard sequence number
    included), so the ranks then shard and sync together and the runtime works."""
    odc.init("host")
    seen = []
    with pytest.raises(odc.OdcRoundMismatchError) as info:
        if rank == 0:
            odc.shard(torch.zeros(4), name="late")
        else:
            odc.sync()
    seen.append(str(info.value))
    st = odc.shard(torch.arange(4.0))  # default name: the same sequence number on both ranks
    odc.push(st, torch.ones(4))
    odc.sync()
    start, stop = st.shard_range
    assert torch.equal(st.grad, torch.full((stop - start,), float(world)))
    st.free()
    return seen


def test_crossed_calls_raise_together_and_change_nothing() -> None:
    for message, in run_ranks(_rank_crossed, 2, env=DEBUG):
        assert "rank 0 called shard(name='late') at test_debug.py" in message, message
        assert "rank 1 called sync() at test_debug.py" in message, message


def _rank_debug_differs(rank: int, world: int) -> str:
    os.environ["ODC_DEBUG"] = "1" if rank == 0 else "0"
    with pytest.raises(odc.OdcMismatchError) as info:
        odc.init("host")
    return str(info.value)


def test_the_setting_is_agreed_at_init() -> None:
    for message in run_ranks(_rank_debug_differs, 2):
        assert "debug setting (ODC_DEBUG)" in message, message


def test_consistent_programs_run_unchanged_in_debug_mode() -> None:
    """No false alarm: the core-API round trip (shard, push, fetch, sync, free, finalize from the same sites on
    every rank, uneven push counts) passes its exact checks with ODC_DEBUG=1."""
    from test_core import _rank_roundtrip

    run_ranks(_rank_roundtrip, 3, (7, 11), env=DEBUG)


def test_setting_is_parsed_in_config(monkeypatch) -> None:
    from odc_runtime import config

    monkeypatch.delenv("ODC_DEBUG", raising=False)
    assert config.debug() is False
    monkeypatch.setenv("ODC_DEBUG", "1")
    assert config.debug() is True
    monkeypatch.setenv("ODC_DEBUG", "detail")
    with pytest.raises(odc.OdcUsageError, match="ODC_DEBUG"):
        config.debug()


def _on(backend: str, fn, world: int, **kwargs) -> list:
    if backend == "host":
        return run_ranks(fn, world, **kwargs)
    if backend == "symm-cpu":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        from test_symm_cpu import run_on_symm

        return run_on_symm(fn, world, **kwargs)
    import _nvshmem_shm

    return run_ranks(_nvshmem_shm.run, world, backend.removeprefix("nvshmem-"), fn, **kwargs)


# -- a peer that exits without finalize ---------------------------------------------------------------------
# Real processes started as a launcher would (each its own interpreter, rendezvous by environment), so that a rank
# really ends its program: interpreter exit, atexit hooks and all.
_RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    import odc_runtime as odc

    torch.set_num_threads(1)
    backend, ending = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    odc.init(backend)
    w = odc.shard(torch.zeros(4), name="w")
    odc.sync()
    if rank == 1:  # one sync fewer than rank 0, then its program ends without odc.finalize()
        if ending == "raise":
            raise RuntimeError("rank 1 gives up")
        sys.exit(0) if ending == "exit" else None
    else:
        try:
            odc.sync()
            result = {"error": None}
        except odc.OdcError as e:
            result = {"error": type(e).__name__, "message": str(e)}
        print("RESULT " + json.dumps(result), flush=True)
        odc.finalize()
""")


@pytest.mark.parametrize("backend, ending", [("host", "return"), ("host", "exit"), ("host", "raise"),
                                             ("symm-cpu", "return")])
def test_a_peer_that_ended_without_finalize_is_reported_as_that(tmp_path, backend: str, ending: str) -> None:
    if backend == "symm-cpu" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "ODC_TIMEOUT": "60", "ODC_SHM_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, str(script), backend, ending], env={**env, "RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    lines = [line for line in outs[0][0].splitlines() if line.startswith("RESULT ")]
    assert lines, f"rank 0 printed no result: {outs[0]}"
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["error"] == "OdcPeerLostError", result
    how = "on an uncaught exception" if ending == "raise" else "normally"
    assert f"rank 1 (pid {procs[1].pid}, EXITED {how} without odc_runtime.finalize()" in result["message"], result
    assert "whose program ended without calling odc_runtime.finalize()" in result["message"], result
    assert "crashed or was killed" not in result["message"], result
    assert procs[0].returncode == 0, outs[0]
    assert procs[1].returncode == (1 if ending == "raise" else 0), outs[1]
