"""A killed rank never hangs the survivors (issue 12), on ONE GPU with 2-4 NVSHMEM PEs.

The survivors must raise OdcTimeoutError in push, fetch and sync within ODC_TIMEOUT + 5 s, name the dead rank,
keep a usable CUDA context, and then exit within 5 s. Mismatched protocol settings must raise on every rank.
Scenario ``queued`` launches thousands of operations behind the barrier that waits for the dead rank (issue 22):
the launch queue fills and a launch blocks inside the driver; the GIL must be released there and the engine's
deadline thread must raise the abort without Python. Runs with CUDA MPS (started by this test when
``nvidia-cuda-mps-control`` exists) and without: several PEs on one
GPU without MPS must then be refused at init with OdcUsageError on every rank (unless a system-wide MPS daemon is
already running, in which case the dead-peer checks apply). Ranks are plain processes (not torchrun, whose agent
would kill the survivors as soon as one rank dies). The push, sync and queued scenarios also run on symm (2 and 4
ranks sharing the GPU under MPS, the heap from CUDA IPC).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from _mps import mps_daemon
from test_nvshmem_gpu import NGPU, _require_backend  # skip without GPU / backend (fail under ODC_REQUIRE_EXTENSION=1)
from test_symm_shared_gpu import require_symm

WORKER = os.path.join(os.path.dirname(__file__), "_dead_peer_worker.py")
TIMEOUT_S = 8  # short: each scenario waits it out once (the proof must fit a 15-minute lease)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

# .ci/gpu --plan: (setup s, s per case, expected fraction); a case is ODC_TIMEOUT + start + exit, an init refusal
# (several PEs on one GPU without MPS) or a skip; measured in the proof of 2026-11-27: the 16 cases in 128 s
# (ODC_TIMEOUT=8)
# (ODC_TIMEOUT=8). symm's cases were never measured: taken as nvshmem's cases under MPS (about 12 s each) plus
# Triton's first compile, 15 s each (a third of 45 s)
GPU_BUDGET = {"test_dead_peer_raises_within_timeout": (0, 45, 0.18), "test_mismatched_settings_raise_on_every_rank":
              (0, 60, 0.2), "test_a_barrier_queued_behind_an_abort_does_not_release_the_peer": (0, 60, 0.3),
              "test_dead_peer_on_symm_raises_within_timeout": (0, 45, 0.34)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(scenario: str, world: int, out_dir, extra_env: dict) -> tuple[list[subprocess.Popen], dict[int, float]]:
    port = _free_port()
    procs = []
    for r in range(world):
        env = {
            **os.environ, **extra_env, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ODC_TIMEOUT": str(TIMEOUT_S),
        }
        procs.append(subprocess.Popen([sys.executable, WORKER, scenario, str(out_dir)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    exited: dict[int, float] = {}
    deadline = time.monotonic() + 300
    while len(exited) < world and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in exited and p.poll() is not None:
                exited[r] = time.time()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return procs, exited


def _system_mps() -> bool:
    """A system-wide MPS daemon is up (then several PEs share a GPU without this test starting one)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


def _output(procs) -> str:
    return "\n".join(f"--- rank {r} rc={p.returncode} ---\n{p.stdout.read()[-3000:]}" for r, p in enumerate(procs))


