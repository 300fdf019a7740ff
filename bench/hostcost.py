"""Host cost of the fast path: microseconds of CPU per ``odc.fetch(st, out=...)`` and ``odc.push(st, grad)`` against
a bare ``out.copy_(src)`` of the same 4 KiB, measured side by side in one process (no GPU needed).

* ``nvshmem``: the nvshmem transport driven by a *fake* extension whose ``Plan.run`` is a no-op (and CPU stand-ins
  for CUDA streams/events), so the figure is the Python and binding-free cost of the GPU fast path: what every
  training step pays per tensor before the GPU sees a launch (the real ``Plan.run`` adds the C++ launch itself).
* ``host``: the shared-memory transport at world size 1 (real data movement, CPU).
* ``symm``: the one-node Triton transport at world size 1 (same host code as on GPUs, its heap in shared memory)
  with its kernels compiled for sm_90 and launched through Triton's real launch path, the cached runners of
  ``kernels/launch.py``, only the driver's launch stubbed (``odc_runtime.testing.stubbed_triton_launches``): the
  figure is what the host pays per call up to ``cuLaunchKernel`` (the real launch adds about 2-5 µs of driver
  time). Shown where triton is installed.

The third table is what ``odc.stats()``'s counters and the profiler check (``odc_runtime.telemetry``) cost per call:
``odc.fetch`` / ``odc.push`` against the same API functions compiled again from their source without their telemetry
statements (``_without_telemetry``: they are inline), interleaved in the same runs, next to the interquartile range
of the call's runs (its run-to-run noise).

* ``sync per call``: ``odc.sync()`` on the host transport at world size 1 with ``ODC_DEBUG`` off and on: what the
  debug mode's fingerprint (the caller's frame walk) and its extra exchange round cost the host per collective call,
  without a peer to wait for (with peers the extra round also waits for the slowest one, as the sync itself does).
  Its symm row: ``odc.sync()`` on the symm row's transport, the barrier launched through its cached runner (the
  driver's launch stubbed) and handed to the watchdog: what a stream-ordered GPU sync costs the host.

The last table is what the window check (``odc_runtime.windows``) costs: per ``odc.fetch`` / ``odc.push`` (the
mark every call makes, in every mode), the call against the same API function compiled without its window mark
(``_without_window_marks``), interleaved; per ``odc.sync()`` (host transport, world 1, ``ODC_DEBUG=1``, where the
check runs, with 1 and with 100 live tensors, each fetched and pushed before the first timed sync), the runtime
with its check against the same runtime with the check taken out (``runtime.windows = None``), alternated run by
run, next to the interquartile range of the sync's runs without the check (its noise), and a plain ``odc.sync()``
(``ODC_DEBUG=0``) of the same tensors with its own spread: the noise a default-on check would have to hide in.

Results are verified before timing (the fetch returns the shard, the push accumulates, the fake plan is called
with the caller's buffer). Each figure is the median over ``--runs`` runs of ``--calls`` calls, the three
operations interleaved run by run so that machine noise hits them alike.

    python bench/hostcost.py [--runs 7] [--calls 5000] [--clock wall|cpu] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import ast
import gc
import itertools
import os
import statistics
import tempfile
import time
import types
from collections.abc import Callable

if not __package__:  # python bench/hostcost.py from a checkout (bench/_checkout.py)
    import _checkout  # noqa: F401

from odc_runtime import cli
from odc_runtime.bench import _common

NUMEL = 1024  # 4 KiB of fp32


CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}  # cpu: this thread's CPU time (resists load)
_clock = CLOCKS["wall"]


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    gc.disable()
    try:
        start = _clock()
        for _ in range(calls):
            fn()
        return (_clock() - start) / calls / 1e3
    finally:
        gc.enable()


def _measure(ops: dict[str, Callable[[], object]], runs: int, calls: int) -> dict[str, float]:
    """Median per-call microseconds of each op; ``"<op> spread"``: the interquartile range of its runs (fetch and
    push), the run-to-run noise."""
    for fn in ops.values():  # warm-up: plan caches, allocator
        _per_call_us(fn, max(100, calls // 10))
    samples: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(runs):
        for name, fn in ops.items():
            samples[name].append(_per_call_us(fn, calls))
    result = {k: statistics.median(v) for k, v in samples.items()}
    quartiles = {k: statistics.quantiles(samples[k], n=4) for k in ("fetch", "push") if k in samples and runs > 1}
    result.update({f"{k} spread": q[2] - q[0] for k, q in quartiles.items()})
    return result


def _source_of(fn: Callable) -> ast.FunctionDef:
    """``fn``'s (an ``odc_runtime.api`` function) syntax tree, to compile again with parts stripped."""
    import inspect
    import textwrap

    func = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(func, ast.FunctionDef)
    return func


