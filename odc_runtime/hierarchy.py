"""Hierarchical push and fetch across nodes, written once above the transports.

Ranks form nodes of ``n`` consecutive ranks (``odc.init(node_size=...)`` / ``ODC_NODE_SIZE``, default the
transport's real node); with ``M = world / n`` nodes, rank ``r`` is on node ``r // n`` at local index ``r % n``.
Inside a node a transport has fast exact accumulates (NVLink atomics, shared memory); across nodes it has only
puts and gets. For a tensor sharded over all ranks (``S`` elements per owner) this module routes the core API's
transfers so that each byte crosses the network once per node and minibatch, not once per rank and micro-batch:

* **push** to an owner on the caller's node: accumulate into the owner's accumulator (as without nodes). Push to
  an owner ``o`` on another node ``d``: accumulate into the *staging* buffer of the caller's node-mate with ``o``'s
  local index (the *proxy*), row ``row(d)``: the node pre-reduces everything it sends to ``o``.
* **sync** (``gradients=True``), after a world barrier: every proxy sends each staging row with one
  put-with-signal into its slot of the owner's *inbox* (signal word = source node), waits until every other
  node's put for each tensor arrived in its own inbox, folds the slots into its accumulator with
  ``odc_runtime.kernels.accumulate_slots_`` (cast, sum of the slots and add in one pass; Triton on GPU),
  zeroes staging and inbox, and meets the others at a second world barrier.
* **fetch** from an owner on the caller's node reads the owner's shard; from an owner on another node it reads the
  proxy's *mirror* row, which the proxy refreshes at every ``sync`` with ``parameters=True`` (a get of each
  remote owner's shard, after the first barrier, so it sees every write made before the sync).

Memory, per rank and hierarchical tensor: ``(M-1)·S`` fp32 staging + ``K·S`` fp32 inbox + ``(M-1)·S``
parameter-dtype mirror, plus two ``int64`` signal words per node for the runtime. ``K`` (``node_slots``) is
``M-1`` by default; a smaller ``K`` flushes in ``ceil((M-1)/K)`` rounds, each slot reused only after the owner's
free signal. Staging and inbox take the dtype of the accumulator they feed: in deterministic mode
(``odc_runtime.deterministic``) the ``int64`` fixed-point one, so they are ``int64`` (8 bytes per element
instead of 4) and the fold is an exact integer sum.

Ordering (why sync is exact and cannot deadlock; docs/design.md has the long form):

1. A push issued before ``sync`` is complete at barrier 1 (barriers imply quiet), so the staging rows and the
   same-node accumulators hold every pre-sync push before any proxy reads a staging row.
2. A put-with-signal's signal is visible only after its data; the owner waits for the count of puts it expects
   (a running count per source node: words never reset), and only the owner reads its inbox, so a network write
   is never read by a GPU other than its target (``GPU_DIRECT_RDMA_WRITES_ORDERING = OWNER`` suffices).
3. No put into an inbox row can overtake the fold of the previous sync: the sender puts after barrier 1 of the
   next sync, which the owner reaches only after folding and zeroing.
4. No push lands in a staging row while its proxy sends it: pushers return from ``sync`` only after barrier 2,
   which the proxy reaches after its puts (stream order) and its zeroing.
5. Mirror gets run between the barriers: after barrier 1 (the owners' writes are fenced), before barrier 2
   (owners write their shards again only after it, and node-mates read the mirror only after it).
6. No deadlock: every rank runs the same sequence (barrier, puts, waits, barrier) with the same counts, because
   the list of hierarchical tensors changes only in collective calls and the flags of ``sync`` are the same on
   every rank; the puts never wait for anything, and every wait has the runtime's deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from odc_runtime import kernels
from odc_runtime.transport.base import (
    FetchRequest,
    Piece,
    PutRequest,
    SymmetricBuffer,
    TransferPlan,
    Transport,
    Work,
)


@dataclass(eq=False)
class _Buffers:
    """The hierarchical buffers of one tensor (rows of ``shard`` elements, one per other node)."""

    shard: int
    param: SymmetricBuffer
    grad: SymmetricBuffer | None
    mirror: SymmetricBuffer
    stage: SymmetricBuffer | None
    inbox: SymmetricBuffer | None

    def extra(self) -> tuple[SymmetricBuffer | None, ...]:
        """The buffers the hierarchy allocated for the tensor (in the order they are freed)."""
        return self.inbox, self.stage, self.mirror


@dataclass
class _Round:
    """One delivery round of the flush, seen from this rank."""

    sends: list[tuple[int, int, int, int]]  # (inbox slot at the owner, staging row, owner's node, owner)
    arrivals: list[tuple[int, int]]  # (source node, its sending rank) whose puts land in this round
    free_next: list[int]  # ranks that send to this rank in the next round: freed at the end of this one


class _AllWork(Work):
    """Completion of several transfers issued together."""

    def __init__(self, works: Sequence[Work]) -> None:
        self._works = list(works)

    def wait(self, timeout: float | None = None) -> None:
        for w in self._works:
            w.wait(timeout)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class SplitPlan(TransferPlan):
    """A fetch or push whose pieces go to two buffers: the owners' (same node) and the proxies' (other nodes)."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[TransferPlan], buf: SymmetricBuffer, kind: str, stream_key: object) -> None:
        pieces = [p for part in parts for p in part.pieces]
        super().__init__(parts[0].transport, buf, kind, pieces, stream_key)
        self.parts = tuple(parts)

    def run(self, tensor: torch.Tensor, scale: float = 1.0, *, async_op: bool = False) -> Work | None:
        works = [part.run(tensor, scale, async_op=async_op) for part in self.parts]
        if not async_op:
            return None
        return _AllWork([w for w in works if w is not None])


