"""CPU tests of ``.ci/gpu`` (issue 28): argument handling, the step plan, the JUnit / benchmark / SFT evaluation,
the report writer, the dry run and the exit codes. No GPU: ``nvidia-smi`` is absent or a fake on ``PATH``."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "gpu"

_spec = importlib.util.spec_from_file_location("gpu_report", ROOT / ".ci" / "gpu_report.py")
gr = importlib.util.module_from_spec(_spec)
sys.modules["gpu_report"] = gr  # dataclasses look their module up
_spec.loader.exec_module(gr)

H100 = "0, NVIDIA H100 80GB HBM3, 9.0, 81559 MiB, 580.159.04\n"


def _fake_smi(tmp_path: Path, rows: str = H100) -> str:
    """A directory holding a fake ``nvidia-smi`` that prints ``rows`` for any query; returns a PATH with it."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    smi = d / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '%s' '{rows}'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return f"{d}{os.pathsep}{_path_without_smi()}"


def _path_without_smi() -> str:
    """The current PATH minus directories that hold a real nvidia-smi or nvidia-cuda-mps-control."""
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not any(os.path.exists(os.path.join(d, n)) for n in ("nvidia-smi", "nvidia-cuda-mps-control"))]
    return os.pathsep.join(keep)


def _script(*args: str, path: str, out: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path, "PYTHON": sys.executable}
    env.pop("ODC_GPU_REPORT_DIR", None)
    if out is not None:
        args = (*args, "--out", str(out))
    return subprocess.run([str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------------------------------- arguments


def test_arguments_default_to_every_phase_and_env_overrides(tmp_path):
    a = gr.parse_args([], environ={})
    assert a.phases == list(gr.PHASES)
    assert a.out == Path("gpu-report") and a.phase_budget == gr.DEFAULT_PHASE_BUDGET_S and a.budget is None
    env = {"ODC_GPU_REPORT_DIR": str(tmp_path / "env"), "ODC_GPU_PHASE_BUDGET_S": "300", "ODC_GPU_BUDGET_S": "570"}
    a = gr.parse_args(["bench"], environ=env)
    assert a.phases == ["build", "bench"]  # the build runs first (incremental)
    assert a.out == tmp_path / "env" and a.phase_budget == 300 and a.budget == 570
    a = gr.parse_args(["e2e", "tests", "--no-build", "--out", "x", "--phase-budget", "100"], environ=env)
    assert a.phases == ["tests", "e2e"] and a.out == Path("x") and a.phase_budget == 100
    assert gr.parse_args(["build"], environ={}).phases == ["build"]
    assert gr.parse_args(["all", "--no-build"], environ={}).phases == ["tests", "bench", "e2e"]


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["bench", "nope"], {}, "unknown phase 'nope'"),
    (["--budget", "0"], {}, "positive"),
    (["--phase-budget", "ten"], {}, "expected seconds"),
    ([], {"ODC_GPU_PHASE_BUDGET_S": "-5"}, "ODC_GPU_PHASE_BUDGET_S"),
])
def test_bad_arguments_exit_2_with_the_reason(argv, env, needle, capsys):
    with pytest.raises(SystemExit) as e:
        gr.parse_args(argv, environ=env)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------- machine


def test_gpu_query_gives_the_visible_architectures_only(tmp_path):
    rows = H100 + "1, NVIDIA A100-SXM4-80GB, 8.0, 81920 MiB, 580.159.04\n"
    m = gr.probe_gpus({"PATH": _fake_smi(tmp_path, rows)})
    assert [g["name"] for g in m.gpus] == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"] and m.no_gpu is None
    assert m.archs == "80-real;90-real"
    m = gr.probe_gpus({"PATH": _fake_smi(tmp_path, rows), "CUDA_VISIBLE_DEVICES": "0"})
    assert m.ngpu == 1 and m.archs == "90-real"
    m = gr.probe_gpus({"PATH": _fake_smi(tmp_path, rows), "CUDA_VISIBLE_DEVICES": ""})
    assert m.ngpu == 0 and "CUDA_VISIBLE_DEVICES" in m.no_gpu
    m = gr.probe_gpus({"PATH": _path_without_smi()})
    assert m.ngpu == 0 and "nvidia-smi not found" in m.no_gpu


def test_software_probe_reads_this_environment():
    import torch

    m = gr.Machine()
    gr.probe_software(m)
    assert "probe_error" not in m.software, m.software
    assert m.software["torch"] == torch.__version__ and m.software["python"] == ".".join(map(str, sys.version_info[:3]))
    assert isinstance(m.software["nvshmem_wheels"], list) and isinstance(m.software["nvshmem_homes"], list)


def test_the_build_uses_the_nvshmem_wheel_torch_pins_only_when_it_is_installed():
    home = os.path.join("/site", "nvidia", "nvshmem")
    sw = {"torch_nvshmem_pin": ["cu13", "3.4.5"], "nvshmem_wheels": [["cu13", "3.4.5"]],
          "nvshmem_homes": ["/opt/nvshmem", home]}
    assert gr.nvshmem_home_for_build(sw) == home
    assert gr.nvshmem_home_for_build({**sw, "nvshmem_wheels": [["cu13", "3.8.0"]]}) is None  # build_ext.sh decides
    assert gr.nvshmem_home_for_build({**sw, "torch_nvshmem_pin": None}) is None


# --------------------------------------------------------------------------------------------------- plan


def _fake_repo(tmp_path: Path, monkeypatch) -> None:
    repo = tmp_path / "repo"
    (repo / "tests" / "gpu").mkdir(parents=True)
    for name in ("test_zeta_gpu.py", "test_dead_peer_gpu.py", "test_nvshmem_gpu.py", "_worker.py"):
        (repo / "tests" / "gpu" / name).write_text("")
    monkeypatch.setattr(gr, "REPO", repo)