def _compiled(func: ast.FunctionDef) -> Callable:
    """The function of the (stripped) syntax tree ``func``, compiled in ``odc_runtime.api``'s globals."""

    from odc_runtime import api

    namespace = dict(vars(api))
    exec(compile(ast.fix_missing_locations(ast.Module([func], type_ignores=[])), api.__file__, "exec"), namespace)
    return namespace[func.name]


def _without_telemetry(fn: Callable) -> Callable:
    """``fn`` (``api.fetch`` / ``api.push``) compiled again from its source without its telemetry, for the third
    table: the ``try`` that holds the profiler range unwrapped to its body, and the ``ranged = ...`` line and the
    counter updates (``_COUNTS.<field> += ...``) dropped; the same code otherwise, in ``api``'s globals."""

    func = _source_of(fn)
    counters = 0

    class Strip(ast.NodeTransformer):
        def visit_AugAssign(self, node: ast.AugAssign) -> ast.AST | None:
            nonlocal counters
            owner = getattr(node.target, "value", None)
            if isinstance(node.target, ast.Attribute) and isinstance(owner, ast.Name) and owner.id == "_COUNTS":
                counters += 1
                return None
            return node

    docstring, ranged, held = func.body
    if not (isinstance(ranged, ast.Assign) and isinstance(held, ast.Try) and held.finalbody):
        raise RuntimeError(f"hostcost: api.{fn.__name__} no longer has the shape this bench strips (docstring, "
                           "`ranged = ...`, try/finally): update _without_telemetry")
    func.body = [docstring, *held.body]
    func.decorator_list = []
    Strip().visit(func)
    if counters != 4:  # two counters, on the fast path and on the checked path
        raise RuntimeError(f"hostcost: found {counters} counter updates in api.{fn.__name__}, expected 4")
    return _compiled(func)


def _without_window_marks(fn: Callable) -> Callable:
    """``fn`` (``api.fetch`` / ``api.push``) compiled again from its source without the window check's marks
    (``st._fetched = True`` / ``st._pushed = True``, on the fast and the checked path), in ``api``'s globals."""

    func = _source_of(fn)
    marks = 0

    class Strip(ast.NodeTransformer):
        def visit_Assign(self, node: ast.Assign) -> ast.AST | None:
            nonlocal marks
            target = node.targets[0]
            if isinstance(target, ast.Attribute) and target.attr in ("_fetched", "_pushed"):
                marks += 1
                return None
            return node

    func.decorator_list = []
    Strip().visit(func)
    if marks != 2:
        raise RuntimeError(f"hostcost: found {marks} window marks in api.{fn.__name__}, expected 2")
    return _compiled(func)


