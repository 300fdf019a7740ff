"""Settings: every ``ODC_*`` variable parsed and validated in ``odc_runtime/config.py``, with typed errors, and
listed in the configuration table (docs/configuration.md)."""

from __future__ import annotations

import pathlib
import re

import pytest
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import config

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "var, read",
    [
        ("ODC_TIMEOUT", lambda: config.resolve_timeout(None)),
        ("ODC_HEAP_SIZE", lambda: config.host_heap_bytes(None)),
        ("ODC_HOST_CHUNK_BYTES", config.host_chunk_bytes),
        ("ODC_SHM_DIR", config.shm_dir),
        ("ODC_TRACE_DIR", config.trace_dir),
        ("ODC_BACKEND", lambda: config.backend_name(None)),
        ("ODC_REQUIRE_EXTENSION", config.require_extension),
        ("ODC_REQUIRE_VERL", config.require_verl),
        ("ODC_NVSHMEM_PUSH", config.nvshmem_settings),
        ("ODC_NVSHMEM_SCRATCH_SLOTS", config.nvshmem_settings),
        ("ODC_NVSHMEM_CELL_BYTES", config.nvshmem_settings),
    ],
)
def test_set_but_empty_is_an_error(monkeypatch, var, read) -> None:
    monkeypatch.setenv(var, "")
    with pytest.raises(odc.OdcUsageError, match=f"{var} is set but empty"):
        read()
    monkeypatch.setenv(var, "   ")
    with pytest.raises(odc.OdcUsageError, match=f"{var} is set but empty"):
        read()


