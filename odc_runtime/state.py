"""The process's runtime state: the one live runtime between ``init`` and ``finalize``, and the guard on it.

The facade (``odc_runtime.api``, which starts and ends the runtime), ``ShardedTensor``
(which checks that it still belongs to the live runtime) and ``odc_runtime.testing`` (which installs a hand-built
one) all read it, so it lives below all of them. Read ``current`` as ``state.current`` (it is rebound).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from odc_runtime.errors import OdcNotInitializedError, OdcUsageError

if TYPE_CHECKING:
    from odc_runtime.deterministic import FixedPointAccumulators
    from odc_runtime.hierarchy import Hierarchy
    from odc_runtime.transport.base import Transport
    from odc_runtime.windows import WindowCheck


@dataclass
class Runtime:
    transport: Transport
    generation: int
    shards: itertools.count  # sequence number of the next shard() call (the same on every rank)
    live_names: set[str] = field(default_factory=set)  # names of the ShardedTensors not freed yet
    # Proper subgroups seen by shard(): global ranks (group-rank order) -> agreed index (the same on every rank)
    groups: dict[tuple[int, ...], int] = field(default_factory=dict)
    hierarchy: Hierarchy | None = None  # nodes smaller than the world: routes world-sharded tensors' transfers
    fixed: FixedPointAccumulators | None = None  # deterministic mode: int64 accumulators and the sync
    debug: bool = False  # ODC_DEBUG: collective calls are fingerprinted and compared (odc_runtime.debug)
    debug_calls: int = 0  # collective calls checked so far (the same on every rank), for messages
    windows: WindowCheck | None = None  # the window rules' check at world syncs (odc_runtime.windows); None: off


current: Runtime | None = None
in_forked_child = False  # set in a child forked while this process had a runtime (by the at-fork hook below)
_generations = itertools.count(1)


def _mark_forked_child() -> None:
    # Only a fork of an initialised rank is refused: a process forked before init (e.g. ranks started by a
    # fork-based launcher from a parent that imported odc_runtime) is a rank in its own right.
    global in_forked_child
    if current is not None:
        in_forked_child = True


os.register_at_fork(after_in_child=_mark_forked_child)


def start(transport: Transport, *, hierarchy: Hierarchy | None = None,
          fixed: FixedPointAccumulators | None = None, debug: bool = False,
          windows: WindowCheck | None = None) -> Runtime:
    """Make a new runtime (the next generation) over ``transport`` the live one; the caller checked none is live."""
    global current
    current = Runtime(transport=transport, generation=next(_generations), shards=itertools.count(),
                      hierarchy=hierarchy, fixed=fixed, debug=debug, windows=windows)
    return current


def take() -> Runtime | None:
    """End the live runtime locally: it is no longer current; returns it (``None`` when none was live)."""
    global current
    runtime, current = current, None
    return runtime


def require(what: str, *, read_only: bool = False) -> Runtime:
    """The live runtime, for the public call ``odc_runtime.<what>()``; raises the documented error otherwise."""
    if current is None:
        raise OdcNotInitializedError(
            f"odc_runtime.{what}() called before odc_runtime.init() or after odc_runtime.finalize(); call "
            "odc_runtime.init() after torch.distributed.init_process_group()"
        )
    if in_forked_child and not read_only:
        raise OdcUsageError(
            f"odc_runtime.{what}() in process {os.getpid()}, a forked child of a rank (e.g. a DataLoader worker): "
            "the child shares the rank's symmetric memory but is not a rank, so it may neither change it nor "
            "take part in collectives; call odc only in the process that called odc_runtime.init()"
        )
    return current