def _ops(odc: object, st: object, out: object, grad: object, src: object) -> dict[str, Callable]:
    """The timed calls: bare copy_ (the reference), fetch into a preallocated buffer, push; and both without their
    telemetry (counters and profiler check, ``odc_runtime.telemetry``)."""
    from odc_runtime import api

    fetch, push = _without_telemetry(api.fetch), _without_telemetry(api.push)
    unmarked_fetch, unmarked_push = _without_window_marks(api.fetch), _without_window_marks(api.push)
    return {
        "copy_": lambda: out.copy_(src),  # type: ignore[attr-defined]
        "fetch": lambda: odc.fetch(st, out=out),  # type: ignore[attr-defined]
        "push": lambda: odc.push(st, grad),  # type: ignore[attr-defined]
        "fetch, no telemetry": lambda: fetch(st, out=out),
        "push, no telemetry": lambda: push(st, grad),
        "fetch, no window mark": lambda: unmarked_fetch(st, out=out),
        "push, no window mark": lambda: unmarked_push(st, grad),
    }


def _host(runs: int, calls: int) -> dict[str, float]:
    import torch

    import odc_runtime as odc

    odc.init("host")
    try:
        full = torch.arange(NUMEL, dtype=torch.float32)
        st = odc.shard(full.clone(), name="hostcost")
        out, grad, src = torch.empty(NUMEL), torch.ones(NUMEL), torch.randn(NUMEL)
        odc.fetch(st, out=out)
        if not torch.equal(out, full):
            raise RuntimeError("host fetch returned wrong values")
        odc.push(st, grad)
        odc.sync()
        if not torch.equal(st.grad, grad):
            raise RuntimeError("host push accumulated wrong values")
        return _measure(_ops(odc, st, out, grad, src), runs, calls)
    finally:
        odc.finalize()


def _sync_cost(runs: int, calls: int) -> dict[str, float]:
    """Host microseconds per ``odc.sync()`` (host transport, world 1) with ``ODC_DEBUG=0`` and ``=1``, the two
    runtimes alternated run by run so that machine noise hits them alike."""
    import torch

    import odc_runtime as odc

    samples: dict[str, list[float]] = {"0": [], "1": []}
    saved = os.environ.get("ODC_DEBUG")
    try:
        for run in range(runs + 1):  # run 0 warms up (plan caches, the first page faults)
            for flag in samples:
                os.environ["ODC_DEBUG"] = flag
                odc.init("host")
                try:
                    st = odc.shard(torch.zeros(NUMEL), name="hostcost-sync")
                    odc.push(st, torch.ones(NUMEL))
                    odc.sync()
                    if not torch.equal(st.grad, torch.ones(NUMEL)):
                        raise RuntimeError(f"host sync (ODC_DEBUG={flag}) did not deliver the push")
                    us = _per_call_us(odc.sync, calls)
                    if run:
                        samples[flag].append(us)
                finally:
                    odc.finalize()
    finally:
        if saved is None:
            os.environ.pop("ODC_DEBUG", None)
        else:
            os.environ["ODC_DEBUG"] = saved
    return {"off": statistics.median(samples["0"]), "on": statistics.median(samples["1"])}


WINDOW_TENSORS = (1, 100)  # live tensors per runtime in the window check's sync rows


