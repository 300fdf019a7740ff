"""GPU tests of the ``symm`` transport's CUDA heap (``odc_runtime.transport.symm.torch_heap``): SymmetricMemory's
allocation and rendezvous through ODC's wrapper, on one GPU and on two. Run under ``torchrun`` in child processes;
skipped without CUDA, without a torch that has SymmetricMemory, or (two GPUs) with fewer GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

WORKER = os.path.join(os.path.dirname(__file__), "_symm_heap_worker.py")
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
# .ci/gpu_plan.py: one torchrun of 1-2 ranks per case (a rendezvous and a few small copies); on a one-GPU machine the
# 2-rank case skips at once.
GPU_BUDGET = {"*": (10, 45, 0.17)}  # 17 s measured for both cases (the proof of 2026-11-27)


def _run(nproc: int, tmp_path) -> dict:
    if NGPU == 0:
        pytest.skip("no CUDA GPU")
    from odc_runtime.transport.symm import _torch_symm

    reason = _torch_symm.unavailable_reason()
    if reason is not None:
        pytest.skip(f"SymmetricMemory unavailable: {reason}")
    if nproc > NGPU:
        pytest.skip(f"needs >= {nproc} GPUs, {NGPU} visible (SymmetricMemory refuses two ranks on one device)")
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", WORKER, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0 and out.exists(), (
        f"torchrun rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("nproc", [1, 2])
def test_heap_maps_every_rank(nproc: int, tmp_path) -> None:
    r = _run(nproc, tmp_path)
    assert r["result"] == "ok", r["result"]
    assert r["world"] == nproc and r["bases_distinct"]
