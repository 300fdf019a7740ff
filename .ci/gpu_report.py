"""Driver of ``.ci/gpu``: run every GPU check of the project on this machine and write one report.

    .ci/gpu                          # all phases: build, tests, bench, e2e
    .ci/gpu tests                    # build (incremental) + tests/gpu
    .ci/gpu bench e2e --out DIR      # build + benchmarks + end to end, report in DIR
    .ci/gpu --dry-run                # list the steps (and, without a GPU, why each would be skipped)
    .ci/gpu tests --only dead_peer   # only the steps whose name contains "dead_peer" (repeatable)
    .ci/gpu tests --budget 570       # the whole command inside 570 s (a lent GPU's 10-minute commands)

Phases (each step runs as a child process with its own timeout; a failing step is recorded and the next runs):

- ``build``: ``.ci/build_ext.sh`` with ``ODC_CUDA_ARCHS`` set to the visible GPUs' architectures only (from
  ``nvidia-smi --query-gpu=compute_cap``), ``PIP_NO_INDEX=1`` (nothing is downloaded: a missing build input is
  an error) and ``NVSHMEM_HOME`` at the NVSHMEM wheel the installed torch pins (what ``import torch`` loads). It
  runs before any other phase (a no-op when ``_C`` is up to date); ``--no-build`` leaves it out.
- ``tests``: each ``tests/gpu/test_*.py`` under pytest with ``ODC_REQUIRE_EXTENSION=1``. A skipped test is a
  failure, except one that needs more GPUs than are visible ("needs >= N GPUs"), reported as ``n/a``.
- ``bench``: ``bench/comm.py`` (which verifies its results exactly before timing) at 1, 64 and 256 MiB with 1 PE
  (nvshmem and symm), with nvshmem's locked push protocol (1 PE, and 4 PEs contending), with 4 PEs on one GPU
  (nvshmem and symm; CUDA MPS, started and stopped here), as 2 virtual nodes of 2, and with every GPU (up to 8)
  against NCCL when there are several; then the targets (1 PE, 64 MiB) checked against its JSON (``TARGETS``).
  The report's benchmark tables name both time columns (``BENCH_COLUMNS``: GPU and host).
- ``e2e``: ``examples/sft.py --comm collective`` and ``--comm odc`` (on nvshmem and on symm) on 4 PEs (same losses,
  rel 1e-4), and the main job ``bench/imbalance.py --quick --backend nvshmem`` on 4 PEs, one GPU per PE (exact
  gradients, else it fails). With fewer than 4 GPUs the sft runs' PEs share the first one (``--pes-per-gpu 4``: gloo
  instead of NCCL, under CUDA MPS).

Output (``--out``, else ``ODC_GPU_REPORT_DIR``, else ``gpu-report/``): ``report.md`` (a table per phase:
check, result, time, numbers; the targets; the benchmark rows; the log tail of every failure), ``report.json``
(the same data) and ``logs/`` (one log per step, plus pytest's JUnit XML and the benchmarks' JSON). Phases not
run this time are kept from an earlier ``report.json`` in the same directory (each phase says its commit and
date); ``--fresh`` drops them. Exit status: 0 when every step of this run passed (or was ``n/a``), 1 otherwise,
2 for a usage error. ``--phase-budget`` (``ODC_GPU_PHASE_BUDGET_S``, default 540 s) bounds each phase and
``--budget`` (``ODC_GPU_BUDGET_S``) the whole run: a step gets what is left, and one that cannot start in time is
recorded as not run (a failure).

Standard library only: it runs under whichever Python holds the CUDA torch (``.ci/gpu`` picks ``$PYTHON``, else
``python3``), and its children use that same interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASES = ("build", "tests", "bench", "e2e")
DEFAULT_OUT = "gpu-report"
DEFAULT_PHASE_BUDGET_S = 540.0
MIN_STEP_S = 20.0  # a step is not started with less time than this left
BENCH_SIZES = "1M,64M,256M"
TARGET_SIZE = 64 << 20
SFT_PES = 4
SFT_STEPS = 4
SFT_REL_TOL = 1e-4  # fp32: the losses differ only by summation order
# ODC_TIMEOUT of the bench and e2e runs (unless set): a hang there fails with the runtime's own error, naming the
# operation and the missing ranks, well before the step's timeout kills it. tests/gpu set their own.
RUN_ODC_TIMEOUT_S = "60"
# Test files run first in this order (the core paths before the slow dead-peer matrix); others follow, sorted.
# The proof's priority: what has never passed on a GPU first, then what has (the run of 2026-11-27).
TEST_ORDER = ("test_symm_shared_gpu.py", "test_gang_gpu.py", "test_hierarchy_gpu.py", "test_transport_contract.py",
              "test_dead_peer_gpu.py", "test_capture_gpu.py", "test_nvshmem_gpu.py", "test_symm_heap_gpu.py")
STATUSES = ("pass", "fail", "timeout", "skip", "n/a")
OK_STATUSES = ("pass", "n/a")

log = print  # the driver's progress lines, on stdout


# --------------------------------------------------------------------------------------------------- machine


@dataclass
class Machine:
    """The GPUs this run can use (``nvidia-smi``), why there are none, and the software versions."""

    gpus: list[dict] = field(default_factory=list)  # {"index", "name", "compute_cap", "memory", "driver"}
    no_gpu: str | None = None  # why no GPU can be used (None when there is one)
    software: dict = field(default_factory=dict)

    @property
    def ngpu(self) -> int:
        return len(self.gpus)

    @property
    def archs(self) -> str:
        """``ODC_CUDA_ARCHS`` for exactly the visible GPUs, e.g. ``90-real``."""
        caps = sorted({g["compute_cap"].replace(".", "") for g in self.gpus})
        return ";".join(f"{c}-real" for c in caps)


def probe_gpus(environ: dict[str, str] | None = None) -> Machine:
    """The visible NVIDIA GPUs from ``nvidia-smi`` (honouring a numeric ``CUDA_VISIBLE_DEVICES``)."""
    environ = os.environ if environ is None else environ
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return Machine(no_gpu="no NVIDIA GPU: nvidia-smi not found")
    query = "index,name,compute_cap,memory.total,driver_version"
    try:
        out = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Machine(no_gpu=f"no NVIDIA GPU: nvidia-smi failed ({e})")
    if out.returncode != 0:
        return Machine(no_gpu=f"no NVIDIA GPU: nvidia-smi failed ({(out.stderr or out.stdout).strip()})")
    gpus = parse_gpu_query(out.stdout)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*|", visible):
        keep = [int(v) for v in visible.split(",") if v.strip()]
        gpus = [g for g in gpus if g["index"] in keep]
    if not gpus:
        return Machine(no_gpu="no NVIDIA GPU: nvidia-smi lists none (or CUDA_VISIBLE_DEVICES hides them)")
    return Machine(gpus=gpus)


def parse_gpu_query(text: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv,noheader``."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5 and parts[0].isdigit() and re.fullmatch(r"\d+\.\d+", parts[2]):
            gpus.append({"index": int(parts[0]), "name": parts[1], "compute_cap": parts[2], "memory": parts[3],
                         "driver": parts[4]})
    return gpus


_SOFTWARE_PROBE = r"""
import importlib.util, json, platform, sys
spec = importlib.util.spec_from_file_location("loc", "odc_runtime/_nvshmem_locate.py")
loc = importlib.util.module_from_spec(spec); spec.loader.exec_module(loc)
info = {"python": platform.python_version(), "torch_nvshmem_pin": loc.torch_nvshmem_pin(),
        "nvshmem_wheels": loc.installed_wheels(), "nvshmem_homes": loc.nvshmem_homes()}
