"""The one-node Triton transport: the data plane and fences are Triton kernels over a ``PeerHeap``.

Protocol, ordering arguments and deadlock freedom: docs/design.md, "One-node Triton transport (symm, symm-cpu)".
In short:

* **push** is one launch of ``push_kernel``: fused cast, scale and fp32 atomic add
  into each owner's region through its peer pointer (deterministic mode: quantise and int64 atomic add, in the
  same kernel for a synchronous push). **fetch** is one launch of the copy kernel.
* **put_signal** is one launch: the data, then (last block of each row) a release add on the peer's signal word.
  **wait_signal** is an acquire spin on the local word that also watches this rank's abort word.
* **barrier** / **group_barrier**: one kernel announces the round number into every member's word (release max)
  and spins until every member's word in its own row reached it (acquire), watching the abort word.
* The host side is the host transport's control plane, inherited: the control pages carry rounds (epoch, op
  digest), liveness (pid, start time) and status; ``HostTransport.exchange`` is the payload round of
  ``shard`` / ``alloc``; allocation is the host transport's (same offsets on every rank). Every kernel wait runs
  under the transport's one persistent **watchdog** thread (``watch``: the host transport's own bounded wait,
  ``HostTransport._wait_for_peers``): it names a dead or failed peer within a liveness period, a crossed
  collective, or the missing ranks at ``ODC_TIMEOUT``, and then raises the abort word that ends the kernel's spin.
  On a GPU a world barrier is stream-ordered (``SymmTransport.ordered_barriers``): the call returns after the
  launch and the next call that needs the round's outcome *settles* it (``SymmTransport.settle``).

Symmetric control words at heap offset 0 (allocated first, so at the same offset on every rank): the abort word,
then one row of ``world`` int64 barrier words for the world and one per group index.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch

from odc_runtime.agree import op_digest, shorten
from odc_runtime.errors import (
    DRIFT_HINT,
    OdcBackendError,
    OdcCrossedCollectivesError,
    OdcRoundMismatchError,
    OdcUsageError,
)
from odc_runtime.transport.base import (
    Capabilities,
    FetchRequest,
    Group,
    Piece,
    PushRequest,
    PutRequest,
    SymmetricBuffer,
    TransferPlan,
)
from odc_runtime.transport.heap import ALIGNMENT
from odc_runtime.transport.host.control import NAME_BYTES
from odc_runtime.transport.host.fences import MAX_GROUPS
from odc_runtime.transport.host.segments import CONTROL_BYTES
from odc_runtime.transport.host.transport import HostTransport
from odc_runtime.transport.symm import heap as heaps
from odc_runtime.transport.symm.heap import PeerHeap, SegmentHeap
from odc_runtime.transport.symm.plan import SymmPlan
from odc_runtime.transport.symm.watch import Entry, Watchdog

log = logging.getLogger("odc_runtime.transport.symm")

_DONE = 1  # kernel status word: the wait completed (else it was aborted)
_BARRIER_MARK = b"\0odc-kernel-barrier"  # control-page payload of a world round that is a kernel barrier
_ABORT_BYTES = 64  # the abort word, alone in its line
_KEEP_DESCS = 64  # generic-path descriptors kept (a training loop repeats a few patterns and addresses)


class SymmTransport(HostTransport):
    """Triton kernels over peer pointers for the data plane; the host control plane for rounds and liveness."""

    name = "symm-cpu"
    device_type = "cpu"
    capabilities = Capabilities(signals=True, group_fences=True, nodes=False, deterministic=True)
    # Whether a world barrier returns right after its launch, settled by the next call (GPU: the host does not
    # wait for the stream). On the CPU a launch is synchronous, so symm-cpu settles at once unless a test turns
    # this on to run the GPU's deferred settling.
    ordered_barriers = False

    def __init__(self, rank: int, world_size: int, job: str, **kwargs: object) -> None:
        super().__init__(rank, world_size, job, **kwargs)
        from odc_runtime.kernels import peer as kernels  # after the caller set the interpreter up (cpu.py)

        self.kernels = kernels
        # First allocation of the same sequence on every rank: offset 0 everywhere.
        self._row_bytes = -(-world_size * 8 // ALIGNMENT) * ALIGNMENT
        self._words_bytes = _ABORT_BYTES + (1 + MAX_GROUPS) * self._row_bytes
        self._words = self._allocator.alloc(self._words_bytes, "the transport's signal and abort words")
        self.heap: PeerHeap | None = None
        self._abort_lock = threading.Lock()
        self._pending: Entry | None = None  # the stream-ordered barrier not settled yet (at most one)
        # Descriptors of the generic (unplanned) fetch/push path by their rows, oldest dropped first: a descriptor is
        # read by kernels queued on a stream, so it is never rewritten, only dropped (the caching allocator keeps
        # its memory until those kernels ran).
        self._descs: dict[tuple, torch.Tensor] = {}
        # A signalled put's signal-word offsets and its per-row counters, by (words, stream): kept like the
        # descriptors, the counters zeroed on the stream before each reuse (a kernel counts its blocks in them).
        self._signal_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._watchdog: Watchdog | None = None
        # Filled once the peers are mapped (map_peers), emptied by finalize, which also runs after a failed init
        self._group_members: dict[int, torch.Tensor] = {}  # group index -> its members, on the device
        self._row_words: dict[int, torch.Tensor] = {}  # barrier row -> its member words in this rank's heap
        # (barrier row, stream) -> (its members tensor, the bound launch of its barrier: launch(epoch))
        self._barriers: dict[tuple[int, object], tuple[torch.Tensor, Callable[[int], None]]] = {}

    # -- setup ----------------------------------------------------------------------------------------
    def create_segment(self) -> tuple[int, int]:
        identity = super().create_segment()
        seg = self.segments.get(self.rank)
        self.segments.reserve(seg.fd, CONTROL_BYTES + self._words, self._words_bytes, "the signal and abort words")
        return identity

    def map_peers(self, identities: Sequence[tuple[int, int, str]]) -> None:
        super().map_peers(identities)
        self.heap = self.open_heap()
        self._table = self.heap.peer_bases
        # Whether every heap base in this process is 16-byte aligned (read once: on a GPU the table is on the
        # device), so a row's own offsets decide the kernels' vector variant (kernels.rows_aligned).
        self._heaps_aligned = all(base % self.kernels.ALIGN == 0 for base in self._table.tolist())
        self._members = torch.arange(self.world_size, dtype=torch.int32, device=self.heap.device)
        self._abort = self.abort_word()
        # What every waiting kernel writes (status word, last value or member words): one block, reused, since one
        # wait at a time is outstanding (each settles the previous first); read only on an abort.
        self._status = torch.zeros(2 + self.world_size, dtype=torch.int64, device=self.heap.device)
        self._watchdog = Watchdog(self)

    def open_heap(self) -> PeerHeap:
        """The symmetric heap the kernels work on (called once every rank mapped every segment): here the
        segments' heaps; a transport over another provider overrides this (and ``alloc``, which views and
        reserves segment memory)."""
        return SegmentHeap(self.segments, self.rank, self.world_size, self._allocator.capacity)

    def abort_word(self) -> torch.Tensor:
        """This rank's abort word (one int64 the waiting kernels poll), in host memory so that raising it is a plain
        host store (``_raise_abort``): here the word at the heap's offset 0, which is host memory on CPU ranks; a
        GPU transport overrides this with a page-locked word mapped into the device's address space."""
        return self._int64(self._words, 1)

    def _int64(self, offset: int, numel: int) -> torch.Tensor:
        """``numel`` int64 words at byte ``offset`` of this rank's heap."""
        assert self.heap is not None
        return self.heap.local[offset : offset + 8 * numel].view(torch.int64)

    def _row_offset(self, row: int) -> int:
        return self._words + _ABORT_BYTES + row * self._row_bytes

    # -- one-sided operations -------------------------------------------------------------------------
    def plan(self, buf: SymmetricBuffer, kind: str, pieces: Sequence[Piece]) -> TransferPlan:
        return SymmPlan(self, buf, kind, pieces, self.stream_key())

    def _rows(self, buf: SymmetricBuffer, peers_offsets_tensors: list[tuple[int, int, torch.Tensor]]) -> tuple:
        """The descriptor tensor of ``(peer, byte offset in the peer's heap, local address, numel)`` rows, the
        longest row and whether the rows may take the kernels' vector variant."""
        itemsize = buf.dtype.itemsize
        if any(t.device != self.device for _, _, t in peers_offsets_tensors):
            raise OdcUsageError(f"symm: local tensors must be on {self.device} (the kernels read them there)")
        rows = tuple((p, buf.handle + off * itemsize, t.data_ptr(), t.numel()) for p, off, t in peers_offsets_tensors)  # type: ignore[operator]
        desc = self._descs.get(rows)
        if desc is None:  # a new pattern or caller address: one host-to-device copy, then reused
            desc = torch.tensor(rows, dtype=torch.int64, device=self.device).reshape(-1, 4)
            if len(self._descs) >= _KEEP_DESCS:
                del self._descs[next(iter(self._descs))]
            self._descs[rows] = desc
        return desc, max((r[3] for r in rows), default=0), self.kernels.rows_aligned(rows, self._heaps_aligned)

    def _fetch_now(self, buf: SymmetricBuffer, requests: Sequence[FetchRequest]) -> None:
        self.check_usable("fetch")
        work = [(r.peer, r.offset, r.dst) for r in requests if r.dst.numel()]
        if not work:
            return
        if any(not t.is_contiguous() or t.dtype != buf.dtype for _, _, t in work):
            raise OdcUsageError(f"symm fetch: destinations must be contiguous {buf.dtype} tensors")
        if any(t.device != self.device for _, _, t in work):
            raise OdcUsageError(f"symm: local tensors must be on {self.device} (the kernels read them there)")
        small = []
        for peer, off, t in work:
            if t.numel() * buf.dtype.itemsize >= heaps.COPY_MIN_BYTES:
                t.view(-1).copy_(self.peer_region(buf, peer, off, t.numel()))  # the copy engines, stream-ordered
            else:
                small.append((peer, off, t))
        if small:
            desc, longest, aligned = self._rows(buf, small)
            self.kernels.fetch(self._table, desc, longest, buf.dtype, aligned)

    def peer_region(self, buf: SymmetricBuffer, peer: int, offset: int, numel: int) -> torch.Tensor:
        """Elements ``[offset, offset + numel)`` of ``peer``'s part of ``buf``: a view of its heap in this process
        (what the copy engines read from)."""
        assert self.heap is not None
        start = buf.handle + offset * buf.dtype.itemsize  # type: ignore[operator]
        return self.heap.peer_view(peer)[start : start + numel * buf.dtype.itemsize].view(buf.dtype)

    def _push_now(self, buf: SymmetricBuffer, requests: Sequence[PushRequest], scale: float) -> None:
        self.check_usable("push")
        exact = buf.dtype == torch.int64  # deterministic mode: int64 sources added exactly (Capabilities)
        if buf.dtype != torch.float32 and not exact:
            raise OdcUsageError(
                f"symm push: accumulators are float32 (or int64 fixed point), buffer {buf.tag!r} is {buf.dtype}"
            )
        by_dtype: dict[torch.dtype, list[tuple[int, int, torch.Tensor]]] = {}
        for r in requests:
            if r.src.numel():
                src = r.src.detach().reshape(-1).contiguous()
                if exact and (src.dtype != torch.int64 or scale != 1.0):
                    raise OdcUsageError(
                        f"symm push into the int64 buffer {buf.tag!r}: sources must be int64 and the scale 1 (an "
                        f"exact integer add), got {src.dtype} with scale {scale}"
                    )
                by_dtype.setdefault(src.dtype, []).append((r.peer, r.offset, src))
        launches = [(dtype, *self._rows(buf, work)) for dtype, work in by_dtype.items()]

        def launch_all() -> None:
            for dtype, desc, longest, aligned in launches:
                self.kernels.push(self._table, desc, longest, scale, dtype, buf.dtype, aligned=aligned)

        self.fail_stop("push", "part of the push may have landed", launch_all)

    # -- signalled puts -------------------------------------------------------------------------------
    def _signal_offset(self, signal: SymmetricBuffer, index: int) -> int:
        if signal.dtype != torch.int64 or not 0 <= index < signal.numel:
            raise OdcUsageError(
                f"symm signal: word {index} of a {signal.dtype} buffer of {signal.numel}; signals are int64 words"
            )
        return signal.handle + index * 8  # type: ignore[operator]

    def put_signal(self, buf: SymmetricBuffer, requests: Sequence[PutRequest], signal: SymmetricBuffer) -> None:
        self.check_usable("put_signal")
        self.quiet()  # asynchronous operations issued before come first, as on a stream
        work, words = [], []
        for req in requests:  # validate everything before writing anything
            if req.src.dtype != buf.dtype or req.offset < 0 or req.offset + req.src.numel() > buf.numel:
                raise OdcUsageError(
                    f"symm put_signal: {req.src.numel()} {req.src.dtype} elements at offset {req.offset} do not fit "
                    f"buffer {buf.tag!r} ({buf.numel} {buf.dtype})"
                )
            words.append(self._signal_offset(signal, req.signal_index))
            work.append((req.peer, req.offset, req.src.detach().reshape(-1).contiguous()))
        if not work:
            return
        desc, longest, _ = self._rows(buf, work)  # put_signal has no vector variant
        offsets, counters = self._signal_words(tuple(words))
        self.fail_stop(
            "put_signal", "some of its puts were delivered",
            lambda: self.kernels.put_signal(self._table, desc, longest, buf.dtype, offsets, counters),
        )

    def _signal_words(self, words: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The signal-word offsets of a put's rows and zeroed counters for them: made once per pattern and stream
        (one host-to-device copy), then reused with the counters zeroed in stream order (no allocation, no copy)."""
        key = (words, self.stream_key())
        entry = self._signal_scratch.get(key)
        if entry is not None:
            entry[1].zero_()  # after the previous put of this pattern on this stream, before the next
            return entry
        entry = (torch.tensor(words, dtype=torch.int64, device=self.device),
                 torch.zeros(len(words), dtype=torch.int64, device=self.device))
        if len(self._signal_scratch) >= _KEEP_DESCS:
            del self._signal_scratch[next(iter(self._signal_scratch))]
        self._signal_scratch[key] = entry
        return entry

    def wait_signal(self, signal: SymmetricBuffer, index: int, value: int, op: str, peers: Sequence[int]) -> None:
        self.check_usable(shorten(op))
        self.settle()
        self.quiet()  # as on a stream: this rank's earlier asynchronous operations come first
        word = self._int64(self._signal_offset(signal, index), 1)
        self._watched(
            op, list(peers) or [self.rank], lambda _: int(word.item()) >= value, lambda _: None,
            f" (their puts did not arrive: signal word {index} stayed below {value})",
            lambda: self.kernels.wait(word, value, self._abort, self._status),
        )

    # -- barriers -------------------------------------------------------------------------------------
    def barrier(self, op: str = "barrier") -> None:
        self.check_usable(shorten(op))
        self.settle()
        self._quiet_then_meet(lambda: self.fail_stop(shorten(op), "this rank announced its arrival",
                                                     lambda: self._world_round(op), aligned=(OdcRoundMismatchError,)))

    def _world_round(self, op: str) -> None:
        digest = op_digest(op)
        # Rounds stay aligned with exchange(): the same epochs, and the marker payload tells a peer's watchdog that
        # this round is a kernel barrier (which will meet it) rather than an exchange (which never will).
        self.control.announce(digest, op.encode()[:NAME_BYTES], _BARRIER_MARK)
        epoch = self.control.epoch
        peers = [p for p in range(self.world_size) if p != self.rank]

        def same_collective() -> None:  # the kernel met every peer in this round: it must have been the same one
            assert self.control.epoch == epoch  # settled before the next round is announced
            for p in peers:
                other = self._other_op(digest, p)
                if other is not None:  # every rank completed the round, so the rounds stay aligned: an ordinary error
                    raise OdcRoundMismatchError(self._mismatch(op, p, other))

        self._kernel_barrier(op, 0, self._members, peers, epoch, lambda p: self._watch_world(op, digest, p),
                             after=same_collective, ordered=self.ordered_barriers)

    def _other_op(self, digest: bytes, peer: int) -> tuple[str, bytes] | None:
        """``(name, payload)`` of the collective ``peer`` announced at this round if it is not ours, else ``None``
        (also while it has not reached the round). A peer is at most one round ahead, so its op at our round is
        its current or its previous one."""
        state = self.control.read(peer)
        epoch = self.control.epoch
        if state.epoch < epoch:
            return None
        at_ours = state.epoch == epoch
        theirs, name = (state.digest, state.name) if at_ours else (state.prev_digest, state.prev_name)
        if theirs == digest:
            return None
        return name.decode(errors="replace"), self.control.payload(state, epoch)

    def _mismatch(self, op: str, peer: int, other: tuple[str, bytes]) -> str:
        return (
            f"odc collective mismatch at barrier #{self.control.epoch}: rank {self.rank} is in {shorten(op)!r} but "
            f"rank {peer} is in {other[0]!r}; every rank must call the same collectives (shard, free, sync, "
            f"finalize) in the same order; {DRIFT_HINT}"
        )

    def _watch_world(self, op: str, digest: bytes, peer: int) -> None:
        """While waiting for ``peer`` in a world barrier: it is in an exchange (not a barrier, so it never meets
        this one) at this round, or it waits in a group fence for this rank."""
        other = self._other_op(digest, peer)
        if other is not None and other[1] != _BARRIER_MARK:
            raise OdcCrossedCollectivesError(self._mismatch(op, peer, other))  # neither can ever meet the other
        self.fences.check_not_waiting_for_us(op, peer)

    def _fence(self, op: str, group: Group) -> None:
        """One group fence (the host transport's ``group_barrier`` validates and wraps it): the kernel barrier on
        the group's row, its fence number published on the control page for crossed-collective detection."""
        epoch = self.fences.enter(group, op)
        members = self._group_members.get(group.index)
        if members is None or members.numel() != len(group.ranks):
            members = torch.tensor(group.ranks, dtype=torch.int32, device=self.device)
            self._group_members[group.index] = members  # a group index names one set of ranks for the run
        peers = [p for p in group.ranks if p != self.rank]
        self._kernel_barrier(op, 1 + group.index, members, peers, epoch, lambda p: self._check_not_crossed(op, p),
                             what=f" (group fence #{epoch} of ranks {list(group.ranks)})",
                             after=lambda: self.fences.leave(group, epoch))

    def _kernel_barrier(self, op: str, row: int, members: torch.Tensor, peers: list[int], epoch: int,
                        watch: Callable[[int], None], what: str = "", *, after: Callable[[], None] | None = None,
                        ordered: bool = False) -> None:
        offset = self._row_offset(row)
        words = self._row_words.get(row)
        if words is None:  # a view of the heap, which lives as long as the transport: made once per row
            words = self._row_words[row] = self._int64(offset, self.world_size)
        self._watched(op, peers, lambda p: int(words[p]) >= epoch, watch, what,
                      lambda: self._launch_barrier(row, members, offset, epoch), after=after, ordered=ordered)

    def _launch_barrier(self, row: int, members: torch.Tensor, offset: int, epoch: int) -> None:
        """The barrier kernel on ``row``: through its bound launch once one exists for this row, members and stream
        (``kernels.bind_barrier``: only the epoch changes from call to call), else through the cached path, binding
        it for the next call."""
        key = (row, self.stream_key())
        bound = self._barriers.get(key)
        if bound is not None and bound[0] is members:
            bound[1](epoch)
            return
        self.kernels.barrier(self._table, members, self.rank, offset, epoch, self._abort, self._status)
        stream = key[1] if isinstance(key[1], int) else None
        launch = self.kernels.bind_barrier(self._table, members, self.rank, offset, epoch, self._abort, self._status,
                                           stream)
        if launch is not None:
            self._barriers[key] = (members, launch)

    # -- the watchdog and settling ----------------------------------------------------------------------
    def _watched(self, op: str, peers: list[int], arrived: Callable[[int], bool], watch: Callable[[int], None],
                 what: str, launch: Callable[[], None], *, after: Callable[[], None] | None = None,
                 ordered: bool = False) -> None:
        """Run a waiting kernel (``launch``) under the watchdog (``watch``), then settle it, or leave it
        pending when ``ordered`` (the next call settles it).

        The watchdog polls what the kernel waits for (``arrived``; on a GPU only the kernel's event, since a read of
        device memory would queue behind the spinning kernel), checks liveness, peer status and ``watch`` every
        liveness period, and at the first error (dead or failed peer, crossed collective, ``ODC_TIMEOUT``) finishes
        the entry with it, records the failure and raises the abort word, which ends the kernel's spin. ``after``
        runs once the kernel completed (the round's mismatch check, a fence's bookkeeping)."""
        assert self._watchdog is not None and self._pending is None
        on_host = self.device.type == "cpu"
        entry = Entry(op, peers, arrived if on_host else None, watch, what, after)
        if on_host:
            self._watchdog.arm(entry)  # the launch below runs the kernel to its end: watched from before it
            try:
                launch()
            except BaseException as e:
                self._watchdog.finish(entry, e)  # the kernel is not spinning any more: stop watching it
                raise
        else:
            launch()
            import torch.cuda

            entry.event = torch.cuda.Event()
            entry.event.record(torch.cuda.current_stream(self.device))
            self._watchdog.arm(entry)
        if ordered:
            self._pending = entry
            return
        self._settle(entry)

    def settle(self) -> None:
        """Complete the stream-ordered barrier still pending, if any: wait (bounded by the watchdog's deadline)
        until it is finished and raise its error or the round's mismatch. Every call that needs a round's outcome
        calls this first; on the CPU nothing is ever pending unless ``ordered_barriers`` is set."""
        entry, self._pending = self._pending, None
        if entry is not None:
            self._settle(entry)

    def _settle(self, entry: Entry) -> None:
        assert self._watchdog is not None
        if entry.event is None:  # CPU: the launch returned, so the kernel completed or was aborted
            self._watchdog.finish(entry)
        else:
            self._watchdog.wait_finished(entry, entry.complete)
        if entry.error is not None:
            self.failure_raised()
            raise entry.error
        if entry.event is None and int(self._status[0]) != _DONE:
            raise self.fail(OdcBackendError(f"odc {shorten(entry.op)}: the wait was aborted (the abort word is up)"))
        if entry.after is not None:
            entry.after()

    def exchange(self, op: str, payload: bytes, *, label: str | None = None) -> list[bytes]:
        self.settle()  # an exchange round follows the barrier round before it: that one's outcome first
        return super().exchange(op, payload, label=label)

    def group_barrier(self, op: str, group: Group) -> None:
        self.settle()
        super().group_barrier(op, group)

    def _raise_abort(self) -> None:
        """Raise this rank's abort word: every waiting kernel of this rank leaves its spin. Never lowered.

        A host store, never a launch: the word is host memory (``abort_word``), so the abort cannot queue behind the
        kernel it must stop (a store on a stream, even a side stream from torch's pool, can be ordered after the
        spinning barrier or wait for a full launch queue) and needs no stream at all."""
        with self._abort_lock:
            if self._abort.device.type != "cpu":
                raise OdcBackendError(f"odc symm: the abort word must be host memory, not {self._abort.device}")
            self._abort.fill_(1)

    # -- teardown -------------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Settle the last barrier (a finalize round: peers must not see this rank leave before it completed),
        then stop the watchdog and release everything; the settled error, if any, is raised after the release."""
        heap, self.heap = self.heap, None
        try:
            if self.failure is None and not self._closed:
                self.settle()
        finally:
            self._pending = None
            self._row_words.clear()
            self._barriers.clear()
            if self._watchdog is not None:
                self._watchdog.stop()
            try:
                super().finalize()
            finally:
                if heap is not None:
                    heap.close()
