"""torchrun worker of tests/gpu/test_symm_shared_gpu.py: the ``symm`` transport with several ranks on ONE GPU (CUDA
MPS), its heap from CUDA IPC. Runs the transport contract of tests/test_transport_contract.py unchanged on every
rank, after checking that the heap came from the ``ipc`` provider (SymmetricMemory refuses ranks sharing a GPU).
Rank 0 writes ``{"result": "ok" | why, ...}`` (the first failing rank's) to ``argv[1]``."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _worker
import test_transport_contract as contract

from odc_runtime.transport.symm import torch_heap


def scenario() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    providers: list[str] = []
    real = torch_heap.open_heap

    def spy(*args, **kwargs):
        heap = real(*args, **kwargs)
        providers.append(heap.provider)
        return heap

    torch_heap.open_heap = spy  # the transport calls it through the module
    result = contract._rank_contract(rank, world, "symm")
    if providers != ["ipc"]:
        return {"result": f"rank {rank}: the heap came from {providers}, expected one from ['ipc']"}
    if result != {"rank": rank}:
        return {"result": f"rank {rank}: the contract returned {result}"}
    return {"result": "ok", "world": world}


def main() -> None:
    dist.init_process_group("gloo")
    _worker.run_scenario(sys.argv[1], scenario)


if __name__ == "__main__":
    main()
