"""``.ci/gpu --plan`` and ``.ci/gpu --resume``: the GPU proof as calls that fit a lent machine (issue 33).

A lent GPU runs one command for at most 10 minutes, with 15 minutes of device time in all (machine start
included), and may be a fresh machine at every call. So the proof is cut into *units*, each with a declared
timeout (the most it may take: the driver kills it there) and an estimate (measured on the GPU run of 2026-11-27
where that run measured it, else expected):

* the build (``gpu_report.plan``'s build step);
* every test function of ``tests/gpu/test_*.py`` and of :data:`GPU_SUITES` (the transport contract on the GPU
  transports), found by pytest's own collection, so that a new file or test is covered without editing this plan
  (functions marked ``multigpu`` only where there are several GPUs). Its
  budget comes from the module's ``GPU_BUDGET`` (``{function name or "*": (setup_s, case_s, expected
  fraction)}``: a function of n cases runs in one pytest process within ``setup_s + n * case_s`` seconds and is
  expected to take that fraction of it), else ``DEFAULT_BUDGET``. A function whose budget exceeds a call is cut
  into chunks of cases;
* every bench and e2e step of ``gpu_report.plan`` (their ``timeout`` and ``estimate``).

``--plan`` prints the calls: units whose estimates, plus ``CALL_OVERHEAD_S``, add up to at most ``CALL_LIMIT_S``
(9 minutes; each unit in plan order goes into the first call with room), and the estimated total against
``DEVICE_BUDGET_S`` (13 minutes, the machine's start included, so that a 15-minute lease keeps room to rerun a
failure). The order is the proof's priority: what has never run on a GPU first (symm with ranks sharing a GPU,
the gang with its symm case), then what passed once (the proof of 2026-11-27: the hierarchy, the contract suite,
the dead-peer scenarios, graph capture, the nvshmem tests), then the benchmarks and the end-to-end runs
(symm's rows beside nvshmem's). A call never outlives ``CALL_LIMIT_S`` whatever the estimates say: ``--resume`` starts a
unit only while its estimate fits the call's time left, gives it at most that time, and a unit cut by the call's
end (not by its own timeout) is not recorded, so the next call runs it again.
Estimates are the declared fractions until a recorded run replaces them (``plan-state.json``).
``--resume`` runs the next call: the first call of the plan of the units not yet recorded in
``DIR/plan-state.json`` (the build first whenever ``odc_runtime._C`` is missing: a fresh machine); each result
is recorded as soon as its unit ends, so a call cut short continues in the next one, and the report
(``report.md``/``report.json``) is rewritten from every recorded result. Every call is the same command:
``.ci/gpu --resume`` (``--fresh`` starts over).

Standard library only (like ``gpu_report.py``, which it uses).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import gpu_report as gr

CALL_LIMIT_S = 540.0  # one call: under the lent machine's 10-minute command limit, with a margin
CALL_OVERHEAD_S = 20.0  # per call: interpreter and CUDA start, the build's no-op check, writing the report
MACHINE_START_S = 60.0  # once: the machine starting (35-60 s measured on 2026-11-27)
# 13 of a lease's 15 minutes of device time: 2 minutes to rerun what failed (any unit but a dead-peer chunk fits)
DEVICE_BUDGET_S = 780.0
# Tests outside tests/gpu/ that the proof runs on the GPU (pytest node ids; a test_*.py module's GPU_BUDGET-like
# entry here): the transport contract on each GPU transport, world 1 on one GPU (nvshmem 9 s, symm 12 s measured in the
# proof of 2026-11-27).
GPU_SUITES: dict[str, tuple[float, float, float]] = {
    "tests/test_transport_contract.py::test_transport_contract[nvshmem]": (0.0, 60.0, 0.16),
    "tests/test_transport_contract.py::test_transport_contract[symm]": (0.0, 60.0, 0.21),
}
DEFAULT_BUDGET = (30.0, 60.0, 0.5)  # a test function without a GPU_BUDGET entry: setup, per case, expected
STATE = "plan-state.json"
# The machine the printed plan is for when this one has no GPU: one H100 (what a lent machine is).
H100 = gr.Machine(gpus=gr.parse_gpu_query("0, NVIDIA H100 80GB HBM3, 9.0, 81559 MiB, -\n"))


@dataclass
class Unit:
    """One piece of the proof: ``step`` (run by ``gpu_report.run_step``), its declared timeout and estimate."""

    step: gr.Step
    estimate: float

    @property
    def name(self) -> str:
        return f"{self.step.phase}: {self.step.name}"

    @property
    def timeout(self) -> float:
        return self.step.timeout


_COLLECT = r"""
import json, sys
import pytest

