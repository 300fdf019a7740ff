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
        fetch((2, 1), table, desc, DT=peer.tl.int16, BLOCK=1024, ALIGNED=False)
    out["fetch"] = list(fetch.launches)
    out["args"] = [list(launched[-1][:4]), list(launched[-1][9:11]), str(launched[-1][11]), launched[-1][12]]
    out["ptrs"] = [table.data_ptr(), desc.data_ptr()]
    # a descriptor 8 bytes into a tensor: not 16-byte aligned, so not the aligned signature's compiled kernel
    odd = torch.zeros(9, 4, dtype=torch.int64).view(-1)[1:9].view(2, 4)
    fetch((2, 1), table, odd, DT=peer.tl.int16, BLOCK=1024, ALIGNED=False)
    out["odd"] = list(fetch.launches)
    fetch((2, 1), table, odd, DT=peer.tl.int16, BLOCK=1024, ALIGNED=False)
    out["odd_again"] = list(fetch.launches)
    # another constexpr: another signature
    fetch((2, 1), table, desc, DT=peer.tl.int32, BLOCK=1024, ALIGNED=False)
    out["dtype"] = list(fetch.launches)
    # a bound launch: the same runner call as the cached path's, nothing else; none for a signature not compiled
    bound = fetch.bind((2, 1), (table, desc), DT=peer.tl.int16, BLOCK=1024, ALIGNED=False)
    fetch((2, 1), table, desc, DT=peer.tl.int16, BLOCK=1024, ALIGNED=False)
    bound()
    out["bound"] = [list(fetch.launches), launched[-1] == launched[-2]]
    out["unbound"] = fetch.bind((2, 1), (table, desc), DT=peer.tl.int8, BLOCK=1024, ALIGNED=False) is None
    # ... with its last runtime parameter (a push's scale) given at each launch
    push = CachedKernel(peer.push_kernel)
    constexprs = dict(SRC=peer.tl.bfloat16, ACC=peer.tl.float32, BLOCK=1024, ALIGNED=False)
    push((1, 1), table, desc, 1.0, 1.0, 0.5, **constexprs)
    bound_push = push.bind((1, 1), (table, desc, 1.0, 1.0), (0.5,), **constexprs)
    push((1, 1), table, desc, 1.0, 1.0, 0.25, **constexprs)
    bound_push(0.25)
    out["bound_push"] = [list(push.launches), launched[-1] == launched[-2], launched[-1][13]]
    # a repeated value reuses the launch's arguments; a new one (the sign of a zero included) replaces them
    values = []
    for scale in (0.25, 0.5, 0.5, -0.0, 0.0, 0.0, -0.0, 0.25):
        bound_push(scale)
        values.append(repr(launched[-1][13]))
    out["bound_values"] = values
    try:
        push.bind((1, 1), (table, desc, 1.0, 1.0), (1,), **constexprs)
    except TypeError:
        out["late_int"] = "TypeError"
    barrier = CachedKernel(peer.barrier_kernel)
    status = torch.zeros(4, dtype=torch.int64)
    members = torch.arange(2, dtype=torch.int32)
    for epoch in range(1, 41):
        barrier((1,), table, members, 2, 0, 64, epoch, status, status)
    out["barrier"] = list(barrier.launches)
    # ... or with an int given at each launch where the kernel does not specialise it (the barrier's epoch), in the
    # middle of the parameters: the same runner call as the cached path's for every i32 value; another width
    # (another compiled kernel) through the cached path
    bound_barrier = barrier.bind((1,), (table, members, 2, 0, 64), (41,), after=(status, status))
    same = []
    for epoch in (42, 1, 48, 2**31 - 1):
        barrier((1,), table, members, 2, 0, 64, epoch, status, status)
        cached = launched[-1]
        bound_barrier(epoch)
        same.append(launched[-1] == cached and launched[-1][14] == epoch)
    before = list(barrier.launches)
    bound_barrier(2**31)
    out["bound_barrier"] = [same, before, list(barrier.launches), launched[-1][14]]
    out["late_int_specialised"] = "bound"
    try:
        barrier.bind((1,), (table,), (5,), after=(2, 0, 64, 41, status, status))  # members is specialised
    except TypeError:
        out["late_int_specialised"] = "TypeError"
    # a launch hook (a profiler) sends every launch through Triton's path, where the hook runs
    hook = lambda metadata: None
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        fetch((2, 1), table, desc, DT=peer.tl.int16, BLOCK=1024, ALIGNED=False)
        bound()
        bound_push(0.5)
        # Triton's path hands the launcher the hook chain (the stub's launcher does not call it)
        out["hooked"] = [list(fetch.launches), list(push.launches), launched[-1][7].calls == [hook]]
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    bound()  # the hook removed: the runner again
    out["unhooked"] = list(fetch.launches)
print(json.dumps(out))
"""


def _run_child(source: str) -> dict:
    """Run ``source`` in a child without the interpreter (compiled kernels, a stubbed driver); its last line's JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_cached_runner_after_the_first_launch_of_each_signature() -> None:
    out = _run_child(_CHILD)
    assert out["fetch"] == [1, 2]  # compiled once through the binder, then the runner
    assert out["args"] == [[2, 1, 1, 0], out["ptrs"], "int16", 1024]  # grid, stream, raw pointers, constexprs
    assert out["odd"] == [2, 2] and out["odd_again"] == [2, 3]  # a new alignment: the binder once, then cached
    assert out["dtype"] == [3, 3]
    assert out["bound"] == [[3, 5], True]  # the runner twice (cached call, bound launch), with the same arguments
    assert out["unbound"]
    assert out["bound_push"] == [[1, 2], True, 0.25] and out["late_int"] == "TypeError"
    assert out["bound_values"] == ["0.25", "0.5", "0.5", "-0.0", "0.0", "0.0", "-0.0", "0.25"]
    binder, runner = out["barrier"]
    assert binder + runner == 40 and binder <= 4, out["barrier"]  # epoch 1 / multiples of 16 / others, i32
    same, before, after, epoch = out["bound_barrier"]
    assert same == [True] * 4 and epoch == 2**31, out["bound_barrier"]
    assert after[0] == before[0] + 1 and after[1] == before[1], out["bound_barrier"]  # i64: compiled through Triton
    assert out["late_int_specialised"] == "TypeError"
    assert out["hooked"] == [[5, 5], [2, 10], True]  # every launch through Triton's path, where hooks run
    assert out["unhooked"] == [5, 6]


