"""A CPU model of the GPU side of ``odc_runtime._C`` for a job of several PEs in one process, so that the nvshmem
transport, its watchdog and the exit handler run for real against the device protocols of ``csrc/``.

Per PE: one stream (a FIFO of kernels; the transport's current, side and internal streams all map to it, which only
orders more than the GPU does), the symmetric words the kernels use (barrier epochs, signal words), the host-mapped
abort word and records, and the engine's deadline thread (its watches). Kernels are generators that follow the
``.cu`` files step by step and ``yield`` where the GPU kernel spins in ``wait_or_abort``:

* ``barrier_kernel`` (barrier.cu): quiet, then *leave if the abort is up* (announce nothing, record nothing), then
  announce the epoch to every PE, then wait for every PE's announcement or the abort (the first barrier kernel
  that gives up records its epoch and what it heard);
* ``push_locked_kernel`` (cells.cu): per cell, wait for the owner's cell lock (``Device.lock_free``: held by a
  third, slow or dead, PE while False) or the abort, which cuts the push short with cells unpushed;
* ``wait_signal_kernel`` / ``signal_kernel`` (signal.cu): a wait *returns to the host at once* and holds the
  stream until the count arrives or the abort releases it (the first that gives up records its id and count);
  a signal is not sent once the abort is up.

The GPU advances whenever the host looks at it (an event query, ``aborted()``, ``watching()``), and the deadline
thread is checked then too: the oldest watch past its deadline raises the abort word, as ``csrc/engine.cu`` does.
"""

from __future__ import annotations

import inspect
import threading
import time
import types
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterator

import pytest
import torch

EVENT_DONE, EVENT_PENDING = 0, 1
_EVENTS: weakref.WeakValueDictionary[int, Event] = weakref.WeakValueDictionary()
ABORTED = "the transport was aborted after a timeout; restart the job"


class Device:
    """The GPUs of ``npes`` PEs; ``current`` is the PE whose transport the test is driving."""

    def __init__(self, npes: int) -> None:
        self.lock = threading.RLock()
        self.pes = [PE(self, r) for r in range(npes)]
        self.current = 0
        self.lock_free = True  # the owner's cell lock that locked pushes wait for

    def progress(self) -> None:
        with self.lock:
            moved = True
            while moved:
                moved = False
                for pe in self.pes:
                    pe.deadline_thread()
                    moved |= pe.run()


class PE:
    def __init__(self, device: Device, rank: int) -> None:
        self.device, self.rank = device, rank
        self.queue: deque[Iterator[None]] = deque()
        self.epochs: list[int] = []  # [q]: the last epoch q announced to this PE (symmetric words)
        self.signal: defaultdict[int, int] = defaultdict(int)  # signal words by symmetric offset
        self.abort = False
        self.expired = False
        self.watches: deque[tuple[Event, float]] = deque()
        self.barrier_epoch = 0
        self.heard: list[int] = []
        self.wait_id = 0
        self.wait_seen = 0
        self.cells_pushed = 0
        self.stream = Stream(self)

    def run(self) -> bool:
        """Run the stream's kernels until one waits; whether anything happened."""
        moved = False
        while self.queue:
            head = self.queue[0]
            started = inspect.getgeneratorstate(head) == inspect.GEN_CREATED  # type: ignore[arg-type]
            try:
                next(head)
            except StopIteration:
                self.queue.popleft()
                moved = True
                continue
            return moved or started
        return moved

    def deadline_thread(self) -> None:
        while self.watches and self.watches[0][0].reached:
            self.watches.popleft()
        if self.watches and not self.abort and time.monotonic() > self.watches[0][1]:
            self.expired = self.abort = True

    # -- kernels (csrc/barrier.cu, cells.cu, signal.cu) ------------------------------------------------------
    def barrier_kernel(self, epoch: int) -> Iterator[None]:
        if self.abort:  # quiet, then the abort check: never announce after an abort
            return
        for q in self.device.pes:
            q.epochs[self.rank] = epoch
        while not all(e >= epoch for e in self.epochs):
            if self.abort:
                if not self.barrier_epoch:
                    self.heard, self.barrier_epoch = list(self.epochs), epoch
                return
            yield

    def push_locked_kernel(self, cells: int) -> Iterator[None]:
        for _ in range(cells):
            while not self.device.lock_free:
                if self.abort:
                    return  # cut short: the remaining cells are not pushed
                yield
            self.cells_pushed += 1

    def wait_signal_kernel(self, sig: int, value: int, wait_id: int) -> Iterator[None]:
        while self.signal[sig] < value:
            if self.abort:
                if not self.wait_id:
                    self.wait_seen, self.wait_id = self.signal[sig], wait_id
                return
            yield

    def signal_kernel(self, targets: list[tuple[int, int]]) -> Iterator[None]:
        if self.abort:  # quiet, then the abort check: no signal after an abort
            return
        for pe, sig in targets:
            self.device.pes[pe].signal[sig] += 1
        yield from ()

    @staticmethod
    def noop() -> Iterator[None]:  # quiet, and every kernel that waits for nothing
        yield from ()

    @staticmethod
    def mark(event: Event) -> Iterator[None]:
        event.reached = True
        yield from ()