def test_values_are_validated(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ODC_HOST_CHUNK_BYTES", "lots")
    with pytest.raises(odc.OdcUsageError, match="ODC_HOST_CHUNK_BYTES"):
        config.host_chunk_bytes()
    monkeypatch.setenv("ODC_HOST_CHUNK_BYTES", "64K")
    assert config.host_chunk_bytes() == 64 << 10

    a_file = tmp_path / "f"
    a_file.write_text("x")
    monkeypatch.setenv("ODC_SHM_DIR", str(a_file))
    with pytest.raises(odc.OdcUsageError, match="not a directory"):
        config.shm_dir()
    monkeypatch.setenv("ODC_SHM_DIR", str(tmp_path))
    assert config.shm_dir() == str(tmp_path)
    monkeypatch.delenv("ODC_SHM_DIR")
    assert config.shm_dir() == "/dev/shm"

    with pytest.raises(odc.OdcUsageError, match="timeout"):
        config.resolve_timeout(True)  # type: ignore[arg-type]
    with pytest.raises(odc.OdcUsageError, match="backend must be"):
        config.backend_name(3)  # type: ignore[arg-type]


def _rank_backend_from_env(rank: int, world: int) -> None:
    import os

    os.environ["ODC_BACKEND"] = "tcp"
    with pytest.raises(odc.OdcUsageError, match=r"unknown ODC backend 'tcp'; choose one of") as e:
        odc.init(heap_size="1M")
    assert "came from ODC_BACKEND=tcp" in str(e.value)
    assert not odc.is_initialized()
    # A transport that cannot run here (symm on CPU ranks) advises backend=...: the error names the variable too.
    os.environ["ODC_BACKEND"] = "symm"
    with pytest.raises(odc.OdcBackendError, match=r"use backend='host'.*came from ODC_BACKEND=symm: change or unset"):
        odc.init(heap_size="1M")
    assert not odc.is_initialized()
    # Passed as an argument, it did not come from the variable: no such note.
    with pytest.raises(odc.OdcBackendError) as e:
        odc.init(backend="symm", heap_size="1M")
    assert "ODC_BACKEND" not in str(e.value)
    assert not odc.is_initialized()
    os.environ["ODC_BACKEND"] = "host"
    odc.init(heap_size="1M")
    try:
        assert odc.backend() == "host"
    finally:
        odc.finalize()


def test_backend_is_read_from_odc_backend_by_init() -> None:
    run_ranks(_rank_backend_from_env, 1, timeout=60)


def test_generic_parsers(monkeypatch) -> None:
    monkeypatch.setenv("ODC_X_FLAG", "TRUE")
    assert config.env_flag("ODC_X_FLAG", False) is True
    monkeypatch.setenv("ODC_X_FLAG", "maybe")
    with pytest.raises(odc.OdcUsageError, match="ODC_X_FLAG must be 0 or 1"):
        config.env_flag("ODC_X_FLAG", False)
    assert config.env_int("ODC_X_UNSET", 7) == 7
    monkeypatch.setenv("ODC_X_INT", "64K")
    assert config.env_int("ODC_X_INT", 1) == 64 << 10
    monkeypatch.setenv("ODC_X_INT", "0")
    with pytest.raises(odc.OdcUsageError, match="at least 1"):
        config.env_int("ODC_X_INT", 1)
    monkeypatch.setenv("ODC_X_CHOICE", "Locked")
    assert config.env_choice("ODC_X_CHOICE", ("auto", "locked"), "auto") == "locked"
    monkeypatch.setenv("ODC_X_CHOICE", "fast")
    with pytest.raises(odc.OdcUsageError, match="one of auto, locked"):
        config.env_choice("ODC_X_CHOICE", ("auto", "locked"), "auto")


def test_every_setting_is_in_the_configuration_table() -> None:
    used: set[str] = set()
    for path in [*(ROOT / "odc_runtime").rglob("*.py"), ROOT / "setup.py", *(ROOT / "tests").rglob("*.py")]:
        # Environment variables are named in string literals (module constants such as ODC_COUNTS are not).
        used |= set(re.findall(r"[\"'](ODC_[A-Z][A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    used -= {v for v in used if v.startswith("ODC_X_")}  # this file's made-up names
    # The CI scripts' own settings (`${ODC_X:-default}`).
    for path in (p for p in (ROOT / ".ci").iterdir() if p.is_file()):
        used |= set(re.findall(r"\$\{?(ODC_[A-Z][A-Z0-9_]*[A-Z0-9])", path.read_text()))
    page = (ROOT / "docs" / "configuration.md").read_text()
    table = page[page.index("| env var |") :]
    table = table[: table.index("\n\n")]
    missing = sorted(v for v in used if f"`{v}`" not in table)
    assert missing == [], f"settings missing from the configuration table of docs/configuration.md: {missing}"


def test_settings_are_parsed_strictly(monkeypatch) -> None:
    """Issue 24: integers are integers, sizes have a minimum and a maximum, every refusal names the variable."""
    for bad in ("1.5", "1b", "2K", "0x2", "two"):
        monkeypatch.setenv("ODC_NODE_SIZE", bad)
        with pytest.raises(odc.OdcUsageError, match=r"ODC_NODE_SIZE must be a whole number .* decimal digits"):
            config.node_size(None, 4)
        monkeypatch.setenv("ODC_NODE_SLOTS", bad)
        with pytest.raises(odc.OdcUsageError, match="ODC_NODE_SLOTS must be a whole number"):
            config.node_slots(None)
    monkeypatch.setenv("ODC_NODE_SIZE", "2")
    assert config.node_size(None, 4) == 2

    monkeypatch.setenv("ODC_HEAP_SIZE", "100")  # would round down to a heap of 0 bytes
    with pytest.raises(odc.OdcUsageError, match=r"ODC_HEAP_SIZE must be at least 4096 bytes, got '100'"):
        config.host_heap_bytes(None)
    monkeypatch.setenv("ODC_HEAP_SIZE", "1" * 23)
    with pytest.raises(odc.OdcUsageError, match=r"ODC_HEAP_SIZE must be at most \d+ bytes"):
        config.host_heap_bytes(None)
    monkeypatch.setenv("ODC_HEAP_SIZE", "1.3")
    with pytest.raises(odc.OdcUsageError, match=r"ODC_HEAP_SIZE: '1\.3' is not a whole number of bytes"):
        config.host_heap_bytes(None)
    monkeypatch.setenv("ODC_HEAP_SIZE", "4.5K")
    assert config.host_heap_bytes(None) == 4608
    with pytest.raises(odc.OdcUsageError, match=r"init\(heap_size=...\) must be at least 4096"):
        config.host_heap_bytes(100)
    monkeypatch.setenv("ODC_HOST_CHUNK_BYTES", "4")
    with pytest.raises(odc.OdcUsageError, match="ODC_HOST_CHUNK_BYTES must be at least 8"):
        config.host_chunk_bytes()
    monkeypatch.setenv("ODC_NVSHMEM_SCRATCH_SLOTS", "1.5")
    with pytest.raises(odc.OdcUsageError, match="ODC_NVSHMEM_SCRATCH_SLOTS must be a whole number"):
        config.nvshmem_settings()


def test_only_config_reads_odc_variables_from_the_environment() -> None:
    """Issue 53: one place parses the environment. A module that reads an ``ODC_*`` variable (or scans the
    environment for them) itself escapes config.py's checks: an empty value taken as unset, a typo unflagged."""
    readers = re.compile(r"os\.environ|os\.getenv|environ\.get")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in (ROOT / "odc_runtime").rglob("*.py") if path.name != "config.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if readers.search(line) and "ODC_" in line
    ]
    assert found == [], "read ODC_* variables through odc_runtime.config:\n" + "\n".join(found)


def _rank_misspelt_setting(rank: int, world: int) -> list[str]:
    """init() with ODC_X_TIMEOUT (a misspelt ODC_TIMEOUT; ODC_X_: made-up names) and ODC_X_UNRELATED set: returns
    the warnings it logged."""
    import logging

    import torch

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.WARNING:
                seen.append(record.getMessage())

    logging.getLogger("odc_runtime").addHandler(Collect())
    odc.init("host")
    st = odc.shard(torch.zeros(4))
    odc.push(st, torch.ones(4))
    odc.sync()
    start, stop = st.shard_range
    assert torch.equal(st.grad, torch.full((stop - start,), float(world)))  # the job runs: a warning only
    return seen


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
def test_init_warns_of_each_unknown_setting_with_its_nearest_name(backend: str) -> None:
    from test_debug import _on

    env = {"ODC_X_TIMEOUT": "5", "ODC_X_UNRELATED": "1", "ODC_GPU_TEST_BACKEND": "symm"}  # the last: known (tooling)
    for warnings in _on(backend, _rank_misspelt_setting, 2, env=env):
        unknown = [w for w in warnings if "odc_runtime does not read it" in w]
        assert len(unknown) == 2, warnings
        assert "ODC_X_TIMEOUT is set but odc_runtime does not read it: did you mean ODC_TIMEOUT?" in unknown[0], unknown
        assert "ODC_X_UNRELATED is set but odc_runtime does not read it (" in unknown[1], unknown