class Hierarchy:
    """The node layout and the hierarchical tensors of one runtime (see the module docstring)."""

    def __init__(self, transport: Transport, node_size: int, slots: int | None = None) -> None:
        """``node_size`` divides the world into at least two nodes; ``slots`` (None: one per other node) >= 1.
        Both are validated and agreed by ``init`` (``odc_runtime.config``)."""
        assert transport.world_size % node_size == 0 and node_size < transport.world_size and (slots or 1) >= 1
        self.transport = transport
        self.node_size = node_size
        self.nodes = transport.world_size // node_size
        self.node = transport.rank // node_size
        self.local_index = transport.rank % node_size
        # Inbox slots per tensor: one per other node by default; fewer bound the memory (the flush then runs in
        # rounds, each slot freed by a signal before it is reused).
        self.slots = self.nodes - 1 if slots is None else min(slots, self.nodes - 1)
        self._signal: SymmetricBuffer | None = None  # words [0, M): arrivals per source node; [M, 2M): frees
        self._arrived = [0] * self.nodes  # running count of puts expected from each node (signal words only grow)
        self._freed = [0] * self.nodes  # running count of slot frees expected from each node
        self._tensors: dict[int, _Buffers] = {}  # by the ShardedTensor's shard sequence number, in shard order
        # The rank with this local index on every other node d: this rank stages for it (row(d) of the staging
        # buffer) and mirrors it (row(d) of the mirror), and it stages for this rank. (d, row(d), rank)
        self._partners = [
            (d, self.row(d), d * node_size + self.local_index) for d in range(self.nodes) if d != self.node
        ]
        self._rounds = self._plan_rounds()

    def _plan_rounds(self) -> list[_Round]:
        """The flush's rounds (see ``_flush``): source node ``c`` of an owner on node ``d`` has inbox row
        ``q = row(c, d)`` there and sends in round ``q // slots`` into slot ``q % slots``."""
        k = self.slots
        rounds = [_Round([], [], []) for _ in range(-(-(self.nodes - 1) // k))]
        for d, row, peer in self._partners:
            q = self.row(self.node, d)  # this node's row at d's owner
            rounds[q // k].sends.append((q % k, row, d, peer))
            q = row  # d's row here
            rounds[q // k].arrivals.append((d, peer))
            if q // k > 0:
                rounds[q // k - 1].free_next.append(peer)
        return rounds

    # -- layout -----------------------------------------------------------------------------------------------
    def same_node(self, rank: int) -> bool:
        return rank // self.node_size == self.node

    def row(self, node: int, of_node: int | None = None) -> int:
        """Row of ``node`` in the staging/inbox/mirror buffers of a rank on ``of_node`` (default: this node);
        rows number the other nodes in order."""
        of_node = self.node if of_node is None else of_node
        return node if node < of_node else node - 1

    def proxy(self, owner: int) -> int:
        """This node's rank with ``owner``'s local index: it pre-reduces and mirrors ``owner`` for the node."""
        return self.node * self.node_size + owner % self.node_size

    # -- tensors ---------------------------------------------------------------------------------------------
    def add(
        self, seq: int, shard: int, param: SymmetricBuffer, grad: SymmetricBuffer | None, tag: str,
        allocated: list[SymmetricBuffer],
    ) -> None:
        """Collective (from ``shard()``): allocate the tensor's hierarchical buffers and fill its mirror. ``grad``
        is the accumulator pushes from this node land in (the fp32 one, or deterministic mode's int64 one). Each
        buffer is appended to ``allocated`` as soon as it exists: the caller releases them if a step fails (under
        the fail-stop rule, which only it can apply to the whole of ``shard``)."""
        t = self.transport
        rows = (self.nodes - 1) * shard
        if self._signal is None:  # kept for the runtime's life
            self._signal = t.alloc(2 * self.nodes, torch.int64, tag="odc.node_signals")
        mirror = t.alloc(rows, param.dtype, tag=f"{tag}.mirror")
        allocated.append(mirror)
        stage = inbox = None
        if grad is not None:  # fp32, or int64 beside deterministic mode's fixed-point accumulator
            stage = t.alloc(rows, grad.dtype, tag=f"{tag}.stage")
            allocated.append(stage)
            inbox = t.alloc(self.slots * shard, grad.dtype, tag=f"{tag}.inbox")
            allocated.append(inbox)
        bufs = _Buffers(shard, param, grad, mirror, stage, inbox)
        self._tensors[seq] = bufs
        self._refresh([bufs])

    def remove(self, seq: int) -> None:
        """Collective (from ``ShardedTensor.free``): release the tensor's hierarchical buffers.

        The tensor stays registered until all of them are freed: each free is its own collective step whose first
        act is the check that every rank frees the same buffer, so a mismatch (every rank raises, nothing freed)
        changes nothing here, and a retry after an interrupted step resumes at the buffer it stopped at (freed
        buffers are skipped), which is the one its peers wait in."""
        bufs = self._tensors.get(seq)
        if bufs is None:
            return
        for buf in bufs.extra():
            if buf is not None:
                self.transport.free(buf)  # skips a buffer freed by an earlier, interrupted call
        del self._tensors[seq]

    def has(self, seq: int) -> bool:
        return seq in self._tensors

    # -- per-call routing ------------------------------------------------------------------------------------
    def plan(self, seq: int, kind: str, pieces: Sequence[Piece]) -> TransferPlan:
        """The core API's plan for a hierarchical tensor: same-node pieces to the owners' buffer, the others to
        the proxies' mirror (get) or staging (accumulate) rows."""
        bufs = self._tensors[seq]
        direct, routed = [], []
        for p in pieces:
            if self.same_node(p.peer):
                direct.append(p)
            else:
                row = self.row(p.peer // self.node_size)
                routed.append(Piece(self.proxy(p.peer), p.start, p.numel, row * bufs.shard))
        own = bufs.param if kind == "fetch" else bufs.grad
        other = bufs.mirror if kind == "fetch" else bufs.stage
        assert own is not None and other is not None
        t = self.transport
        parts = []
        if direct:
            parts.append(t.plan(own, kind, direct))
        if routed:
            parts.append(t.plan(other, kind, routed))
        if not parts:  # an empty tensor: nothing to move
            return t.plan(own, kind, ())
        if len(parts) == 1:
            return parts[0]
        return SplitPlan(parts, own, kind, t.stream_key())

    # -- sync ------------------------------------------------------------------------------------------------
    def sync(
        self, op: str, *, gradients: bool, parameters: bool, pushed: set[int] | None = None, discard: bool = False,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Barrier 1, then flush staged pushes (``gradients``) and refresh mirrors (``parameters``), barrier 2.

        Deterministic mode (``odc_runtime.deterministic.FixedPointAccumulators.sync``) passes what it agreed
        in its round 1, the same on every rank: ``pushed``, the tensors some rank pushed into since the last sync
        (only they are flushed, whatever ``gradients`` says: a staged value is quantised with this window's scale,
        so it must be converted in this window), ``discard`` (an overflow window: every rank zeroes those staging
        rows instead of sending them) and ``then`` (the conversion, run after this rank's folds and before
        barrier 2, which then also keeps peers' next pushes out of the accumulators until it is done)."""
        t = self.transport
        # The flags are part of the barrier's name: a transport that compares names (host) turns ranks passing
        # different flags into OdcMismatchError on every rank instead of a signal wait that runs into the timeout.
        t.barrier(f"{op}(gradients={gradients}, parameters={parameters})")
        # A tensor whose free was interrupted between its collective steps (some buffers freed, on every rank alike:
        # each free is collective) takes no part any more: its staged pushes are dropped with it, as documented.
        live = {s: b for s, b in self._tensors.items() if not any(x is not None and x.freed for x in b.extra())}
        if pushed is None:
            flush = [b for b in live.values() if b.stage is not None] if gradients else []
        else:
            flush = [b for s, b in live.items() if s in pushed and b.stage is not None]
        refresh = list(live.values()) if parameters else []
        if not (flush or refresh or then):
            return

        def deliver() -> None:
            if discard:
                for bufs in flush:
                    bufs.stage.local.zero_()  # type: ignore[union-attr]  # no puts: the inboxes stay zero
            else:
                self._flush(flush, op)
            self._refresh(refresh)
            if then is not None:
                then()
            t.barrier(op)

        # Fail-stop: after barrier 1 every rank is committed to the puts, folds and zeroing of this sync; one
        # that stops halfway leaves staging rows and inboxes that no retry can account for.
        t.fail_stop(op, "the flush of staged pushes began", deliver)

    def _flush(self, tensors: list[_Buffers], op: str) -> None:
        """Deliver the staging rows into the owners' inboxes and fold them, in rounds of ``slots`` source nodes.

        Round ``r`` on every rank: (a) for each of its sends of round ``r``, wait until the owner freed the slot
        (``r > 0``: the owner's free signal, word ``nodes + d``), then put-with-signal the rows of every tensor;
        (b) wait for this rank's own arrivals of round ``r`` (word ``c`` per source node), fold them, zero the
        slots, then free them for round ``r + 1``'s senders. Deadlock-free by induction on ``r``: round 0's puts
        wait for nothing, so every rank finishes round 0's folds; round ``r``'s frees are sent at the end of round
        ``r - 1`` on every owner, so every send of round ``r`` proceeds, so every owner's waits of round ``r`` are
        met (docs/design.md, "Across nodes").
        """
        if not tensors:
            return
        t = self.transport
        signal = self._signal
        assert signal is not None
        for rnd, plan in enumerate(self._rounds):
            if rnd > 0:
                for _, _, d, peer in plan.sends:
                    self._freed[d] += 1
                    t.wait_signal(signal, self.nodes + d, self._freed[d], f"{op}: free inbox slot on node {d}", [peer])
            for bufs in tensors:  # one call per tensor for all of this round's owners
                n, stage = bufs.shard, bufs.stage.local  # type: ignore[union-attr]
                puts = [
                    PutRequest(peer, stage[row * n : (row + 1) * n], slot * n, self.node)
                    for slot, row, _, peer in plan.sends
                ]
                if puts:
                    t.put_signal(bufs.inbox, puts, signal)  # type: ignore[arg-type]
            for d, peer in plan.arrivals:
                self._arrived[d] += len(tensors)
                t.wait_signal(signal, d, self._arrived[d], f"{op}: staged pushes from node {d}", [peer])
            for bufs in tensors:
                slots = bufs.inbox.local.view(self.slots, bufs.shard)[: len(plan.arrivals)]  # type: ignore[union-attr]
                _fold(bufs.grad.local[: bufs.shard], slots)  # type: ignore[union-attr]
                slots.zero_()
            if plan.free_next:  # free the slots for the next round's senders (a signal without data)
                inbox = tensors[0].inbox
                assert inbox is not None
                t.put_signal(inbox, [PutRequest(p, inbox.local[:0], 0, self.nodes + self.node) for p in plan.free_next],
                             signal)
        for bufs in tensors:
            bufs.stage.local.zero_()  # type: ignore[union-attr]

    def _refresh(self, tensors: list[_Buffers]) -> None:
        t = self.transport
        for bufs in tensors:
            n = bufs.shard
            t.fetch(bufs.param, [FetchRequest(o, bufs.mirror.local[r * n : (r + 1) * n]) for _, r, o in self._partners])


def _fold(dst: torch.Tensor, slots: torch.Tensor) -> None:
    """``dst += slots[0] + ... + slots[K-1]``: fp32 in one pass (``odc_runtime.kernels.accumulate_slots_``,
    Triton on GPU); int64 (deterministic mode) with torch's integer sum and add, exact, so the grouping does not
    matter (on CUDA: torch's reduction kernel and an elementwise add, a temporary of one shard)."""
    if dst.dtype == torch.int64:
        dst.add_(slots.sum(0))
    else:
        kernels.accumulate_slots_(dst, slots)