def _window_cost(runs: int, calls: int) -> dict[str, float]:
    """Host microseconds per ``odc.sync()`` (host transport, world 1) for each of ``WINDOW_TENSORS`` live tensors,
    each fetched and pushed before every run: ``"<n> plain"`` with ``ODC_DEBUG=0``, and with ``ODC_DEBUG=1`` the
    window check on (``"<n> on"``, the debug mode's default) and taken out of the same runtime (``"<n> off"``), the
    three alternated run by run; ``"<n> spread"`` / ``"<n> plain spread"``: the interquartile range of the runs
    without the check / of the plain ones."""
    import torch

    import odc_runtime as odc
    from odc_runtime import state

    def quartile_range(values: list[float]) -> float:
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [0.0, 0.0, 0.0]
        return q[2] - q[0]

    result: dict[str, float] = {}
    saved = os.environ.get("ODC_DEBUG")
    try:
        for n in WINDOW_TENSORS:
            samples: dict[str, list[float]] = {"plain": [], "on": [], "off": []}
            for run in range(runs + 1):  # run 0 warms up
                for mode in samples:
                    os.environ["ODC_DEBUG"] = "0" if mode == "plain" else "1"
                    odc.init("host")
                    try:
                        runtime = state.current
                        assert runtime is not None and (runtime.windows is None) == (mode == "plain")
                        if mode == "off":
                            runtime.windows = None  # the same debug runtime without its window check
                        tensors = [odc.shard(torch.zeros(NUMEL), name=f"hostcost-window{i}") for i in range(n)]
                        out, grad = torch.empty(NUMEL), torch.ones(NUMEL)
                        for st in tensors:  # the marks the first timed sync summarises
                            odc.fetch(st, out=out)
                            odc.push(st, grad)
                        odc.sync()
                        if not all(torch.equal(st.grad, grad) for st in tensors):
                            raise RuntimeError(f"host sync ({mode}) did not deliver the pushes")
                        us = _per_call_us(odc.sync, calls)
                        if run:
                            samples[mode].append(us)
                    finally:
                        odc.finalize()
            for mode, values in samples.items():
                result[f"{n} {mode}"] = statistics.median(values)
            result[f"{n} spread"] = quartile_range(samples["off"])
            result[f"{n} plain spread"] = quartile_range(samples["plain"])
    finally:
        if saved is None:
            os.environ.pop("ODC_DEBUG", None)
        else:
            os.environ["ODC_DEBUG"] = saved
    return result


class _Views:
    """What a symmetric view keeps alive (weakly referenced by the free quarantine)."""


class _FakeStream:
    def __init__(self, ptr: int) -> None:
        self.cuda_stream = ptr

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass


class _FakeEvent:
    cuda_event = 0  # the handle the watchdog passes to the extension's query_event

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True


def _fake_extension(runs: list) -> types.SimpleNamespace:
    class Plan:
        def __init__(
            self, engine: object, kind: int, addr: list, rel: list, numel: list, pe: list, acc_dtype: int | None = None
        ) -> None:
            self.kind = kind

        def run(self, base: int, dtype: int, scale: float, stream: int) -> None:  # the launch: a no-op
            if len(runs) < 4:
                runs.append((self.kind, base, dtype, scale, stream))

    class Engine:
        def watch(self, stream: int, timeout_s: float) -> None: ...
        def barrier(self, epoch: int, stream: int) -> None: ...
        def quiet(self, stream: int) -> None: ...
        def set_abort(self) -> None: ...
        def aborted(self) -> bool:
            return False

    return types.SimpleNamespace(
        DTYPE_FLOAT32=0, DTYPE_BFLOAT16=1, DTYPE_FLOAT16=2, DTYPE_INT64=3, PLAN_FETCH_COPY=0, PLAN_FETCH_KERNEL=1,
        PLAN_FETCH_STAGED=2, PLAN_PUSH_ATOMIC=3, PLAN_PUSH_LOCKED=4, Plan=Plan, Engine=Engine,
        EVENT_DONE=0, EVENT_PENDING=1, query_event=lambda event: 0,
    )


