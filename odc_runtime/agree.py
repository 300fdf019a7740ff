"""Rank agreement: every collective step fails on every rank together, within ``ODC_TIMEOUT``, or on none.

A rank that rejects its arguments (or hits any local error) must not simply raise: its peers would wait forever in
the collective it abandoned. ``gather_checked`` runs the local step everywhere, exchanges the outcomes, and
then raises on every rank if any rank failed. Local errors of every kind reach the exchange (an ``OSError`` from
``mmap`` as much as a bad argument), so no peer is left behind.

The exchange itself is bounded. Before a transport exists (``init``) it goes through the ``torch.distributed``
store with our own deadline (``StoreExchange``) instead of a gloo collective, whose wait is the process
group's (30 minutes by default) and whose error on a dead peer is a raw ``RuntimeError`` naming a port. A transport
may offer its own exchange (the host transport's goes through its shared control pages, where ranks in
*different* collectives see each other's operation at once). Either way a peer that died while we waited is
reported as ``OdcPeerLostError`` naming its rank, as soon as its death is seen when it ran
on this machine, else after ``ODC_TIMEOUT`` as ``OdcTimeoutError`` naming the rank.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import socket
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Protocol, TypeVar

import torch.distributed as dist

from odc_runtime.errors import (
    DRIFT_HINT,
    ELSEWHERE_HINT,
    OdcBackendError,
    OdcError,
    OdcMemoryError,
    OdcMismatchError,
    OdcPeerLostError,
    OdcTimeoutError,
    OdcUsageError,
)
from odc_runtime.transport.wait import Backoff, wait_for

T = TypeVar("T")
H = TypeVar("H", bound=Hashable)

# -- processes ---------------------------------------------------------------------------------------------------
def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22); ``None`` if the
    process does not exist or ``/proc`` cannot tell. With the pid it identifies a process even after pid reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return int(fields[19])  # field 22 overall; the first two fields (pid, comm) were cut off
    except (OSError, IndexError, ValueError):
        return None


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether process ``pid`` exists, is not a zombie, and (if ``start_time`` is given) is the same process that
    had that start time, not a later one that reused the pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to someone else
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")
    if not fields or fields[0] == "Z":  # killed, not yet reaped by its parent
        return False
    return start_time is None or len(fields) < 20 or int(fields[19]) == start_time


def pid_namespace() -> str:
    """Identity of this process's pid namespace (``""`` if unknown): pids of processes in another namespace (another
    container sharing ``/dev/shm``) cannot be checked from here."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


# Where a peer runs: pids can be checked only for peers with the same host name and pid namespace.
_HOST = f"{socket.gethostname()}|{pid_namespace()}"
_PID = os.getpid()
_START = process_start_time(_PID)


def _refresh_identity() -> None:
    global _PID, _START
    _PID, _START = os.getpid(), process_start_time(os.getpid())


os.register_at_fork(after_in_child=_refresh_identity)


def op_digest(op: str) -> bytes:
    """16-byte digest of an operation's full identity: two operations are the same collective iff equal."""
    return hashlib.blake2b(op.encode(), digest_size=16).digest()


def ranks_by_value(values: Iterable[tuple[int, H]]) -> dict[H, list[int]]:
    """``(rank, value)`` pairs -> the ranks that hold each value, values in order of first appearance."""
    out: dict[H, list[int]] = {}
    for rank, value in values:
        out.setdefault(value, []).append(rank)
    return out


def describe_calls(by_value: dict[H, list[int]], name: Callable[[H, int], str]) -> str:
    """``rank 0 called X; ranks [1, 2] called Y`` for a mismatch message: ``name(value, first rank)`` names what
    the ranks holding ``value`` called."""
    return "; ".join(
        f"{f'ranks {ranks}' if len(ranks) > 1 else f'rank {ranks[0]}'} called {name(value, ranks[0])}"
        for value, ranks in by_value.items()
    )