def test_plan_on_one_gpu(tmp_path, monkeypatch):
    _fake_repo(tmp_path, monkeypatch)
    machine = gr.Machine(gpus=gr.parse_gpu_query(H100))
    steps = gr.plan(list(gr.PHASES), machine, tmp_path / "out")
    by = {s.name: s for s in steps}
    build = steps[0]
    assert build.phase == "build" and build.env["ODC_CUDA_ARCHS"] == "90-real"
    # every tests/gpu file in the proof's priority (gr.TEST_ORDER: what never passed on a GPU first), then the others
    assert [s.name for s in steps if s.phase == "tests"] == [
        "tests/gpu/test_dead_peer_gpu.py", "tests/gpu/test_nvshmem_gpu.py", "tests/gpu/test_zeta_gpu.py"]
    assert by["comm 4pe-1gpu"].mps and "--pes-per-gpu" in by["comm 4pe-1gpu"].argv
    assert by["comm 1pe-locked"].env["ODC_NVSHMEM_PUSH"] == "locked"
    assert by["comm 4pe-1gpu-locked"].env["ODC_NVSHMEM_PUSH"] == "locked" and by["comm 4pe-1gpu-locked"].mps
    # the hierarchy's run, the targets' runs with symm's beside nvshmem's, the shared-GPU runs (symm's too, under MPS)
    assert [s.name for s in steps if s.phase == "bench"][:4] == ["comm 4pe-1gpu-2nodes", "comm 1pe", "comm 1pe-symm",
                                                                 "comm 1pe-locked"]
    for name in ("comm 1pe-symm", "comm 4pe-1gpu-symm"):
        assert by[name].argv[by[name].argv.index("--backend") + 1] == "symm"
    assert by["comm 4pe-1gpu-symm"].mps and by["comm 4pe-1gpu-symm"].argv[
        by["comm 4pe-1gpu-symm"].argv.index("--pes-per-gpu") + 1] == "4"
    assert all("ODC_TIMEOUT" not in s.env for s in steps if s.phase == "tests")  # tests/gpu choose their own
    assert by["comm 2gpu-vs-nccl"].na == "needs >= 2 GPUs, 1 visible" and by["comm 2gpu-vs-nccl"].skip is None
    assert not any(s.skip for s in steps)
    assert [s.name for s in steps if s.na] == ["comm 2gpu-vs-nccl", "imbalance --quick --backend nvshmem, 4 PEs"]
    assert all(s.timeout <= gr.DEFAULT_PHASE_BUDGET_S for s in steps)


def test_plan_e2e_shares_one_gpu_between_4_pes_and_uses_every_gpu_on_eight(tmp_path, monkeypatch):
    _fake_repo(tmp_path, monkeypatch)
    monkeypatch.delenv("ODC_TIMEOUT", raising=False)
    one = gr.plan(["e2e"], gr.Machine(gpus=gr.parse_gpu_query(H100)), tmp_path)
    assert [s.name for s in one] == ["sft --comm collective, 4 PEs", "sft --comm odc, 4 PEs",
                                     "sft --comm odc --odc-backend symm, 4 PEs",
                                     "imbalance --quick --backend nvshmem, 4 PEs"]
    assert [s.skip for s in one] == [None, None, None, None]
    assert [bool(s.na) for s in one] == [False, False, False, True]  # it measures time: PEs sharing a GPU time it
    for step in one:  # 4 ranks on GPU 0: --pes-per-gpu 4 (gloo, nvshmem) under MPS
        assert step.mps and step.argv[step.argv.index("--pes-per-gpu") + 1] == "4"
        assert step.argv[step.argv.index("--nproc") + 1] == "4"
        assert step.env == {"CUDA_VISIBLE_DEVICES": "0", "ODC_TIMEOUT": gr.RUN_ODC_TIMEOUT_S}
    assert one[1].argv[one[1].argv.index("--odc-backend") + 1] == "nvshmem"
    assert one[2].argv[one[2].argv.index("--odc-backend") + 1] == "symm"
    imb = one[3].argv
    assert imb[1:3] == ["bench/imbalance.py", "--quick"] and imb[imb.index("--backend") + 1] == "nvshmem"
    monkeypatch.setenv("ODC_TIMEOUT", "30")  # the user's deadline is kept
    assert all("ODC_TIMEOUT" not in s.env for s in gr.plan(["bench", "e2e"], gr.Machine(gpus=[]), tmp_path))
    rows = "".join(H100.replace("0,", f"{i},", 1) for i in range(8))
    eight = gr.plan(["bench", "e2e"], gr.Machine(gpus=gr.parse_gpu_query(rows)), tmp_path)
    by = {s.name: s for s in eight}
    assert by["comm 8gpu-vs-nccl"].na is None and by["comm 8gpu-vs-nccl"].argv[4:6] == ["--nproc", "8"]
    for name in ("sft --comm odc, 4 PEs", "imbalance --quick --backend nvshmem, 4 PEs"):  # a GPU per rank: NCCL
        assert not by[name].mps and "--pes-per-gpu" not in by[name].argv and "CUDA_VISIBLE_DEVICES" not in by[name].env


# --------------------------------------------------------------------------------------------------- evaluation

SYNTHETIC_TESTS = '''
import pytest

def test_passes():
    print("push world=2 mps=False rank 0: raised after 12.40 s, exited 0.30 s later")
    print("sync world=4 mps=True rank 2: raised after 13.10 s, exited 1.25 s later")

def test_needs_two_gpus():
    pytest.skip("needs >= 2 GPUs, found 1")

def test_other_skip():
    pytest.skip("could not start CUDA MPS (permission denied)")

def test_fails():
    assert 1 == 2, "wrong value"
'''


def _junit(tmp_path: Path, source: str) -> tuple[Path, int]:
    (tmp_path / "test_synthetic.py").write_text(source)
    xml = tmp_path / "junit.xml"
    rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_synthetic.py",
                         f"--junitxml={xml}", "-o", "junit_logging=system-out", "--rootdir", str(tmp_path)],
                        cwd=tmp_path, capture_output=True, text=True, timeout=100).returncode
    return xml, rc


def test_junit_skip_is_a_failure_unless_more_gpus_are_needed(tmp_path):
    xml, rc = _junit(tmp_path, SYNTHETIC_TESTS)
    status, numbers, detail = gr.evaluate_junit(xml, 1, rc)
    assert status == "fail"
    assert numbers["passed"] == 1 and numbers["failed"] == 1 and numbers["skipped"] == 1 and numbers["n/a"] == 1
    assert "test_fails" in detail and "test_other_skip" in detail and "could not start CUDA MPS" in detail
    assert "test_needs_two_gpus" not in detail
    assert numbers["survivors"] == 2 and numbers["max_raise_s"] == 13.1 and numbers["max_exit_s"] == 1.25
    # with 2 GPUs visible, a skip for "needs >= 2 GPUs" is no longer explained: a failure
    assert "test_needs_two_gpus" in gr.evaluate_junit(xml, 2, rc)[2]


