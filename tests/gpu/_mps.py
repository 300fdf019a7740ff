"""A private CUDA MPS daemon for GPU tests that run several NVSHMEM PEs on one GPU (the nvshmem transport refuses
that configuration without MPS): the GPU report's daemon (``.ci/gpu_report.py``, one implementation), with a test
skipped, saying what is missing, when MPS cannot be started."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

_REPORT = Path(__file__).resolve().parents[2] / ".ci" / "gpu_report.py"


def _gpu_report() -> ModuleType:
    """``.ci/gpu_report.py`` as the module ``gpu_report`` (loaded once per process; ``.ci`` is no package)."""
    module = sys.modules.get("gpu_report")
    if module is None:
        spec = importlib.util.spec_from_file_location("gpu_report", _REPORT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_report"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def mps_daemon(enabled: bool, tmp: Path) -> Iterator[dict[str, str]]:
    """Start MPS with its logs under ``tmp``; yields the environment the job's processes need (empty when
    ``enabled`` is false). Stops the daemon on exit. The daemon serves the first visible GPU (the parent's
    ``CUDA_VISIBLE_DEVICES``, physical numbering) and remaps it to device 0 for its clients, so the yielded
    environment sets ``CUDA_VISIBLE_DEVICES=0``, which overrides whatever the caller set."""
    if not enabled:
        yield {}
        return
    report = _gpu_report()
    with contextlib.ExitStack() as stack:
        try:
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
            env = {**stack.enter_context(report.mps_daemon(tmp / "mps-log", first)), "CUDA_VISIBLE_DEVICES": "0"}
        except report.MpsError as e:
            pytest.skip(f"{e} (the multi-PE-per-GPU run needs CUDA MPS)")
        yield env