@pytest.mark.parametrize("mps", [False, True], ids=["no-mps", "mps"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", ["push", "fetch", "sync", "queued"])
def test_dead_peer_raises_within_timeout(scenario: str, world: int, mps: bool, tmp_path) -> None:
    _require_backend()
    if not mps and world > NGPU and scenario != "push" and not _system_mps():
        # On fewer GPUs than PEs without MPS every scenario is the same refusal at init: the push case checks it.
        pytest.skip(f"needs >= {world} GPUs to run without MPS (the refusal on {NGPU}: the push case)")
    with mps_daemon(mps, tmp_path) as env:
        procs, exited = _launch(scenario, world, tmp_path, env)
    log = _output(procs)
    results = {r: json.loads(p.read_text()) for r in range(world) if (p := tmp_path / f"rank{r}.json").exists()}
    refused = any((res.get("error") or "").startswith("OdcUsageError") for res in results.values())
    if not mps and world > NGPU and refused:
        # Several PEs on one GPU without MPS: every rank refuses at init, naming how to start MPS.
        for r in range(world):
            assert r in results, f"rank {r} wrote no result\n{log}"
            err = results[r]["error"] or ""
            assert err.startswith("OdcUsageError") and "nvidia-cuda-mps-control" in err, f"rank {r}: {err}\n{log}"
        return
    victim = world - 1
    for r in range(world - 1):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"survivor {r} wrote no result (hung or crashed)\n{log}"
        res = json.loads(path.read_text())
        assert res["error"] and res["error"].startswith("OdcTimeoutError"), f"rank {r}: {res}\n{log}"
        # The ranks named before "did not arrive" (not any digit of the message: "after 12 s" holds a 1 and a 2).
        named = re.search(r"rank\(s\) ([0-9, ]+) did not arrive", res["error"])
        assert named and victim in [int(x) for x in named.group(1).split(", ")], f"rank {r}: no rank {victim}: {res}"
        assert res["seconds"] <= TIMEOUT_S + 5, f"rank {r} raised after {res['seconds']:.1f} s: {res}"
        assert res["context_ok"] is True, f"rank {r}: CUDA context unusable after the error: {res}"
        assert r in exited and exited[r] - res["finished_at"] <= 5, f"rank {r} took too long to exit\n{log}"
        print(f"{scenario} world={world} mps={mps} rank {r}: raised after {res['seconds']:.2f} s, "
              f"exited {exited[r] - res['finished_at']:.2f} s later")
    assert procs[victim].returncode == -9, log


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", ["push", "sync", "queued"])
def test_dead_peer_on_symm_raises_within_timeout(scenario: str, world: int, tmp_path) -> None:
    """The same on symm, its ranks sharing the GPU under MPS (heap from CUDA IPC): the survivors raise
    OdcTimeoutError (or its subclass OdcPeerLostError) naming the dead rank within ODC_TIMEOUT + 5 s, keep a usable
    CUDA context, and exit within 5 s. Never run on a GPU yet."""
    require_symm()
    with mps_daemon(True, tmp_path) as env:
        procs, exited = _launch(scenario, world, tmp_path, {**env, "ODC_GPU_TEST_BACKEND": "symm"})
    log = _output(procs)
    victim = world - 1
    for r in range(world - 1):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"survivor {r} wrote no result (hung or crashed)\n{log}"
        res = json.loads(path.read_text())
        err = res.get("error") or ""
        assert err.startswith(("OdcTimeoutError", "OdcPeerLostError")), f"rank {r}: {res}\n{log}"
        named = re.search(r"rank\(s\) \[?([0-9, ]+)\]?", err)
        assert named and victim in [int(x) for x in named.group(1).split(",")], f"rank {r}: no rank {victim}: {res}"
        assert res["seconds"] <= TIMEOUT_S + 5, f"rank {r} raised after {res['seconds']:.1f} s: {res}"
        assert res["context_ok"] is True, f"rank {r}: CUDA context unusable after the error: {res}"
        assert r in exited and exited[r] - res["finished_at"] <= 5, f"rank {r} took too long to exit\n{log}"
        print(f"symm {scenario} world={world} rank {r}: raised after {res['seconds']:.2f} s, "
              f"exited {exited[r] - res['finished_at']:.2f} s later")
    assert procs[victim].returncode == -9, log


@pytest.mark.parametrize("world", [2])
def test_mismatched_settings_raise_on_every_rank(world: int, tmp_path) -> None:
    _require_backend()
    procs, _ = _launch("mismatch", world, tmp_path, {})
    log = _output(procs)
    for r in range(world):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["error"] and "ODC_NVSHMEM_PUSH" in res["error"], f"rank {r}: {res}\n{log}"
        assert procs[r].returncode == 0, log


@pytest.mark.parametrize("mps", [True], ids=["mps"])
def test_a_barrier_queued_behind_an_abort_does_not_release_the_peer(mps: bool, tmp_path) -> None:
    # Issue 33, finding 1, on real kernels: the barrier kernel reads the abort word after its quiet and leaves
    # without announcing; rank 1 must time out naming rank 0 (before the fix it completed its barrier).
    _require_backend()
    with mps_daemon(mps, tmp_path) as env:
        procs, _ = _launch("queued_after_abort", 2, tmp_path, env)
    log = _output(procs)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    if res[0]["error"] and "MPS" in res[0]["error"] and "OdcUsageError" in res[0]["error"]:
        pytest.skip(res[0]["error"])
    assert res[1]["error"] and "rank(s) 0 did not arrive at barrier" in res[1]["error"], f"{res}\n{log}"
    assert res[1]["seconds"] <= TIMEOUT_S + 5, res
    assert res[0]["error"] and "OdcTimeoutError" in res[0]["error"], f"{res}\n{log}"
    assert res[0]["barrier_recorded"] == 0, f"a barrier that started with the abort up recorded itself: {res}"
