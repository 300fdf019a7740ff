"""Worker for tests/gpu/test_dead_peer_gpu.py: one rank of a job in which the last rank dies.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python _dead_peer_worker.py SCENARIO RESULT_DIR

Every rank shards a tensor, pushes and syncs once (a good minibatch). Then the last rank kills itself (SIGKILL,
like an OOM kill) and the survivors run SCENARIO: ``push`` (push + sync + sync), ``fetch`` (fetch + sync + sync) or
``sync`` (sync + sync) or ``queued`` (sync, then 20000 pushes and fetches queued behind the barrier that waits for
the dead rank: the launch queue fills and launches block inside the driver, then sync). The second sync waits for
the first, so the survivors must raise OdcTimeoutError within
ODC_TIMEOUT + a margin. Each survivor writes RESULT_DIR/rank<r>.json with the error, the seconds it took and the
wall-clock time it finished, then exits (the test measures how long the exit takes).

Scenario ``queued_after_abort`` (issue 33, finding 1): nobody dies. Rank 0 queues a signal wait that no one will
satisfy, then a barrier behind it, then raises its abort word (as the exit handler or the deadline thread would):
the wait leaves cut short and the barrier kernel starts with the abort up. It must not announce: rank 1's barrier
must time out naming rank 0 instead of completing (which would let rank 1 finish a step rank 0 never did). Rank 0
records whether a barrier kernel recorded itself (it must not: the late operation is the wait).

Scenario ``mismatch``: rank 0 sets ODC_NVSHMEM_PUSH=locked, the others keep the default; every rank must raise
OdcMismatchError from init, naming the setting (nobody enters NVSHMEM).

The backend is ``ODC_GPU_TEST_BACKEND`` (default ``nvshmem``); ``symm`` runs the dead-peer scenarios on the one-node
Triton transport (its heap from CUDA IPC: the ranks share the GPU).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import odc_runtime as odc


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result: dict = {"rank": rank}
    if scenario == "mismatch":
        if rank == 0:
            os.environ["ODC_NVSHMEM_PUSH"] = "locked"
        try:
            odc.init("nvshmem", heap_size="64M")
            result["error"] = None
        except odc.OdcMismatchError as e:
            result["error"] = f"{type(e).__name__}: {e}"
        _write(out_dir, rank, result)
        return
    if not _init(rank, out_dir, result):
        return
    if scenario == "queued_after_abort":
        _queued_after_abort(rank, out_dir, result)
        return
    n = 1 << 20
    st = odc.shard(torch.zeros(n, device="cuda"), name="w")
    g = torch.ones(n, device="cuda")
    odc.push(st, g)
    odc.sync()
    odc.sync()  # the good minibatch is complete everywhere
    torch.cuda.synchronize()
    assert torch.all(st.grad == world), "the good minibatch before the failure was wrong"
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # let the victim die first
    start = time.monotonic()
    try:
        if scenario == "push":
            odc.push(st, g)
        elif scenario == "fetch":
            odc.fetch(st)
        elif scenario == "queued":
            odc.sync()  # its barrier waits for the dead rank on the stream; the host returns
            out = torch.empty(st.shape, dtype=st.dtype, device="cuda")  # fetch fills the full tensor
            for _ in range(10000):
                odc.push(st, g)
                odc.fetch(st, out=out)
        odc.sync()
        odc.sync()
        torch.cuda.synchronize()
        result["error"] = None
    except odc.OdcError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result["seconds"] = time.monotonic() - start
    # The CUDA context must still be usable after the error (a checkpoint can be written).
    try:
        result["context_ok"] = float((torch.ones(4, device="cuda") * 2).sum().item()) == 8.0
    except Exception as e:  # reported, not raised: the test asserts on it
        result["context_ok"] = f"{type(e).__name__}: {e}"
    result["finished_at"] = time.time()
    _write(out_dir, rank, result)
    sys.exit(0)  # not os._exit: a normal exit must be prompt too


def _init(rank: int, out_dir: str, result: dict) -> bool:
    """odc.init; False (the refusal written as this rank's result) where several PEs share a GPU without MPS."""
    try:
        odc.init(os.environ.get("ODC_GPU_TEST_BACKEND", "nvshmem"), heap_size="256M")
        return True
    except odc.OdcUsageError as e:  # several PEs on one GPU without MPS: refused on every rank
        result["error"] = f"{type(e).__name__}: {e}"
        _write(out_dir, rank, result)
        return False


def _queued_after_abort(rank: int, out_dir: str, result: dict) -> None:
    from odc_runtime import testing

    t = testing.transport()
    sig = t.alloc(1, torch.int64, "never_signalled")
    odc.sync()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.monotonic()
    try:
        if rank == 0:
            t.wait_signal(sig, 0, 1, "wait (never signalled)", [1])  # the stream waits; the host returns
            t.barrier("sync")  # queued behind the wait
            time.sleep(1.0)  # rank 1 is in its barrier by now
            t._engine.set_abort()  # the wait leaves cut short; the barrier kernel starts with the abort up
            time.sleep(1.0)
            result["barrier_recorded"] = int(t._engine.barrier_gave_up())
        if rank == 1:
            t.barrier("sync")  # waits on the GPU for rank 0's announcement
        t.barrier("next sync")  # waits (bounded) for the previous barrier
        torch.cuda.synchronize()
        result["error"] = None
    except odc.OdcError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result["seconds"] = time.monotonic() - start
    _write(out_dir, rank, result)


def _write(out_dir: str, rank: int, result: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