def shorten(text: str, limit: int = 160) -> str:
    """``text`` cut to ``limit`` characters for messages (the digest, not this, is what is compared)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- exchanges ---------------------------------------------------------------------------------------------------
class Exchange(Protocol):
    """A bounded all-gather of bytes: every rank calls ``exchange`` with the same ``op`` in the same order."""

    def exchange(self, op: str, payload: bytes, *, label: str | None = None) -> list[bytes]:
        """Return every rank's payload (indexed by rank). Raises OdcMismatchError if ranks are in different
        operations (``op`` is compared; ``label``, default ``op``, is what messages call it), OdcPeerLostError /
        OdcTimeoutError naming the ranks that did not arrive in time."""
        ...


# rank -> (host, pid, start time), learnt from every store round
_PEERS: dict[int, tuple[str, int, int | None]] = {}


class StoreExchange:
    """``Exchange`` through the default ``torch.distributed`` store with an explicit deadline.

    Round ``k`` of this process writes key ``odc_runtime/agree/<k>/<rank>`` and polls for the peers' keys. A
    rank deletes its key of round ``k-1`` once round ``k`` completed (every peer posted round ``k``, so every peer
    is done reading round ``k-1``). Peers' pids and hosts learnt in earlier rounds let a waiting rank tell a dead
    peer on its own machine from a slow one.
    """

    _round = itertools.count()  # shared by every instance: all ranks run the same rounds in the same order
    # Set when a round failed after this process posted its key (a timeout, a lost peer, an interrupt): peers may
    # have completed that round with it, so this process's round numbers no longer match theirs (fail-stop).
    _failed: str | None = None

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def exchange(self, op: str, payload: bytes, *, label: str | None = None) -> list[bytes]:
        rank, world = dist.get_rank(), dist.get_world_size()
        digest = op_digest(op).hex()
        op = op if label is None else label  # from here on: what messages say
        if StoreExchange._failed is not None:
            raise OdcUsageError(
                f"odc {shorten(op)}: cannot run after {StoreExchange._failed} in this process: peers may have "
                "completed that round with this rank, so the ranks' agreement rounds are no longer aligned and no "
                "retry can succeed; restart the job (every rank)"
            )
        store = _default_store()
        k = next(StoreExchange._round)
        keys = [f"odc_runtime/agree/{k}/{r}" for r in range(world)]
        header = {"op": shorten(op), "digest": digest, "host": _HOST, "pid": _PID, "start": _START}
        posted = False
        try:
            store.set(keys[rank], json.dumps(header).encode() + b"\n" + payload)
            posted = True
            self._wait(store, keys, rank, op)
            raw = [store.get(key) for key in keys]
        except BaseException as e:
            if posted:
                self._fail(store, k, rank, op, e)
            if isinstance(e, OdcError) or not isinstance(e, Exception):
                raise
            limit = _own_limit(e)
            if limit is not None:
                raise OdcBackendError(
                    f"odc {shorten(op)}: rank {rank} cannot use the torch.distributed store: this process hit "
                    f"{limit} ({type(e).__name__}: {e}); the store itself may be fine"
                ) from e
            raise OdcPeerLostError(
                f"odc {shorten(op)}: rank {rank} lost the torch.distributed store ({type(e).__name__}: {e}); the "
                "process hosting it (rank 0 under torch.multiprocessing, the launcher under torchrun) has died"
            ) from e
        return self._finish(store, k, rank, op, header, raw)

    @staticmethod
    def _fail(store: dist.Store, k: int, rank: int, op: str, error: BaseException) -> None:
        """Record the failure, and post a poisoned next round: a peer that completed round ``k`` with us and
        waits in round ``k + 1`` raises OdcMismatchError naming this failure at once, instead of timing out."""
        StoreExchange._failed = f"the failure of {shorten(op)!r} on rank {rank} ({type(error).__name__})"
        header = {"op": f"nothing: rank {rank} failed in {shorten(op, 80)!r}", "digest": "failed", "host": _HOST,
                  "pid": _PID, "start": _START}
        with contextlib.suppress(Exception):
            store.set(f"odc_runtime/agree/{k + 1}/{rank}", json.dumps(header).encode() + b"\n")

    def _finish(
        self, store: dist.Store, k: int, rank: int, op: str, header: dict, raw: list[bytes]
    ) -> list[bytes]:
        """Decode a completed round, remember the peers' identities, and compare the operations."""
        headers, payloads = [], []
        for blob in raw:
            head, _, body = bytes(blob).partition(b"\n")
            headers.append(json.loads(head))
            payloads.append(body)
        for r, h in enumerate(headers):
            _PEERS[r] = (h["host"], h["pid"], h["start"])
        if k > 0:
            with contextlib.suppress(Exception):  # housekeeping only; a store without delete keeps small keys
                store.delete_key(f"odc_runtime/agree/{k - 1}/{rank}")
        different = [r for r, h in enumerate(headers) if h["digest"] != header["digest"]]
        if different:
            listing = "; ".join(f"rank {r}: {h['op']!r}" for r, h in enumerate(headers))
            raise OdcMismatchError(
                f"odc collective mismatch: rank {rank} is in {shorten(op)!r} but rank(s) {different} are in another "
                f"collective ({listing}); every rank must call the same collectives in the same order; {DRIFT_HINT}"
            )
        return payloads

    def _wait(self, store: dist.Store, keys: list[str], rank: int, op: str) -> None:
        def check(missing: list[int], waited: float) -> None:
            dead = [r for r in missing if self._known_dead(r)]
            if dead:
                listing = ", ".join(f"rank {r} (pid {_PEERS[r][1]})" for r in dead)
                raise OdcPeerLostError(
                    f"odc {shorten(op)}: rank {rank} waited for {listing}, which died before reaching it "
                    f"(process gone after {waited:.1f} s of waiting)"
                )

        def timed_out(missing: list[int], waited: float) -> OdcTimeoutError:
            return OdcTimeoutError(
                f"odc {shorten(op)}: rank {rank} timed out after {self.timeout:g} s waiting for rank(s) "
                f"{missing}, which did not reach this collective within that time: they are stuck, dead on another "
                f"machine, or in a different collective. {ELSEWHERE_HINT}. Raise ODC_TIMEOUT if they are merely slow."
            )

        wait_for(
            [r for r in range(len(keys)) if r != rank], lambda r: store.check([keys[r]]),
            timeout=self.timeout, check=check, on_timeout=timed_out, backoff=Backoff(spins=20, step=1e-4, cap=5e-3),
        )

    def _known_dead(self, peer: int) -> bool:
        known = _PEERS.get(peer)
        if known is None or known[0] != _HOST:
            return False
        return not process_alive(known[1], known[2])


