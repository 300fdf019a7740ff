"""Every command-line entry point (``bench/*.py``, ``examples/*.py``, ``python -m odc_runtime.*``, ``odc-bench``):
``--help`` works without any optional extra, shows defaults, and has no reST markup; a missing optional dependency
is one line naming what to install. The extras are hidden from the child process by an import blocker, so the test
holds whatever this venv has installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from odc_runtime import cli

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("verl", "transformers", "matplotlib", "tqdm", "hydra", "triton")  # every optional dependency

# Runs its argv[1] (a path or -m module) as __main__ with the extras' top-level packages unimportable.
_BLOCKED = """
import importlib.abc, runpy, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
        return None
sys.meta_path.insert(0, Blocker())
target, sys.argv = sys.argv[1], sys.argv[1:]
if target == "-m":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.path.insert(0, str(__import__("pathlib").Path(target).resolve().parent))
    runpy.run_path(target, run_name="__main__")
"""


def _entry_points() -> list[list[str]]:
    scripts = [p for folder in ("bench", "examples") for p in sorted((ROOT / folder).glob("*.py"))
               if not p.name.startswith("_") and 'if __name__ == "__main__"' in p.read_text()]
    modules = [["-m", m] for m in ("odc_runtime.doctor", "odc_runtime.report", "odc_runtime.kernels.ptx",
                                   "odc_runtime.bench")]
    return [[str(p.relative_to(ROOT))] for p in scripts] + modules


def _run(argv: list[str], *extra: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCKED.format(blocked=set(EXTRAS)), *argv, *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_every_entry_point_is_walked() -> None:
    names = {" ".join(a) for a in _entry_points()}
    assert {"bench/imbalance.py", "bench/comm.py", "examples/sft.py", "examples/verl_odc.py", "-m odc_runtime.doctor",
            "-m odc_runtime.bench"} <= names, names


# Entry points whose options all default to nothing (flags, optional paths): no default to show.
_NO_DEFAULTS = {"-m odc_runtime.doctor", "-m odc_runtime.kernels.ptx", "-m odc_runtime.bench", "examples/verl_odc.py"}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("argv", _entry_points(), ids=" ".join)
def test_help_without_extras_is_plain_text_with_defaults(argv: list[str]) -> None:
    proc = _run(argv, "--help")
    out = proc.stdout
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert out.strip(), proc.stderr[-2000:]
    for markup in ("``", ":mod:`", ":func:`", ":class:`", ":data:`", ":meth:`"):
        assert markup not in out, f"reST {markup!r} in the help of {' '.join(argv)}"
    if " ".join(argv) not in _NO_DEFAULTS:
        assert "default:" in out, f"{' '.join(argv)} --help shows no default"


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("argv", "needs", "install"), [
    (["examples/grpo.py", "--steps", "1"], "transformers", "pip install 'odc_runtime[hf]'"),
    (["examples/verl_odc.py"], "verl", "pip install verl==0.9.1"),
], ids=["grpo", "verl_odc"])
def test_a_missing_optional_dependency_is_one_line(argv: list[str], needs: str, install: str) -> None:
    proc = _run(argv)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"{argv[0]} needs {needs}") and lines[0].endswith(install), lines


def test_plain_shows_rest_as_text() -> None:
    assert cli.plain("planned with :data:`odc_runtime.balance.POLICY_REGISTRY` and :func:`~x.fetch`; "
                     "``--quick`` runs::\n") == "planned with odc_runtime.balance.POLICY_REGISTRY and x.fetch; " \
                                                "--quick runs:\n"
