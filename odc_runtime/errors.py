"""Typed errors raised by odc_runtime. All derive from :class:`OdcError`."""

from __future__ import annotations


class OdcError(RuntimeError):
    """Base class of every error odc_runtime raises on purpose."""


class OdcNotInitializedError(OdcError):
    """The runtime is used before :func:`odc_runtime.init` or after :func:`odc_runtime.finalize`."""


class OdcUsageError(OdcError, ValueError):
    """Bad arguments: wrong shape, dtype, device, layout, or a call that is not valid in this state."""


class OdcMismatchError(OdcError):
    """A collective call (``init``, ``shard``) received different arguments on different ranks."""


class OdcMemoryError(OdcError, MemoryError):
    """The symmetric heap cannot hold an allocation."""


class OdcTimeoutError(OdcError, TimeoutError):
    """A blocking wait gave up: a peer is dead or stuck. The message names the operation and the ranks."""


class OdcBackendError(OdcError):
    """A transport failed (CUDA/NVSHMEM error, missing extension, unsupported platform)."""