# Limits of this process that a store call reports (as an OSError, or as the text of torch's DistStoreError, e.g.
# 'Too many open files' when a FileStore cannot open its file): not a dead store host. ENFILE's text contains EMFILE's,
# so it is tried first.
_OWN_LIMITS = {
    errno.ENFILE: "the system's limit of open files; close files or raise fs.file-max",
    errno.EMFILE: "its limit of open files; raise it (ulimit -n, or resource.setrlimit(RLIMIT_NOFILE)) or close files "
                  "this process holds",
    errno.ENOMEM: "an out-of-memory condition; free memory on this machine",
}


def _own_limit(error: BaseException) -> str | None:
    """What limit of this process ``error`` (from a store call) reports, with what to do, or ``None``."""
    code = error.errno if isinstance(error, OSError) else None
    for limit, advice in _OWN_LIMITS.items():
        if code == limit or os.strerror(limit) in str(error):
            return f"{advice} [{os.strerror(limit)}]"
    return None


def _default_store() -> dist.Store:
    if not (dist.is_available() and dist.is_initialized()):
        raise OdcBackendError("odc_runtime needs torch.distributed.init_process_group() to have been called")
    # torch has no public getter for the default group's store; this one has existed since torch 1.x.
    return dist.distributed_c10d._get_default_store()


# -- checked collectives -----------------------------------------------------------------------------------------
def _jsonable_to_tuples(value: object) -> object:
    if isinstance(value, list):
        return tuple(_jsonable_to_tuples(v) for v in value)
    return value


def gather_checked(
    what: str,
    local: Callable[[], T],
    *,
    exchange: Exchange | None = None,
    timeout: float | None = None,
) -> list[T]:
    """Collective: run ``local()`` on every rank and return every rank's result (indexed by rank).

    ``local`` returns a JSON-serialisable value (tuples come back as tuples). If it raised on some rank, that
    rank raises its error (any non-``OdcError`` wrapped in ``OdcBackendError``) and every other rank
    raises ``OdcMismatchError`` naming the rank and its error (``OdcMemoryError`` when every failure
    was one). ``exchange`` defaults to a ``StoreExchange`` bounded by ``timeout`` (else ``ODC_TIMEOUT``).
    """
    error: OdcError | None = None
    value: T | None = None
    try:
        value = local()
    except OdcError as e:
        error = e
    except Exception as e:  # an untyped local failure must still reach the peers
        wrapped = OdcBackendError(f"odc {shorten(what)}: rank {_rank()} failed: {type(e).__name__}: {e}")
        wrapped.__cause__ = e
        error = wrapped
    record = {
        "value": value,
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "memory": isinstance(error, OdcMemoryError),
    }
    try:
        payload = json.dumps(record).encode()
    except TypeError as e:  # a caller bug: fail on every rank together instead of sending a stringified value
        error = OdcBackendError(f"odc {shorten(what)}: rank {_rank()}: the checked value is not JSON-serialisable: {e}")
        record = {"value": None, "error": f"{type(error).__name__}: {error}", "memory": False}
        payload = json.dumps(record).encode()
    if exchange is None:
        from odc_runtime import config

        exchange = StoreExchange(timeout if timeout is not None else config.resolve_timeout(None))
    try:
        raw = exchange.exchange(what, payload)
    except OdcError:
        if error is not None:
            raise error from None  # our own failure is the cause; the peers are told or time out on it
        raise
    if error is not None:
        raise error
    outcomes = [json.loads(r) for r in raw]
    failed = [(r, o["error"], o["memory"]) for r, o in enumerate(outcomes) if o["error"]]
    if failed:
        cls = OdcMemoryError if all(m for _, _, m in failed) else OdcMismatchError
        raise cls(f"odc {shorten(what)}: " + "; ".join(f"rank {r} rejected the call ({msg})" for r, msg, _ in failed))
    return [_jsonable_to_tuples(o["value"]) for o in outcomes]  # type: ignore[misc]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def require_same(
    what: str,
    values: Sequence[object],
    rule: str = "must be called with the same arguments, in the same order, on every rank",
) -> None:
    """Raise OdcMismatchError (on every rank, since every rank sees the same ``values``) unless all are equal."""
    if any(v != values[0] for v in values):
        listing = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise OdcMismatchError(f"odc {what} {rule}; got {listing}")