def _nvshmem_fake(runs_: int, calls: int) -> dict[str, float]:
    import torch

    import odc_runtime as odc
    from odc_runtime import api, config, testing
    from odc_runtime import plans as plan_keys
    from odc_runtime.transport.nvshmem import memory, plans
    from odc_runtime.transport.nvshmem.transport import NvshmemTransport

    current = _FakeStream(1000)
    made = itertools.count(2000)
    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    base = arena.data_ptr()
    saved = [(torch.cuda, "Stream"), (torch.cuda, "Event"), (torch.cuda, "current_stream"), (torch.cuda, "set_device"),
             (plans, "raw_stream"), (plans, "record"), (memory, "wrap")]
    old = [getattr(m, n) for m, n in saved]
    torch.cuda.Stream = lambda device=None: _FakeStream(next(made))
    torch.cuda.Event = _FakeEvent
    torch.cuda.current_stream = lambda device=None: current
    torch.cuda.set_device = lambda device: None
    plans.raw_stream = lambda index: current.cuda_stream
    plans.record = lambda t, stream: None
    memory.wrap = lambda ptr, nbytes, device: (arena[ptr - base : ptr - base + nbytes], _Views())
    launched: list = []
    try:
        ext = _fake_extension(launched)
        transport = NvshmemTransport(
            ext, 0, 1, torch.device("cpu"), 60.0, settings=config.NvshmemSettings(), scratch_slots=4,
            capacity=1 << 20, arena=base, peer_bases=[base], engine=ext.Engine(), atomic_push=True, node=1,
        )
        testing.install(transport)  # the public API on the fake-extension transport
        st = odc.shard(torch.zeros(NUMEL), name="hostcost")
        out, grad, src = torch.empty(NUMEL), torch.ones(NUMEL), torch.randn(NUMEL)
        odc.fetch(st, out=out)
        odc.push(st, grad)
        if [(k, b) for k, b, *_ in launched[:2]] != [(0, out.data_ptr()), (3, grad.data_ptr())]:
            raise RuntimeError(f"the fake extension did not see the expected plans: {launched}")
        result = _measure(_ops(odc, st, out, grad, src), runs_, calls)
        # Where the fetch's time goes (same runs discipline): the pieces of api.fetch's fast path, in call order.
        key = plan_keys.tensor_key("fetch", out, transport.stream_key())
        plan = st._plans.get(key)
        fetch = api.fetch
        parts = _measure({
            "copy_": lambda: out.copy_(src),
            "odc.fetch lookup": lambda: odc.fetch,  # the package attribute (bound on first use)
            "api.fetch direct": lambda: fetch(st, out=out),
            "stream_key": transport.stream_key,
            "tensor_key": lambda: plan_keys.tensor_key("fetch", out, key[-1]),
            "plan cache get": lambda: st._plans.get(key),
            "plan.run (transport)": lambda: plan.run(out),  # type: ignore[union-attr]
        }, runs_, calls)
        result["breakdown"] = parts  # type: ignore[assignment]
        testing.uninstall()
        transport._finalized = True
        return result
    finally:
        for (m, n), v in zip(saved, old, strict=True):
            setattr(m, n, v)