def test_junit_failures_with_one_reason_are_grouped(tmp_path):
    source = "import pytest\n" + "".join(f"def test_{i}():\n    pytest.skip('no CUDA GPU')\n" for i in range(5))
    xml, rc = _junit(tmp_path, source)
    detail = "5 tests (test_0, test_1, ...): skipped (no CUDA GPU)"
    assert gr.evaluate_junit(xml, 1, rc) == ("fail", {"skipped": 5}, detail)


def test_junit_all_passed_or_not_applicable(tmp_path):
    source = "import pytest\ndef test_a():\n    pass\ndef test_b():\n    pytest.skip('needs >= 2 GPUs, found 1')\n"
    xml, rc = _junit(tmp_path, source)
    assert gr.evaluate_junit(xml, 1, rc) == ("pass", {"passed": 1, "n/a": 1}, "")
    xml, rc = _junit(tmp_path, "import pytest\ndef test_b():\n    pytest.skip('needs >= 8 GPUs, found 1')\n")
    assert gr.evaluate_junit(xml, 1, rc)[0] == "n/a"
    xml, rc = _junit(tmp_path, "X = 1\n")  # collected nothing
    assert gr.evaluate_junit(xml, 1, rc)[:1] == ("fail",)
    assert gr.evaluate_junit(tmp_path / "missing.xml", 1, 4) == ("fail", {}, "pytest wrote no report (exit status 4)")


def _comm_json(path: Path, rows: dict[tuple[str, int], dict]) -> Path:
    results = [{"op": op, "bytes": nbytes, "time_s": 1e-3, "host_us": 10.0, "algbw_GBps": 1.0,
                "busbw_GBps": float("nan"), "vs_local": None, "vs_collective": None, "host_vs_copy": None, **extra}
               for (op, nbytes), extra in rows.items()]
    path.write_text(json.dumps({"results": results}))
    return path


def test_targets_pass_and_fail_against_the_issue_bounds(tmp_path):
    m64 = 64 << 20
    _comm_json(tmp_path / "comm-1pe.json", {
        ("copy", m64): {}, ("fetch", m64): {"vs_local": 0.96, "host_vs_copy": 1.31},
        ("push", m64): {"vs_local": 0.80, "host_vs_copy": 1.0}, ("sync_busy", m64): {"time_s": 45e-6},
        ("fetch", 1 << 20): {"vs_local": 0.10},  # other sizes are not the targets' size
    })
    got = {r.name: r for r in gr.check_targets(tmp_path, {"1pe", "1pe-locked"})}
    assert len(got) == len([t for t in gr.TARGETS if t.source in ("1pe", "1pe-locked")]) == 6
    status = {name.split(" (")[0].removeprefix("target: "): r.status for name, r in got.items()}
    assert status == {"fetch >= 0.95 x copy_": "pass", "push >= 0.87 x add_": "fail",
                      "fetch host us/call <= 1.3 x copy_": "fail", "push host us/call <= 1.3 x copy_": "pass",
                      "sync_busy GPU time <= 60 us": "pass", "locked push >= 150 GB/s": "fail"}
    sync = next(r for n, r in got.items() if "busy" in n)
    assert sync.numbers == {"measured": 45.0, "bound": 60.0}
    locked = next(r for n, r in got.items() if "locked" in n)
    assert locked.detail == "not measured (comm 1pe-locked wrote no results)"
    assert [r.name for r in gr.check_targets(tmp_path, {"1pe-locked"})] == [
        "target: locked push >= 150 GB/s (1 PE, 64 MiB)"]  # targets of runs not attempted are left out
    # symm's run has the same targets (push: 0.9 x add_), read from its own JSON
    _comm_json(tmp_path / "comm-1pe-symm.json", {
        ("fetch", m64): {"vs_local": 0.65, "host_vs_copy": 1.2}, ("push", m64): {"vs_local": 0.89, "host_vs_copy": 1.4},
        ("sync_busy", m64): {"time_s": 146e-6},
    })
    symm = {r.name.split(" (")[0].removeprefix("target: "): r.status
            for r in gr.check_targets(tmp_path, {"1pe-symm"})}
    assert symm == {"symm fetch >= 0.95 x copy_": "fail", "symm push >= 0.9 x add_": "fail",
                    "symm fetch host us/call <= 1.3 x copy_": "pass", "symm push host us/call <= 1.3 x copy_": "fail",
                    "symm sync_busy GPU time <= 60 us": "fail"}


