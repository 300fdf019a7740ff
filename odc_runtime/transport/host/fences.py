"""Group fences (``sync(group=...)``) on the second control page, and crossed-collective detection.

The page holds a slot per group index (this rank's last fence number in that group, and the digests of the
operations it fenced with at that number and the one before), a *marker* (the group this rank waits in, that
fence's number, a bitmap of its ranks) and the name of the last fence it entered (for messages). A fence: quiet,
bump and publish the group's number and digest with the marker set (one locked store), poll the members' numbers for
that group until each reached ours, clear the marker, then compare the members' digests at that number
(``leave``): members that fenced from different operations (with ``ODC_DEBUG=1``, from different call sites)
all raise ``OdcRoundMismatchError`` there, since every member completed the fence and reads the same digests (a
member is at most one fence ahead in the group, so its digest at our number is its current or its previous one).
The world epoch is untouched, so groups fence at their own pace. Two ranks waiting for each
other in different collectives (one in a group fence, the other in a world round or another group's fence, each
needing the other first) see it from the peer's world epoch or marker and raise
``OdcMismatchError`` instead of timing out; longer cycles (rank 0 in a fence waiting for
rank 1 in another fence waiting for rank 2 ... waiting for rank 0) are found in the wait-for graph of every rank's
pages (``GroupFences.wait_graph``), read twice one liveness period apart. Ordering and deadlock argument:
docs/design.md, "Process groups".
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from odc_runtime.agree import describe_calls, op_digest, ranks_by_value, shorten
from odc_runtime.errors import OdcCrossedCollectivesError, OdcRoundMismatchError
from odc_runtime.transport.base import Group
from odc_runtime.transport.host.locks import ByteRangeLocks
from odc_runtime.transport.host.segments import CONTROL_BYTES, PAGE, Segments

# A marker (index + 1 of the group this rank waits in, 0 if none; that fence's number; a bitmap of the group's
# ranks, for ranks below MARKER_RANKS); the last fence this rank entered (index + 1, number, the operation's name,
# its end kept: with ODC_DEBUG=1 that is the call site); then one slot per group: its last fence number and the
# 8-byte digests of the operations of that fence and of the one before.
_MARKER = struct.Struct("<qq64s")
MARKER_RANKS = 64 * 8
_NAME_BYTES = 64
_LAST = struct.Struct(f"<qq{_NAME_BYTES}s")
_LAST_OFFSET = PAGE + _MARKER.size
_SLOT = struct.Struct("<q8s8s")
_GROUP_SLOTS_OFFSET = _LAST_OFFSET + _LAST.size
MAX_GROUPS = (CONTROL_BYTES - _GROUP_SLOTS_OFFSET) // _SLOT.size
_EPOCH = struct.Struct("<q")
_NO_DIGEST = b"\0" * 8


class GroupFences:
    """This rank's fence numbers per group and access to every rank's group page."""

    def __init__(self, segments: Segments, locks: ByteRangeLocks, rank: int) -> None:
        self._segments = segments
        self._locks = locks
        self._rank = rank
        self.epochs: dict[int, int] = {}  # group index -> number of this rank's last fence in it
        self._digests: dict[int, tuple[bytes, bytes]] = {}  # group index -> digests at its last fence, the one before

    def marker(self, peer: int) -> tuple[int, int, bytes]:
        """``(group index or -1, fence number, member bitmap)`` of the group fence ``peer`` waits in."""
        seg = self._segments.get(peer)
        with self._locks.held(peer, PAGE, _MARKER.size, exclusive=False, op="group barrier"):
            plus1, epoch, bitmap = _MARKER.unpack_from(seg.map, PAGE)
        return plus1 - 1, epoch, bitmap

    def reached(self, peer: int, index: int, epoch: int) -> bool:
        """Whether ``peer``'s last fence in group ``index`` is at least ``epoch``."""
        return self.epoch(peer, index) >= epoch

    def enter(self, group: Group, op: str) -> int:
        """Bump and publish this rank's fence number in ``group``, with ``op``'s digest and name and the marker
        set; return the number."""
        epoch = self.epochs.get(group.index, 0) + 1
        self.epochs[group.index] = epoch
        digest = op_digest(op)[: len(_NO_DIGEST)]
        self._digests[group.index] = (digest, self._digests.get(group.index, (_NO_DIGEST,))[0])
        self._publish(group, epoch, waiting=True, name=op.encode()[-_NAME_BYTES:])
        return epoch

    def leave(self, group: Group, epoch: int) -> None:
        """After fence ``epoch`` of ``group`` completed on every member: clear the marker, then raise
        ``OdcRoundMismatchError`` if members fenced with different operations (on every member alike: they read the
        same digests)."""
        self._publish(group, epoch, waiting=False)
        mine = self._digests[group.index][0]
        digests = {p: mine if p == self._rank else self._digest_at(p, group.index, epoch) for p in group.ranks}
        if all(d == mine for d in digests.values()):
            return
        sides = describe_calls(ranks_by_value(digests.items()),
                               lambda _, first: self._name_at(first, group.index, epoch))
        raise OdcRoundMismatchError(
            f"odc collective mismatch at group fence #{epoch} of ranks {list(group.ranks)}: {sides}. Every member of a "
            "group must call sync(group=...) the same number of times, in the same order (with ODC_DEBUG=1: from the "
            "same places); the fence completed, so the runtime stays usable"
        )

    def _publish(self, group: Group, epoch: int, waiting: bool, name: bytes | None = None) -> None:
        """One exclusive lock over the slot, the marker and the name: a peer sees them change together."""
        seg = self._segments.get(self._rank)
        bitmap = bytearray(64)
        for r in group.ranks:
            if r < MARKER_RANKS:
                bitmap[r // 8] |= 1 << (r % 8)
        at = _GROUP_SLOTS_OFFSET + _SLOT.size * group.index
        with self._locks.held(self._rank, PAGE, CONTROL_BYTES - PAGE, exclusive=True, op="group barrier"):
            _SLOT.pack_into(seg.map, at, epoch, *self._digests[group.index])
            _MARKER.pack_into(seg.map, PAGE, group.index + 1 if waiting else 0, epoch, bytes(bitmap))
            if name is not None:
                _LAST.pack_into(seg.map, _LAST_OFFSET, group.index + 1, epoch, name)

    def _digest_at(self, peer: int, index: int, epoch: int) -> bytes:
        """``peer``'s digest at its fence ``epoch`` of group ``index`` (it reached it, and is at most one ahead)."""
        seg = self._segments.get(peer)
        at = _GROUP_SLOTS_OFFSET + _SLOT.size * index
        with self._locks.held(peer, at, _SLOT.size, exclusive=False, op="group barrier"):
            last, current, previous = _SLOT.unpack_from(seg.map, at)
        return current if last == epoch else previous

    def _name_at(self, peer: int, index: int, epoch: int) -> str:
        """The name of ``peer``'s operation at fence ``epoch`` of group ``index``, while its last fence is that
        one (a peer that went on to another fence since has overwritten it)."""
        seg = self._segments.get(peer)
        with self._locks.held(peer, _LAST_OFFSET, _LAST.size, exclusive=False, op="group barrier"):
            plus1, last, name = _LAST.unpack_from(seg.map, _LAST_OFFSET)
        if (plus1 - 1, last) != (index, epoch):
            return "(its call site is no longer recorded: it went on to another fence)"
        text = name.rstrip(b"\0")
        return ("" if len(text) < _NAME_BYTES else "...") + text.decode(errors="replace")  # full: maybe cut

    def position(self, peer: int) -> tuple[bool, str] | None:
        """Where ``peer`` is in its group fences, for messages: ``(True, description)`` of the fence it waits in
        (or failed in: the marker stays set then), ``(False, description)`` of the last fence it entered, ``None``
        when it never entered one. A rank's last world barrier alone would be stale for a rank that went on to
        group fences."""
        index, epoch, bitmap = self.marker(peer)
        seg = self._segments.get(peer)
        with self._locks.held(peer, _LAST_OFFSET, _LAST.size, exclusive=False, op="group barrier"):
            plus1, last, name = _LAST.unpack_from(seg.map, _LAST_OFFSET)
        if plus1 == 0:
            return None
        text = name.rstrip(b"\0")
        call = ("" if len(text) < _NAME_BYTES else "...") + text.decode(errors="replace")
        if index >= 0:
            members = [m for m in range(MARKER_RANKS) if bitmap[m // 8] >> (m % 8) & 1]
            return True, f"in group fence #{epoch} of ranks {members}, {call!r}"
        return False, f"last group fence #{last} in {call!r}"

    def check_not_waiting_for_us(self, op: str, peer: int) -> None:
        """Raise (crossed collectives) if ``peer``, which we wait for, waits in a group fence for *us*.

        ``peer`` is in fence #k of group g, g contains this rank and this rank's last fence in g is below k: the
        peer cannot leave before we enter g's fence #k, and we are in another collective that waits for it, so
        neither can move. Both sides see it (each checks the rank it waits for) and raise."""
        index, epoch, bitmap = self.marker(peer)
        if index < 0 or self._rank >= MARKER_RANKS or not bitmap[self._rank // 8] >> (self._rank % 8) & 1:
            return
        if self.epochs.get(index, 0) < epoch:
            raise OdcCrossedCollectivesError(
                f"odc collective mismatch: rank {self._rank} is in {shorten(op)!r} but rank {peer} waits for it in "
                f"group fence #{epoch} (sync(group=...), group index {index}) that rank {self._rank} has not "
                "reached; ranks must call sync(group=...) and the collectives they share with other ranks in the "
                "same order"
            )

    def wait_graph(
        self, world_size: int, world_epoch: Callable[[int], int]
    ) -> tuple[tuple, dict[int, list[int]], dict[int, str]]:
        """Who waits for whom, read from every rank's pages: ``(state, edges, where)``.

        Rank q in group fence #k of g waits for each member whose last fence in g is below k; any other rank q
        waits for each rank whose world epoch is below q's (q cannot have completed its round without them). Each
        edge holds while the state it was read from is unchanged (every number only grows), so an edge cycle seen
        in two reads with the same ``state`` held at one instant, and a wait-for cycle never resolves: it is a
        deadlock. ``where`` describes each rank's wait for messages."""
        epochs = [world_epoch(q) for q in range(world_size)]
        markers = [self.marker(q) for q in range(world_size)]
        group_epochs: dict[tuple[int, int], int] = {}
        edges: dict[int, list[int]] = {}
        where: dict[int, str] = {}
        for q, (index, k, bitmap) in enumerate(markers):
            if index >= 0:
                members = [m for m in range(min(world_size, MARKER_RANKS)) if bitmap[m // 8] >> (m % 8) & 1]
                for m in members:
                    if m != q and (m, index) not in group_epochs:
                        group_epochs[(m, index)] = self.epoch(m, index)
                edges[q] = [m for m in members if m != q and group_epochs[(m, index)] < k]
                where[q] = f"group fence #{k} of ranks {members}"
            else:
                edges[q] = [r for r in range(world_size) if epochs[r] < epochs[q]]
                where[q] = f"world collective #{epochs[q]}"
        state = (tuple(epochs), tuple((i, k) for i, k, _ in markers), tuple(sorted(group_epochs.items())))
        return state, edges, where

    def epoch(self, peer: int, index: int) -> int:
        """``peer``'s last fence number in group ``index``."""
        seg = self._segments.get(peer)
        at = _GROUP_SLOTS_OFFSET + _SLOT.size * index
        with self._locks.held(peer, at, 8, exclusive=False, op="group barrier"):
            return _EPOCH.unpack_from(seg.map, at)[0]


def find_cycle(edges: dict[int, list[int]], start: int) -> list[int] | None:
    """A cycle of the wait-for graph reachable from ``start`` (its ranks in order), or ``None``."""
    path: list[int] = []
    on_path: set[int] = set()
    done: set[int] = set()

    def visit(q: int) -> list[int] | None:
        if q in on_path:
            return path[path.index(q):]
        if q in done:
            return None
        path.append(q)
        on_path.add(q)
        for r in edges.get(q, ()):
            cycle = visit(r)
            if cycle is not None:
                return cycle
        path.pop()
        on_path.discard(q)
        done.add(q)
        return None

    return visit(start)
