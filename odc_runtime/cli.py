"""What every command-line entry point shares (``bench/*.py``, ``examples/*.py``, ``python -m odc_runtime.*``):
a parser whose ``--help`` reads as plain text and shows each option's default, and a one-line refusal where an
optional dependency is missing.

The help is made from the module docstrings, which are reST for the API reference; ``plain`` turns the inline
markup into what a terminal should show (a role such as func or data around a name, and double back-quotes
around a literal, give the bare text).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import re
import sys
from types import ModuleType

__all__ = ["HelpFormatter", "parser", "plain", "require"]

_ROLE = re.compile(r":(?:mod|func|class|meth|data|attr|obj|exc|ref|doc):`~?([^`<]+?)(?:\s*<[^>]+>)?`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """``text`` (reST) with its inline roles and literals shown as plain text, and ``::`` ending a paragraph as
    ``:``."""
    text = _ROLE.sub(lambda m: m.group(1).lstrip("."), text)
    text = _LITERAL.sub(r"\1", text)
    return re.sub(r"(\S)::\n", r"\1:\n", text).replace("\n::\n", "\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The description as written (paragraphs, tables), every option's default shown (an option without a help
    text too), its help as plain text."""

    @staticmethod
    def _default_worth_showing(action: argparse.Action) -> bool:
        default = action.default
        return bool(action.option_strings) and not (default is None or default is False or
                                                    default is argparse.SUPPRESS)

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._default_worth_showing(action):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text is None or text is argparse.SUPPRESS:
            return text
        text = plain(text)
        if "%(default)" in text or not self._default_worth_showing(action):
            return text  # said already, or a flag / an option without a default: nothing worth showing
        return text + " (default: %(default)s)"


def parser(doc: str | None, *, prog: str | None = None, first_paragraph: bool = False,
           epilog: str | None = None) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` for an entry point whose module docstring is ``doc`` (all of it, or its first
    paragraph), with ``HelpFormatter``."""
    text = (doc or "").strip()
    if first_paragraph:
        text = text.split("\n\n")[0]
    return argparse.ArgumentParser(prog=prog, description=plain(text), epilog=epilog and plain(epilog),
                                   formatter_class=HelpFormatter)


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module``, or leave the program with one line naming what to install (``extra``: the
    ``odc_runtime`` extra that brings it, or a full pip requirement when it contains ``=``/``<``/``>``)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        install = extra if any(c in extra for c in "=<>") else f"'odc_runtime[{extra}]'"
        sys.exit(f"{what} needs {module.split('.')[0]} ({type(e).__name__}: {e}): pip install {install}")
