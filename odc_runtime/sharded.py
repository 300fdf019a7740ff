"""The objects the core API hands out: ``ShardedTensor`` (from ``shard``) and ``Handle`` (from an
asynchronous ``fetch`` / ``push``). Their layout comes from ``odc_runtime.layout``; the runtime they belong to
lives in ``odc_runtime.api``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from odc_runtime import checks, debug, layout, state
from odc_runtime.errors import OdcNotInitializedError, OdcUsageError
from odc_runtime.plans import PlanCache
from odc_runtime.transport.base import SymmetricBuffer, Work
from odc_runtime.windows import own_counter

if TYPE_CHECKING:
    from odc_runtime.state import Runtime


class Handle:
    """Completion handle returned by ``fetch``/``push`` with ``async_op=True``.

    ``wait()`` blocks until the operation completed (on GPU: makes the current stream wait for it), re-raises
    its error, and returns the result (the fetched tensor, or ``None`` for ``push``).
    """

    def __init__(self, work: Work, result: torch.Tensor | None) -> None:
        self._work = work
        self._result = result

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        """Wait at most ``timeout`` seconds (a non-negative number; default ``ODC_TIMEOUT``); OdcUsageError for a bad
        ``timeout``.

        OdcTimeoutError after ``timeout`` means this wait gave up while the operation is still running: it has not
        failed, it completes on its own (``sync()`` waits for it, and ``wait()`` may be called again), and it must
        not be issued again (a repeated push would be added twice). An operation that itself failed raises its own
        error here (e.g. a push that timed out after part of it landed says the runtime is unusable)."""
        self._work.wait(checks.wait_timeout(timeout))
        return self._result

    def is_completed(self) -> bool:
        return self._work.is_completed()


class ShardedTensor:
    """A tensor sharded across the ranks of a group (all ranks by default), created by ``shard``.

    Attributes:
        local: this rank's parameter shard (1-D, writable; the optimizer updates it in place).
        grad: this rank's gradient accumulator shard (1-D, ``accum_dtype``); ``None`` for a tensor sharded with
            ``requires_grad=False`` (no accumulator is allocated; pushing into it is an error).
        shard_range: ``(start, stop)`` of the flattened full tensor owned by this rank.
        nbytes: bytes of the full tensor (what a fetch returns; ``odc_runtime.stats()`` counts them).
        group: the ``torch.distributed`` process group passed to ``shard`` (``None``: all ranks).
        group_ranks: global ranks of the owners, in group-rank order.
        rank, world_size: this rank's rank in the group and the group's size (the world's without a group).
    """

    def __init__(
        self,
        name: str,
        shape: torch.Size,
        dtype: torch.dtype,
        accum_dtype: torch.dtype,
        param: SymmetricBuffer,
        grad: SymmetricBuffer | None,
        runtime: Runtime,
        seq: int = 0,
        group: object | None = None,
        group_ranks: tuple[int, ...] | None = None,
    ) -> None:
        self.name = name
        self.seq = seq  # this tensor's shard() sequence number (the same on every rank)
        self.shape = shape
        self.dtype = dtype
        self.accum_dtype = accum_dtype
        self.numel = math.prod(shape)
        self.nbytes = self.numel * dtype.itemsize  # of the full tensor: what a fetch returns
        if group_ranks is None:
            group_ranks = tuple(range(runtime.transport.world_size))
        self.group = group
        self.group_ranks = group_ranks
        self.world_size = len(group_ranks)
        self.rank = group_ranks.index(runtime.transport.rank)
        self.shard_size = layout.shard_size(self.numel, self.world_size)  # param.numel may be larger (other groups)
        self._param = param
        self._grad = grad
        self._plans = PlanCache()  # validated fetch/push plans of this tensor (odc_runtime.plans)
        self._generation = runtime.generation
        start, stop = self.owner_range(self.rank)
        # Own version counters: the window check (odc_runtime.windows) reads them to see the owner's writes
        self._local = own_counter(param.local[: stop - start])
        self._grad_view = None if grad is None else own_counter(grad.local[: stop - start])
        # The window check's state: fetched / pushed by this rank in the current window (set by every call), and
        # the version counters of local and grad at the window's start
        self._fetched = False
        self._pushed = False
        self._written: tuple[int, int] = (0, 0)

    # The views are symmetric memory: rebinding them (``st.local = st.local - lr * st.grad``) would silently detach
    # the shard (fetches keep returning the old values, pushes land where nobody reads). Augmented assignment
    # (``st.local -= ...``) updates in place and assigns the same tensor back, which is allowed.
    @property
    def local(self) -> torch.Tensor:
        """This rank's parameter shard (a view of symmetric memory; update it in place). OdcNotInitializedError
        after ``finalize``."""
        self._require_runtime("local")
        return self._local

    @local.setter
    def local(self, value: object) -> None:
        self._refuse_rebind("local", value, self._local)

    @property
    def grad(self) -> torch.Tensor | None:
        """This rank's gradient accumulator shard (a view of symmetric memory), ``None`` without one.
        OdcNotInitializedError after ``finalize``."""
        self._require_runtime("grad")
        return self._grad_view

    @grad.setter
    def grad(self, value: object) -> None:
        self._refuse_rebind("grad", value, self._grad_view)

    def _require_runtime(self, attr: str) -> None:
        # After finalize the views' memory belongs to no runtime: writes reach no peer and reads are no parameter.
        # A read-only check (a forked child may read), one attribute compare: the optimizer reads these per step.
        runtime = state.current
        if runtime is None or runtime.generation != self._generation:
            raise OdcNotInitializedError(
                f"ShardedTensor {self.name!r}: st.{attr} after odc_runtime.finalize(): its symmetric memory was "
                f"released with the runtime; copy what you need (st.{attr}.clone(), a checkpoint) before finalize"
            )

    def _refuse_rebind(self, attr: str, value: object, current: torch.Tensor | None) -> None:
        if value is not current:
            raise OdcUsageError(
                f"ShardedTensor {self.name!r}: st.{attr} is a view of symmetric memory and cannot be rebound; update "
                f"it in place (st.{attr}.copy_(new), st.{attr}.add_(delta), st.{attr} -= x)"
            )

    def owner_range(self, owner: int) -> tuple[int, int]:
        """``(start, stop)`` of the flattened tensor owned by group rank ``owner``."""
        return layout.owner_range(self.numel, self.world_size, owner)

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.owner_range(self.rank)

    def zero_grad(self) -> None:
        """Zero this rank's accumulator (no-op without one). Call ``sync()`` before peers push into it again.

        Raises OdcUsageError in a forked child of the rank (it would zero the rank's accumulator)."""
        self._check_alive("zero_grad")
        if self.grad is not None:
            self.grad.zero_()

    def free(self) -> None:
        """Collective: release this tensor's symmetric memory (same order on all ranks).

        Every rank checks that its peers free the same tensor (its whole name and its shard sequence number):
        freeing in different orders raises OdcMismatchError on every rank and frees nothing. Pushes not yet
        delivered by a ``sync()`` are dropped with the tensor (across nodes they still sit in staging buffers).
        """
        runtime = self._check_alive("free")
        if runtime.debug:
            debug.check(runtime, f"free({self.name!r})")
        if runtime.hierarchy is not None:
            runtime.hierarchy.remove(self.seq)
        if runtime.fixed is not None:
            runtime.fixed.remove(self.seq)
        if runtime.windows is not None:
            runtime.windows.remove(self.seq)
        if self._grad is not None:
            runtime.transport.free(self._grad)
        runtime.transport.free(self._param)
        runtime.live_names.discard(self.name)

    def _check_alive(self, what: str) -> Runtime:
        runtime = state.require(what)
        if self._generation != runtime.generation:
            raise OdcNotInitializedError(
                f"odc_runtime.{what}(): ShardedTensor {self.name!r} belongs to a runtime that was finalized"
            )
        if self._param.freed:
            raise OdcUsageError(f"odc_runtime.{what}(): ShardedTensor {self.name!r} was freed")
        return runtime

    def __repr__(self) -> str:
        return (
            f"ShardedTensor(name={self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"shard_range={self.shard_range}, world_size={self.world_size}"
            + ("" if self.group is None else f", group_ranks={list(self.group_ranks)}")
            + ")"
        )
