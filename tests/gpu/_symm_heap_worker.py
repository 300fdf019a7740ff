"""torchrun worker of tests/gpu/test_symm_heap_gpu.py: the CUDA heap of the ``symm`` transport on real GPUs
(PyTorch SymmetricMemory's allocation and rendezvous, the peer addresses and views ODC derives from its handle).
One rank per GPU; writes ``{"result": "ok" | why, ...}`` (rank 0, the first failing rank's) to ``argv[1]``."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from odc_runtime.transport.symm import torch_heap

NBYTES = 1 << 20


def scenario(rank: int, world: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    heap = torch_heap.open_heap(rank, world, NBYTES, device, timeout=120)
    try:
        if heap.local.numel() != NBYTES or heap.local.device != device or int(heap.local.count_nonzero()) != 0:
            return {"result": f"rank {rank}: the heap is not {NBYTES} zero bytes on {device}"}
        if heap.peer_bases.device != device or heap.peer_bases.dtype != torch.int64:
            return {"result": f"rank {rank}: peer_bases is {heap.peer_bases.dtype} on {heap.peer_bases.device}"}
        heap.local[:8].fill_(rank + 1)
        torch.cuda.synchronize()
        dist.barrier()
        bases = heap.peer_bases.tolist()
        for p in range(world):
            view = heap.peer_view(p)
            if view.data_ptr() != bases[p]:
                return {"result": f"rank {rank}: peer_view({p}) at {view.data_ptr():#x}, peer_bases {bases[p]:#x}"}
            if view[:8].tolist() != [p + 1] * 8:
                return {"result": f"rank {rank}: peer {p}'s heap reads {view[:8].tolist()}, expected {p + 1}s"}
        # A write into the next rank's heap through its view (a P2P copy) is seen there after a barrier.
        nxt = (rank + 1) % world
        heap.peer_view(nxt)[64 + rank : 65 + rank].fill_(100 + rank)
        torch.cuda.synchronize()
        dist.barrier()
        prev = (rank - 1) % world
        got = int(heap.local[64 + prev])
        if got != 100 + prev:
            return {"result": f"rank {rank}: byte {64 + prev} is {got} after rank {prev}'s write, not {100 + prev}"}
        dist.barrier()
        return {"result": "ok", "world": world, "bases_distinct": len(set(bases)) == world}
    finally:
        heap.close()


def main() -> None:
    out = sys.argv[1]
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = scenario(rank, world)
    except Exception:
        result = {"result": f"rank {rank}: {traceback.format_exc()[-3000:]}"}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(next((r for r in gathered if r["result"] != "ok"), gathered[0]), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
