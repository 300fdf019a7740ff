"""The cached launch path (``kernels/launch.py``): after the first launch of a signature through Triton's binder,
launches go straight to the compiled kernel's runner with raw pointers, never with a kernel compiled for another
specialisation. Run in a child process without ``TRITON_INTERPRET`` (other tests may have defined the kernels for
the interpreter), through Triton's real launch path with only the driver's launch stubbed
(``odc_runtime.testing.stubbed_triton_launches``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_CHILD = r"""
import json, torch, triton
from odc_runtime import testing
out = {}
with testing.stubbed_triton_launches() as launched:
    from odc_runtime.kernels import peer
    from odc_runtime.kernels.launch import CachedKernel
    table = torch.zeros(4, dtype=torch.int64)
    desc = torch.zeros(2, 4, dtype=torch.int64)
    fetch = CachedKernel(peer.fetch_kernel)
    for _ in range(3):
        fetch((2, 1), table, desc, DT=peer.tl.int16, BLOCK=1024)
    out["fetch"] = list(fetch.launches)
    out["args"] = [list(launched[-1][:4]), list(launched[-1][9:11]), str(launched[-1][11]), launched[-1][12]]
    out["ptrs"] = [table.data_ptr(), desc.data_ptr()]
    # a descriptor 8 bytes into a tensor: not 16-byte aligned, so not the aligned signature's compiled kernel
    odd = torch.zeros(9, 4, dtype=torch.int64).view(-1)[1:9].view(2, 4)
    fetch((2, 1), table, odd, DT=peer.tl.int16, BLOCK=1024)
    out["odd"] = list(fetch.launches)
    fetch((2, 1), table, odd, DT=peer.tl.int16, BLOCK=1024)
    out["odd_again"] = list(fetch.launches)
    # another constexpr: another signature
    fetch((2, 1), table, desc, DT=peer.tl.int32, BLOCK=1024)
    out["dtype"] = list(fetch.launches)
    # barrier rounds: one compiled kernel for every epoch (do_not_specialize), few binder launches
    barrier = CachedKernel(peer.barrier_kernel)
    status = torch.zeros(4, dtype=torch.int64)
    members = torch.arange(2, dtype=torch.int32)
    for epoch in range(1, 41):
        barrier((1,), table, members, 2, 0, 64, epoch, status, status)
    out["barrier"] = list(barrier.launches)
    # a launch hook (a profiler) sends every launch through Triton's path, where the hook runs
    seen = []
    hook = lambda metadata: seen.append(1)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        fetch((2, 1), table, desc, DT=peer.tl.int16, BLOCK=1024)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    out["hooked"] = list(fetch.launches)
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_cached_runner_after_the_first_launch_of_each_signature() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["fetch"] == [1, 2]  # compiled once through the binder, then the runner
    assert out["args"] == [[2, 1, 1, 0], out["ptrs"], "int16", 1024]  # grid, stream, raw pointers, constexprs
    assert out["odd"] == [2, 2] and out["odd_again"] == [2, 3]  # a new alignment: the binder once, then cached
    assert out["dtype"] == [3, 3]
    binder, runner = out["barrier"]
    assert binder + runner == 40 and binder <= 4, out["barrier"]  # epoch 1 / multiples of 16 / others, i32
    assert out["hooked"] == [4, 3]


def test_runner_lines() -> None:
    from odc_runtime.kernels import launch

    assert launch.runner_supported((3, 5)) == launch.runner_supported((3, 9)) == (not launch.INTERPRET)
    assert not launch.runner_supported((3, 4)) and not launch.runner_supported((3, 10))
