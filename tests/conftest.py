"""Set-up for the whole suite, before any test module is imported.

The checkout's root is taken off ``sys.path`` (``python -m pytest`` puts the working directory first): its
``kernels/`` folder, the source of ``odc_runtime.kernels``, would otherwise be found as the top-level package
``kernels`` and shadow Hugging Face's ``kernels``, which transformers 5.x requires and imports with its models
("cannot import name 'CUDAProperties' from 'kernels'"). ``odc_runtime`` and its sub-packages are imported through
the install (``pip install -e``, or the wheel), never through the root; the tests' helpers through ``tests/``,
which pytest puts on the path. Spawned ranks inherit this ``sys.path``.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
