"""odc_runtime: On-Demand Communication for LLM post-training.

FSDP's per-layer all-gather and reduce-scatter are replaced by one-sided operations on symmetric memory:
``fetch`` reads parameter shards from their owners, ``push`` adds gradient slices into their owners'
accumulators, and ``sync`` is the only barrier, once per minibatch. Importing this package needs neither a
GPU nor the compiled extension.

Typical loop::

    import odc_runtime as odc
    odc.init()                                   # after torch.distributed.init_process_group
    st = odc.shard(weight)                       # collective, same order on all ranks
    for mb in my_micro_batches:                  # counts may differ between ranks
        w = odc.fetch(st)
        grad = compute_grad(w, mb)
        odc.push(st, grad)
    odc.sync()
    st.local -= lr * st.grad                     # optimizer on this rank's shard
    st.zero_grad()
    odc.sync()
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

from odc_runtime.errors import (
    OdcBackendError,
    OdcCrossedCollectivesError,
    OdcError,
    OdcMemoryError,
    OdcMismatchError,
    OdcNotInitializedError,
    OdcOverflowError,
    OdcPeerLostError,
    OdcRoundMismatchError,
    OdcTimeoutError,
    OdcUsageError,
    OdcWindowError,
)

__version__ = "0.1.0"


#: Sub-packages whose source is a top-level folder of the checkout, mapped into the package by an install
#: (``setup.py``'s ``package_dir``): ``odc_runtime.kernels`` is ``kernels/``, ``odc_runtime.bench`` is ``bench/``.
SOURCE_FOLDERS = {"odc_runtime.kernels": "kernels", "odc_runtime.bench": "bench"}


class _SourceFolders(importlib.abc.MetaPathFinder):
    """Resolves the sub-packages of ``SOURCE_FOLDERS`` to their top-level folders of a source checkout.

    An install maps those folders into the package; a checkout used from ``PYTHONPATH=.`` has no such mapping, so
    without this finder ``import odc_runtime.kernels`` (and the hierarchy, which imports it) or ``import
    odc_runtime.bench`` would fail there. Registered only for folders that sit next to this package while the
    package has no sub-package of that name (an install), so it resolves each name exactly as the install does."""

    def __init__(self, directories: dict[str, str]) -> None:
        self._directories = directories

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        directory = self._directories.get(name)
        if directory is None:
            return None
        init = os.path.join(directory, "__init__.py")
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[directory])


def _register_source_folders() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    found = {}
    for name, folder in SOURCE_FOLDERS.items():
        source = os.path.join(os.path.dirname(here), folder)
        installed = os.path.isdir(os.path.join(here, name.rsplit(".", 1)[1]))
        if os.path.isfile(os.path.join(source, "__init__.py")) and not installed:
            found[name] = source
    if found and not any(isinstance(f, _SourceFolders) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceFolders(found))


_register_source_folders()

# The core API imports torch; it is loaded on first use so that torch-free modules such as
# ``odc_runtime.balance`` can be used in a data loader without importing torch.
_API_NAMES = frozenset(
    {"Handle", "ShardedTensor", "backend", "fetch", "finalize", "init", "is_initialized", "node_size", "push", "rank",
     "shard", "sync", "world_size"}
)


def __getattr__(name: str) -> Any:
    # Called only for names not bound yet: the first access binds every API name into this module, so later
    # accesses (``odc.fetch`` on the per-call fast path) are plain attribute lookups, not a call of this hook.
    if name in _API_NAMES:
        from odc_runtime import api

        globals().update({n: getattr(api, n) for n in _API_NAMES})
        return globals()[name]
    if name == "stats":  # torch-free, like the counters it reads
        from odc_runtime.telemetry import stats

        globals()["stats"] = stats
        return stats
    raise AttributeError(f"module 'odc_runtime' has no attribute {name!r}")


def device_type() -> str:
    """``torch.device`` type of the tensors the active transport works on (``"cpu"`` for ``host``, ``"cuda"`` for
    ``nvshmem``: ``odc_runtime.transport.Transport.device_type``); OdcNotInitializedError before ``init``."""
    from odc_runtime import state

    return state.require("device_type", read_only=True).transport.device_type


if TYPE_CHECKING:
    from odc_runtime.api import (
        Handle,
        ShardedTensor,
        backend,
        fetch,
        finalize,
        init,
        is_initialized,
        node_size,
        push,
        rank,
        shard,
        sync,
        world_size,
    )
    from odc_runtime.telemetry import stats

__all__ = [
    "Handle",
    "OdcBackendError",
    "OdcCrossedCollectivesError",
    "OdcError",
    "OdcMemoryError",
    "OdcMismatchError",
    "OdcNotInitializedError",
    "OdcOverflowError",
    "OdcPeerLostError",
    "OdcRoundMismatchError",
    "OdcTimeoutError",
    "OdcUsageError",
    "OdcWindowError",
    "ShardedTensor",
    "__version__",
    "backend",
    "device_type",
    "fetch",
    "finalize",
    "init",
    "is_initialized",
    "node_size",
    "push",
    "rank",
    "shard",
    "stats",
    "sync",
    "world_size",
]