def _symm_stubbed(runs_: int, calls: int) -> dict[str, float] | None:
    """The symm transport's host cost per call through Triton's real launch path: the kernels compiled for sm_90,
    launched through their cached runners (``kernels/launch.py``), only the driver's launch stubbed
    (:func:`odc_runtime.testing.stubbed_triton_launches`). None: not installed, or the kernels were already
    imported for the interpreter in this process."""
    import importlib.util
    import sys

    if importlib.util.find_spec("odc_runtime.transport.symm.transport") is None or importlib.util.find_spec(
        "triton"
    ) is None:
        return None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or "odc_runtime.kernels.peer" in sys.modules:
        print("hostcost: no symm row: the Triton kernels must be compiled, not interpreted (unset TRITON_INTERPRET)")
        return None
    import torch

    import odc_runtime as odc
    from odc_runtime import testing
    from odc_runtime.transport import host
    from odc_runtime.transport.symm.transport import SymmTransport

    with testing.stubbed_triton_launches() as launched:
        transport = host.create(timeout=60.0, heap_size="16M", transport_class=SymmTransport)
        # The stubbed barrier kernel writes nothing: its status word says "completed" from the start (world 1).
        transport._status[0] = 1  # type: ignore[attr-defined]
        testing.install(transport)
        try:
            from odc_runtime.kernels import peer

            st = odc.shard(torch.zeros(NUMEL), name="hostcost")
            out, grad, src = torch.empty(NUMEL), torch.ones(NUMEL), torch.randn(NUMEL)
            for _ in range(2):  # the first launch of each kernel compiles (sm_90) through Triton's binder
                odc.fetch(st, out=out)
                odc.push(st, grad)
            before = peer.launches()
            odc.fetch(st, out=out)
            odc.push(st, grad)
            after = peer.launches()
            fast = {k: after[k][1] - before[k][1] for k in ("fetch_kernel", "push_kernel")}
            if fast != {"fetch_kernel": 1, "push_kernel": 1}:
                raise RuntimeError(f"the symm kernels did not launch through their cached runners: {before} {after}")
            # The last two stubbed launches: the fetch's and the push's runners, grid (1, 1, 1), descriptor pointers
            # of one row (peer 0, the shard's offset, the caller's buffer, NUMEL) from the plans' caches.
            plans = {p.kind: p for p in st._plans.plans()}  # type: ignore[attr-defined]
            for (kind, tensor, buf), args in zip(
                (("fetch", out, st._param), ("push", grad, st._grad)), list(launched)[-2:], strict=True  # type: ignore[attr-defined]
            ):
                desc, _ = plans[kind]._desc_of(tensor)  # type: ignore[attr-defined]
                if args[:3] != (1, 1, 1) or args[10] != desc.data_ptr() or desc.tolist() != [
                    [0, buf.handle, tensor.data_ptr(), NUMEL]
                ]:
                    raise RuntimeError(f"the {kind} launch did not carry its plan's descriptor: {args[:12]}")
            result = _measure(_ops(odc, st, out, grad, src), runs_, calls)
            # odc.sync(): the world barrier through its cached runner (and, from the second run on, the watchdog
            # armed per call: symm/watch.py), as a stream-ordered GPU sync pays before the GPU sees the launch
            barriers = peer.launches()["barrier_kernel"][1]
            odc.sync()
            if peer.launches()["barrier_kernel"][1] != barriers + 1:
                raise RuntimeError(f"the symm sync did not launch its barrier through the cached runner: "
                                   f"{peer.launches()['barrier_kernel']}")
            result["sync"] = statistics.median(_per_call_us(odc.sync, calls) for _ in range(runs_))
            # Where the time goes (same runs discipline): the plan (the transport's share) and its bound launch
            # (kernels/launch.py: the compiled runner, which calls the stubbed launcher).
            fetch_launch = plans["fetch"]._launches[out.data_ptr()]  # type: ignore[attr-defined]
            push_launch = plans["push"]._launches[grad.data_ptr()]  # type: ignore[attr-defined]
            result["breakdown"] = _measure({  # type: ignore[assignment]
                "copy_": lambda: out.copy_(src),
                "fetch: plan.run (transport)": lambda: plans["fetch"].run(out),
                "fetch: bound launch": fetch_launch,
                "push: plan.run (transport)": lambda: plans["push"].run(grad),
                "push: bound launch": lambda: push_launch(1.0),
            }, runs_, calls)
            return result
        finally:
            testing.uninstall()
            transport.finalize()


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser(__doc__, first_paragraph=True)
    parser.add_argument("--runs", type=int, default=7, help="runs per figure (the median is reported)")
    parser.add_argument("--calls", type=int, default=5000, help="calls per run")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: the calling thread's CPU time (steadier on a loaded machine; "
                             "work of other threads is not counted)")
    _common.add_output_args(parser, "hostcost")
    return parser


