"""FSDP2 in ODC mode on GPUs: examples/sft.py on 2 GPUs (nccl + nvshmem) gives the same losses in both modes.
Skipped without 2 GPUs and the extension."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from test_nvshmem_gpu import NGPU, _require_backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.timeout(900)]

# .ci/gpu --plan: (setup s, s per case, expected fraction); needs several GPUs (unmeasured)
GPU_BUDGET = {"*": (0, 240, 0.5)}


@pytest.mark.parametrize("bf16", [False, True])
def test_sft_losses_agree_between_collective_and_odc(bf16: bool) -> None:
    if NGPU < 2:
        pytest.skip(f"needs >= 2 GPUs, found {NGPU}")
    _require_backend()
    losses = {}
    for comm in ("collective", "odc"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "examples/sft.py", "--comm", comm, "--steps", "4", "--odc-backend", "nvshmem"]
        proc = subprocess.run(cmd + (["--bf16"] if bf16 else []), cwd=ROOT, capture_output=True, text=True,
                              timeout=850)
        assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        losses[comm] = [float(v) for v in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
        assert len(losses[comm]) == 4, proc.stdout
    assert losses["odc"] == pytest.approx(losses["collective"], rel=2e-2 if bf16 else 1e-4)