homes = info["nvshmem_homes"]
info["nvshmem_header"] = ".".join(map(str, loc.header_version(homes[0]) or ())) if homes else None
try:
    import torch
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
except Exception as e:
    info["torch"] = f"not importable: {e}"
try:
    import triton
    info["triton"] = triton.__version__
except Exception:
    info["triton"] = None
print(json.dumps(info))
"""


def probe_software(machine: Machine) -> None:
    """Versions of Python, torch (+CUDA), triton, NVSHMEM (the pin, the wheels, the one the build uses), nvcc."""
    sw: dict = {}
    try:
        out = subprocess.run([sys.executable, "-c", _SOFTWARE_PROBE], capture_output=True, text=True, timeout=120,
                             cwd=REPO)
        sw.update(json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else
                  {"probe_error": (out.stderr or out.stdout).strip()[-500:]})
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        sw["probe_error"] = str(e)
    nvcc = shutil.which("nvcc") or next((p for p in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                                   "bin", "nvcc"),) if os.access(p, os.X_OK)), None)
    if nvcc:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            m = re.search(r"release (\d+\.\d+)", subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                                                timeout=30).stdout)
            sw["nvcc"] = m.group(1) if m else None
    sw["mps_control"] = shutil.which("nvidia-cuda-mps-control")
    machine.software = sw


def nvshmem_home_for_build(software: dict) -> str | None:
    """The NVSHMEM install to build against: the wheel whose version the installed torch pins (what ``import torch``
    loads), when it is installed; else None (``build_ext.sh`` then picks, and its version check decides)."""
    pin = software.get("torch_nvshmem_pin")
    if pin and tuple(pin) in {tuple(w) for w in software.get("nvshmem_wheels") or []}:
        for home in software.get("nvshmem_homes") or []:
            if home.endswith(os.path.join("nvidia", "nvshmem")):
                return home
    return None


# --------------------------------------------------------------------------------------------------- steps


@dataclass
class Result:
    """What one step did: ``status`` one of STATUSES; ``numbers`` what it measured; ``detail`` why (one line)."""

    phase: str
    name: str
    status: str
    seconds: float = 0.0
    numbers: dict = field(default_factory=dict)
    detail: str = ""
    command: str = ""
    log: str | None = None
    log_tail: str = ""
    outputs: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES


@dataclass
class Step:
    """One check: ``argv`` run as a child process (in the repository root, environment ``env`` on top of the
    run's), at most ``timeout`` seconds; ``mps``: under a private CUDA MPS daemon; ``evaluate(rc, log_text)``
    turns its exit status and output into (status, numbers, detail); ``skip``: why it cannot run here."""

    phase: str
    name: str
    argv: list[str]
    timeout: float
    env: dict[str, str] = field(default_factory=dict)
    mps: bool = False
    evaluate: Callable[[int, str], tuple[str, dict, str]] | None = None
    skip: str | None = None
    na: str | None = None  # why it does not apply to this machine (e.g. needs more GPUs): "n/a", not a failure
    progress: Callable[[str], dict] | None = None  # numbers from the log of a run cut by its timeout
    outputs: list[Path] = field(default_factory=list)  # files it writes (removed before it runs: nothing stale)
    estimate: float | None = None  # expected seconds on one H100 (.ci/gpu --plan; None: half the timeout)

    @property
    def command(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items() if k not in BASE_ENV_KEYS)
        argv = [os.path.basename(a) if a == sys.executable else a for a in self.argv]
        return (f"{env} " if env else "") + " ".join(argv) + (" [MPS]" if self.mps else "")


BASE_ENV_KEYS = ("PYTHONPATH", "PYTHONUNBUFFERED", "PIP_NO_INDEX", "ODC_REQUIRE_EXTENSION", "PYTHON")


def _rc_only(rc: int, text: str) -> tuple[str, dict, str]:
    return ("pass", {}, "") if rc == 0 else ("fail", {}, f"exit status {rc}")


def evaluate_build(rc: int, text: str) -> tuple[str, dict, str]:
    numbers: dict = {}
    if m := re.search(r"NVSHMEM (\d+\.\d+\.\d+), CUDA devices visible: (\d+)", text):
        numbers.update(nvshmem=m.group(1), devices=int(m.group(2)))
    if m := re.search(r"archs ([^)]+)\)", text):
        numbers["archs"] = m.group(1)
    return ("pass", numbers, "") if rc == 0 else ("fail", numbers, f"exit status {rc}")


_NEEDS_GPUS = re.compile(r"needs >= ?(\d+) GPUs")
_DEAD_PEER = re.compile(r"raised after ([\d.]+) s, exited ([\d.]+) s later")


def junit_evaluator(xml_path: Path, ngpu: int) -> Callable[[int, str], tuple[str, dict, str]]:
    """Evaluate a pytest run from its JUnit XML: every test must pass; a skip is a failure unless the test needs
    more GPUs than ``ngpu`` (``n/a``); no test at all is a failure. Numbers: counts, and for the dead-peer tests
    the slowest survivor's time to raise and to exit (printed by the test)."""

    def evaluate(rc: int, text: str) -> tuple[str, dict, str]:
        return evaluate_junit(xml_path, ngpu, rc)

    return evaluate


def evaluate_junit(xml_path: Path, ngpu: int, rc: int) -> tuple[str, dict, str]:
    if not xml_path.exists():
        return "fail", {}, f"pytest wrote no report (exit status {rc})"
    try:
        root = ET.parse(xml_path).getroot()
    except ET.ParseError as e:
        return "fail", {}, f"unreadable JUnit XML ({e})"
    counts = {"passed": 0, "failed": 0, "skipped": 0, "n/a": 0}
    bad: dict[str, list[str]] = {}  # reason -> tests
    raise_s: list[float] = []
    exit_s: list[float] = []
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            counts["failed"] += 1
            first = (failure.get("message") or "failed").splitlines() or ["failed"]
            bad.setdefault(first[0][:160], []).append(name)
        elif skipped is not None:
            msg = skipped.get("message") or ""
            m = _NEEDS_GPUS.search(msg)
            if m and int(m.group(1)) > ngpu:
                counts["n/a"] += 1
            else:
                counts["skipped"] += 1
                bad.setdefault(f"skipped ({msg[:160]})", []).append(name)
        else:
            counts["passed"] += 1
        for out in case.iter("system-out"):
            for a, b in _DEAD_PEER.findall(out.text or ""):
                raise_s.append(float(a))
                exit_s.append(float(b))
    numbers: dict = {k: v for k, v in counts.items() if v}
    if raise_s:
        numbers.update(survivors=len(raise_s), max_raise_s=max(raise_s), max_exit_s=max(exit_s))
    total = sum(counts.values())
    if total == 0:
        return "fail", numbers, f"no test ran (exit status {rc})"
    if bad:
        return "fail", numbers, "; ".join(_one_reason(reason, names) for reason, names in bad.items())
    if rc not in (0, 5) and counts["passed"] + counts["n/a"] == total:
        return "fail", numbers, f"pytest exit status {rc}"
    return ("n/a" if counts["passed"] == 0 else "pass"), numbers, ""


_PYTEST_VERBOSE = re.compile(r"^(\S+::\S+)[ \t]*(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)?", re.M)


def pytest_progress(text: str) -> dict:
    """From a ``pytest -v`` log cut short: how many tests ended how, and the test that was running."""
    numbers: dict = {}
    running = None
    for test, outcome in _PYTEST_VERBOSE.findall(text):
        if outcome:
            numbers[outcome.lower()] = numbers.get(outcome.lower(), 0) + 1
            running = None
        else:
            running = test
    if running:
        numbers["running"] = running
    return numbers


def _one_reason(reason: str, names: list[str]) -> str:
    """``test_a: reason``, or for several tests with one reason ``3 tests (test_a, test_b, ...): reason``."""
    if len(names) == 1:
        return f"{names[0]}: {reason}"
    shown = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
    return f"{len(names)} tests ({shown}): {reason}"


def _comm_rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["results"]


def comm_evaluator(json_path: Path) -> Callable[[int, str], tuple[str, dict, str]]:
    """A ``bench/comm.py`` run passes when it exits 0 (it verifies every size exactly before timing) and wrote
    its JSON; numbers: fetch/push vs the local bound at 64 MiB where measured."""

    def evaluate(rc: int, text: str) -> tuple[str, dict, str]:
        if rc != 0:
            return "fail", {}, f"exit status {rc}"
        if not json_path.exists():
            return "fail", {}, f"no JSON written at {json_path}"
        rows = _comm_rows(json_path)
        numbers = {f"{r['op']}/local@{_human(r['bytes'])}": r["vs_local"] for r in rows
                   if r["op"] in ("fetch", "push") and r["bytes"] == TARGET_SIZE and r.get("vs_local") is not None}
        return "pass", numbers, f"{len(rows)} rows"

    return evaluate


def _human(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def sft_evaluator(json_path: Path, reference: Path | None) -> Callable[[int, str], tuple[str, dict, str]]:
    """An ``examples/sft.py`` run passes when it exits 0 with ``SFT_STEPS`` losses; the ODC run's losses must
    equal the collective run's (``reference``) within ``SFT_REL_TOL``."""

    def evaluate(rc: int, text: str) -> tuple[str, dict, str]:
        if rc != 0:
            return "fail", {}, f"exit status {rc}"
        losses = sft_losses(json_path)
        numbers: dict = {"losses": losses}
        if rec := _json_or_none(json_path):
            numbers["tokens_per_s"] = rec.get("tokens_per_s")
        if len(losses) != SFT_STEPS:
            return "fail", numbers, f"{len(losses)} losses, expected {SFT_STEPS}"
        if reference is None:
            return "pass", numbers, ""
        ref = sft_losses(reference)
        if len(ref) != SFT_STEPS:
            return "fail", numbers, "the collective run left no losses to compare with"
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref, strict=True))
        numbers["max_rel_diff_vs_collective"] = worst
        if worst > SFT_REL_TOL:
            return "fail", numbers, f"losses differ from the collective run by {worst:.3g} (rel) > {SFT_REL_TOL:g}"
        return "pass", numbers, "same losses as --comm collective"

    return evaluate