def _draw(results: dict[str, dict[str, float]]) -> Callable[[object, str], None]:
    def draw(plots: object, path: str) -> None:
        import matplotlib.pyplot as plt  # bench/plots.py (imported by the caller) chose the Agg backend

        fig, ax = plt.subplots(figsize=(6, 2.8))
        names = list(results)
        for i, op in enumerate(("copy_", "fetch", "push")):
            ax.barh([j + 0.27 * i for j in range(len(names))], [results[n][op] for n in names], height=0.25, label=op)
        ax.set_yticks([j + 0.27 for j in range(len(names))], names)
        ax.set_xlabel("host µs per call (4 KiB)")
        ax.legend()
        plots._save(fig, path)  # type: ignore[attr-defined]  # creates the folder, like every benchmark's plot

    return draw


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    global _clock
    _clock = CLOCKS[args.clock]

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = tempfile.mktemp(prefix="odc-hostcost-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        results = {
            "nvshmem (fake ext)": _nvshmem_fake(args.runs, args.calls),
            "host (world 1)": _host(args.runs, args.calls),
        }
        sync = _sync_cost(args.runs, args.calls)
        windows = _window_cost(args.runs, args.calls)
        symm = _symm_stubbed(args.runs, args.calls)
        if symm is not None:
            results["symm (triton path, launch stubbed)"] = symm
        else:
            print("hostcost: no symm row: odc_runtime.transport.symm.transport is not installed")
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.unlink(store)
    breakdowns = {name: r.pop("breakdown") for name, r in results.items() if "breakdown" in r}  # type: ignore[misc]
    rows = []
    for name, r in results.items():
        rows.append([name, r["copy_"], r["fetch"], r["push"], r["fetch"] / r["copy_"], r["push"] / r["copy_"]])
    _common.print_table(
        ["transport", "copy_ us", "fetch us", "push us", "fetch/copy_", "push/copy_"], rows,
        {
            "copy_ us": "host microseconds per bare out.copy_(src) of 4 KiB (median of runs)",
            "fetch us": "host microseconds per odc.fetch(st, out=out), 4 KiB shard, steady state",
            "push us": "host microseconds per odc.push(st, grad), 4 KiB gradient, steady state",
            "fetch/copy_": "ratio, measured side by side in the same runs",
            "push/copy_": "ratio, measured side by side in the same runs",
            "transport": "nvshmem: fake extension (Plan.run a no-op, CPU tensors); host: shared memory, world 1; "
                         "symm: world 1, Triton's launch path with the driver's launch stubbed",
        },
        title=f"host cost per call ({args.runs} runs x {args.calls} calls, medians, {args.clock} clock)",
    )
    nan = float("nan")
    sync_rows = [["host (world 1)", sync["off"], sync["on"], sync["on"] - sync["off"]]]
    if "sync" in results.get("symm (triton path, launch stubbed)", {}):
        sync_rows.append(["symm (triton path, launch stubbed)", results["symm (triton path, launch stubbed)"]["sync"],
                          nan, nan])
    _common.print_table(
        ["transport", "sync us", "ODC_DEBUG=1 us", "debug extra us"], sync_rows,
        {
            "transport": "host: shared memory, world 1 (no peer to wait for); symm: world 1, its barrier launched "
                         "through the cached runner with the driver's launch stubbed (ODC_DEBUG not measured: -)",
            "sync us": "host microseconds per odc.sync() with ODC_DEBUG=0 (median of runs)",
            "ODC_DEBUG=1 us": "the same with ODC_DEBUG=1: the call's fingerprint and its exchange round first",
            "debug extra us": "what ODC_DEBUG=1 adds per sync (and per shard, free, finalize)",
        },
        title=f"sync per call ({args.runs} runs x {args.calls} calls, medians)",
    )
    parts = breakdowns["nvshmem (fake ext)"]
    _common.print_table(
        ["piece", "us", "x copy_"], [[k, v, v / parts["copy_"]] for k, v in parts.items()],
        {
            "piece": "part of odc.fetch(st, out=out) on the nvshmem fast path, timed alone (fake extension)",
            "us": "host microseconds per call (median of runs)",
            "x copy_": "ratio to a bare out.copy_(src) of 4 KiB in the same runs",
        },
        title="where odc.fetch's host time goes (nvshmem, fake extension)",
    )
    _common.print_table(
        ["transport", "call", "us", "no telemetry us", "telemetry us", "spread us"],
        [[name, op, r[op], r[f"{op}, no telemetry"], r[op] - r[f"{op}, no telemetry"], r.get(f"{op} spread", 0.0)]
         for name, r in results.items() for op in ("fetch", "push")],
        {
            "transport": "as in the first table",
            "call": "odc.fetch(st, out=out) / odc.push(st, grad), 4 KiB, as in the first table",
            "us": "host microseconds per call (median of runs), counters and profiler check included",
            "no telemetry us": "the same API function compiled without its telemetry statements (the profiler "
                               "range's try/finally, the counter updates), interleaved in the same runs",
            "telemetry us": "the difference: what odc.stats()'s counters and the profiler-range check cost per call",
            "spread us": "interquartile range over the runs of the call itself: the run-to-run noise",
        },
        title="what the counters cost per call (odc_runtime.telemetry)",
    )
    host = results["host (world 1)"]
    _common.print_table(
        ["what", "us", "check off us", "check us", "spread us", "plain sync us", "plain spread us"],
        [[f"odc.{op}, host", host[op], host[f"{op}, no window mark"], host[op] - host[f"{op}, no window mark"],
          host.get(f"{op} spread", 0.0), nan, nan] for op in ("fetch", "push")]
        + [[f"odc.sync(), host, {n} tensor{'s' if n > 1 else ''}", windows[f"{n} on"], windows[f"{n} off"],
            windows[f"{n} on"] - windows[f"{n} off"], windows[f"{n} spread"], windows[f"{n} plain"],
            windows[f"{n} plain spread"]] for n in WINDOW_TENSORS],
        {
            "what": "a 4 KiB fetch/push (as in the first table; the mark is made in every mode), or odc.sync() on the "
                    "host transport at world 1 with ODC_DEBUG=1 and that many live tensors, each fetched and pushed "
                    "before the first timed sync",
            "us": "host microseconds per call with the window check (median of runs)",
            "check off us": "the same without it: fetch/push compiled without the mark, interleaved; sync: the same "
                            "debug runtime with its check taken out, alternated run by run",
            "check us": "the difference: what the window check costs per call",
            "spread us": "interquartile range over the runs without the check: the run-to-run noise",
            "plain sync us": "odc.sync() of the same tensors with ODC_DEBUG=0 (no check, no fingerprint round), "
                             "alternated with the two others",
            "plain spread us": "its interquartile range: the noise a check on by default would have to stay within",
        },
        title="what the window check costs (odc_runtime.windows)",
    )
    symm_parts = breakdowns.get("symm (triton path, launch stubbed)")
    if symm_parts is not None:
        _common.print_table(
            ["piece", "us", "x copy_"], [[k, v, v / symm_parts["copy_"]] for k, v in symm_parts.items()],
            {
                "piece": "part of odc.fetch/odc.push on the symm fast path, timed alone: the plan's run (everything "
                         "below the core API) and its bound launch (the compiled runner, the stubbed launcher)",
                "us": "host microseconds per call (median of runs)",
                "x copy_": "ratio to a bare out.copy_(src) of 4 KiB in the same runs",
            },
            title="where symm's host time goes (Triton's launch path, launch stubbed)",
        )
    _common.write_outputs(args, "hostcost", {
        "fetch_breakdown_us": parts, "symm_breakdown_us": symm_parts,
        "machine": _common.machine_info(), "runs": args.runs, "calls": args.calls, "numel": NUMEL, "clock": args.clock,
        "results_us": results,
        "sync_us": sync,
        "window_check_us": windows,
        "ratios": {k: {"fetch": r["fetch"] / r["copy_"], "push": r["push"] / r["copy_"]} for k, r in results.items()},
    }, _draw(results))


if __name__ == "__main__":
    main()