def test_a_real_comm_json_feeds_the_evaluation_targets_and_report(tmp_path, monkeypatch):
    """The JSON bench/comm.py really writes (host transport, 2 ranks, one small size) has what the driver reads."""
    path = tmp_path / "comm-1pe.json"
    proc = subprocess.run([sys.executable, "bench/comm.py", "--backend", "host", "--nproc", "2", "--sizes", "64K",
                           "--ops", "copy,add,fetch,push,sync", "--repeats", "2", "--warmup", "1", "--json", str(path),
                           "--plot", "none"], cwd=ROOT, capture_output=True, text=True, timeout=100,
                          env={**os.environ, "ODC_TIMEOUT": "60"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    monkeypatch.setattr(gr, "TARGET_SIZE", 64 << 10)
    status, numbers, _ = gr.comm_evaluator(path)(0, "")
    assert status == "pass" and set(numbers) == {"fetch/local@64K", "push/local@64K"}
    targets = {r.name.split(" (")[0].removeprefix("target: "): r for r in gr.check_targets(tmp_path, {"1pe"})}
    for name in ("fetch >= 0.95 x copy_", "push >= 0.87 x add_", "fetch host us/call <= 1.3 x copy_",
                 "push host us/call <= 1.3 x copy_"):
        assert targets[name].status in ("pass", "fail") and targets[name].numbers["measured"] > 0, name
    busy = targets["sync_busy GPU time <= 60 us"]  # a GPU-only row
    assert busy.status == "fail" and busy.detail == "not measured (no sync_busy row at 64M in comm-1pe.json)"
    md = gr.render_markdown(gr.merge_report(None, _meta(), [gr.Result("bench", "comm 1pe", "pass", 1.0,
                                                                      outputs=[str(path)])], ["bench"]))
    for op in ("copy", "add", "fetch", "push", "sync"):
        assert f"| 64K | {op} |" in md, op


def test_comm_step_passes_only_with_exit_0_and_its_json(tmp_path):
    path = tmp_path / "comm-1pe.json"
    ev = gr.comm_evaluator(path)
    assert ev(1, "")[0] == "fail" and ev(0, "")[2].startswith("no JSON")
    _comm_json(path, {("fetch", 64 << 20): {"vs_local": 0.97}, ("fetch", 1 << 20): {"vs_local": 0.5}})
    assert ev(0, "") == ("pass", {"fetch/local@64M": 0.97}, "2 rows")


def test_sft_losses_must_match_the_collective_run(tmp_path):
    def write(name, losses):
        p = tmp_path / name
        p.write_text(json.dumps({"records": [{"loss": v} for v in losses], "tokens_per_s": 1234.0}))
        return p

    ref = write("collective.json", [6.25, 6.0, 5.5, 5.0])
    assert gr.sft_evaluator(ref, None)(0, "")[0] == "pass"
    same = gr.sft_evaluator(write("odc.json", [6.25, 6.0 * (1 + 5e-5), 5.5, 5.0]), ref)(0, "")
    assert same[0] == "pass" and same[1]["max_rel_diff_vs_collective"] == pytest.approx(5e-5)
    off = gr.sft_evaluator(write("odc2.json", [6.25, 6.0, 5.6, 5.0]), ref)(0, "")
    assert off[0] == "fail" and "differ" in off[2]
    assert gr.sft_evaluator(write("odc3.json", [6.25, 6.0]), ref)(0, "")[2] == "2 losses, expected 4"
    assert gr.sft_evaluator(ref, None)(3, "") == ("fail", {}, "exit status 3")


def test_imbalance_run_passes_only_with_exact_gradients(tmp_path):
    path = tmp_path / "imbalance.json"
    ev = gr.imbalance_evaluator(path)
    assert ev(1, "") == ("fail", {}, "exit status 1")
    assert ev(0, "") == ("fail", {}, "no runs in imbalance.json")

    def run(comm, policy, ok=True, x=1.0):
        return {"comm": comm, "policy": policy, "grad_check_ok": ok, "tokens_per_s": 10.0, "sim_speedup": 1.5,
                **{f"speedup_vs_collective_{b}": x for b in ("local_sort", "verl_lb_micro", "lb_micro")}}

    path.write_text(json.dumps({"runs": [run("collective", "lb_micro"), run("odc", "lb_mini", x=1.25)]}))
    status, numbers, detail = ev(0, "")
    assert (status, detail) == ("pass", "2 configurations, exact gradients")
    assert numbers == {"odc_lb_mini_x_local_sort": 1.25, "odc_lb_mini_x_verl_lb_micro": 1.25,
                       "odc_lb_mini_x_lb_micro": 1.25, "sim_x_local_sort": 1.5, "tokens_per_s": 10.0}
    path.write_text(json.dumps({"runs": [run("collective", "lb_micro", ok=False), run("odc", "lb_mini")]}))
    assert ev(0, "") == ("fail", {}, "wrong gradients in collective/lb_micro")


# --------------------------------------------------------------------------------------------------- running


def _step(name: str, code: str, timeout: float = 60, **kw) -> object:
    return gr.Step("tests", name, [sys.executable, "-c", code], timeout, **kw)


def test_a_failing_step_is_recorded_and_the_next_runs(tmp_path):
    steps = [_step("fails", "import sys; print('boom'); sys.exit(3)"), _step("passes", "print('fine')"),
             _step("hangs", "import time; time.sleep(60)", timeout=1)]
    results = gr.execute(steps, tmp_path, phase_budget=300, budget=None)
    assert [(r.name, r.status) for r in results] == [("fails", "fail"), ("passes", "pass"), ("hangs", "timeout")]
    assert results[0].detail == "exit status 3" and "boom" in results[0].log_tail
    assert results[1].log_tail == "" and "fine" in Path(results[1].log).read_text()
    assert results[2].detail == "killed after 1 s"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_timed_out_step_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])"
            f"; open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    res = gr.run_step(_step("hangs", code), tmp_path, 3)
    assert res.status == "timeout"
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30  # SIGKILL is delivered asynchronously
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the step's child outlived the timeout"


