"""``python -m odc_runtime.doctor``: every transport with whether it runs here and why not, what ``odc.init()``
would take, and every ``ODC_*`` variable set, checked by the reader ``init`` uses (a typo flagged, not ignored)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

import odc_runtime as odc
from odc_runtime import config, doctor
from odc_runtime import transport as registry
from odc_runtime.transport import symm

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def clean_env(monkeypatch):
    for name in [k for k in os.environ if k.startswith("ODC_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def _symm_reason() -> str:
    """Why symm cannot run on this CPU machine: first what every install lacks (the README's install without the
    triton extra has no Triton), then the device."""
    return "triton is not installed" if importlib.util.find_spec("triton") is None else "no CUDA device is available"


def test_the_command_reports_every_transport_and_the_choice_of_init(clean_env) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ODC_")}
    proc = subprocess.run([sys.executable, "-m", "odc_runtime.doctor", "--json", "-"], capture_output=True, text=True,
                          env=env, timeout=100)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rows = {t["name"]: t for t in report["transports"]}
    assert list(rows) == list(registry.names())
    assert rows["host"]["available"] and rows["host"]["reason"] is None
    import torch

    if not torch.cuda.is_available():
        assert not rows["nvshmem"]["available"] and "no CUDA device" in rows["nvshmem"]["reason"], rows["nvshmem"]
        assert not rows["symm"]["available"] and _symm_reason() in rows["symm"]["reason"], rows["symm"]
        assert report["init"]["backend"] == "host"
    assert rows["symm-cpu"]["available"] is (importlib.util.find_spec("triton") is not None)
    assert not rows["symm-cpu"]["automatic"] and rows["nvshmem"]["multi_node"]
    assert report["torch"] == torch.__version__ and report["settings"] == []
    assert report["odc_runtime"] == odc.__version__
    assert report["odc_runtime_dir"] == os.path.dirname(os.path.abspath(odc.__file__))  # this process's package
    text = subprocess.run([sys.executable, "-m", "odc_runtime.doctor"], capture_output=True, text=True, env=env,
                          timeout=100).stdout
    assert "transport  device  automatic  available  why not" in text and "odc.init() here: " in text


def test_bad_and_unknown_settings_are_flagged_with_inits_error(clean_env, tmp_path) -> None:
    clean_env.setenv("ODC_HEAP_SIZE", "lots")
    with pytest.raises(odc.OdcUsageError) as inits:  # what init would raise for it
        config.host_heap_bytes(None)
    clean_env.setenv("ODC_X_TIMEOUT", "30")  # a misspelt ODC_TIMEOUT (ODC_X_: tests' made-up names)
    clean_env.setenv("ODC_TIMEOUT", "30")
    clean_env.setenv("ODC_NODE_SIZE", "two")  # parsed here; init also checks it against the world size
    clean_env.setenv("ODC_BUILD_JOBS", "4")  # read by setup.py
    clean_env.setenv("ODC_GPU_TEST_BACKEND", "symm")  # the project's tests read it: known, not flagged
    report = doctor.collect()
    rows = {s["name"]: s for s in report["settings"]}
    assert list(rows) == ["ODC_BUILD_JOBS", "ODC_GPU_TEST_BACKEND", "ODC_HEAP_SIZE", "ODC_NODE_SIZE", "ODC_TIMEOUT",
                          "ODC_X_TIMEOUT"]
    assert rows["ODC_GPU_TEST_BACKEND"]["ok"] and "tests and CI" in rows["ODC_GPU_TEST_BACKEND"]["note"]
    assert not rows["ODC_HEAP_SIZE"]["ok"] and rows["ODC_HEAP_SIZE"]["note"] == str(inits.value)
    assert not rows["ODC_X_TIMEOUT"]["ok"] and "did you mean ODC_TIMEOUT?" in rows["ODC_X_TIMEOUT"]["note"]
    assert not rows["ODC_NODE_SIZE"]["ok"] and "ODC_NODE_SIZE must be a whole number" in rows["ODC_NODE_SIZE"]["note"]
    assert rows["ODC_TIMEOUT"]["ok"] and rows["ODC_BUILD_JOBS"]["ok"]
    assert "not checked" in rows["ODC_BUILD_JOBS"]["note"]
    assert not doctor.healthy(report)
    assert doctor.main(["--json", str(tmp_path / "r.json")]) == 1
    assert json.loads((tmp_path / "r.json").read_text())["settings"] == report["settings"]
    for name in ("ODC_HEAP_SIZE", "ODC_X_TIMEOUT", "ODC_NODE_SIZE"):
        clean_env.delenv(name)
    assert doctor.healthy(doctor.collect())


def test_a_requested_backend_that_cannot_run_is_named_with_why(clean_env) -> None:
    clean_env.setenv("ODC_BACKEND", "no-such")
    assert "unknown ODC backend 'no-such'" in doctor.collect()["init"]["error"]
    clean_env.setenv("ODC_BACKEND", "host")
    assert doctor.collect()["init"] == {"backend": "host", "how": "ODC_BACKEND=host"}
    import torch

    if not torch.cuda.is_available():
        clean_env.setenv("ODC_BACKEND", "symm")
        report = doctor.collect()
        assert report["init"]["error"].startswith(f"ODC_BACKEND=symm, which cannot run here: {_symm_reason()}")
        assert not doctor.healthy(report)


def test_a_backend_init_refuses_is_an_error_in_the_settings_too(clean_env) -> None:
    """The settings table agrees with the init line: ODC_BACKEND=foo was 'ok' there while init said it fails."""
    clean_env.setenv("ODC_BACKEND", "foo")
    report = doctor.collect()
    [row] = report["settings"]
    assert not row["ok"] and row["note"] == report["init"]["error"] and "unknown ODC backend 'foo'" in row["note"]
    assert "ERROR: " + row["note"] in doctor.render(report)
    clean_env.setenv("ODC_BACKEND", "host")
    assert doctor.collect()["settings"][0]["ok"]


def test_an_unwritable_json_path_is_one_line(clean_env, capsys) -> None:
    assert doctor.main(["--json", "/proc/no/such/dir/report.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m odc_runtime.doctor: cannot write the JSON report to /proc/")


def test_every_setting_read_by_the_package_is_in_the_registry() -> None:
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    used: set[str] = set()
    for path in [*(root / "odc_runtime").rglob("*.py"), root / "setup.py"]:
        used |= set(re.findall(r"[\"'](ODC_[A-Z][A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    assert sorted(used - set(config.SETTINGS) - set(config.TOOLING)) == []  # (config.py names TOOLING's too)
    page = (root / "docs" / "configuration.md").read_text()
    table = page[page.index("| env var |") :]
    first_cells = [row.split("|")[1] for row in table[: table.index("\n\n")].splitlines()[2:]]
    documented = {name for cell in first_cells for name in re.findall(r"`(ODC_[A-Z0-9_]+)`", cell)}
    assert documented == set(config.SETTINGS) | set(config.TOOLING)
    for name, read in config.SETTINGS.items():  # every reader parses the default without error
        assert read is None or read() is not None or name in ("ODC_BACKEND", "ODC_TRACE_DIR", "ODC_NODE_SIZE",
                                                               "ODC_NODE_SLOTS"), name


def test_why_a_transport_is_unavailable(monkeypatch) -> None:
    broken = registry.TransportSpec("broken", "odc_runtime.no_such_module", device_type="cpu", priority=-99)
    assert "does not load: ModuleNotFoundError" in broken.unavailable_reason() and not broken.is_available()
    silent = types.ModuleType("silent_transport")
    silent.is_available = lambda: False  # a module without unavailable_reason
    monkeypatch.setitem(sys.modules, "silent_transport", silent)
    spec = registry.TransportSpec("silent", "silent_transport", device_type="cpu", priority=-99)
    assert spec.unavailable_reason() == "silent_transport.is_available() is false" and not spec.is_available()
    silent.is_available = lambda: True
    assert spec.unavailable_reason() is None and spec.is_available()
    for name in registry.names():
        s = registry.get(name)
        assert s.is_available() is (s.unavailable_reason() is None), name
    # Without triton neither symm transport runs, and both say so
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "triton" else real(n, *a))
    from odc_runtime.transport.symm import cpu, cuda

    assert "triton is not installed" in symm.common_reason()
    assert cpu.unavailable_reason() == cuda.unavailable_reason() == symm.common_reason()
    assert not cpu.is_available() and not registry.get("symm-cpu").is_available()


def test_the_shared_memory_directory_and_its_free_space(clean_env, tmp_path) -> None:
    clean_env.setenv("ODC_SHM_DIR", str(tmp_path))
    shm = doctor.collect()["shared_memory"]
    stats = os.statvfs(tmp_path)
    assert shm["dir"] == str(tmp_path) and shm["error"] is None
    assert abs(shm["free_bytes"] - stats.f_bavail * stats.f_frsize) < 64 << 20  # the same filesystem, moments apart
    clean_env.setenv("ODC_SHM_DIR", str(tmp_path / "missing"))
    report = doctor.collect()
    assert report["shared_memory"]["free_bytes"] is None and "missing" in report["shared_memory"]["error"]
    assert "unusable" in doctor.render(report)
