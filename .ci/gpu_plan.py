"""``.ci/gpu --plan`` and ``.ci/gpu --resume``: the GPU proof as calls that fit a lent machine (issue 33).

A lent GPU runs one command for at most 10 minutes, with 15 minutes of device time in all (machine start,
idle time and every try included), and may be a fresh machine at every call. So the proof is cut into *units*, each
with a declared timeout (the most it may take: the driver kills it there) and an estimate (measured in the proof of
2026-11-27 where it ran there, else declared, and said to be an estimate):

* the build (``gpu_report.plan``'s build step);
* every test function of ``tests/gpu/test_*.py`` and of :data:`GPU_SUITES` (the transport contract on the GPU
  transports), found by pytest's own collection, so that a new file or test is covered without editing this plan
  (functions marked ``multigpu`` only where there are several GPUs). Its
  budget comes from the module's ``GPU_BUDGET`` (``{function name or "*": (setup_s, case_s, expected
  fraction)}``: a function of n cases runs in one pytest process within ``setup_s + n * case_s`` seconds and is
  expected to take that fraction of it), else ``DEFAULT_BUDGET``. A function whose budget exceeds a call is cut
  into chunks of cases;
* every bench and e2e step of ``gpu_report.plan`` (their ``timeout`` and ``estimate``).

``--plan`` prints the calls and checks them against the lease (:func:`budget`): at most ``MAX_CALLS`` calls, each
cut at ``CALL_LIMIT_S`` (9 minutes; a lent machine cuts a command at 10), all calls' commands together at most
``COMMANDS_BUDGET_S`` (660 s: with ``MACHINE_START_S``, 720 s of a lease's 15 minutes of device time, the rest kept
to rerun a failure), and every call's estimate (``CALL_OVERHEAD_S`` plus its units') at least ``MARGIN_S`` under its
cut. Units come in tiers, packed in this order (each unit into the first call with room, so a call keeps their
order): what has never run on a GPU (:data:`TIER_NEVER_RUN`: symm with 2 and 4 ranks sharing a GPU, its contract,
dead peer and capture, the gang and FSDP2 on symm, symm's shared-GPU comm row), then symm again beside nvshmem
(:data:`TIER_SYMM_AGAIN`: its 1-PE rows against nvshmem's, its units that passed once); both are required and must
fit. Last, the nvshmem units that passed in the proof of 2026-11-27 (:data:`TIER_IF_TIME`, :data:`IF_TIME`): they go
where time is left and the rest waits for another lease (``--plan`` lists it). A unit's estimate is its duration in
that proof's raw report (:data:`MEASURED`) where it ran under the same name, else its declared one, printed as an
estimate with the measured unit it was taken from (:data:`LIKE`). A call never outlives its cut whatever the
estimates say: ``--resume`` starts a required unit only while its estimate fits the call's time left (an
if-time unit only with ``MARGIN_S`` to spare), gives it at most that time, and a unit cut by the call's end (not by
its own timeout) is not recorded, so the next call runs it again. A call's cut is ``CALL_LIMIT_S`` or what the
earlier calls left of ``COMMANDS_BUDGET_S`` (``plan-state.json`` records each call's seconds), whichever is less.
Estimates are replaced by the durations a recorded run measured (``plan-state.json``).
``--resume`` runs the next call: the first call of the plan of the units not yet recorded in
``DIR/plan-state.json`` (the build first whenever ``odc_runtime._C`` is missing: a fresh machine); each result
is recorded as soon as its unit ends, so a call cut short continues in the next one, and the report
(``report.md``/``report.json``) is rewritten from every recorded result. Every call is the same command:
``.ci/gpu --resume`` (``--fresh`` starts over: a new lease).

Standard library only (like ``gpu_report.py``, which it uses).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import gpu_report as gr

CALL_LIMIT_S = 540.0  # one call's cut: under the lent machine's 10-minute command limit
CALL_OVERHEAD_S = 20.0  # per call: interpreter and CUDA start, the build's no-op check, writing the report
MACHINE_START_S = 60.0  # once: the machine starting (not recorded in gpu-runs/; 35-60 s seen on 2026-11-27)
MAX_CALLS = 2
COMMANDS_BUDGET_S = 660.0  # every call's command together; with the start, 720 s of a lease's 900 s of device time
DEVICE_BUDGET_S = COMMANDS_BUDGET_S + MACHINE_START_S
MARGIN_S = 30.0  # every call's estimate at least this far under its cut
TIER_BUILD, TIER_NEVER_RUN, TIER_SYMM_AGAIN, TIER_IF_TIME = 0, 1, 2, 3
TIER_NAMES = {TIER_BUILD: "build", TIER_NEVER_RUN: "first: never run on a GPU (with its reference runs)",
              TIER_SYMM_AGAIN: "then: symm against nvshmem", TIER_IF_TIME: "last: if time is left"}
# Units (regular expressions, matched in full against a test case's node id or a step's "phase: name") of the later
# tiers; any other unit is taken as never run on a GPU. IF_TIME: the nvshmem units that passed in the proof of
# 2026-11-27 (gpu-runs/2026-11-27-proof/report.json; a CPU test checks each passed there). Their code has changed
# since in places (the nvshmem transport's Python among them): they run again where a lease has time left.
SYMM_AGAIN = (r"tests/test_transport_contract\.py::test_transport_contract\[symm\]",
              r"tests/gpu/test_symm_heap_gpu\.py::.*", r"bench: comm 1pe", r"bench: comm 1pe-symm")
IF_TIME = (r"tests/gpu/test_hierarchy_gpu\.py::.*",
           r"tests/test_transport_contract\.py::test_transport_contract\[nvshmem\]",
           r"tests/gpu/test_dead_peer_gpu\.py::(test_dead_peer_raises_within_timeout|test_mismatched_settings_raise_on_"
           r"every_rank|test_a_barrier_queued_behind_an_abort_does_not_release_the_peer)\[.*",
           r"tests/gpu/test_capture_gpu\.py::test_watchers_leave_another_threads_graph_capture_alone\[nvshmem\]",
           r"tests/gpu/test_gang_gpu\.py::test_gang_on_gpu\[(2-exact,checkpoint|2-syncs|3-exact,flash)-nvshmem\]",
           r"tests/gpu/test_nvshmem_gpu\.py::(test_single_gpu|test_locked_push|test_four_pes_on_one_gpu|"
           r"test_locked_push_four_pes_on_one_gpu)\[.*",
           r"bench: comm (4pe-1gpu-2nodes|1pe-locked|4pe-1gpu|4pe-1gpu-locked)", r"e2e: sft --comm odc, 4 PEs")
# The raw report of the last full proof: each unit that ran there under the same name takes its duration as estimate.
MEASURED_RUN = gr.REPO / "gpu-runs" / "2026-11-27-proof" / "report.json"
# Units never measured under their name (regular expression, full match on the unit's name) -> the measured unit of
# MEASURED_RUN their declared estimate was taken from, and how they differ.
LIKE = {
    r"tests: tests/gpu/test_symm_shared_gpu\.py::.*": (
        "tests: tests/test_transport_contract.py::test_transport_contract[symm]",
        "the same contract at world 1 (12 s), here 2 and 4 ranks started by torchrun under MPS"),
    r"tests: tests/gpu/test_gang_gpu\.py::test_gang_on_gpu \[.*\]": (
        "tests: tests/gpu/test_gang_gpu.py::test_gang_on_gpu", "79 s for 5 nvshmem torchruns then, 16 s each"),
    r"tests: tests/gpu/test_dead_peer_gpu\.py::test_dead_peer_on_symm_raises_within_timeout": (
        "tests: tests/gpu/test_dead_peer_gpu.py::test_dead_peer_raises_within_timeout [1-11 of 16]",
        "nvshmem's cases under MPS, about 12 s each, plus Triton's first compile"),
    r"tests: tests/gpu/test_capture_gpu\.py::test_watchers_leave_another_threads_graph_capture_alone \[.*\]": (
        "tests: tests/gpu/test_capture_gpu.py::test_watchers_leave_another_threads_graph_capture_alone",
        "one process with 8 s of syncs, 17 s on nvshmem"),
    r"bench: comm 4pe-1gpu-symm": ("bench: comm 4pe-1gpu", "the same run on nvshmem (16 s); symm's 1-PE run took 18 s"),
    r"e2e: sft --comm odc --odc-backend symm, 4 PEs": ("e2e: sft --comm odc, 4 PEs", "the same run on nvshmem (17 s)"),
}
# Units renamed since MEASURED_RUN (now -> then): their measured duration still applies.
RENAMED = {
    "tests: tests/gpu/test_capture_gpu.py::test_watchers_leave_another_threads_graph_capture_alone [nvshmem]":
        "tests: tests/gpu/test_capture_gpu.py::test_watchers_leave_another_threads_graph_capture_alone",
}
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
    """One piece of the proof: ``step`` (run by ``gpu_report.run_step``), its declared timeout and estimate, its tier
    and where the estimate comes from (``basis``; set by :func:`plan_units`)."""

    step: gr.Step
    estimate: float
    tier: int = TIER_NEVER_RUN
    basis: str = "declared estimate"

    @property
    def required(self) -> bool:
        return self.tier < TIER_IF_TIME

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


def tier_of(key: str) -> int:
    """The tier of a test case (its node id) or a step (``"phase: name"``): :data:`SYMM_AGAIN`, :data:`IF_TIME`,
    else never run on a GPU (a new test or step is taken as never run)."""
    if key.startswith("build: "):
        return TIER_BUILD
    for tier, patterns in ((TIER_SYMM_AGAIN, SYMM_AGAIN), (TIER_IF_TIME, IF_TIME)):
        if any(re.fullmatch(p, key) for p in patterns):
            return tier
    return TIER_NEVER_RUN


def test_units(cases: list[dict], ngpu: int, logs: Path) -> list[Unit]:
    """The test units: each test function's cases (in order) of one tier, cut into chunks that fit a call (a
    function whose cases fall in several tiers is one unit per tier, named with its case ids)."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for c in cases:
        if c.get("multigpu") and ngpu < 2:
            continue  # needs several GPUs: reported n/a by its own skip wherever it runs, not planned here
        groups.setdefault((c["nodeid"].split("::")[0], c["function"], tier_of(c["nodeid"])), []).append(c)
    order = gr.TEST_ORDER
    files = sorted({f for f, _, _ in groups},
                   key=lambda f: (order.index(Path(f).name) if Path(f).name in order else len(order), f))
    split = {(f, fn) for f, fn, _ in groups if sum(1 for g in groups if g[:2] == (f, fn)) > 1}
    units = []
    room = CALL_LIMIT_S - CALL_OVERHEAD_S
    for f in files:
        for (file, function, tier), group in groups.items():
            if file != f:
                continue
            setup, per_case, expect = group[0]["budget"] or DEFAULT_BUDGET
            per_chunk = max(1, int((room - setup) // per_case)) if setup + per_case <= room else 1
            part = ""
            if (file, function) in split:
                ids = (c["nodeid"].split("[", 1)[1].rstrip("]") if "[" in c["nodeid"] else c["function"]
                       for c in group)
                part = " [" + ", ".join(ids) + "]"
            for i in range(0, len(group), per_chunk):
                chunk = group[i : i + per_chunk]
                n = len(group)
                name = (f"{file}::{function}{part}"
                        + (f" [{i + 1}-{i + len(chunk)} of {n}]" if len(chunk) < n else ""))
                xml = logs / ("junit-" + "".join(ch if ch.isalnum() else "_" for ch in name) + ".xml")
                timeout = setup + per_case * len(chunk)
                argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                        *[c["nodeid"] for c in chunk], f"--junitxml={xml}", "-o", "junit_logging=system-out"]
                step = gr.Step("tests", name, argv, timeout, evaluate=gr.junit_evaluator(xml, ngpu),
                               outputs=[xml], progress=gr.pytest_progress)
                units.append(Unit(step, timeout * expect, tier))
    return units


def _step_unit(step: gr.Step) -> Unit:
    return Unit(step, step.estimate if step.estimate is not None else step.timeout / 2,
                tier_of(f"{step.phase}: {step.name}"))


def measured(path: Path = MEASURED_RUN) -> dict[str, float]:
    """``{"phase: name": seconds}`` of every unit the raw report at ``path`` ran (its targets left out)."""
    report = gr._json_or_none(path) or {}
    return {f"{phase}: {r['name']}": float(r["seconds"]) for phase, data in report.get("phases", {}).items()
            for r in data["results"] if not r["name"].startswith("target: ")}


def like(name: str) -> tuple[str, str] | None:
    """The measured unit a never-measured unit's estimate was taken from, and how they differ (:data:`LIKE`)."""
    return next((v for k, v in LIKE.items() if re.fullmatch(k, name)), None)


def plan_units(machine: gr.Machine, out: Path, phases: Sequence[str] = gr.PHASES) -> list[Unit]:
    """Every unit of ``phases`` for ``machine``: the build, then the tiers in order (steps that cannot apply here
    are left out); each unit's estimate is its duration in :data:`MEASURED_RUN` where it ran there, else declared."""
    steps = [s for s in gr.plan([p for p in phases if p != "tests"], machine, out) if not s.na]
    units = [_step_unit(s) for s in steps if s.phase == "build"]
    if "tests" in phases:
        files = sorted((gr.REPO / "tests" / "gpu").glob("test_*.py"))
        units += test_units(collect_tests(files) + suite_cases(), machine.ngpu, out / "logs")
    units += [_step_unit(s) for s in steps if s.phase != "build"]
    seen = measured()
    day = MEASURED_RUN.parent.name
    for u in units:
        then = RENAMED.get(u.name, u.name)
        if then in seen:
            u.estimate = float(math.ceil(seen[then]))
            u.basis = f"measured {seen[then]:.1f} s ({day}" + (f", as {then})" if then != u.name else ")")
        elif ref := like(u.name):
            u.basis = f"estimate, never measured: like {ref[0]} ({ref[1]})"
        else:
            u.basis = "estimate, never measured"
    return sorted(units, key=lambda u: u.tier)  # stable: each tier keeps the plan's order


def _fits(used: Sequence[float], spent: float) -> bool:
    """Every call's estimate ``used[i]`` at least MARGIN_S under its cut: CALL_LIMIT_S, or what ``spent`` and the
    calls before it (by their estimates) leave of COMMANDS_BUDGET_S, whichever is less."""
    before = spent
    for u in used:
        if u + MARGIN_S > min(CALL_LIMIT_S, COMMANDS_BUDGET_S - before):
            return False
        before += u
    return True


def _with(used: Sequence[float], i: int, cost: float) -> list[float]:
    """``used`` with ``cost`` added to call ``i`` (a new call, with its overhead, when ``i == len(used)``)."""
    out = [*used, CALL_OVERHEAD_S] if i == len(used) else list(used)
    out[i] += cost
    return out


def calls(units: Sequence[Unit], est: dict[str, float] | None = None, spent: float = 0.0) -> list[list[Unit]]:
    """The units packed into calls by their estimates (``est``, else each unit's own; plus each call's overhead).
    The required tiers first, in order, each unit into the first call where every call keeps MARGIN_S under its
    cut (:func:`_fits`; a required unit that fits none opens a call, even past MAX_CALLS: :func:`budget` then says the
    plan does not fit); then the if-time tier, each unit where it fits within MAX_CALLS, else left for another
    lease. ``spent``: command seconds this lease's earlier calls used. A unit whose declared timeout exceeds a call
    is refused: no call could let it finish."""
    out: list[list[Unit]] = []
    used: list[float] = []
    for u in units:
        if u.timeout + CALL_OVERHEAD_S > CALL_LIMIT_S:
            raise ValueError(f"{u.name}: declared {u.timeout:.0f} s, more than one call holds "
                             f"({CALL_LIMIT_S - CALL_OVERHEAD_S:.0f} s); give it a smaller GPU_BUDGET or split it")
    for required in (True, False):
        for u in (u for u in units if u.required == required):
            cost = est[u.name] if est is not None else u.estimate
            i = next((i for i in range(len(out) + 1) if _fits(_with(used, i, cost), spent)), None)
            if i is None or (i == len(out) and not required and len(out) >= MAX_CALLS):
                if not required:
                    continue  # left for another lease
                i = len(out)  # does not fit: a call of its own (budget() says so)
            used[:] = _with(used, i, cost)
            if i == len(out):
                out.append([])
            out[i].append(u)
    return out


def budget(units: Sequence[Unit], est: dict[str, float] | None = None, spent: float = 0.0) -> dict:
    """The plan against the lease: each call's cut, estimate and margin, the units left for another lease, the
    command and device totals by the estimates, and ``problems`` (empty when it fits)."""
    packed = calls(units, est, spent)
    cost = {u.name: (est[u.name] if est is not None else u.estimate) for u in units}
    rows, before = [], spent
    for c in packed:
        e = CALL_OVERHEAD_S + sum(cost[u.name] for u in c)
        cut = min(CALL_LIMIT_S, COMMANDS_BUDGET_S - before)
        rows.append({"cut": cut, "estimate": e, "margin": cut - e, "units": [u.name for u in c]})
        before += e
    placed = {u.name for c in packed for u in c}
    commands = sum(r["estimate"] for r in rows)
    problems = []
    if len(packed) > MAX_CALLS:
        problems.append(f"{len(packed)} calls, at most {MAX_CALLS}")
    problems += [f"call {i}: margin {r['margin']:.0f} s, under {MARGIN_S:.0f} s" for i, r in enumerate(rows, 1)
                 if r["margin"] < MARGIN_S]
    if spent + commands > COMMANDS_BUDGET_S:
        problems.append(f"commands {spent + commands:.0f} s, more than {COMMANDS_BUDGET_S:.0f} s")
    return {"calls": rows, "left_out": [u.name for u in units if u.name not in placed],
            "commands_s": spent + commands, "device_s": MACHINE_START_S + spent + commands, "problems": problems}


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
    """Print the calls (each unit with its tier, timeout, estimate and where the estimate comes from), the units left
    for another lease and the totals against the lease; 0 when the plan fits (:func:`budget`), else 1."""
    est = estimates(units, state)
    plan = budget(units, est)
    by = {u.name: u for u in units}
    done = state.get("results", {})
    gr.log(f".ci/gpu --plan for {machine.gpus[0]['name']}: {len(units)} units; at most {MAX_CALLS} calls, each cut "
           f"at {CALL_LIMIT_S:.0f} s or what the earlier calls left of {COMMANDS_BUDGET_S:.0f} s of commands, each "
           f"estimated at least {MARGIN_S:.0f} s under its cut; every call is `.ci/gpu --resume` (it runs the next "
           "units not yet recorded)")
    for i, row in enumerate(plan["calls"], 1):
        gr.log(f"call {i}: estimated {row['estimate']:.0f} s, cut at {row['cut']:.0f} s, margin {row['margin']:.0f} s")
        tier = None
        for name in row["units"]:
            u = by[name]
            if u.tier != tier:
                tier = u.tier
                gr.log(f"  -- {TIER_NAMES[tier]}")
            basis = (f"recorded {done[name]['seconds']:.1f} s in this lease" if name in done else u.basis)
            gr.log(f"  {'[done] ' if name in done else ''}{name}: timeout {u.timeout:.0f} s, "
                   f"estimate {est[name]:.0f} s ({basis})")
    if plan["left_out"]:
        gr.log(f"left for another lease ({TIER_NAMES[TIER_IF_TIME]}; no time left in this one):")
        for name in plan["left_out"]:
            gr.log(f"  {name}: estimate {est[name]:.0f} s ({by[name].basis})")
    gr.log(f"estimated commands: {plan['commands_s']:.0f} s of {COMMANDS_BUDGET_S:.0f} s; device time with the "
           f"machine's start ({MACHINE_START_S:.0f} s): {plan['device_s']:.0f} s of {DEVICE_BUDGET_S:.0f} s; a fresh "
           "machine at a later call rebuilds _C first (its time counts against that call)")
    for p in plan["problems"]:
        gr.log(f"DOES NOT FIT: {p}")
    return 0 if not plan["problems"] else 1


def _extension_built() -> bool:
    return any((gr.REPO / "odc_runtime").glob("_C*.so"))


def resume(units: Sequence[Unit], out: Path, machine: gr.Machine, argv: Sequence[str]) -> int:
    """Run the next call: the first call of the plan of the units not yet recorded, cut at CALL_LIMIT_S or what the
    lease's earlier calls left of COMMANDS_BUDGET_S (``plan-state.json``'s ``calls_s``: each call's seconds from
    here to its end, plus CALL_OVERHEAD_S for the interpreter, the probes and the collection before)."""
    t0 = time.monotonic()
    state = load_state(out)
    recorded: dict = state["results"]
    spent_calls: list = state.setdefault("calls_s", [])
    spent = float(sum(spent_calls))
    cut = min(CALL_LIMIT_S, COMMANDS_BUDGET_S - spent)
    if cut <= CALL_OVERHEAD_S:
        gr.log(f".ci/gpu --resume: this lease's calls used {spent:.0f} s of {COMMANDS_BUDGET_S:.0f} s of commands; "
               "nothing more runs in it (`--fresh` starts a new lease)")
        return 1
    spent_calls.append(CALL_OVERHEAD_S)
    build = [u for u in units if u.step.phase == "build"]
    pending = [u for u in units if u.name not in recorded]
    if build and build[0] not in pending and not _extension_built():
        pending.insert(0, build[0])  # a fresh machine: the extension is gone
    est = estimates(units, state)
    ends = t0 + cut - CALL_OVERHEAD_S  # the call's own end, whatever the estimates say
    ran = 0
    for u in calls(pending, est, spent)[0] if pending else []:  # what --plan shows as the next call
        left = ends - time.monotonic()
        if left < est[u.name] + (0 if u.required else MARGIN_S):
            gr.log(f"[{u.step.phase}] {u.step.name}: left for "
                   + ("the next call" if u.required else "another call or lease (if time is left)")
                   + f" ({left:.0f} s left in this one, estimate {est[u.name]:.0f} s)", flush=True)
            if u.required:
                break
            continue
        gr.log(f"[{u.step.phase}] {u.step.name} ...", flush=True)
        res = gr.run_step(u.step, out / "logs", min(u.timeout, left))
        gr.log(f"[{u.step.phase}] {u.step.name}: {res.status} in {res.seconds:.1f} s", flush=True)
        spent_calls[-1] = round(time.monotonic() - t0 + CALL_OVERHEAD_S, 1)
        if res.status == "timeout" and left < u.timeout:
            gr.log(f"[{u.step.phase}] {u.step.name}: cut by the call's end, not its own timeout; the next call runs "
                   "it again", flush=True)
            save_state(out, state)
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
    spent_calls[-1] = round(time.monotonic() - t0 + CALL_OVERHEAD_S, 1)
    save_state(out, state)
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