def test_steps_run_in_the_repository_with_the_extension_required_and_no_index(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    code = (f"import os, odc_runtime; e = os.environ; assert os.getcwd() == {str(ROOT)!r}, os.getcwd(); "
            "assert e['ODC_REQUIRE_EXTENSION'] == '1' and e['PIP_NO_INDEX'] == '1' and e['PYTHONUNBUFFERED'] == '1';"
            " assert e['EXTRA'] == 'x'")
    res = gr.run_step(_step("env", code, env={"EXTRA": "x"}), tmp_path, 60)
    assert res.status == "pass", res.log_tail


def test_steps_that_do_not_apply_are_na_and_skipped_ones_fail(tmp_path):
    steps = [_step("needs 8 GPUs", "import sys; sys.exit(1)", na="needs >= 8 GPUs, 1 visible"),
             _step("no GPU", "import sys; sys.exit(1)", skip="no NVIDIA GPU")]
    results = gr.execute(steps, tmp_path, phase_budget=300, budget=None)
    assert [(r.status, r.ok, r.detail) for r in results] == [
        ("n/a", True, "needs >= 8 GPUs, 1 visible"), ("skip", False, "no NVIDIA GPU")]
    assert not list(tmp_path.glob("*.log"))  # neither ran


def test_a_pytest_step_cut_by_its_timeout_reports_its_progress(tmp_path):
    source = ("import time\ndef test_a():\n    pass\ndef test_b():\n    assert False\n"
              "def test_c():\n    time.sleep(120)\ndef test_d():\n    pass\n")
    (tmp_path / "test_slow.py").write_text(source)
    step = gr.Step("tests", "slow", [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                                     str(tmp_path / "test_slow.py"), "--rootdir", str(tmp_path), "-o", "addopts="],
                   60, progress=gr.pytest_progress)
    res = gr.run_step(step, tmp_path / "logs", 10)  # test_c sleeps past it; pytest reaches it well before
    assert res.status == "timeout"
    running = res.numbers.pop("running")
    assert running.endswith("test_slow.py::test_c") and res.numbers == {"passed": 1, "failed": 1}
    assert res.detail == f"killed after 10 s while running {running}"


def test_a_step_without_time_left_is_not_run(tmp_path):
    results = gr.execute([_step("late", "print(1)")], tmp_path, phase_budget=gr.MIN_STEP_S / 2, budget=None)
    assert results[0].status == "timeout" and "phase's time budget" in results[0].detail
    results = gr.execute([_step("late", "print(1)")], tmp_path, phase_budget=300, budget=gr.MIN_STEP_S / 2)
    assert results[0].status == "timeout" and "run's time budget" in results[0].detail


def test_a_step_that_needs_mps_fails_with_the_reason_when_mps_cannot_start(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _path_without_smi())
    res = gr.run_step(_step("shared", "print(1)", mps=True), tmp_path, 30)
    assert res.status == "fail" and "nvidia-cuda-mps-control not found" in res.detail


def _fake_mps(tmp_path: Path, start_rc: int) -> tuple[str, Path]:
    """A fake ``nvidia-cuda-mps-control`` that appends what it was asked (and its pipe directory) to a record."""
    d = tmp_path / "mpsbin"
    d.mkdir()
    record = tmp_path / "mps.record"
    script = d / "nvidia-cuda-mps-control"
    script.write_text(f'#!/bin/sh\nif [ "$1" = "-d" ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >> {record}; '
                      f'echo "devices ${{CUDA_VISIBLE_DEVICES-unset}}" >> {record}; '
                      f'echo "cannot start: no GPU" >&2; exit {start_rc}; fi\n'
                      f'read cmd; echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> {record}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{d}{os.pathsep}{_path_without_smi()}", record


def test_a_step_that_shares_a_gpu_runs_under_its_own_mps_daemon_which_is_stopped(tmp_path, monkeypatch):
    path, record = _fake_mps(tmp_path, 0)
    monkeypatch.setenv("PATH", path)
    seen = tmp_path / "seen"
    code = f"import os; open({str(seen)!r}, 'w').write(os.environ['CUDA_MPS_PIPE_DIRECTORY'])"
    res = gr.run_step(_step("shared", code, mps=True), tmp_path / "logs", 30)
    assert res.status == "pass", res.log_tail
    pipes = seen.read_text()
    assert record.read_text().splitlines() == [f"start {pipes}", "devices unset", f"quit {pipes}"]  # started, stopped
    assert len(os.path.join(pipes, "control")) < 100 and not os.path.exists(pipes)  # socket-sized, removed


def test_the_mps_daemon_gets_the_steps_gpu_and_its_clients_the_remapped_index(tmp_path, monkeypatch):
    # The parent restricts devices (CUDA_VISIBLE_DEVICES=3) and the step pins the first visible GPU: the daemon must
    # serve that GPU, and its clients must not set CUDA_VISIBLE_DEVICES (the daemon remaps it to device 0).
    path, record = _fake_mps(tmp_path, 0)
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    seen = tmp_path / "seen"
    code = f"import os; open({str(seen)!r}, 'w').write(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))"
    step = _step("shared", code, mps=True)
    step.env["CUDA_VISIBLE_DEVICES"] = "3"
    res = gr.run_step(step, tmp_path / "logs", 30)
    assert res.status == "pass", res.log_tail
    assert "devices 3" in record.read_text().splitlines() and seen.read_text() == "unset"


def test_a_step_fails_with_the_reason_when_mps_cannot_start(tmp_path, monkeypatch):
    path, record = _fake_mps(tmp_path, 1)
    monkeypatch.setenv("PATH", path)
    res = gr.run_step(_step("shared", "print(1)", mps=True), tmp_path / "logs", 30)
    assert res.status == "fail" and res.detail == "could not start CUDA MPS (cannot start: no GPU)"
    assert len(record.read_text().splitlines()) == 2  # started (and its devices), never stopped; the step did not run


def test_stale_outputs_are_removed_before_a_step_runs(tmp_path):
    stale = tmp_path / "comm-1pe.json"
    _comm_json(stale, {("fetch", 64 << 20): {"vs_local": 0.99}})
    res = gr.run_step(_step("comm 1pe", "import sys; sys.exit(0)", evaluate=gr.comm_evaluator(stale),
                            outputs=[stale]), tmp_path, 30)
    assert res.status == "fail" and res.detail.startswith("no JSON") and not stale.exists()


# --------------------------------------------------------------------------------------------------- report


def _results() -> list:
    return [
        gr.Result("build", "build _C for 90-real", "pass", 71.2, {"nvshmem": "3.4.5", "archs": "90-real"}),
        gr.Result("tests", "tests/gpu/test_nvshmem_gpu.py", "pass", 80.0, {"passed": 20}),
        gr.Result("tests", "tests/gpu/test_fsdp_gpu.py", "n/a", 3.0, {"n/a": 2}),
        gr.Result("tests", "tests/gpu/test_dead_peer_gpu.py", "fail", 200.5, {"passed": 11, "failed": 1},
                  "test_x[push-2-mps]: rank 0 raised after 19 s", "python -m pytest ...", "/x/log",
                  "E   AssertionError: rank 0 raised | after 19 s"),
    ]


def _meta() -> dict:
    return {"command": ".ci/gpu tests", "date": "2026-11-23 20:00 UTC", "commit": "abc123", "dirty": False,
            "no_gpu": None,
            "gpus": gr.parse_gpu_query(H100),
            "software": {"torch": "2.11.0+cu130", "torch_cuda": "13.0", "nvshmem_header": "3.4.5",
                         "torch_nvshmem_pin": ["cu13", "3.4.5"], "nvshmem_wheels": [["cu13", "3.4.5"]],
                         "nvcc": "13.0", "triton": "3.6.0", "python": "3.12.3"}}


def test_report_writer_md_and_json(tmp_path):
    report = gr.merge_report(None, _meta(), _results(), ["build", "tests"])
    gr.write_report(tmp_path, report)
    data = json.loads((tmp_path / "report.json").read_text())
    assert list(data["phases"]) == ["build", "tests"]
    assert [r["status"] for r in data["phases"]["tests"]["results"]] == ["pass", "n/a", "fail"]
    assert data["phases"]["tests"]["meta"]["software"]["torch"] == "2.11.0+cu130"
    md = (tmp_path / "report.md").read_text()
    assert "## build: all passed" in md and "## tests: 1 of 3 failed" in md
    assert "| check | result | time | numbers |" in md
    assert "| build _C for 90-real | pass | 71.2 s | nvshmem=3.4.5, archs=90-real |" in md
    assert "| tests/gpu/test_fsdp_gpu.py | n/a | 3.0 s | n/a=2 |" in md
    assert "| GPU | 1 x NVIDIA H100 80GB HBM3 (sm_90, 81559 MiB) |" in md and "| driver | 580.159.04 |" in md
    assert "| command | `.ci/gpu tests` |" in md
    assert "| NVSHMEM | 3.4.5 (torch pins cu13-3.4.5; wheels cu13-3.4.5) |" in md
    # the failure: its row (a "|" in the text escaped), then its section with the log tail
    assert "| tests/gpu/test_dead_peer_gpu.py | fail: test_x[push-2-mps]: rank 0 raised after 19 s | 200.5 s |" in md
    failures = md.split("## Failures", 1)[1]
    assert "### tests: tests/gpu/test_dead_peer_gpu.py" in failures
    assert "```\nE   AssertionError: rank 0 raised | after 19 s\n```" in failures
    assert "test_fsdp_gpu" not in failures


def test_report_keeps_earlier_phases_and_replaces_rerun_ones(tmp_path):
    first = gr.merge_report(None, _meta(), _results(), ["build", "tests"])
    later_meta = {**_meta(), "date": "2026-11-23 21:00 UTC", "commit": "def456"}
    bench = [gr.Result("bench", "comm 1pe", "pass", 30.0), gr.Result("build", "build _C for 90-real", "pass", 2.0)]
    merged = gr.merge_report(json.loads(json.dumps(first)), later_meta, bench, ["build", "bench"])
    md = gr.render_markdown(merged)
    # build (def456), tests (abc123), bench (def456): each phase says its run
    assert md.count("| commit | abc123 |") == 1 and md.count("| commit | def456 |") == 2
    assert md.count("Same run as the phase above.") == 0
    assert gr.render_markdown(first).count("Same run as the phase above.") == 1
    assert list(merged["phases"]) == ["build", "tests", "bench"]
    assert merged["phases"]["tests"] == json.loads(json.dumps(first["phases"]["tests"]))  # kept as it was
    assert merged["phases"]["build"]["meta"]["commit"] == "def456"
    assert [r["seconds"] for r in merged["phases"]["build"]["results"]] == [2.0]


def test_report_shows_the_benchmark_rows(tmp_path):
    path = _comm_json(tmp_path / "comm-1pe.json", {("copy", 64 << 20): {"algbw_GBps": 1500.0},
                                                  ("fetch", 64 << 20): {"vs_local": 0.97, "host_vs_copy": 1.1},
                                                  ("mm", 64 << 20): {}})
    res = gr.Result("bench", "comm 1pe", "pass", 20.0, outputs=[str(path)])
    md = gr.render_markdown(gr.merge_report(None, _meta(), [res], ["bench"]))
    assert "### comm 1pe" in md
    # both time columns are named: the GPU's (CUDA events) and the host's (the Python call)
    assert "| size | op | GPU ms | host µs |" in md and gr.BENCH_COLUMNS in md
    assert "CUDA events" in gr.BENCH_COLUMNS and "perf_counter" in gr.BENCH_COLUMNS
    assert "| 64M | copy | 1 | 10 | 1500 | - | - | - | - |" in md
    assert "| 64M | fetch | 1 | 10 | 1 | - | 0.97 | - | 1.1 |" in md
    assert "| 64M | mm |" not in md


# --------------------------------------------------------------------------------------------------- the script


def test_dry_run_without_a_gpu_lists_every_step_skipped_with_its_reason(tmp_path):
    proc = _script("--dry-run", path=_path_without_smi(), out=tmp_path / "rep")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("  [")]
    phases = {ln.split("]")[0].strip(" [") for ln in lines}
    assert phases == set(gr.PHASES)
    assert all(ln.endswith("skip: no NVIDIA GPU: nvidia-smi not found") for ln in lines), proc.stdout
    for f in (ROOT / "tests" / "gpu").glob("test_*.py"):
        assert f"[tests] tests/gpu/{f.name}: skip" in proc.stdout
    assert "bench/comm.py --backend nvshmem" in proc.stdout and "examples/sft.py --comm odc" in proc.stdout
    assert "bench/imbalance.py --quick --backend nvshmem" in proc.stdout
    assert not (tmp_path / "rep").exists()  # a dry run writes nothing


def test_dry_run_with_a_gpu_would_build_for_its_architecture(tmp_path):
    proc = _script("build", "tests", "--dry-run", path=_fake_smi(tmp_path), out=tmp_path / "rep")
    assert proc.returncode == 0, proc.stderr
    assert "1 GPU(s): NVIDIA H100 80GB HBM3 (ODC_CUDA_ARCHS=90-real)" in proc.stdout
    assert "[build] build _C for 90-real: would run" in proc.stdout
    assert "ODC_CUDA_ARCHS=90-real" in proc.stdout and "[bench]" not in proc.stdout


def test_run_without_a_gpu_writes_the_report_and_exits_1(tmp_path):
    out = tmp_path / "rep"
    proc = _script("e2e", path=_path_without_smi(), out=out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads((out / "report.json").read_text())
    statuses = [r["status"] for p in data["phases"].values() for r in p["results"]]
    assert list(data["phases"]) == ["build", "e2e"] and statuses and set(statuses) == {"skip"}
    assert "no NVIDIA GPU" in (out / "report.md").read_text()


def test_exit_status_0_only_when_every_check_passed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gr, "probe_gpus", lambda: gr.Machine(gpus=gr.parse_gpu_query(H100)))
    monkeypatch.setattr(gr, "probe_software", lambda machine: None)
    outcome = {"code": "print('ok')"}
    monkeypatch.setattr(gr, "plan", lambda phases, machine, out: [
        gr.Step("build", "build", [sys.executable, "-c", "print(1)"], 30),
        gr.Step("tests", "t", [sys.executable, "-c", outcome["code"]], 30)])
    assert gr.main(["tests", "--out", str(tmp_path)]) == 0
    outcome["code"] = "import sys; sys.exit(1)"
    assert gr.main(["tests", "--out", str(tmp_path)]) == 1
    assert "1 of 2 checks passed" in capsys.readouterr().out


def test_script_is_executable_and_ignored_output():
    assert os.access(SCRIPT, os.X_OK)
    assert "gpu-report/" in (ROOT / ".gitignore").read_text().split()


def test_help_documents_the_phases():
    proc = subprocess.run([str(SCRIPT), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0
    for word in (*gr.PHASES, "--dry-run", "ODC_GPU_REPORT_DIR", "ODC_REQUIRE_EXTENSION", "MPS"):
        assert word in proc.stdout, word
    assert textwrap.dedent(gr.__doc__).strip().splitlines()[0] in proc.stdout


# --------------------------------------------------------------------------------------------------- plan (issue 33)


def _plan_module():
    spec = importlib.util.spec_from_file_location("gpu_plan", ROOT / ".ci" / "gpu_plan.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_plan"] = module
    spec.loader.exec_module(module)
    return module


gp = _plan_module()


def test_the_plan_covers_every_gpu_test_and_step_and_every_call_fits_a_lent_gpu(tmp_path):
    units = gp.plan_units(gp.H100, tmp_path)
    # every test case of every tests/gpu file is in exactly one unit (multi-GPU-only tests: not on one H100)
    files = sorted((ROOT / "tests" / "gpu").glob("test_*.py"))
    cases = gp.collect_tests(files)
    assert {c["nodeid"].split("::")[0] for c in cases} == {f.relative_to(ROOT).as_posix() for f in files}
    planned = [a for u in units if u.step.phase == "tests" for a in u.step.argv if "::" in a]
    expected = [c["nodeid"] for c in cases if not c["multigpu"]] + list(gp.GPU_SUITES)
    assert sorted(planned) == sorted(expected), set(planned) ^ set(expected)
    # every build, bench and e2e step that applies to one H100
    steps = [s for s in gr.plan(["build", "bench", "e2e"], gp.H100, tmp_path) if not s.na]
    assert sorted(s.name for s in steps) == sorted(u.step.name for u in units if u.step.phase != "tests")
    # the lease: at most 2 calls, each cut at 9 minutes at most, 660 s of commands in all (720 s with the 60 s start),
    # every call's estimate at least 30 s under its cut; every unit's own timeout fits a call
    assert gp.CALL_LIMIT_S <= 9 * 60 and gp.MAX_CALLS == 2 and gp.COMMANDS_BUDGET_S <= 660
    assert gp.MACHINE_START_S >= 60 and gp.DEVICE_BUDGET_S <= 720 and gp.MARGIN_S >= 30
    plan = gp.budget(units)
    assert plan["problems"] == [], plan["problems"]
    assert len(plan["calls"]) <= 2 and plan["commands_s"] <= 660 and plan["device_s"] <= 720
    for c in plan["calls"]:
        assert c["cut"] <= 540 and c["estimate"] + 30 <= c["cut"], c
    placed = [u.name for c in gp.calls(units) for u in c]
    assert sorted(placed + plan["left_out"]) == sorted(u.name for u in units)
    assert all(gp.CALL_OVERHEAD_S + u.timeout <= gp.CALL_LIMIT_S for u in units)
    # every required unit is planned; only if-time units may wait for another lease
    assert all(u.name not in plan["left_out"] for u in units if u.required)
    assert gp.print_plan(units, {"results": {}}, gp.H100) == 0, "the plan exceeds the lease"
    # the order: the build, what has never run on a GPU, then symm against nvshmem, then the if-time tier
    tiers = [u.tier for u in units]
    assert tiers == sorted(tiers) and tiers[0] == gp.TIER_BUILD
    first = {u.name for u in units if u.tier == gp.TIER_NEVER_RUN}
    for needle in ("test_symm_shared_gpu.py::test_contract_with_ranks_sharing_one_gpu",
                   "test_dead_peer_on_symm_raises_within_timeout", "capture_alone [symm]",
                   "test_gang_on_gpu [3-exact,checkpoint-symm]", "sft --comm odc --odc-backend symm, 4 PEs",
                   "comm 4pe-1gpu-symm"):
        assert any(needle in n for n in first), (needle, first)
    assert {u.name for u in units if u.tier == gp.TIER_SYMM_AGAIN} == {
        "bench: comm 1pe", "bench: comm 1pe-symm",
        "tests: tests/test_transport_contract.py::test_transport_contract[symm]",
        "tests: tests/gpu/test_symm_heap_gpu.py::test_heap_maps_every_rank"}
    # the if-time tier: nvshmem units only, each of which passed in the proof of 2026-11-27 (its raw report)
    seen = gp.measured()
    passed = {f"{p}: {r['name']}" for p, d in json.loads(gp.MEASURED_RUN.read_text())["phases"].items()
              for r in d["results"] if r["status"] == "pass"}
    for u in units:
        if u.tier == gp.TIER_IF_TIME:
            assert "symm" not in u.name, u.name
            then = gp.RENAMED.get(u.name, u.name)
            # the gang's nvshmem cases passed then as 5 torchruns of one scenario each, regrouped since
            assert then in passed or u.name.startswith("tests: tests/gpu/test_gang_gpu.py::test_gang_on_gpu ["), u.name
    # an estimate is a measured duration, or says it is an estimate and the measured unit it was taken from
    for u in units:
        then = gp.RENAMED.get(u.name, u.name)
        if then in seen:
            assert u.basis.startswith("measured ") and u.estimate >= seen[then], (u.name, u.basis)
        else:
            assert u.basis.startswith("estimate, never measured: like "), (u.name, u.basis)
            assert gp.like(u.name)[0] in seen, (u.name, gp.like(u.name))


def test_only_units_that_passed_go_to_the_if_time_tier():
    # nvshmem's multi-GPU test never ran on a GPU: first, wherever several GPUs make it run; likewise a new test
    assert gp.tier_of("tests/gpu/test_nvshmem_gpu.py::test_multi_gpu[fetch]") == gp.TIER_NEVER_RUN
    assert gp.tier_of("tests/gpu/test_nvshmem_gpu.py::test_single_gpu[fetch]") == gp.TIER_IF_TIME
    assert gp.tier_of("tests/gpu/test_gang_gpu.py::test_gang_on_gpu[4-exact-nvshmem]") == gp.TIER_NEVER_RUN
    assert gp.tier_of("tests/gpu/test_dead_peer_gpu.py::test_dead_peer_on_symm_raises_within_timeout[sync-2]") == \
        gp.TIER_NEVER_RUN
    assert gp.tier_of("bench: comm 8gpu-vs-nccl") == gp.TIER_NEVER_RUN
    assert gp.tier_of("bench: comm 1pe-symm") == gp.TIER_SYMM_AGAIN
    assert gp.tier_of("build: build _C for 90-real") == gp.TIER_BUILD


def test_the_budget_check_fails_a_plan_over_the_lease(tmp_path):
    def unit(name, estimate, tier=gp.TIER_NEVER_RUN):
        return gp.Unit(_step(name, "pass", timeout=100), estimate, tier)

    # required work of 3 x 200 s: call 1 holds two (420 s, margin 120 s), call 2's cut is what is left of 660 s
    # (240 s) and 220 s leaves 20 s: under the 30 s margin
    over = gp.budget([unit(f"r{i}", 200.0) for i in range(3)])
    assert any("margin" in p for p in over["problems"]), over
    # a third call is refused
    third = gp.budget([unit(f"r{i}", 240.0) for i in range(5)])
    assert any("calls, at most 2" in p for p in third["problems"]), third
    # if-time units never break the budget: what does not fit waits for another lease
    fits = gp.budget([unit("r", 300.0), *[unit(f"o{i}", 100.0, gp.TIER_IF_TIME) for i in range(5)]])
    assert fits["problems"] == [] and fits["left_out"], fits
    assert fits["commands_s"] + 30 * len(fits["calls"]) <= gp.COMMANDS_BUDGET_S
    # the printed plan says so and exits 1
    assert gp.print_plan([unit(f"r{i}", 200.0) for i in range(3)], {"results": {}}, gp.H100) == 1


def test_a_unit_larger_than_a_call_is_refused_and_a_long_function_is_cut_into_chunks(tmp_path):
    cases = [{"nodeid": f"tests/gpu/test_x.py::test_f[{i}]", "function": "test_f", "budget": [0, 100, 0.5],
              "multigpu": False} for i in range(12)]
    units = gp.test_units(cases, 1, tmp_path)
    assert [len([a for a in u.step.argv if "::" in a]) for u in units] == [5, 5, 2]  # 5 * 100 s fit 520 s
    assert all(u.timeout <= gp.CALL_LIMIT_S - gp.CALL_OVERHEAD_S for u in units)
    big = gp.Unit(_step("huge", "pass", timeout=gp.CALL_LIMIT_S), 1.0)
    with pytest.raises(ValueError, match="more than one call holds"):
        gp.calls([big])


def test_resume_runs_one_call_at_a_time_and_continues_from_the_recorded_state(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gp, "_extension_built", lambda: True)
    ran = tmp_path / "ran"

    def unit(i: int) -> object:
        return gp.Unit(_step(f"u{i}", f"open({str(ran)!r}, 'a').write('{i}')", timeout=200), 200.0)

    units = [unit(i) for i in range(5)]  # 200 s estimated each: two per call
    out = tmp_path / "report"
    assert gp.resume(units, out, gp.H100, ["--resume"]) == 1  # units left
    assert ran.read_text() == "01"
    state = json.loads((out / gp.STATE).read_text())
    assert sorted(state["results"]) == ["tests: u0", "tests: u1"]
    assert len(state["calls_s"]) == 1 and gp.CALL_OVERHEAD_S <= state["calls_s"][0] < gp.CALL_OVERHEAD_S + 30
    # the call was cut short while u1 ran (its result never recorded): the next call starts with u1 again
    del state["results"]["tests: u1"]
    (out / gp.STATE).write_text(json.dumps(state))
    assert gp.resume(units, out, gp.H100, ["--resume"]) == 1
    assert ran.read_text() == "0112"
    assert gp.resume(units, out, gp.H100, ["--resume"]) == 0  # the last call: everything passed
    assert ran.read_text() == "011234"
    report = json.loads((out / "report.json").read_text())
    assert sorted(r["name"] for r in report["phases"]["tests"]["results"]) == [f"u{i}" for i in range(5)]
    assert "the proof is complete" in capsys.readouterr().out


def test_a_lease_whose_commands_are_spent_runs_nothing_more(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gp, "_extension_built", lambda: True)
    ran = tmp_path / "ran"
    units = [gp.Unit(_step("u", f"open({str(ran)!r}, 'a').write('x')", timeout=10), 1.0)]
    out = tmp_path / "report"
    gp.save_state(out, {"schema": 1, "results": {}, "calls_s": [540.0, 110.0]})  # 650 of 660 s used
    assert gp.resume(units, out, gp.H100, ["--resume"]) == 1
    assert not ran.exists() and "nothing more runs in it" in capsys.readouterr().out


def test_plan_prints_the_calls_without_a_gpu(tmp_path):
    r = _script("--plan", path=_path_without_smi(), out=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "call 1:" in r.stdout and "estimated commands:" in r.stdout and "test_dead_peer_gpu.py" in r.stdout
    assert "DOES NOT FIT" not in r.stdout and "estimate, never measured: like" in r.stdout


def test_a_call_ends_at_its_limit_and_the_unit_it_cut_runs_again_in_the_next(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gp, "_extension_built", lambda: True)
    monkeypatch.setattr(gp, "CALL_LIMIT_S", gp.CALL_OVERHEAD_S + 4.0)  # 4 s of room in a call
    units = [gp.Unit(_step("slow", "import time; time.sleep(60)", timeout=4), 1.0),  # its own timeout: the room
             gp.Unit(_step("next", "pass", timeout=4), 1.0)]
    out = tmp_path / "report"
    t0 = time.monotonic()
    assert gp.resume(units, out, gp.H100, ["--resume"]) == 1
    assert time.monotonic() - t0 < 20  # cut at the call's end (4 s, plus the kill)
    assert gp.load_state(out)["results"] == {}  # not recorded as its own timeout
    assert "the next call runs it again" in capsys.readouterr().out