class Stream:
    """Every stream of a PE is its one FIFO (joins between streams are then implied)."""

    made = 0

    def __init__(self, pe: PE) -> None:
        Stream.made += 1
        self.pe, self.cuda_stream = pe, 1000 * (pe.rank + 1) + Stream.made

    def wait_stream(self, other: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass


class Event:
    """torch.cuda.Event: reached when its PE's stream gets there."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.reached = False
        self.pe: PE | None = None

    @property
    def cuda_event(self) -> int:
        _EVENTS[id(self)] = self
        return id(self)

    def record(self, stream: Stream | None = None) -> None:
        self.pe = (stream or device().pes[device().current].stream).pe
        self.pe.queue.append(PE.mark(self))
        self.pe.device.progress()

    def query(self) -> bool:
        if self.pe is not None:
            self.pe.device.progress()
        return self.reached


_DEVICE: list[Device] = []


class _Owner:
    """What a symmetric view keeps alive (weakly referenced by the free quarantine)."""


def device() -> Device:
    return _DEVICE[-1]


def extension(dev: Device) -> types.SimpleNamespace:
    """The fake ``odc_runtime._C`` over ``dev``: every launch queues the kernel that csrc/ would launch."""

    class Engine:
        def __init__(self, rank: int) -> None:
            self.pe = dev.pes[rank]
            self.pe.epochs = [0] * len(dev.pes)
            self.waits = 0

        def _launch(self, kernel: Iterator[None]) -> None:
            if self.pe.abort:  # engine.cu / plan.cu refuse every launch once the abort is up
                raise RuntimeError(ABORTED)
            self.pe.queue.append(kernel)
            dev.progress()

        def watch(self, stream: int, timeout_s: float) -> None:
            ev = Event()
            ev.record(self.pe.stream)
            self.pe.watches.append((ev, time.monotonic() + timeout_s))

        def watching(self) -> int:
            dev.progress()
            return sum(not ev.reached for ev, _ in self.pe.watches)

        def aborted(self) -> bool:
            dev.progress()
            return self.pe.abort

        def set_abort(self) -> None:
            self.pe.abort = True
            dev.progress()

        def deadline_passed(self) -> bool:
            return self.pe.expired

        def barrier(self, epoch: int, stream: int) -> None:
            self._launch(self.pe.barrier_kernel(epoch))

        def quiet(self, stream: int) -> None:
            self._launch(PE.noop())

        def barrier_gave_up(self) -> int:
            return self.pe.barrier_epoch

        def heard(self) -> list[int]:
            return list(self.pe.heard)

        def put_signal(self, remote, local, nbytes, pe, near, sig, stream) -> None:
            self._launch(self.pe.signal_kernel(list(zip(pe, sig, strict=True))))

        def wait_signal(self, sig: int, value: int, stream: int) -> int:
            self.waits += 1
            self._launch(self.pe.wait_signal_kernel(sig, value, self.waits))
            return self.waits

        def wait_gave_up(self) -> int:
            return self.pe.wait_id

        def wait_seen(self) -> int:
            return self.pe.wait_seen

    class Plan:
        def __init__(self, engine: Engine, kind: int, addr, rel, numel, pe, acc_dtype: int | None = None) -> None:
            self.engine, self.kind, self.cells = engine, kind, len(addr)

        def run(self, base: int, dtype: int, scale: float, stream: int) -> None:
            locked = self.kind == 4
            self.engine._launch(self.engine.pe.push_locked_kernel(self.cells) if locked else PE.noop())

    def query_event(event: int) -> int:
        return EVENT_DONE if _EVENTS[event].query() else EVENT_PENDING

    return types.SimpleNamespace(
        DTYPE_FLOAT32=0, DTYPE_BFLOAT16=1, DTYPE_FLOAT16=2, DTYPE_INT64=3, PLAN_FETCH_COPY=0, PLAN_FETCH_KERNEL=1,
        PLAN_FETCH_STAGED=2, PLAN_PUSH_ATOMIC=3, PLAN_PUSH_LOCKED=4, Plan=Plan, Engine=Engine,
        EVENT_DONE=EVENT_DONE, EVENT_PENDING=EVENT_PENDING, query_event=query_event,
    )


def transports(monkeypatch: pytest.MonkeyPatch, npes: int, timeout: float) -> tuple[Device, list]:
    """``npes`` nvshmem transports over one modelled device, every PE on its own node (no peer pointers: the
    locked push), each with ``timeout``. Drive them from one thread, one collective call per PE in turn."""
    from odc_runtime import config
    from odc_runtime.transport import nvshmem
    from odc_runtime.transport.nvshmem import memory as nv_memory
    from odc_runtime.transport.nvshmem import plans as nv_plans

    dev = Device(npes)
    _DEVICE.append(dev)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: dev.pes[dev.current].stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: dev.pes[dev.current].stream)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(nv_plans, "raw_stream", lambda index: dev.pes[dev.current].stream.cuda_stream)
    monkeypatch.setattr(nv_plans, "record", lambda t, stream: None)
    monkeypatch.setattr(nv_memory, "wrap", lambda ptr, n, device: (torch.zeros(n, dtype=torch.uint8), _Owner()))
    ext = extension(dev)
    out = []
    for rank in range(npes):
        dev.current = rank
        out.append(nvshmem.NvshmemTransport(
            ext, rank, npes, torch.device("cpu"), timeout, settings=config.NvshmemSettings(), scratch_slots=4,
            capacity=1 << 16, arena=1 << 40, peer_bases=[0] * npes, engine=ext.Engine(rank), atomic_push=False,
            node=1,
        ))
    return dev, out


def on(dev: Device, rank: int, call: Callable[[], object]) -> object:
    """Run ``call`` as PE ``rank`` (its current stream)."""
    dev.current = rank
    return call()
