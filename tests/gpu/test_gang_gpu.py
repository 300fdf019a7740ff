"""GPU test of gang attention (odc_runtime.gang) on the nvshmem transport, on ONE GPU: a sample split across 2 and 3
PEs (CUDA MPS) equals the unsplit reference, twice in a row (slot reuse), also with activation checkpointing; a gang
micro-batch synchronises the host once per pass, not per layer; bf16 gang attention runs on SDPA's flash kernel alone
(no dense mask). The exact split also on the symm transport (its heap from CUDA IPC: the ranks share the GPU).
Skipped without a GPU, the extension (symm: Triton) or CUDA MPS, saying which."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _mps import mps_daemon
from test_nvshmem_gpu import _require_backend
from test_symm_shared_gpu import require_symm

WORKER = os.path.join(os.path.dirname(__file__), "_gang_worker.py")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

# .ci/gpu --plan: (setup s, s per case, expected fraction), one torchrun of 2-3 PEs per case under MPS (measured in
# the proof of 2026-11-27: five nvshmem cases of one scenario each in 79 s; a start is most of a case)
GPU_BUDGET = {"*": (0, 90, 0.22)}


# Scenarios of one case run in one torchrun (a start costs more than a scenario); "syncs" alone, in a fresh process.
@pytest.mark.parametrize(("nproc", "scenarios", "backend"),
                         [(2, "exact,checkpoint", "nvshmem"), (2, "syncs", "nvshmem"), (3, "exact,flash", "nvshmem"),
                          (3, "exact,checkpoint", "symm")])
def test_gang_on_gpu(nproc: int, scenarios: str, backend: str, tmp_path) -> None:
    if backend == "symm":
        require_symm()
    else:
        _require_backend()
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    out = tmp_path / "gang.json"
    with mps_daemon(True, tmp_path) as mps_env:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", WORKER,
               str(out), scenarios]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": first, **mps_env, "ODC_GPU_TEST_BACKEND": backend}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=850, env=env)
    assert proc.returncode == 0 and out.exists(), (
        f"torchrun failed rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    result = json.loads(out.read_text())["result"]
    assert result == "ok", result
