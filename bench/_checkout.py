"""``python bench/<tool>.py`` from a source checkout: the checkout's ``odc_runtime`` is the one imported.

Each tool imports this module (by its plain name, from its own folder) only when it runs as a script, i.e. with an
empty ``__package__``; ``python -m odc_runtime.bench.<tool>`` and ``odc-bench <tool>`` never need it. The
checkout's root goes first on ``sys.path``, so the tool, its helpers (``odc_runtime.bench``, which ``odc_runtime``
maps to this folder: ``odc_runtime.SOURCE_FOLDERS``) and the runtime all come from the same tree, installed or not,
whatever other ``odc_runtime`` the environment holds. In an installed package this folder's parent is the package
itself, not a checkout, and nothing changes.
"""

import sys
from pathlib import Path

_root = Path(__file__).resolve().parent.parent
if not (_root / "__init__.py").is_file() and str(_root) not in sys.path:
    sys.path.insert(0, str(_root))