def test_runner_lines() -> None:
    from odc_runtime.kernels import launch

    assert launch.runner_supported((3, 5)) == launch.runner_supported((3, 9)) == (not launch.INTERPRET)
    assert not launch.runner_supported((3, 4)) and not launch.runner_supported((3, 10))


_PLAN_CHILD = r"""
import json, os, tempfile, torch, torch.distributed as dist
import odc_runtime as odc
from odc_runtime import testing
from odc_runtime.transport import host
from odc_runtime.transport.symm.transport import SymmTransport
store = tempfile.mktemp(prefix="odc-launch-test-")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
out = {"fetch": [], "push": []}
with testing.stubbed_triton_launches() as launched:
    transport = host.create(timeout=60.0, heap_size="4M", transport_class=SymmTransport)
    transport._status[0] = 1  # the stubbed barrier kernel writes nothing: "completed" (world 1)
    testing.install(transport)
    from odc_runtime.kernels import peer
    st = odc.shard(torch.zeros(1000), name="bound")
    dsts = [torch.empty(1000) for _ in range(6)]  # more addresses than a plan keeps launches for (4)
    grads = [torch.ones(1000) for _ in range(6)]

    def desc_rows(args):  # the descriptor a stubbed launch carried: its pointer is an entry of the plan's cache
        # 9 runner arguments, then the kernel's: fetch (table, desc, DT, BLOCK, ALIGNED), push (8 more)
        plan = next(p for p in st._plans.plans() if p.kind == ("fetch" if len(args) == 14 else "push"))
        ptr = args[10] if isinstance(args[10], int) else args[10].data_ptr()  # Triton's own path passes tensors
        found = [d for d, _ in plan._descs.values() if d.data_ptr() == ptr]
        return found[0].tolist() if found else None

    for rnd in range(3):
        for i, (dst, grad) in enumerate(zip(dsts, grads)):
            before = peer.launches()
            odc.fetch(st, out=dst)
            fetch_args = launched[-1]
            odc.push(st, grad, scale=0.5 + rnd + i)
            push_args = launched[-1]
            after = peer.launches()
            out["fetch"].append([desc_rows(fetch_args) == [[0, st._param.handle, dst.data_ptr(), 1000]],
                                 after["fetch_kernel"][1] - before["fetch_kernel"][1]])
            out["push"].append([desc_rows(push_args) == [[0, st._grad.handle, grad.data_ptr(), 1000]],
                                after["push_kernel"][1] - before["push_kernel"][1], push_args[13]])
    # the vector variant (ALIGNED, the kernel's last argument) exactly where every address is 16-byte aligned
    odd = torch.empty(1001)[1:]  # 4 bytes past an aligned allocation
    aligned = []
    for dst in (odd, odd, dsts[0]):
        odc.fetch(st, out=dst)
        aligned.append(launched[-1][-1])
    out["aligned"] = aligned
    plan = next(p for p in st._plans.plans() if p.kind == "push")
    out["kept"] = [sorted(plan._launches) == sorted(plan._descs), len(plan._launches)]
    # a failed transport: the bound launches are not used (the generic path raises the failure), nothing launched
    fetch_plan = next(p for p in st._plans.plans() if p.kind == "fetch")
    transport.fail(odc.OdcBackendError("failed on purpose"))
    count = len(launched), launched[-1]
    refused = []
    for run in (lambda: fetch_plan.run(dsts[-1]), lambda: plan.run(grads[-1], 0.5)):
        try:
            run()
            refused.append("ran")
        except odc.OdcError as e:
            refused.append(type(e).__name__)
    out["refused"] = [*refused, (len(launched), launched[-1]) == count]
    testing.uninstall()
    transport.finalize()
dist.destroy_process_group()
os.path.exists(store) and os.unlink(store)
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_plans_bind_their_launch_per_caller_tensor() -> None:
    """A symm plan launches through a bound launch (kernels/launch.py ``CachedKernel.bind``) from a caller tensor's
    second call on, with that tensor's descriptor and the call's scale, also as addresses come and go."""
    out = _run_child(_PLAN_CHILD)
    assert all(right for right, _ in out["fetch"]), out["fetch"]  # every launch carried the caller's descriptor
    assert all(right for right, _, _ in out["push"]), out["push"]
    assert [s for _, _, s in out["push"]] == [0.5 + r + i for r in range(3) for i in range(6)]  # the call's scale
    # bound launches count as runner launches: the first call for an address launches through the cached path
    # (also a runner launch once the signature is compiled), so every call after the very first is a runner call
    assert [n for _, n in out["fetch"]][1:] == [1] * 17 and [n for _, n, _ in out["push"]][1:] == [1] * 17
    assert out["kept"] == [True, 4]
    assert out["aligned"] == [False, False, True]  # a caller tensor 4 bytes off: the scalar variant
    assert out["refused"] == ["OdcBackendError", "OdcBackendError", True]
