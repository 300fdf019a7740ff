"""``odc-bench <tool> [options]`` (or ``python -m odc_runtime.bench <tool> ...``): run one benchmark of
``odc_runtime.bench`` from an installed package, exactly as ``python -m odc_runtime.bench.<tool>`` or, in a
checkout, ``python bench/<tool>.py`` would. ``odc-bench`` alone lists the tools; ``odc-bench <tool> --help`` gives
a tool's options.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from odc_runtime.cli import plain

__all__ = ["TOOLS", "main", "summary"]

#: The benchmarks with a command line (each module has ``build_parser()`` and ``main(argv)``), main job first.
TOOLS = ("imbalance", "comm", "hostcost", "balance", "simulate", "netmodel", "determinism")


def summary(tool: str, width: int = 100) -> str:
    """The first sentence of ``tool``'s module docstring, at most ``width`` characters, read from its source
    (importing a tool may import torch)."""
    spec = importlib.util.find_spec(f"{__package__}.{tool}")
    if spec is None or spec.origin is None:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        doc = plain(ast.get_docstring(ast.parse(f.read())) or "")
    sentence = " ".join(doc.split("\n\n", 1)[0].split()).split(". ", 1)[0].rstrip(".")
    return sentence if len(sentence) <= width else sentence[: width - 1].rstrip() + "…"


def _usage() -> str:
    rows = "\n".join(f"  {tool:<12} {summary(tool)}" for tool in TOOLS)
    return f"usage: odc-bench {{{','.join(TOOLS)}}} [options]   (odc-bench TOOL --help: its options)\n\n{rows}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``argv[0]``'s ``main`` with the remaining arguments; the tool list (exit status 2 on a bad tool name)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    tool, rest = args[0], args[1:]
    if tool not in TOOLS:
        print(f"odc-bench: unknown tool {tool!r}\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__package__}.{tool}")
    sys.argv = [f"odc-bench {tool}", *rest]  # the tool's --help names the command that was typed
    module.main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
