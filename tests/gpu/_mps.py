"""A private CUDA MPS daemon for GPU tests that run several NVSHMEM PEs on one GPU (the nvshmem transport refuses
that configuration without MPS). Skips the test, saying what is missing, when MPS cannot be started."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mps_daemon(enabled: bool, tmp: Path) -> Iterator[dict[str, str]]:
    """Start MPS with its pipe/log directories under ``tmp``; yields the environment the job's processes need
    (empty when ``enabled`` is false). Stops the daemon on exit."""
    if not enabled:
        yield {}
        return
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("nvidia-cuda-mps-control not found: cannot start CUDA MPS for the multi-PE-per-GPU run")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp / "mps-pipe"), "CUDA_MPS_LOG_DIRECTORY": str(tmp / "mps-log")}
    for d in env.values():
        os.makedirs(d, exist_ok=True)
    full = {**os.environ, **env}
    started = subprocess.run([control, "-d"], env=full, capture_output=True, text=True, timeout=30)
    if started.returncode != 0:
        pytest.skip(f"could not start CUDA MPS ({started.stderr.strip() or started.stdout.strip()})")
    try:
        yield env
    finally:
        subprocess.run([control], input="quit\n", env=full, capture_output=True, text=True, timeout=30)
