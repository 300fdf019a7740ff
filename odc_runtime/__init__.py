"""odc_runtime: On-Demand Communication for LLM post-training.

FSDP's per-layer all-gather and reduce-scatter are replaced by one-sided operations on symmetric memory:
:func:`fetch` reads parameter shards from their owners, :func:`push` adds gradient slices into their owners'
accumulators, and :func:`sync` is the only barrier, once per minibatch. Importing this package needs neither a
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

from typing import TYPE_CHECKING, Any

from odc_runtime.errors import (
    OdcBackendError,
    OdcError,
    OdcMemoryError,
    OdcMismatchError,
    OdcNotInitializedError,
    OdcPeerLostError,
    OdcTimeoutError,
    OdcUsageError,
)

__version__ = "0.1.0"

# The core API imports torch; it is loaded on first use so that torch-free modules such as
# ``odc_runtime.balance`` can be used in a data loader without importing torch.
_API_NAMES = frozenset(
    {"Handle", "ShardedTensor", "backend", "fetch", "finalize", "init", "is_initialized", "node_size", "push", "rank",
     "shard", "sync", "world_size"}
)


def __getattr__(name: str) -> Any:
    if name in _API_NAMES:
        from odc_runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'odc_runtime' has no attribute {name!r}")


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

__all__ = [
    "Handle",
    "OdcBackendError",
    "OdcError",
    "OdcMemoryError",
    "OdcMismatchError",
    "OdcNotInitializedError",
    "OdcPeerLostError",
    "OdcTimeoutError",
    "OdcUsageError",
    "ShardedTensor",
    "__version__",
    "backend",
    "fetch",
    "finalize",
    "init",
    "is_initialized",
    "node_size",
    "push",
    "rank",
    "shard",
    "sync",
    "world_size",
]