def imbalance_evaluator(json_path: Path) -> Callable[[int, str], tuple[str, dict, str]]:
    """A ``bench/imbalance.py`` run passes when it exits 0 (it fails itself on a wrong gradient) and its JSON says
    every configuration's gradients were exact; the numbers are ODC + lb_mini's speedups over the collective
    baselines (measured, and what the compute-only simulation predicts)."""

    def evaluate(rc: int, text: str) -> tuple[str, dict, str]:
        if rc != 0:
            return "fail", {}, f"exit status {rc}"
        runs = (_json_or_none(json_path) or {}).get("runs", [])
        if not runs:
            return "fail", {}, f"no runs in {json_path.name}"
        wrong = [f"{r['comm']}/{r['policy']}" for r in runs if not r.get("grad_check_ok")]
        if wrong:
            return "fail", {}, f"wrong gradients in {', '.join(wrong)}"
        numbers: dict = {}
        for r in runs:
            if (r["comm"], r["policy"]) == ("odc", "lb_mini"):  # × collective + each baseline policy
                numbers = {f"odc_lb_mini_x_{b}": r.get(f"speedup_vs_collective_{b}")
                           for b in ("local_sort", "verl_lb_micro", "lb_micro")}
                numbers.update(sim_x_local_sort=r.get("sim_speedup"), tokens_per_s=r.get("tokens_per_s"))
        return "pass", numbers, f"{len(runs)} configurations, exact gradients"

    return evaluate


