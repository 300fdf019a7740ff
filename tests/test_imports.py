"""The shape of ``odc_runtime/``: no import circles (lazy imports included) and no module over 700 lines.

The import graph is built from the source with :mod:`ast`, so it sees every import that can run: module-level
ones and the ones inside functions (a lazy import hides a circle; it does not remove it). Imports under
``if TYPE_CHECKING:`` are left out because they never run. ``from pkg import name`` counts as an import of
``pkg.name`` when that is a submodule, else of ``pkg`` (its ``__init__``), so a child importing a name from its
own package's ``__init__`` while that ``__init__`` re-exports the child is a circle. The parent packages that Python
runs implicitly on ``import a.b.c`` are not edges (every module would then be in a circle with the top package).
"""
from __future__ import annotations

import ast
from pathlib import Path

from odc_runtime import SOURCE_FOLDERS

PKG = "odc_runtime"
ROOT = Path(__file__).resolve().parent.parent / PKG
# Source folders and the package they install as (setup.py's package_dir: kernels/ is odc_runtime.kernels, bench/
# is odc_runtime.bench).
SOURCES = {ROOT: PKG, **{ROOT.parent / folder: name for name, folder in SOURCE_FOLDERS.items()}}
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    mods = {}
    for src, name in SOURCES.items():
        for path in sorted(src.rglob("*.py")):
            parts = [name, *path.relative_to(src).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: skips the bodies of ``if TYPE_CHECKING:`` (keeps their ``else``)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(mod, is_pkg, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            for target in targets:
                # `import a.b.c` where only a.b is ours (c an attribute) -> the longest known prefix.
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_graph_sees_lazy_relative_and_submodule_imports():
    graph = import_graph()
    # One edge of each kind the graph must see, taken from today's source.
    assert "odc_runtime.errors" in graph["odc_runtime.api"]  # module level
    assert "odc_runtime.kernels" in graph["odc_runtime.hierarchy"]  # from pkg import submodule (kernels/)
    assert "odc_runtime.kernels.reference" in graph["odc_runtime.kernels"]  # relative
    # Function-level imports count; TYPE_CHECKING ones do not.
    src = "import os\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\ndef f():\n    import c\n"
    assert sorted(a.name for n in _imports(ast.parse(src)) for a in n.names) == ["b", "c", "os"]


def test_no_import_circles():
    graph = import_graph()
    found = cycles(graph)
    for comp in found:
        print("import circle:", " <-> ".join(comp))
        for m in comp:
            print(f"    {m} -> {sorted(d for d in graph[m] if d in comp)}")
    assert not found, f"{len(found)} import circle(s) in {PKG}/: {found}"


def test_no_module_over_700_lines():
    too_long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
                if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines (split them): {too_long}"
