"""What ODC did on this rank: counters, ``torch.profiler`` ranges and the per-minibatch trace.

* **Counters** (``stats``, also ``odc_runtime.stats``): calls of ``fetch``, ``push`` and ``sync`` that
  returned, the bytes they moved, the host seconds spent in ``sync`` and the minibatches ended, since ``init`` (or the
  last ``stats(reset=True)``). Counted on the calling thread by the core API (``fetch``, ``push``: inline, see
  ``counts``; ``sync``: its wrapper below), with no collective and no lock: two attribute adds per call
  (``bench/hostcost.py`` measures what they cost). Unlocked, so two threads calling at
  the same instant could lose a count; ODC's own callers (FSDP's hooks included: autograd's device thread runs
  while the trainer's thread waits in ``backward``) call from one thread at a time.
* **Profiler ranges.** While a ``torch.profiler`` records, every ``fetch``, ``push`` and ``sync`` runs inside a
  ``record_function`` range named ``odc.fetch``, ``odc.push``, ``odc.sync``; the gang exchange's steps inside
  ``odc.gang.*`` ranges (``span``). On GPUs the kernels and copies a call launches are attributed to its range
  by the profiler, as for torch's own ops. When no profiler records, the cost is one flag read.
* **Trace** (``ODC_TRACE_DIR``): each rank appends one JSON line per minibatch to ``<dir>/rank<r>.jsonl``, written
  and flushed when the minibatch ends (after its closing ``sync``), so a crash loses no finished minibatch. The
  trace is an observer: a rank whose file cannot be opened or written (a full disk) warns and traces no more, and
  the job goes on (the directory itself is checked at ``init``, on every rank together).
  Minibatches are marked by ``begin_minibatch`` / ``end_minibatch``: FSDP ODC mode marks its own; a
  core-API trainer calls them around each minibatch. ``python -m odc_runtime.report DIR`` draws the lines.

A trace line (``make_record``; one format for the runtime and ``bench/imbalance.py --trace-dir``)::

    {"v": 2, "run": "...", "label": null, "rank": 0, "world": 2, "minibatch": 3, "start": 1.7e9, "end": 1.7e9,
     "micro_batches": 4, "sync_wait_s": 0.12, "syncs": 2, "fetches": 96, "pushes": 48, "fetch_bytes": ...,
     "push_bytes": ..., "waits": [[t0, t1, "sync"], ...]}

``start``/``end`` and the ``waits`` intervals are wall-clock seconds (``time.time()``), comparable between the
ranks of one machine (across machines: as well as their clocks agree). ``run`` tells apart the runs appended to one
file and ties together the ranks' lines of one run (rank 0's ``run_id`` at ``init``, the same on every rank; version 1
lines had a per-rank id, paired by position); ``waits`` are the intervals the rank spent waiting (here: in
``sync``); the rest of ``[start, end]`` counts as busy.

``sync_wait_s`` is host time. On the host transport ``sync`` blocks until every peer arrived and every push landed;
on GPU transports ``sync`` returns once the barrier is queued on the stream and the host waits only for the
*previous* one, so the figure lags by one ``sync`` there (and device-side waiting shows in a profiler trace).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from odc_runtime import config, state
from odc_runtime.errors import OdcUsageError

log = logging.getLogger(__name__)

__all__ = ["FIELDS", "Minibatch", "TraceWriter", "begin_minibatch", "end_minibatch", "make_record", "span", "stats"]

#: The counters, in the order ``stats`` returns them.
FIELDS = ("fetches", "pushes", "syncs", "fetch_bytes", "push_bytes", "sync_wait_s", "minibatches")
TRACE_VERSION = 2  # 2: ``run`` is the job's id, the same on every rank (1: per rank)


class _Counters:
    __slots__ = FIELDS

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        for name in FIELDS:
            setattr(self, name, 0.0 if name == "sync_wait_s" else 0)

    def snapshot(self) -> dict[str, int | float]:
        return {name: getattr(self, name) for name in FIELDS}


#: This rank's counters since ``init``. ``fetch`` and ``push`` update them in place on their way out (two slot adds,
#: written out in ``odc_runtime.api``: a wrapper's extra call cost more than the counting itself). Cleared in place
#: at ``init`` only, never replaced, so a reference taken at import stays the live one; ``stats(reset=True)`` moves
#: the user's zero (``_stats_zero``) instead, so the trace's open minibatches never lose what they counted.
counts = _Counters()
_stats_zero = counts.snapshot()  # the counters at the user's last stats(reset=True) (or init)
_open: list[Minibatch] = []  # this rank's open minibatches (normally 0 or 1): each sync adds its interval to them
_trace: TraceWriter | None = None
_run = ""  # the job's run id in the trace, the same on every rank (agreed at init: run_id)
_next_index = 0  # the next minibatch's index since init
_NULL = nullcontext()


def stats(reset: bool = False) -> dict[str, int | float]:
    """This rank's figures since ``init`` (or since the last ``stats(reset=True)``), without any communication.

    Keys: ``fetches``, ``pushes``, ``syncs`` (calls that returned), ``fetch_bytes`` (the full tensor's bytes per
    fetch, this rank's own shard included), ``push_bytes`` (the gradient's bytes per push), ``sync_wait_s`` (host
    seconds in ``sync``: waiting for the peers and for pushes to land; see the module docstring for GPUs) and
    ``minibatches`` (ended by FSDP ODC mode or ``end_minibatch``). ``reset=True`` zeroes them after reading (these
    figures only: the trace's minibatch lines count every call, whenever the user resets).
    Usable before ``init`` (zeros) and after ``finalize`` (the ended runtime's figures); ``init`` zeroes them.
    """
    if not isinstance(reset, bool):
        raise OdcUsageError(f"odc_runtime.stats(): reset must be a bool, got {reset!r}")
    now = counts.snapshot()
    figures = {name: now[name] - _stats_zero[name] for name in FIELDS}
    if reset:
        _stats_zero.update(now)  # the user's zero only: the trace's minibatches measure from their own start
    return figures


# -- the core API's telemetry (odc_runtime.api; the counting happens after the call returned) ---------------------
def _profiler() -> tuple[Any, Callable[[str], AbstractContextManager]]:
    from torch.autograd import profiler  # api imports torch anyway; this module stays importable without it

    return profiler, profiler.record_function


def profiling() -> Any:
    """The ``torch.autograd.profiler`` module: ``profiling()._is_profiler_enabled`` says whether a profiler records
    (the one flag the core API reads per call)."""
    return _profiler()[0]


def open_range(name: str) -> AbstractContextManager:
    """The ``record_function`` range ``name``, entered: for a function that holds it over its whole body
    (``try: ... finally: close_range(r)``) instead of a ``with`` around a call of another function."""
    return _profiler()[1](name).__enter__()


def close_range(opened: AbstractContextManager) -> None:
    """Close a range of ``open_range``."""
    opened.__exit__(None, None, None)


def counted_sync(fn: Callable) -> Callable:
    """Wrap ``api.sync``: the ``odc.sync`` range while a profiler records; its host time counted as waiting (in
    the counters and in every open minibatch) once it returned."""
    profiler, record_function = _profiler()

    @functools.wraps(fn)
    def sync(*args: Any, **kwargs: Any) -> None:
        wall, t0 = time.time(), time.perf_counter()
        with record_function("odc.sync") if profiler._is_profiler_enabled else _NULL:
            fn(*args, **kwargs)
        waited = time.perf_counter() - t0
        counts.syncs += 1
        counts.sync_wait_s += waited
        for window in _open:
            window.waits.append((wall, wall + waited, "sync"))

    return sync


def span(name: str) -> AbstractContextManager:
    """A ``torch.profiler.record_function`` range named ``name`` while a profiler records, else a no-op context."""
    from torch.autograd import profiler

    return profiler.record_function(name) if profiler._is_profiler_enabled else _NULL


# -- lifecycle (called by api.init / api.finalize) ----------------------------------------------------------------
def check_trace_dir(arg: str | os.PathLike[str] | None = None) -> str | None:
    """The trace directory (``init(trace_dir=...)``, else ``ODC_TRACE_DIR``: ``odc_runtime.config.trace_dir``),
    created if missing; part of ``init``'s checks, so a bad value fails every rank together."""
    directory = config.trace_dir(arg)
    if directory is None:
        return None
    where = f"trace directory {directory!r} (init(trace_dir=...) / ODC_TRACE_DIR)"
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OdcUsageError(f"{where} cannot be created ({e}); point it at a writable directory") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OdcUsageError(f"{where} is not writable; point it at a writable directory")
    return directory


def run_id() -> str:
    """A fresh id for a run of the job (its start time, process and a random part): ``init`` takes rank 0's, so
    every rank's trace lines of one run carry the same one and the report pairs them by it."""
    return f"{time.time():.6f}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def start(rank: int, trace_dir: str | None, run: str) -> None:
    """A runtime started on this rank: zero the counters, forget open minibatches, open the trace if asked; its
    lines carry ``run`` (``run_id``, the same on every rank)."""
    global _trace, _run, _next_index
    stop()
    counts.clear()
    _stats_zero.update(counts.snapshot())
    _open.clear()
    _next_index = 0
    _run = run
    if trace_dir is not None:
        try:
            _trace = TraceWriter(trace_dir, rank)
        except OdcUsageError as e:  # the directory was agreed usable at init: this rank's file alone is not
            log.warning("odc_runtime: not tracing on this rank: %s", e)
        else:
            log.info("odc_runtime: tracing minibatches to %s", _trace.path)


def _stop_tracing(error: OSError) -> None:
    """A trace write failed (a full disk, an I/O error): the trace is an observer, so it must never fail or hold up
    the job. Warn once and trace no more on this rank; the lines written so far stay."""
    global _trace
    trace, _trace = _trace, None
    if trace is None:
        return
    log.warning("odc_runtime: the trace file %s cannot be written (%s); tracing stops on this rank, the job goes on",
                trace.path, error)
    with contextlib.suppress(OSError):  # its buffered line cannot be flushed either
        trace.close()


def stop() -> None:
    """The runtime ended: close the trace (the counters stay readable). Never raises: an unwritable trace is
    warned of (``_stop_tracing``), so ``finalize`` always goes on to release the transport."""
    global _trace
    if _trace is not None:
        try:
            _trace.close()
        except OSError as e:
            _stop_tracing(e)
        _trace = None


# -- minibatches ---------------------------------------------------------------------------------------------------
class Minibatch:
    """A minibatch open on this rank (``begin_minibatch``); collects the intervals spent in ``sync``."""

    def __init__(self, label: str | None) -> None:
        self.label = label
        self.start = time.time()
        self.waits: list[tuple[float, float, str]] = []
        self._base = counts.snapshot()


def begin_minibatch(label: str | None = None) -> Minibatch:
    """Open a minibatch on this rank (``label`` tells apart the kinds of minibatches in one trace). Call
    ``end_minibatch`` with the result after the minibatch's closing ``sync``, or ``abandon_minibatch``."""
    state.require("telemetry.begin_minibatch", read_only=True)
    window = Minibatch(label)
    _open.append(window)
    return window


def abandon_minibatch(window: Minibatch) -> None:
    """Close ``window`` without a record (the minibatch failed)."""
    if window in _open:
        _open.remove(window)


def end_minibatch(window: Minibatch, micro_batches: int) -> dict[str, Any]:
    """Close ``window``: count the minibatch, append its line to the trace (``ODC_TRACE_DIR``) and return it
    (``make_record``'s fields: what this rank did between ``begin_minibatch`` and now)."""
    global _next_index
    runtime = state.require("telemetry.end_minibatch", read_only=True)
    if window not in _open:
        raise OdcUsageError("odc_runtime.telemetry.end_minibatch(): this minibatch is not open (ended twice?)")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 0:
        raise OdcUsageError(f"odc_runtime.telemetry.end_minibatch(): micro_batches must be an int >= 0, "
                            f"got {micro_batches!r}")
    _open.remove(window)
    counts.minibatches += 1
    now = counts.snapshot()
    delta = {k: now[k] - window._base[k] for k in ("fetches", "pushes", "syncs", "fetch_bytes", "push_bytes",
                                                    "sync_wait_s")}
    record = make_record(
        rank=runtime.transport.rank, world=runtime.transport.world_size, minibatch=_next_index, start=window.start,
        end=time.time(), micro_batches=micro_batches, waits=window.waits, label=window.label, run=_run, **delta,
    )
    _next_index += 1
    if _trace is not None:
        try:
            _trace.write(record)
        except OSError as e:
            _stop_tracing(e)
    return record


def make_record(
    *, rank: int, world: int, minibatch: int, start: float, end: float, micro_batches: int,
    waits: list[tuple[float, float, str]], label: str | None = None, run: str = "", sync_wait_s: float | None = None,
    **figures: int,
) -> dict[str, Any]:
    """One trace line: who (``rank`` of ``world``, ``run``, ``label``), which ``minibatch``, when (wall seconds),
    ``micro_batches`` run, the waiting intervals ``(t0, t1, kind)`` (``kind``: ``"sync"``, or ``"comm"`` for a
    collective's wait in the main job), ``sync_wait_s`` (default: the ``sync`` intervals' total; the runtime passes
    its exact sum, which wall-clock differences round) and ``figures`` (``fetches``, ``pushes``, ``syncs``,
    ``fetch_bytes``, ``push_bytes``; absent where not measured)."""
    unknown = set(figures) - {"fetches", "pushes", "syncs", "fetch_bytes", "push_bytes"}
    if unknown:
        raise TypeError(f"make_record(): unknown figures {sorted(unknown)}")
    return {
        "v": TRACE_VERSION, "run": run, "label": label, "rank": rank, "world": world, "minibatch": minibatch,
        "start": start, "end": end, "micro_batches": micro_batches,
        "sync_wait_s": sum(t1 - t0 for t0, t1, kind in waits if kind == "sync") if sync_wait_s is None
        else sync_wait_s, **figures,
        "waits": [[t0, t1, kind] for t0, t1, kind in waits],
    }


class TraceWriter:
    """Appends trace lines to ``<directory>/rank<rank>.jsonl`` (the directory made if missing), each flushed as
    written."""

    def __init__(self, directory: str, rank: int) -> None:
        self.path = os.path.join(directory, f"rank{rank}.jsonl")
        try:
            os.makedirs(directory, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  (held until close())
            if _ends_torn(self.path):  # a crash cut the last line: end it, so this run's first line stands alone
                self._file.write("\n")
        except OSError as e:
            raise OdcUsageError(f"cannot open the trace file {self.path!r} ({e}); point the trace (ODC_TRACE_DIR) "
                                "at a writable directory") from None

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _ends_torn(path: str) -> bool:
    """Whether the file at ``path`` is non-empty and does not end with a newline (its last line was cut)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


_LINE_START = '{"v":'  # every trace line starts so (make_record's first key, written without spaces)


def records(path: str) -> Iterator[dict[str, Any]]:
    """The lines of one trace file, parsed. A torn line (a crash while writing it) is skipped with a warning: at the
    end of the file, or glued to the first line a restart appended after it (traces written before writers ended a
    torn line first); anything else that is not a trace line is an OdcUsageError."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        record = _parse(line, where)
        if record is None:  # not JSON: torn if it is a last line without its newline, or one a later writer ended
            glued = line.rfind(_LINE_START)
            record = _parse(line[glued:], where) if glued > 0 else None
            if record is None and not (i == len(lines) - 1 or line.startswith(_LINE_START)):
                raise OdcUsageError(f"{where}: not a trace line (JSON): {line[:80]!r}")
            log.warning("%s: skipping a torn line (a crash while writing it)", where)
            if record is None:
                continue
        yield record


def _parse(line: str, where: str) -> dict[str, Any] | None:
    """``line`` as a trace record; ``None`` when it is not JSON; OdcUsageError for JSON that is no record."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not (isinstance(record, dict) and "run" in record and "rank" in record):
        raise OdcUsageError(f"{where}: not a trace line (a JSON object with its run and rank): {line[:80]!r}")
    return record
