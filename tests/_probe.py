"""Probes for reliability tests, run inside a rank of ``_dist.run_ranks``: interrupt the rank at a chosen or random
moment, hold a peer's byte-range lock (so an operation is provably mid-flight when the interrupt lands), stop or kill
a rank, and run a collective that peers may mismatch.

Interrupts are real signals: an interval timer whose handler raises (``KeyboardInterrupt`` as Ctrl-C does, or an
ordinary exception as a preemption handler may), delivered while the main thread waits inside the runtime.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import torch

import odc_runtime as odc
from odc_runtime import testing
from odc_runtime.transport.host import CONTROL_BYTES


class Preempted(RuntimeError):
    """The ordinary exception a probe's signal handler raises (as a preemption handler might)."""


def interrupt_in(seconds: float, error: type[BaseException] | BaseException = KeyboardInterrupt) -> None:
    """Raise ``error`` in the main thread once, ``seconds`` from now (SIGALRM; replaces a pending one)."""

    def handler(signum: int, frame: object) -> None:
        raise error

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-6))


def cancel_interrupt() -> None:
    """Disarm a pending :func:`interrupt_in` (a late signal then does nothing)."""
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)


def random_interrupt(rng: random.Random, within: float,
                     errors: tuple[type[BaseException], ...] = (KeyboardInterrupt, Preempted)) -> None:
    """:func:`interrupt_in` a delay drawn from ``[0, within)`` seconds, raising one of ``errors`` (drawn too)."""
    interrupt_in(rng.random() * within, rng.choice(errors))


class HeldLock:
    """An exclusive byte-range lock on elements of ``owner``'s accumulator of ``st``, as a pusher holding it would
    take it: a push into those bytes waits until :meth:`release` (or :meth:`release_after`)."""

    def __init__(self, st: odc.ShardedTensor, owner: int, element: int, count: int = 1) -> None:
        transport = testing.transport()
        grad = testing.buffers(st)[1]
        assert grad is not None
        self.fd = transport.segments.get(owner).fd  # type: ignore[attr-defined]
        self.start = CONTROL_BYTES + grad.handle + 4 * element  # type: ignore[operator]
        self.length = 4 * count
        fcntl.lockf(self.fd, fcntl.LOCK_EX, self.length, self.start)
        self._held = True
        self._timer: threading.Timer | None = None

    def release(self) -> None:
        if self._held:
            self._held = False
            fcntl.lockf(self.fd, fcntl.LOCK_UN, self.length, self.start)

    def release_after(self, seconds: float) -> None:
        """Release from a timer thread (POSIX locks belong to the process, so any of its threads may unlock)."""
        self._timer = threading.Timer(seconds, self.release)
        self._timer.daemon = True
        self._timer.start()


def stop_for(seconds: float) -> None:
    """Stop this rank (SIGSTOP) for ``seconds``; a detached helper process sends SIGCONT."""
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def die() -> None:
    """Kill this rank at once (SIGKILL: no handler, no cleanup), as a crash or the OOM killer would."""
    os.kill(os.getpid(), signal.SIGKILL)


def pause_after_next_announce(seconds: float) -> None:
    """Make this rank sleep ``seconds`` right after it announces its next world round (host transport), as a rank
    descheduled between announcing and polling would: its peers may complete that round and go on meanwhile."""
    control = testing.transport().control  # type: ignore[attr-defined]
    original = control.announce

    def announce(*args: object) -> None:
        original(*args)
        del control.announce  # once
        time.sleep(seconds)

    control.announce = announce


def raise_in(obj: object, method: str, error: type[BaseException] | BaseException = KeyboardInterrupt,
             after_calls: int = 0) -> None:
    """Make call number ``after_calls + 1`` of ``obj.method`` raise ``error`` on entry, as a signal landing right
    there would (the deterministic form of :func:`interrupt_in`); the other calls run unchanged."""
    original = getattr(obj, method)
    calls = [0]

    def wrapper(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == after_calls + 1:
            raise error
        return original(*args, **kwargs)

    setattr(obj, method, wrapper)


def collective(kind: str, tensors: dict[str, odc.ShardedTensor]) -> Callable[[], object]:
    """A collective call by name, for mismatch probes (ranks pass different ``kind`` values): ``"sync"``,
    ``"free:<name>"`` or ``"shard:<name>"``."""
    if kind == "sync":
        return odc.sync
    op, _, name = kind.partition(":")
    if op == "free":
        return tensors[name].free
    if op == "shard":
        return lambda: odc.shard(torch.zeros(8), name=name)
    raise ValueError(f"unknown collective {kind!r}")
