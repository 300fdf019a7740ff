"""Every error class the package raises is public: defined in ``odc_runtime.errors``, exported as ``odc.<name>``
(and in ``odc_runtime.__all__``), and a row of the error table in docs/troubleshooting.md.

The classes are found by reading the source (every ``.py`` of ``odc_runtime/`` and ``kernels/``): every exception
class defined there, every ``raise X`` / ``raise X(...)`` and every construction ``X(...)`` of an exception class
(errors built in one place and raised in another: a wait's ``on_timeout``, a recorded failure). Built-in exceptions
are allowed only where :data:`BUILTIN_RAISES` says why a user never sees them from the documented API.
"""

from __future__ import annotations

import ast
import builtins
import pathlib
import re

import pytest

import odc_runtime
import odc_runtime.errors as errors

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "odc_runtime").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])

# (file relative to the root, built-in exception) -> why it is not an error a user of the documented API sees.
BUILTIN_RAISES: dict[tuple[str, str], str] = {
    ("odc_runtime/__init__.py", "AttributeError"): "the module __getattr__ protocol (hasattr, from-imports) needs it",
    ("odc_runtime/checks.py", "ValueError"): "caught at once and raised as OdcUsageError (check_scale)",
    ("odc_runtime/layout.py", "IndexError"): "owner_of's index contract, a sequence lookup; no API call passes a user "
    "index",
    ("odc_runtime/fsdp/_compat.py", "KeyError"): "an unknown feature name: a bug in odc_runtime.fsdp, not a user input",
    ("odc_runtime/transport/base.py", "ValueError"): "an unknown plan kind: a bug in a transport, not a user input",
    ("kernels/__init__.py", "ImportError"): "odc_runtime.kernels used without triton; the runtime checks first",
    ("kernels/__init__.py", "TypeError"): "odc_runtime.kernels is a kernel library with Python's argument "
    "conventions; the runtime validates every tensor before it calls them",
    ("kernels/__init__.py", "ValueError"): "as TypeError above",
    ("kernels/peer.py", "TypeError"): "a dtype the kernels do not move; the transports refuse it first (OdcUsageError)",
    ("kernels/ptx.py", "TypeError"): "the PTX check tool of the CI (a developer's tool, not the runtime)",
    ("kernels/ptx.py", "ValueError"): "as TypeError above",
    ("kernels/launch.py", "TypeError"): "CachedKernel.bind's argument contract, called by the transport's plans only",
    ("kernels/launch_check.py", "RuntimeError"): "the CI's launch check (a developer's tool, not the runtime)",
    ("odc_runtime/telemetry.py", "TypeError"): "make_record's keyword contract, as Python's own for an unknown "
    "keyword; "
    "its callers are the runtime and the main job",
}
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _name(node: ast.expr) -> str | None:
    """``X`` of ``X`` or ``a.b.X``; None for anything else (a variable's type, a call result)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _package_exceptions(trees: dict[str, ast.Module]) -> dict[str, str]:
    """Every exception class defined in the sources: name -> file (bases followed to a fixed point)."""
    known = set(BUILTIN_EXCEPTIONS)
    found: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for path, tree in trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in found and any(
                    _name(b) in known for b in node.bases
                ):
                    found[node.name] = path
                    known.add(node.name)
                    changed = True
    return found


def _used_exceptions(trees: dict[str, ast.Module], classes: set[str]) -> set[tuple[str, str]]:
    """``(file, class)`` for every raise or construction of an exception class."""
    used = set()
    for path, tree in trees.items():
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Raise) and node.exc is not None:
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            elif isinstance(node, ast.Call):
                target = node.func
            name = None if target is None else _name(target)
            if name in classes:
                used.add((path, name))
    return used


def _documented() -> set[str]:
    """The rows of the error table, and the base class its introduction names."""
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)`", page, flags=re.M))
    return rows | ({"OdcError"} if "Every error is an `odc.OdcError`" in page else set())


def test_every_raised_error_class_is_public_and_documented() -> None:
    trees = {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p)) for p in SOURCES}
    defined = _package_exceptions(trees)
    used = _used_exceptions(trees, set(defined) | BUILTIN_EXCEPTIONS)
    # the walk sees what it must: the errors every transport raises (a broken walk would pass vacuously)
    assert {"OdcUsageError", "OdcRoundMismatchError", "OdcCrossedCollectivesError", "OdcPeerLostError"} <= {
        name for _, name in used
    }
    documented = _documented()
    problems = []
    for path, name in sorted(used | {(p, n) for n, p in defined.items()}):
        if name in BUILTIN_EXCEPTIONS and name not in defined:
            if (path, name) not in BUILTIN_RAISES:
                problems.append(f"{path}: raises the built-in {name}; raise an odc_runtime.errors class")
            continue
        if defined.get(name) != "odc_runtime/errors.py":
            problems.append(f"{path}: {name} is defined in {defined.get(name)}, not in odc_runtime/errors.py")
            continue
        cls = getattr(errors, name)
        if getattr(odc_runtime, name, None) is not cls or name not in odc_runtime.__all__:
            problems.append(f"{name} is not exported as odc_runtime.{name} (and in odc_runtime.__all__)")
        if name not in documented:
            problems.append(f"{name} has no row in docs/troubleshooting.md's error table")
    assert not problems, "\n".join(problems)
    unused = {k for k in BUILTIN_RAISES if k not in used}
    assert not unused, f"BUILTIN_RAISES lists raises the source no longer has: {sorted(unused)}"


def test_every_error_class_is_a_public_odc_error() -> None:
    """The reverse direction: each class of ``odc_runtime.errors`` is an OdcError, exported and documented."""
    documented = _documented()
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(classes) >= 11
    for cls in classes:
        assert issubclass(cls, errors.OdcError), cls
        assert getattr(odc_runtime, cls.__name__) is cls and cls.__name__ in odc_runtime.__all__, cls
        assert cls.__name__ in documented, cls
        assert cls.__doc__, cls


@pytest.mark.parametrize("source, name", [("class _Mine(OdcMismatchError):\n    pass\n", "_Mine"),
                                          ("def f():\n    raise RuntimeError('x')\n", "RuntimeError")])
def test_the_walk_catches_a_private_class_and_a_builtin(source: str, name: str) -> None:
    """The checks above would flag a new private subclass or an unlisted built-in (they cannot pass vacuously)."""
    trees = {"odc_runtime/new.py": ast.parse(source)}
    defined = _package_exceptions({**trees, "odc_runtime/errors.py": ast.parse(
        (ROOT / "odc_runtime" / "errors.py").read_text())})
    used = _used_exceptions(trees, set(defined) | BUILTIN_EXCEPTIONS)
    if name.startswith("_"):
        assert defined[name] == "odc_runtime/new.py"
    else:
        assert ("odc_runtime/new.py", name) in used and ("odc_runtime/new.py", name) not in BUILTIN_RAISES