class Collect:
    items = []

    def pytest_collection_modifyitems(self, items):
        for it in items:
            budget = getattr(it.module, "GPU_BUDGET", {})
            name = getattr(it, "originalname", it.name)
            entry = budget.get(name, budget.get("*"))
            self.items.append({"nodeid": it.nodeid, "function": name, "budget": entry,
                               "multigpu": it.get_closest_marker("multigpu") is not None})

c = Collect()
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[c])
print("ODC-COLLECTED " + json.dumps(c.items))
sys.exit(0 if rc in (0, 5) else rc)
"""


def collect_tests(files: Sequence[Path]) -> list[dict]:
    """Every test case of ``files`` in collection order: ``{"nodeid", "function", "budget"}`` (pytest collects
    them in a child process; the GPU tests skip at run time, so this works without a GPU)."""
    if not files:
        return []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(gr.REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _COLLECT, *[f.relative_to(gr.REPO).as_posix() for f in files]],
                         cwd=gr.REPO, env=env, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ODC-COLLECTED ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"collecting tests/gpu failed (exit {out.returncode}):\n{out.stdout[-3000:]}"
                           f"{out.stderr[-3000:]}")
    return json.loads(line.split(" ", 1)[1])


def suite_cases() -> list[dict]:
    """:data:`GPU_SUITES` as collected cases (their budget from the table)."""
    return [{"nodeid": n, "function": n.split("::")[1], "budget": b, "multigpu": False} for n, b in GPU_SUITES.items()]


def test_units(cases: list[dict], ngpu: int, logs: Path) -> list[Unit]:
    """The test units: each test function's cases (in order), cut into chunks that fit a call."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in cases:
        if c.get("multigpu") and ngpu < 2:
            continue  # needs several GPUs: reported n/a by its own skip wherever it runs, not planned here
        groups.setdefault((c["nodeid"].split("::")[0], c["function"]), []).append(c)
    files = sorted({f for f, _ in groups}, key=lambda f: (gr.TEST_ORDER.index(Path(f).name)
                                                          if Path(f).name in gr.TEST_ORDER else len(gr.TEST_ORDER), f))
    units = []
    room = CALL_LIMIT_S - CALL_OVERHEAD_S
    for f in files:
        for (file, function), group in groups.items():
            if file != f:
                continue
            setup, per_case, expect = group[0]["budget"] or DEFAULT_BUDGET
            per_chunk = max(1, int((room - setup) // per_case)) if setup + per_case <= room else 1
            for i in range(0, len(group), per_chunk):
                chunk = group[i : i + per_chunk]
                n = len(group)
                name = f"{file}::{function}" + (f" [{i + 1}-{i + len(chunk)} of {n}]" if len(chunk) < n else "")
                xml = logs / ("junit-" + "".join(ch if ch.isalnum() else "_" for ch in name) + ".xml")
                timeout = setup + per_case * len(chunk)
                argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                        *[c["nodeid"] for c in chunk], f"--junitxml={xml}", "-o", "junit_logging=system-out"]
                step = gr.Step("tests", name, argv, timeout, evaluate=gr.junit_evaluator(xml, ngpu),
                               outputs=[xml], progress=gr.pytest_progress)
                units.append(Unit(step, timeout * expect))
    return units


def _step_unit(step: gr.Step) -> Unit:
    return Unit(step, step.estimate if step.estimate is not None else step.timeout / 2)


def plan_units(machine: gr.Machine, out: Path, phases: Sequence[str] = gr.PHASES) -> list[Unit]:
    """Every unit of ``phases`` for ``machine``, in order (steps that cannot apply here are left out)."""
    steps = [s for s in gr.plan([p for p in phases if p != "tests"], machine, out) if not s.na]
    units = [_step_unit(s) for s in steps if s.phase == "build"]
    if "tests" in phases:
        files = sorted((gr.REPO / "tests" / "gpu").glob("test_*.py"))
        units += test_units(collect_tests(files) + suite_cases(), machine.ngpu, out / "logs")
    units += [_step_unit(s) for s in steps if s.phase != "build"]
    return units


def calls(units: Sequence[Unit], est: dict[str, float] | None = None) -> list[list[Unit]]:
    """The units packed into calls whose estimates (``est``, else each unit's own; plus the call's overhead) fit
    CALL_LIMIT_S: each unit, in plan order, goes into the first call with room (so a call's units keep their
    relative order). A unit whose declared timeout exceeds a call is refused: no call could let it finish."""
    out: list[list[Unit]] = []
    used: list[float] = []
    for u in units:
        if u.timeout + CALL_OVERHEAD_S > CALL_LIMIT_S:
            raise ValueError(f"{u.name}: declared {u.timeout:.0f} s, more than one call holds "
                             f"({CALL_LIMIT_S - CALL_OVERHEAD_S:.0f} s); give it a smaller GPU_BUDGET or split it")
        cost = est[u.name] if est is not None else u.estimate
        i = next((i for i, s in enumerate(used) if s + cost <= CALL_LIMIT_S), len(out))
        if i == len(out):
            out.append([])
            used.append(CALL_OVERHEAD_S)
        out[i].append(u)
        used[i] += cost
    return out


def load_state(out: Path) -> dict:
    state = gr._json_or_none(out / STATE)
    return state if state and state.get("schema") == 1 else {"schema": 1, "results": {}}


def save_state(out: Path, state: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(out / STATE)  # atomic: a call killed here leaves the previous state


def estimates(units: Sequence[Unit], state: dict) -> dict[str, float]:
    """Each unit's estimate: its recorded duration when a run recorded one, else the declared estimate."""
    recorded = state.get("results", {})
    return {u.name: float(recorded[u.name]["seconds"]) if u.name in recorded else u.estimate for u in units}


def print_plan(units: Sequence[Unit], state: dict, machine: gr.Machine) -> int:
    est = estimates(units, state)
    packed = calls(units, est)
    total = MACHINE_START_S + sum(CALL_OVERHEAD_S + sum(est[u.name] for u in c) for c in packed)
    done = set(state.get("results", {}))
    gr.log(f".ci/gpu --plan for {machine.gpus[0]['name']}: {len(units)} units in {len(packed)} calls of at most "
           f"{CALL_LIMIT_S:.0f} s by estimates; every call is `.ci/gpu --resume` (it runs the next units "
           "not yet recorded)")
    for i, c in enumerate(packed, 1):
        gr.log(f"call {i}: estimated {CALL_OVERHEAD_S + sum(est[u.name] for u in c):.0f} s (cut at "
               f"{CALL_LIMIT_S:.0f} s whatever the estimates)")
        for u in c:
            gr.log(f"  {'[done] ' if u.name in done else ''}{u.name}: timeout {u.timeout:.0f} s, "
                   f"estimate {est[u.name]:.0f} s")
    gr.log(f"estimated device time: {total:.0f} s of {DEVICE_BUDGET_S:.0f} s (machine start {MACHINE_START_S:.0f} s "
           f"+ {CALL_OVERHEAD_S:.0f} s per call); a fresh machine at a later call rebuilds _C first (its time counts "
           "against that call)")
    return 0 if total <= DEVICE_BUDGET_S else 1


def _extension_built() -> bool:
    return any((gr.REPO / "odc_runtime").glob("_C*.so"))


def resume(units: Sequence[Unit], out: Path, machine: gr.Machine, argv: Sequence[str]) -> int:
    """Run the next call: the first call of the plan of the units not yet recorded."""
    state = load_state(out)
    recorded: dict = state["results"]
    build = [u for u in units if u.step.phase == "build"]
    pending = [u for u in units if u.name not in recorded]
    if build and build[0] not in pending and not _extension_built():
        pending.insert(0, build[0])  # a fresh machine: the extension is gone
    est = estimates(units, state)
    ends = time.monotonic() + CALL_LIMIT_S - CALL_OVERHEAD_S  # the call's own end, whatever the estimates say
    ran = 0
    for u in calls(pending, est)[0] if pending else []:  # what --plan shows as the next call
        left = ends - time.monotonic()
        if left < est[u.name]:
            gr.log(f"[{u.step.phase}] {u.step.name}: left for the next call ({left:.0f} s left in this one, "
                   f"estimate {est[u.name]:.0f} s)", flush=True)
            break
        gr.log(f"[{u.step.phase}] {u.step.name} ...", flush=True)
        res = gr.run_step(u.step, out / "logs", min(u.timeout, left))
        gr.log(f"[{u.step.phase}] {u.step.name}: {res.status} in {res.seconds:.1f} s", flush=True)
        if res.status == "timeout" and left < u.timeout:
            gr.log(f"[{u.step.phase}] {u.step.name}: cut by the call's end, not its own timeout; the next call runs "
                   "it again", flush=True)
            break
        recorded[u.name] = asdict(res)
        save_state(out, state)
        ran += 1
    results = [gr.Result(**r) for r in recorded.values()]
    names = {u.step.name for u in units}
    if all(f"comm {t.source}" in names for t in gr.TARGETS):
        results += gr.check_targets(out / "logs", {t.source for t in gr.TARGETS
                                                   if f"bench: comm {t.source}" in recorded})
    meta = gr.run_meta(machine, argv)
    phases = [p for p in gr.PHASES if any(r.phase == p for r in results)]
    gr.write_report(out, gr.merge_report(None, meta, results, phases))
    left = [u for u in units if u.name not in recorded]
    gr.log(f".ci/gpu --resume: ran {ran} unit(s); {len(left)} left"
           + (": run `.ci/gpu --resume` again" if left else "; the proof is complete")
           + f"; report {out / 'report.md'}")
    bad = [r for r in results if not r.ok]
    return 1 if bad or left else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog=".ci/gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--plan", action="store_true", help="print the calls, their units and estimates; run nothing")
    mode.add_argument("--resume", action="store_true", help="run the next call's units (from the recorded state)")
    p.add_argument("--out", default=None, help=f"report and state directory (default: ODC_GPU_REPORT_DIR, else "
                                               f"{gr.DEFAULT_OUT}/)")
    p.add_argument("--fresh", action="store_true", help="forget the recorded state (start the proof over)")
    args = p.parse_args(argv)
    out = Path(args.out or os.environ.get("ODC_GPU_REPORT_DIR") or gr.DEFAULT_OUT).resolve()
    if args.fresh:
        (out / STATE).unlink(missing_ok=True)
    machine = gr.probe_gpus()
    if args.plan:
        shown = H100 if machine.no_gpu else machine
        return print_plan(plan_units(shown, out), load_state(out), shown)
    if machine.no_gpu:
        gr.log(f".ci/gpu --resume: {machine.no_gpu}")
        return 1
    gr.probe_software(machine)
    return resume(plan_units(machine, out), out, machine, [".ci/gpu", *argv])


if __name__ == "__main__":
    sys.exit(main())
