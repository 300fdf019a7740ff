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


class _SourceKernels(importlib.abc.MetaPathFinder):
    """Resolves ``odc_runtime.kernels`` to the top-level ``kernels/`` folder of a source checkout.

    An install maps that folder into the package (``setup.py``'s ``package_dir``); a checkout used from
    ``PYTHONPATH=.`` has no such mapping, so without this finder ``import odc_runtime.kernels`` (and the hierarchy,
    which imports it) would fail there. Registered only when the folder sits next to this package and the package
    has no ``kernels`` of its own (an install), so it resolves the name exactly as the install does."""

    def __init__(self, directory: str) -> None:
        self._directory = directory

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != "odc_runtime.kernels":
            return None
        init = os.path.join(self._directory, "__init__.py")
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[self._directory])


def _register_source_kernels() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    source = os.path.join(os.path.dirname(here), "kernels")
    checkout = os.path.isfile(os.path.join(source, "__init__.py")) and not os.path.isdir(os.path.join(here, "kernels"))
    if checkout and not any(isinstance(f, _SourceKernels) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceKernels(source))


_register_source_kernels()

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
