"""Typed errors raised by odc_runtime. All derive from ``OdcError``.

Every error says what went wrong and what to do; docs/troubleshooting.md lists each error, docs/core-api.md what
is checked (and what is not).
"""

from __future__ import annotations


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
