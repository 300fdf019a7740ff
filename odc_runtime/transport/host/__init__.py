"""The ``host`` transport: ranks on one machine share memory through files in ``/dev/shm``.

Every rank maps every rank's segment, so a *fetch* is a ``memcpy`` from a peer's mapping and a *push* is an
``add_`` into it. The package is split by concern, each part a helper object the transport owns:

* ``segments``: segment files (naming, sparse sizing, ``posix_fallocate`` reservation, mapping, stale-file
  removal). Memory is reserved before it is touched, so a full ``/dev/shm`` is an OdcMemoryError, not a SIGBUS.
* ``locks``: byte-range locks that make concurrent pushes exact (one lock held at a time: no cycles).
* ``control``: the first control page: world rounds (barrier and exchange: epoch, operation digest, payload)
  and the failed flag.
* ``fences``: group fences (``sync(group=...)``) and crossed-collective detection.
* ``worker``: the asynchronous operations' thread.
* ``plan``: ``HostPlan``, a fetch/push plan with its segment views and lock ranges resolved once.
* ``transport``: ``HostTransport`` itself (the data paths, rounds, waits and fail-stop).
* ``bootstrap``: ``create``, the collective construction.

Dead peers: while it waits, a rank checks every half second whether the processes it waits for still exist (pid +
start time from their control pages) or have failed; either raises ``OdcPeerLostError``
at once, naming the rank and where it was. After that (or any timeout) the transport is *failed*: every later
operation raises at once, ``free`` releases locally, and ``finalize`` does not wait again.
"""

from __future__ import annotations

import fcntl
import os

from odc_runtime.transport.host.bootstrap import create
from odc_runtime.transport.host.segments import CONTROL_BYTES, remove_stale_segments
from odc_runtime.transport.host.transport import HostTransport

__all__ = ["CONTROL_BYTES", "HostTransport", "create", "is_available", "remove_stale_segments", "unavailable_reason"]


def unavailable_reason() -> str | None:
    """Why the host transport cannot run here (``None``: it can): it needs POSIX shared memory and ``fcntl``
    byte-range locks (Linux, macOS). Never raises."""
    if not hasattr(os, "register_at_fork") or not hasattr(fcntl, "lockf"):
        return "this platform lacks os.register_at_fork or fcntl.lockf (the host transport needs Linux or macOS)"
    return None


def is_available() -> bool:
    """The host transport runs wherever POSIX shared memory and ``fcntl`` locks do (Linux, macOS)."""
    return unavailable_reason() is None
