"""Typed errors raised by odc_runtime. All derive from ``OdcError``.

Every error says what went wrong and what to do; docs/troubleshooting.md lists each error, docs/core-api.md what
is checked (and what is not).
"""

from __future__ import annotations

# Part of every timeout message that names a rank which did not arrive: ODC sees only its own waits, and the commonest
# cause of an alive rank that never comes is a collective of torch.distributed it waits in.
ELSEWHERE_HINT = (
    "An alive rank that does not come may be waiting in a torch.distributed collective, which ODC cannot see: e.g. "
    "FSDP's all-gather of a forward outside odc_runtime.fsdp.minibatch that not every rank runs, or a collective of "
    "the training loop (all_reduce, barrier, a checkpoint) that only some ranks reached; its own traceback "
    "(py-spy dump, faulthandler) shows where"
)

# Part of every message of ranks found in different collectives: ranks pair collectives by count, so the round that
# shows the drift (often finalize) may be far from the call that caused it; the debug mode names that call.
DRIFT_HINT = (
    "to find the call that drifted, rerun with ODC_DEBUG=1: every collective call is then compared across ranks "
    "before it runs, and the first one that differs raises on every rank naming each rank's call site (file:line)"
)


class OdcError(RuntimeError):
    """Base class of every error odc_runtime raises on purpose."""


class OdcNotInitializedError(OdcError):
    """The runtime is used before ``odc_runtime.init`` or after ``odc_runtime.finalize``."""


class OdcUsageError(OdcError, ValueError):
    """Bad arguments or settings: wrong shape, dtype, device, layout, a bad ``ODC_*`` value, or a call that is not
    valid in this state (e.g. from a forked child of a rank)."""


class OdcMismatchError(OdcError):
    """Ranks disagree in a collective: different arguments, another rank rejected its arguments, or ranks are in
    different collectives (e.g. ``free`` in different orders)."""


class OdcRoundMismatchError(OdcMismatchError):
    """Ranks met at one barrier round from different collectives (rank 0 in ``sync``, rank 1 in ``finalize``), or,
    with ``ODC_DEBUG=1``, from different call sites of the program. Raised on every rank at that round, naming each
    side; every rank completed the round, so the runtime stays usable, but the ranks' collectives are out of step
    (fix the program)."""


class OdcWindowError(OdcUsageError):
    """Between two world syncs an owner changed a shard that a peer fetched (rule a), or zeroed or wrote an
    accumulator that a peer pushed into (rule b): a race whose result is torn values or lost gradients. Raised on
    every rank at the sync that closes that window, naming the shard, the owner, the rule and the fix; the sync
    completed, so the runtime stays usable, but that window's values are not to be trusted (fix the loop: usually
    the second ``sync`` of a minibatch is missing, or ``zero_grad()`` comes after it)."""


class OdcCrossedCollectivesError(OdcMismatchError):
    """Two ranks wait for each other in different collectives (a ``sync(group=...)`` crossed with another fence or a
    world collective, directly or around a cycle of ranks), so neither can complete. Raised by the ranks that see
    it; the runtime is unusable afterwards (restart the job)."""


class OdcMemoryError(OdcError, MemoryError):
    """The symmetric heap, or the filesystem that backs it, cannot hold an allocation."""


class OdcTimeoutError(OdcError, TimeoutError):
    """A blocking wait gave up: a peer is dead or stuck. The message names the operation and the ranks."""


class OdcPeerLostError(OdcTimeoutError):
    """A peer process died (or the ``torch.distributed`` store became unreachable) while this rank waited for it.

    Raised as soon as the death is seen (at the latest after ``ODC_TIMEOUT``), naming the rank and the operation.
    The runtime is unusable afterwards: every later collective raises this error again at once, and
    ``odc_runtime.finalize`` releases local resources without waiting.
    """


class OdcOverflowError(OdcError):
    """Deterministic mode: a push did not fit its tensor's fixed-point bound (or was not finite). Raised by ``sync``
    on every rank, which discarded the window's pushes everywhere (``st.grad`` unchanged); a retry fits."""


class OdcBackendError(OdcError):
    """A transport failed (CUDA/NVSHMEM error, missing extension, unsupported platform, OS error)."""
