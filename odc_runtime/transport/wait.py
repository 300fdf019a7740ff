"""Bounded waits: the one polling loop every wait of the runtime goes through.

A wait that a dead, stopped or misbehaving peer can block must end. ``wait_for`` polls a set of pending items
(usually peer ranks) until each is done, spinning first (most waits end within microseconds) and then backing
off to a cap; every liveness period it calls a *check* that may raise what is already known (a peer died, a
peer failed, two ranks are crossed in different collectives), and past the deadline it raises the error its
caller builds from the items still missing ("who is missing"). ``Deadline`` and ``Backoff`` are the
two parts, for loops that poll something other than a set of peers (a contended byte-range lock).

Used by ``odc_runtime.agree`` (the store exchange) and the host transport (barriers, group fences, signal
waits, byte-range locks); a transport whose waits run on a device models its host-side waits on the same parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

LIVENESS_PERIOD_S = 0.5  # how often a waiting rank checks whether the peers it waits for still exist


class Backoff:
    """Sleep nothing for the first ``spins`` rounds, then ``step × round`` seconds, at most ``cap``."""

    __slots__ = ("cap", "round", "spins", "step")

    def __init__(self, *, spins: int = 50, step: float = 1e-5, cap: float = 1e-3) -> None:
        self.spins, self.step, self.cap = spins, step, cap
        self.round = 0

    def pause(self) -> None:
        self.round += 1
        time.sleep(0 if self.round < self.spins else min(self.cap, self.step * self.round))


class Deadline:
    """``timeout`` seconds from now (monotonic clock)."""

    __slots__ = ("end", "start", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.start = time.monotonic()
        self.end = self.start + timeout

    def waited(self) -> float:
        """Seconds since the wait began."""
        return time.monotonic() - self.start

    def passed(self) -> bool:
        return time.monotonic() > self.end


def wait_for(
    pending: Iterable[T],
    done: Callable[[T], bool],
    *,
    timeout: float,
    check: Callable[[list[T], float], None] | None,
    on_timeout: Callable[[list[T], float], BaseException],
    backoff: Backoff | None = None,
    period: float = LIVENESS_PERIOD_S,
) -> None:
    """Poll until ``done(p)`` for every ``p`` in ``pending``.

    Every ``period`` seconds ``check(missing, waited)`` runs and may raise (a dead peer, a peer's recorded failure,
    crossed collectives); past ``timeout`` the error ``on_timeout(missing, waited)`` is raised. ``done`` may raise
    too (a peer in another collective). Nothing is held while waiting.
    """
    deadline = Deadline(timeout)
    backoff = backoff or Backoff()
    next_check = deadline.start + period
    missing = list(pending)
    while True:
        missing = [p for p in missing if not done(p)]
        if not missing:
            return
        now = time.monotonic()
        if check is not None and now >= next_check:
            next_check = now + period
            check(missing, now - deadline.start)
        if now > deadline.end:
            raise on_timeout(missing, now - deadline.start)
        backoff.pause()
