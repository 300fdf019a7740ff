"""``ODC_DEBUG=1``: every collective call of the core API is checked against the other ranks' before it runs.

ODC's collectives pair up by count: a rank that calls ``sync()`` once more than its peers meets their next ``sync``
(or ``free``, ``finalize``) and nothing is wrong until the sums are. In debug mode every collective call (``sync``,
``shard``, ``free``, ``finalize``) first exchanges its *fingerprint*, the operation and the user's call site (the
innermost frame outside odc_runtime, torch and contextlib: ``train.py:42 in step``), in one extra round over the
transport's bounded exchange. Ranks whose fingerprints differ all raise ``odc_runtime.errors.
OdcRoundMismatchError`` at that round, naming every rank's operation and call site; every rank completed the round,
so they raise together and none hangs (the round is part of the collective sequence of every rank: the setting is
agreed at ``init``).

``sync(group=...)`` is a fence of its group only, not a world round: its fingerprint travels in the fence itself
(``odc_runtime.transport.host.fences``: the members compare their operations' digests once the fence completed,
and with ``ODC_DEBUG=1`` the operation carries the call site), so a drifted group sync raises
``OdcRoundMismatchError`` on every member of the group, naming the call sites, at no extra round.

A world ``sync``'s round also carries the window check's summary (``odc_runtime.windows``): an owner that wrote a
shard a peer fetched, or an accumulator a peer pushed into, since the last world sync raises ``OdcWindowError`` on
every rank once the sync's fence completed.

What it cannot see: the same line called a different number of times (the same fingerprint every time; the
mismatch shows at the next differing call, or at ``finalize``). Cost: one exchange round per world collective call
(``bench/hostcost.py``, "sync per call").
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

import torch

from odc_runtime.agree import describe_calls, ranks_by_value
from odc_runtime.errors import OdcRoundMismatchError

if TYPE_CHECKING:
    from odc_runtime.state import Runtime

# The round's identity, the same on every rank (it pairs by count; the payloads are compared here). Never shown:
# messages name the user's call (the exchange's label).
_OP = "debug: collective fingerprint"
_MAX_BYTES = 480  # a fingerprint fits every transport's exchange payload (at least about 1.9 KB)
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKIP = (_PACKAGE, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, os.path.abspath(contextlib.__file__))


def call_site() -> str:
    """``file:line in function`` of the innermost frame outside odc_runtime, torch and contextlib (the user's
    call of the collective, also when it runs from a ``with`` block's exit or a module hook)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIP):
        frame = frame.f_back
    if frame is None:
        return "<no caller outside odc_runtime>"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def check(runtime: Runtime, op: str, payload: bytes = b"") -> list[bytes]:
    """Collective over the world, the first step of a core-API collective call ``op`` in debug mode: raise
    OdcRoundMismatchError on every rank if any rank's fingerprint differs from another's.

    ``payload`` (at most about 1.4 KB) rides along in the same round; returns every rank's (the window check's
    summary at a world sync, ``odc_runtime.windows``)."""
    runtime.debug_calls += 1
    call = f"{op} at {call_site()}"
    mine = call.encode()[:_MAX_BYTES]
    # messages name the user's call, not _OP
    received = runtime.transport.exchange(_OP, len(mine).to_bytes(2, "little") + mine + payload, label=call)
    fingerprints = [r[2 : 2 + int.from_bytes(r[:2], "little")] for r in received]
    if all(f == mine for f in fingerprints):
        return [r[2 + len(f):] for r, f in zip(received, fingerprints, strict=True)]
    sides = describe_calls(ranks_by_value(enumerate(fingerprints)), lambda f, _: f.decode(errors="replace"))
    raise OdcRoundMismatchError(
        f"odc collective mismatch (ODC_DEBUG=1) at collective call #{runtime.debug_calls}: {sides}. Every rank must "
        "make the same collective calls (shard, free, sync, finalize) from the same places in the same order; a rank "
        "made an extra or a missing call at one of these sites"
    )
