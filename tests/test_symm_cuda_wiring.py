"""The ``symm`` (CUDA) transport's wiring, on CPU ranks: selecting it where it cannot run fails every rank together
with an error that says what to use instead, and leaves no segment behind. Its data plane is the one
``tests/test_symm_cpu.py`` executes; its heap is covered by ``tests/test_symm_torch.py`` and ``tests/gpu``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from _dist import run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or torch.cuda.is_available(), reason="needs triton and no CUDA device"
)


def _init_symm(rank: int, world: int, shm: str) -> tuple[str, str, list[str]]:
    import odc_runtime as odc
    from odc_runtime.transport.symm import cuda

    assert not cuda.is_available()
    try:
        odc.init(backend="symm")
    except Exception as e:  # the test reports the type and message
        return type(e).__name__, str(e), sorted(os.listdir(shm))
    return "none", "", []


@pytest.mark.timeout(60)
def test_symm_without_cuda_fails_every_rank_and_leaves_nothing(tmp_path) -> None:
    shm = str(tmp_path)
    results = run_ranks(_init_symm, 2, shm, env={"ODC_SHM_DIR": shm}, timeout=50)
    for rank, (kind, message, leftover) in enumerate(results):
        assert kind in ("OdcBackendError", "OdcMismatchError"), (rank, kind, message)
        assert leftover == [], leftover
    mine = [m for kind, m, _ in results if kind == "OdcBackendError"]
    assert mine and all("no CUDA device" in m and "symm-cpu" in m for m in mine), mine