def _json_or_none(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sft_losses(path: Path) -> list[float]:
    rec = _json_or_none(path) or {}
    return [float(r["loss"]) for r in rec.get("records", [])]


def plan(phases: Sequence[str], machine: Machine, out: Path) -> list[Step]:
    """The steps of ``phases`` for this machine, in order; a step that cannot run here carries its reason."""
    py = sys.executable
    logs = out / "logs"
    steps: list[Step] = []
    ngpu = machine.ngpu
    first_gpu = {"CUDA_VISIBLE_DEVICES": str(machine.gpus[0]["index"])} if machine.gpus else {}
    deadline = {} if os.environ.get("ODC_TIMEOUT") else {"ODC_TIMEOUT": RUN_ODC_TIMEOUT_S}

    if "build" in phases:
        env = {"ODC_CUDA_ARCHS": machine.archs or "<visible GPU>", "PYTHON": py}
        home = nvshmem_home_for_build(machine.software)
        if home:
            env["NVSHMEM_HOME"] = home
        steps.append(Step("build", f"build _C for {machine.archs or 'the visible GPU'}", ["bash", ".ci/build_ext.sh"],
                          420, env, evaluate=evaluate_build, estimate=30))  # 24-28 s measured

    if "tests" in phases:
        files = sorted((REPO / "tests" / "gpu").glob("test_*.py"),
                       key=lambda p: (TEST_ORDER.index(p.name) if p.name in TEST_ORDER else len(TEST_ORDER), p.name))
        for f in files:
            xml = logs / f"junit-{f.stem}.xml"
            rel = f.relative_to(REPO).as_posix()
            steps.append(Step("tests", rel, [py, "-m", "pytest", "-v", "-p", "no:cacheprovider", rel,
                                             f"--junitxml={xml}", "-o", "junit_logging=system-out"],
                              480, evaluate=junit_evaluator(xml, ngpu), outputs=[xml], progress=pytest_progress))

    if "bench" in phases:
        def comm(name: str, nproc: int, *extra: str, env: dict | None = None, mps: bool = False,
                 sizes: str = BENCH_SIZES, need: int = 1, estimate: float = 20, backend: str = "nvshmem") -> None:
            path = logs / f"comm-{name}.json"
            argv = [py, "bench/comm.py", "--backend", backend, "--nproc", str(nproc), "--sizes", sizes,
                    *extra, "--json", str(path), "--plot", "none"]
            na = f"needs >= {need} GPUs, {ngpu} visible" if ngpu < need else None
            steps.append(Step("bench", f"comm {name}", argv, 150, {**deadline, **(env or {})}, mps=mps,
                              evaluate=comm_evaluator(path), na=na, outputs=[path], estimate=estimate))

        # the hierarchy's run first, then the targets' runs, symm's beside nvshmem's, then the shared-GPU runs
        # (symm's from CUDA IPC under MPS as nvshmem's; each verifies its results exactly before timing). Estimates:
        # 11-21 s measured per run on 2026-11-27.
        locked = {**first_gpu, "ODC_NVSHMEM_PUSH": "locked"}
        comm("4pe-1gpu-2nodes", 4, "--pes-per-gpu", "4", "--node-size", "2", env=first_gpu, mps=True, sizes="64M",
             estimate=12)
        comm("1pe", 1, env=first_gpu, estimate=13)
        comm("1pe-symm", 1, env=first_gpu, backend="symm", estimate=18)
        comm("1pe-locked", 1, "--ops", "copy,add,push,sync", env=locked, sizes="64M,256M", estimate=12)
        comm("4pe-1gpu", 4, "--pes-per-gpu", "4", env=first_gpu, mps=True, estimate=16)
        comm("4pe-1gpu-symm", 4, "--pes-per-gpu", "4", env=first_gpu, mps=True, backend="symm", estimate=18)
        comm("4pe-1gpu-locked", 4, "--pes-per-gpu", "4", "--ops", "copy,add,push,sync", env=locked, mps=True,
             sizes="64M", estimate=11)  # the ticket lock contended by 4 PEs
        # (a 2-PE shared-GPU run was dropped: 1pe and 4pe-1gpu bracket it, and the plan must fit 30 device minutes)
        comm(f"{min(max(ngpu, 2), 8)}gpu-vs-nccl", min(max(ngpu, 2), 8), need=2)

    if "e2e" in phases:
        shared = ngpu < SFT_PES  # the PEs share the first GPU (gloo instead of NCCL, under MPS)
        extra = ["--pes-per-gpu", str(SFT_PES)] if shared else []
        env = {**deadline, **(first_gpu if shared else {})}
        # FSDP2 in ODC mode against the collective run, on nvshmem and on symm (whose heap comes from CUDA IPC
        # where the ranks share a GPU); both compared with the one collective run. 17-20 s measured per run.
        paths = {c: logs / f"sft-{c}.json" for c in ("collective", "odc", "odc-symm")}
        for run, comm_mode, backend in (("collective", "collective", "nvshmem"), ("odc", "odc", "nvshmem"),
                                        ("odc-symm", "odc", "symm")):
            argv = [py, "examples/sft.py", "--comm", comm_mode, "--nproc", str(SFT_PES), "--steps", str(SFT_STEPS),
                    "--odc-backend", backend, "--json", str(paths[run]), *extra]
            ref = paths["collective"] if comm_mode == "odc" else None
            name = f"sft --comm {comm_mode}{' --odc-backend symm' if backend == 'symm' else ''}, {SFT_PES} PEs"
            steps.append(Step("e2e", name, argv, 180, dict(env), mps=shared,
                              evaluate=sft_evaluator(paths[run], ref), outputs=[paths[run]], estimate=21))
        path = logs / "imbalance.json"
        argv = [py, "bench/imbalance.py", "--quick", "--backend", "nvshmem", "--nproc", str(SFT_PES), *extra,
                "--json", str(path), "--plot", "none"]
        # Its point is time (busy and waiting per rank): PEs sharing one GPU time the sharing, not ODC, and its
        # exactness on the GPU data plane is the sft run's; so it needs a GPU per PE.
        na = f"needs >= {SFT_PES} GPUs (one per PE: it measures time), {ngpu} visible" if shared else None
        steps.append(Step("e2e", f"imbalance --quick --backend nvshmem, {SFT_PES} PEs", argv, 180, dict(env),
                          mps=shared, evaluate=imbalance_evaluator(path), outputs=[path], estimate=40, na=na))

    if machine.no_gpu:
        for s in steps:
            s.skip = machine.no_gpu
    return steps


# --------------------------------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """One number of the issue's "On a GPU" list: field ``key`` of the ``op`` row at 64 MiB of the comm run
    ``source`` (``time_us``: its time in µs), compared with ``bound`` by ``cmp`` (``>=`` or ``<=``)."""

    name: str
    source: str  # comm JSON name (logs/comm-<source>.json)
    op: str
    key: str  # field of the row, or "time_us"
    cmp: str
    bound: float
    unit: str = ""


TARGETS = (
    Target("fetch >= 0.95 x copy_ (1 PE, 64 MiB)", "1pe", "fetch", "vs_local", ">=", 0.95),
    Target("push >= 0.87 x add_ (1 PE, 64 MiB)", "1pe", "push", "vs_local", ">=", 0.87),
    Target("fetch host us/call <= 1.3 x copy_ (1 PE, 64 MiB)", "1pe", "fetch", "host_vs_copy", "<=", 1.3),
    Target("push host us/call <= 1.3 x copy_ (1 PE, 64 MiB)", "1pe", "push", "host_vs_copy", "<=", 1.3),
    # sync_busy: a sync behind queued GPU work; its GPU time (CUDA events) is bounded here, its host time is not
    Target("sync_busy GPU time <= 60 us (1 PE)", "1pe", "sync_busy", "time_us", "<=", 60.0, " us"),
    Target("locked push >= 150 GB/s (1 PE, 64 MiB)", "1pe-locked", "push", "algbw_GBps", ">=", 150.0, " GB/s"),
    # symm's, the same bounds (push: 0.9 x add_), not yet met (docs/gpu-report.md)
    Target("symm fetch >= 0.95 x copy_ (1 PE, 64 MiB)", "1pe-symm", "fetch", "vs_local", ">=", 0.95),
    Target("symm push >= 0.9 x add_ (1 PE, 64 MiB)", "1pe-symm", "push", "vs_local", ">=", 0.9),
    Target("symm fetch host us/call <= 1.3 x copy_ (1 PE, 64 MiB)", "1pe-symm", "fetch", "host_vs_copy", "<=", 1.3),
    Target("symm push host us/call <= 1.3 x copy_ (1 PE, 64 MiB)", "1pe-symm", "push", "host_vs_copy", "<=", 1.3),
    Target("symm sync_busy GPU time <= 60 us (1 PE)", "1pe-symm", "sync_busy", "time_us", "<=", 60.0, " us"),
)


def check_targets(logs: Path, sources: set[str]) -> list[Result]:
    """One result per target whose comm run (in ``sources``) was attempted, from its JSON in ``logs`` (a missing
    measurement is a failure)."""
    out = []
    for t in TARGETS:
        if t.source not in sources:
            continue
        path = logs / f"comm-{t.source}.json"
        row = None
        if path.exists():
            with contextlib.suppress(ValueError, KeyError):
                row = next((r for r in _comm_rows(path) if r["op"] == t.op and r["bytes"] == TARGET_SIZE), None)
        value = None if row is None else (row["time_s"] * 1e6 if t.key == "time_us" else row.get(t.key))
        if value is None or (isinstance(value, float) and math.isnan(value)):
            why = f"no {t.op} row at 64M in {path.name}" if path.exists() else f"comm {t.source} wrote no results"
            out.append(Result("bench", f"target: {t.name}", "fail", detail=f"not measured ({why})"))
            continue
        ok = value >= t.bound if t.cmp == ">=" else value <= t.bound
        out.append(Result("bench", f"target: {t.name}", "pass" if ok else "fail",
                          numbers={"measured": round(value, 4), "bound": t.bound},
                          detail=f"{value:.4g}{t.unit} {t.cmp} {t.bound:g}{t.unit}" + ("" if ok else ": missed")))
    return out


# --------------------------------------------------------------------------------------------------- running


class MpsError(RuntimeError):
    pass


@contextlib.contextmanager
def mps_daemon(workdir: Path, visible: str | None = None) -> Iterator[dict[str, str]]:
    """A private CUDA MPS control daemon for the duration (its logs in ``workdir``; its pipes in a short temporary
    directory, since a socket path is limited to 107 bytes); yields the environment its clients need. Raises
    MpsError saying why it could not start.

    ``visible``: the GPUs the daemon serves (``CUDA_VISIBLE_DEVICES``; None: none set). The daemon remaps them to
    0, 1, ... for its clients, so a client must not set ``CUDA_VISIBLE_DEVICES`` itself (NVIDIA's MPS manual,
    "CUDA_VISIBLE_DEVICES": keeping the daemon's value in the client leads to an error): ``run_step`` gives the
    daemon the step's devices and removes them from the client's environment."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise MpsError("nvidia-cuda-mps-control not found: cannot share one GPU between several PEs")
    with tempfile.TemporaryDirectory(prefix="odc-mps-") as pipes:
        env = {"CUDA_MPS_PIPE_DIRECTORY": pipes, "CUDA_MPS_LOG_DIRECTORY": str(workdir)}
        workdir.mkdir(parents=True, exist_ok=True)
        full = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        full.update(env)
        if visible is not None:
            full["CUDA_VISIBLE_DEVICES"] = visible
        started = subprocess.run([control, "-d"], env=full, capture_output=True, text=True, timeout=30)
        if started.returncode != 0:
            raise MpsError(f"could not start CUDA MPS ({(started.stderr or started.stdout).strip()})")
        try:
            yield env
        finally:
            subprocess.run([control], input="quit\n", env=full, capture_output=True, text=True, timeout=30)


def base_env() -> dict[str, str]:
    """The environment of every step: the repository importable, unbuffered output, no package index, and the
    extension required (a missing ``_C`` fails instead of skipping)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.update(PYTHONUNBUFFERED="1", PIP_NO_INDEX="1", ODC_REQUIRE_EXTENSION="1")
    return env


def run_step(step: Step, logs: Path, timeout: float) -> Result:
    """Run one step (its own process group, killed at ``timeout``), its output to ``logs/<name>.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / (re.sub(r"[^A-Za-z0-9._-]+", "_", f"{step.phase}-{step.name}").strip("_") + ".log")
    for stale in step.outputs:
        stale.unlink(missing_ok=True)
    start = time.monotonic()
    status, numbers, detail = "fail", {}, ""
    try:
        with contextlib.ExitStack() as stack:
            env = {**base_env(), **step.env}
            if step.mps:  # the daemon gets the step's devices; its clients see them as 0, 1, ... (mps_daemon)
                visible = env.pop("CUDA_VISIBLE_DEVICES", None)
                env.update(stack.enter_context(mps_daemon(logs / f"mps-{log_path.stem}", visible)))
            with open(log_path, "w") as f:
                f.write(f"$ {step.command}\n")
                f.flush()
                proc = subprocess.Popen(step.argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                try:
                    rc = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    rc = None
                _kill_group(proc)  # also after a normal exit: a leftover worker would hold the GPU
        text = log_path.read_text(errors="replace")
        if rc is None:
            status, detail = "timeout", f"killed after {timeout:.0f} s"
            numbers = step.progress(text) if step.progress else {}
            if numbers.get("running"):
                detail += f" while running {numbers['running']}"
        else:
            status, numbers, detail = (step.evaluate or _rc_only)(rc, text)
    except MpsError as e:
        detail = str(e)
    except OSError as e:
        detail = f"could not run: {e}"
    seconds = time.monotonic() - start
    tail = "" if status in OK_STATUSES or not log_path.exists() else _tail(log_path.read_text(errors="replace"))
    return Result(step.phase, step.name, status, seconds, numbers, detail, step.command, str(log_path), tail,
                  [str(p) for p in step.outputs if p.exists()])


def _kill_group(proc: subprocess.Popen) -> None:
    """End the step's process group (it was started in its own session, so the group is the step's alone):
    SIGTERM, up to 10 s for the step's own process to exit, then SIGKILL for whatever of the group is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def execute(steps: Sequence[Step], logs: Path, phase_budget: float, budget: float | None) -> list[Result]:
    """Run ``steps`` in order; each gets at most its timeout, what its phase has left and what the run has left."""
    results: list[Result] = []
    run_end = time.monotonic() + budget if budget else math.inf
    phase_end: dict[str, float] = {}
    for step in steps:
        if step.skip or step.na:
            status, why = ("skip", step.skip) if step.skip else ("n/a", step.na)
            results.append(Result(step.phase, step.name, status, detail=why, command=step.command))
            log(f"[{step.phase}] {step.name}: {status} ({why})")
            continue
        now = time.monotonic()
        end = phase_end.setdefault(step.phase, now + phase_budget)
        left = min(end, run_end) - now
        if left < MIN_STEP_S:
            which = "phase" if end <= run_end else "run"
            results.append(Result(step.phase, step.name, "timeout", command=step.command,
                                  detail=f"not run: the {which}'s time budget was spent"))
            log(f"[{step.phase}] {step.name}: not run (time budget spent)")
            continue
        log(f"[{step.phase}] {step.name} ...", flush=True)
        res = run_step(step, logs, min(step.timeout, left))
        results.append(res)
        log(f"[{step.phase}] {step.name}: {res.status} in {res.seconds:.1f} s"
            + (f" ({res.detail})" if res.detail else ""), flush=True)
    ran = {r.name for r in results if r.status not in ("skip", "n/a")}
    results.extend(check_targets(logs, {t.source for t in TARGETS if f"comm {t.source}" in ran}))
    return results


# --------------------------------------------------------------------------------------------------- report


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_meta(machine: Machine, argv: Sequence[str]) -> dict:
    """Where, when and how: date, commit (dirty or not), the command line, GPUs, driver and software versions."""
    return {
        "command": " ".join([".ci/gpu", *argv]),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git("rev-parse", "--short=12", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "gpus": machine.gpus,
        "no_gpu": machine.no_gpu,
        "software": machine.software,
    }


def merge_report(previous: dict | None, meta: dict, results: Sequence[Result], phases: Sequence[str]) -> dict:
    """The report's data: this run's phases (with ``meta``), plus the other phases of ``previous``, unchanged."""
    report: dict = {"schema": 1, "phases": {}}
    if previous and previous.get("schema") == 1:
        report["phases"].update({p: v for p, v in previous.get("phases", {}).items() if p not in phases})
    for p in phases:
        report["phases"][p] = {"meta": meta, "results": [asdict(r) for r in results if r.phase == p]}
    report["phases"] = {p: report["phases"][p] for p in PHASES if p in report["phases"]}
    return report


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _meta_lines(meta: dict) -> list[str]:
    sw = meta.get("software") or {}
    gpus = meta.get("gpus") or []
    names: dict[str, int] = {}
    for g in gpus:
        key = f"{g['name']} (sm_{g['compute_cap'].replace('.', '')}, {g['memory']})"
        names[key] = names.get(key, 0) + 1
    pin = sw.get("torch_nvshmem_pin")
    rows = [
        ("date", meta.get("date")),
        ("command", f"`{meta['command']}`" if meta.get("command") else None),
        ("commit", f"{meta.get('commit')}{' (uncommitted changes)' if meta.get('dirty') else ''}"),
        ("GPU", ", ".join(f"{n} x {k}" for k, n in names.items()) or meta.get("no_gpu")),
        ("driver", gpus[0]["driver"] if gpus else None),
        ("torch", f"{sw.get('torch')} (CUDA {sw.get('torch_cuda')})" if sw.get("torch") else None),
        ("NVSHMEM", f"{sw.get('nvshmem_header')} (torch pins {'-'.join(pin) if pin else 'none'}; wheels "
                    f"{', '.join('-'.join(w) for w in sw.get('nvshmem_wheels') or []) or 'none'})"
         if sw else None),
        ("nvcc", sw.get("nvcc")),
        ("triton", sw.get("triton")),
        ("Python", sw.get("python")),
    ]
    return [f"| {k} | {_cell(str(v))} |" for k, v in rows if v not in (None, "")]


def render_markdown(report: dict) -> str:
    """``report.md``: per phase its run (date, commit, machine) and a table of checks; the benchmark rows; the
    log tails of what failed."""
    lines = ["# GPU report (`.ci/gpu`)", ""]
    failures: list[dict] = []
    previous_meta = None
    for phase, data in report["phases"].items():
        results = data["results"]
        bad = sum(r["status"] not in OK_STATUSES for r in results)
        lines += [f"## {phase}: {'all passed' if not bad else f'{bad} of {len(results)} failed'}", ""]
        if data["meta"] == previous_meta:
            lines += ["Same run as the phase above.", ""]
        else:
            lines += ["| | |", "|---|---|", *_meta_lines(data["meta"]), ""]
        previous_meta = data["meta"]
        lines += ["| check | result | time | numbers |", "|---|---|---|---|"]
        for r in results:
            nums = ", ".join(f"{k}={_fmt(v)}" for k, v in r["numbers"].items())
            detail = f"{r['status']}" + (f": {r['detail']}" if r["detail"] else "")
            lines.append(f"| {_cell(r['name'])} | {_cell(detail)} | {r['seconds']:.1f} s | {_cell(nums)} |")
            if r["status"] not in OK_STATUSES:
                failures.append(r)
        lines.append("")
        if phase == "bench":
            lines += _bench_tables(data["results"])
    if failures:
        lines += ["## Failures", ""]
        for r in failures:
            lines += [f"### {r['phase']}: {r['name']}", "", f"`{r['command']}`" if r["command"] else "",
                      "", f"{r['status']}: {r['detail']}" + (f" (log: {r['log']})" if r.get("log") else ""), ""]
            if r.get("log_tail"):
                lines += ["```", r["log_tail"], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


BENCH_OPS = ("copy", "add", "fetch", "push", "all_gather", "red_scatter", "sync", "sync_flush", "sync_busy",
             "mm+fetch", "mm+push")


# The two time columns of a bench/comm.py row, named in every table of the report: they can differ widely (a
# stream-ordered sync returns to the host long before the GPU is done; a host-bound call is the other way round).
BENCH_COLUMNS = ("GPU ms: the call's time on the GPU (`time_s`: CUDA events on its stream around the call, the start "
                 "recorded before the Python call; max over ranks per repeat, median over repeats). host µs: the "
                 "Python call's own time on the host (`host_us`: perf_counter, median over repeats, rank 0).")


def _bench_tables(results: Sequence[dict]) -> list[str]:
    """The measured rows of each comm run whose JSON is still there (ms, host µs, GB/s and the ratios)."""
    lines: list[str] = []
    for r in results:
        data = _json_or_none(Path(r["outputs"][0])) if r["name"].startswith("comm ") and r.get("outputs") else None
        if not data or "results" not in data:
            continue
        lines += [f"### {r['name']}", "", BENCH_COLUMNS, "", "| size | op | GPU ms | host µs | algbw GB/s | busbw GB/s"
                  " | /local | /collective | host/copy |", "|---|---|---|---|---|---|---|---|---|"]
        for row in data["results"]:
            if row["op"] not in BENCH_OPS:
                continue
            vals = [row["time_s"] * 1e3, row["host_us"], row["algbw_GBps"], row["busbw_GBps"], row.get("vs_local"),
                    row.get("vs_collective"), row.get("host_vs_copy")]
            lines.append(f"| {_human(row['bytes'])} | {row['op']} | "
                         + " | ".join("-" if v is None or (isinstance(v, float) and math.isnan(v)) else _fmt(v)
                                      for v in vals) + " |")
        lines.append("")
    return lines


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, allow_nan=True) + "\n")
    (out / "report.md").write_text(render_markdown(report))


# --------------------------------------------------------------------------------------------------- main


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=".ci/gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # no choices=: argparse rejects an empty nargs="*" list against choices (Python < 3.12); checked below
    p.add_argument("phases", nargs="*", metavar="PHASE", help=f"any of {', '.join(PHASES)}, all (default: all)")
    p.add_argument("--out", default=None, help=f"report directory (default: ODC_GPU_REPORT_DIR, else {DEFAULT_OUT}/)")
    p.add_argument("--dry-run", action="store_true", help="list the steps (and why each would be skipped); run none")
    p.add_argument("--only", action="append", default=None, metavar="SUBSTR",
                   help="run only the steps whose name contains SUBSTR (repeatable; the build still runs)")
    p.add_argument("--no-build", action="store_true", help="leave the build phase out (also from all)")
    p.add_argument("--phase-budget", type=_positive, default=None,
                   help=f"seconds per phase (default: ODC_GPU_PHASE_BUDGET_S, else {DEFAULT_PHASE_BUDGET_S:g})")
    p.add_argument("--budget", type=_positive, default=None,
                   help="seconds for the whole run (default: ODC_GPU_BUDGET_S, else no limit beyond the phases')")
    p.add_argument("--fresh", action="store_true", help="drop the phases of an earlier report.json in --out")
    return p


def parse_args(argv: Sequence[str] | None, environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Arguments, with the env-var defaults (``ODC_GPU_REPORT_DIR``, ``ODC_GPU_PHASE_BUDGET_S``,
    ``ODC_GPU_BUDGET_S``) parsed here, in one place."""
    environ = os.environ if environ is None else environ
    p = build_parser()
    args = p.parse_args(argv)
    unknown = [ph for ph in args.phases if ph not in (*PHASES, "all")]
    if unknown:
        p.error(f"unknown phase {', '.join(map(repr, unknown))} (choose from {', '.join(PHASES)}, all)")
    chosen = set(args.phases or ["all"])
    if "all" in chosen:
        chosen = set(PHASES)
    if args.no_build:
        chosen.discard("build")
    elif chosen - {"build"}:
        chosen.add("build")
    args.phases = [ph for ph in PHASES if ph in chosen]
    args.out = Path(args.out or environ.get("ODC_GPU_REPORT_DIR") or DEFAULT_OUT)
    for attr, var, default in (("phase_budget", "ODC_GPU_PHASE_BUDGET_S", DEFAULT_PHASE_BUDGET_S),
                               ("budget", "ODC_GPU_BUDGET_S", None)):
        if getattr(args, attr) is None:
            text = environ.get(var)
            try:
                setattr(args, attr, _positive(text) if text else default)
            except argparse.ArgumentTypeError as e:
                p.error(f"{var}: {e}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()  # the steps run in the repository root, the driver wherever it was started
    machine = probe_gpus()
    if not machine.no_gpu and not args.dry_run:
        probe_software(machine)
    steps = plan(args.phases, machine, args.out)
    if args.only:
        steps = [s for s in steps if s.phase == "build" or any(o in s.name for o in args.only)]
    if args.dry_run:
        log(f".ci/gpu dry run: phases {', '.join(args.phases)}; "
            + (machine.no_gpu or f"{machine.ngpu} GPU(s): {machine.gpus[0]['name']} (ODC_CUDA_ARCHS={machine.archs})"))
        for s in steps:
            state = (f"skip: {s.skip}" if s.skip else f"n/a: {s.na}" if s.na else
                     f"would run (timeout {s.timeout:.0f} s)")
            log(f"  [{s.phase}] {s.name}: {state}\n      {s.command}")
        return 0
    log(f".ci/gpu: phases {', '.join(args.phases)} -> {args.out}/; "
        + (machine.no_gpu or f"{machine.ngpu} x {machine.gpus[0]['name']}"))
    results = execute(steps, args.out / "logs", args.phase_budget, args.budget)
    previous = None if args.fresh else _json_or_none(args.out / "report.json")
    meta = run_meta(machine, sys.argv[1:] if argv is None else argv)
    write_report(args.out, merge_report(previous, meta, results, args.phases))
    bad = [r for r in results if not r.ok]
    log(f".ci/gpu: {len(results) - len(bad)} of {len(results)} checks passed; report {args.out / 'report.md'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
