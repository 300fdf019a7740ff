"""The frame every torchrun worker of the GPU tests shares: one PE per process (several per GPU when there are
more processes than GPUs, under CUDA MPS), gloo for the test's own collectives, ODC on the nvshmem transport (or
the one ``ODC_GPU_TEST_BACKEND`` names: the tests that also run on ``symm`` set it); each
rank's failure caught with its rank and traceback, gathered, and written by rank 0 as the JSON result file the
pytest side reads (so that a failure on any rank is reported, not just a hang or a non-zero exit)."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import odc_runtime as odc


def start(heap_size: str, **init_kwargs: Any) -> None:
    """Select this PE's GPU, start gloo and ``odc.init(backend=..., heap_size=..., **init_kwargs)`` (the backend:
    ``ODC_GPU_TEST_BACKEND``, default ``nvshmem``)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())  # several PEs per GPU when nproc > GPUs
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    odc.init(backend=os.environ.get("ODC_GPU_TEST_BACKEND", "nvshmem"), **init_kwargs, heap_size=heap_size)


def failure() -> str:
    """The exception being handled, as ``rank R: <traceback tail>``."""
    return f"rank {dist.get_rank()}: {traceback.format_exc()[-3000:]}"


def finish(out_path: str, result: Any, merge: Callable[[list[Any]], Any], *, finalize: bool = True) -> None:
    """Gather every rank's ``result``, ``odc.finalize()`` (unless the scenario left the runtime failed on purpose),
    and on rank 0 write ``merge(results in rank order)`` to ``out_path``."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if finalize:
        odc.finalize()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(merge(gathered), f)
    dist.destroy_process_group()


def run_scenario(out_path: str, scenario: Callable[[], dict], *, finalize: bool = True) -> None:
    """Run one scenario (it returns ``{"result": "ok" or why, ...}``) on every rank; rank 0 writes the first
    failing rank's dict, else its own."""
    try:
        result = scenario()
    except Exception:
        result = {"result": failure()}
    finish(out_path, result, lambda gathered: next((r for r in gathered if r["result"] != "ok"), gathered[0]),
           finalize=finalize)
