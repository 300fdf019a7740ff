"""GPU test of gang attention (odc_runtime.gang) on the nvshmem transport, on ONE GPU: a sample split across 2 and 3
PEs (CUDA MPS) equals the unsplit reference, twice in a row (slot reuse), also with activation checkpointing; a gang
micro-batch synchronises the host once per pass, not per layer; bf16 gang attention runs on SDPA's flash kernel alone
(no dense mask). Skipped without a GPU, the extension or CUDA MPS,
saying which. Not yet run on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _mps import mps_daemon
from test_nvshmem_gpu import _require_backend

WORKER = os.path.join(os.path.dirname(__file__), "_gang_worker.py")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

# .ci/gpu --plan: (setup s, s per case, expected fraction), one torchrun of 2-3 PEs per case under MPS (unmeasured;
# a torchrun of 4 PEs with NVSHMEM's init measured 18 s for a whole function of 9 cases)
GPU_BUDGET = {"*": (0, 90, 0.14)}


@pytest.mark.parametrize(("nproc", "scenario"),
                         [(2, "exact"), (3, "exact"), (2, "checkpoint"), (2, "syncs"), (3, "flash")])
def test_gang_on_gpu(nproc: int, scenario: str, tmp_path) -> None:
    _require_backend()
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    out = tmp_path / "gang.json"
    with mps_daemon(True, tmp_path) as mps_env:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", WORKER,
               str(out), scenario]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": first, **mps_env}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=850, env=env)
    assert proc.returncode == 0 and out.exists(), (
        f"torchrun failed rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    assert json.loads(out.read_text())["result"] == "ok"
