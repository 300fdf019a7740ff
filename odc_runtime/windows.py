"""The window rules, checked at every world ``sync``.

A *window* is the time between two world syncs. Fetch and push are one-sided: the owner does nothing for them, so
within one window nothing orders them against what the owner does to the same shard. Two rules follow:

(a) an owner must not change a shard's values (``st.local``) in a window in which a peer fetches that shard
    (the fetch may return old values, new ones, or a mix of both: *torn*);
(b) an owner must not zero or write its accumulator (``st.grad``) in a window in which a peer pushes into it (the
    zeroing may wipe pushes that already landed).

That is why a core-API loop has two syncs per minibatch: the first ends the pushes before the optimizer reads
``st.grad``; the second ends the optimizer's writes to ``st.local`` and the ``zero_grad`` before the next
minibatch's fetches and pushes. Dropping the second one, or zeroing after it, breaks (a) or (b).

How it is checked (``WindowCheck``), with ``ODC_DEBUG=1``:

* a fetch or push marks its ``ShardedTensor`` (one attribute store per call, in every mode: within the noise of
  a call, ``bench/hostcost.py``);
* an owner's writes are seen through ``torch``'s version counter of ``st.local`` / ``st.grad``, which every
  in-place operation bumps (each shard's view gets a counter of its own, so writing shard A does not look like a
  write to shard B); it is read at every world sync, so nothing runs per write;
* at the closing sync every rank sends a *summary* of its window: four bitmaps over the tensors' ``shard()``
  sequence numbers (modulo ``BITS``): written ``local``, written ``grad``, fetched, pushed. It rides in the round
  of the debug fingerprint (``odc_runtime.debug``), which every world sync takes first in debug mode: no round of
  its own. Every rank then has every summary, computes the same verdict and, after the sync's fence completed,
  raises ``OdcWindowError`` naming the shard, the owner, the rule and the fix: all ranks fail together and the
  runtime stays usable (the fence itself happened).

Why only in debug mode: reading a version counter costs about 0.1-0.2 µs per tensor, two per tensor per sync, so
the check adds about 10 µs to a sync of one tensor and about 57 µs to one of a hundred (``bench/hostcost.py``,
"what the window check costs"), against a plain host ``sync`` (world 1) of about 10.5 µs whose run-to-run spread
is 0.1-2 µs: not within its noise.

Ordering: the summary describes only what this rank did *before* it called the closing sync (its fetches and
pushes were issued, its writes made), so it is complete when it is sent, although the round that carries it comes
before the sync's fence; it adds no wait to a round every rank takes anyway (the setting is agreed at ``init``),
so it cannot deadlock, and the verdict is raised only after the fence, by every rank alike.

What is not seen: reads of ``st.grad`` (a read bumps no counter); writes through tensors that do not view
``st.local`` / ``st.grad`` (``st.local.data`` has a counter of its own). A group ``sync(group=g)`` closes the
window of ``g``'s tensors without a check (its fence carries no payload). Two live tensors whose sequence numbers
differ by a multiple of ``BITS`` share a bit: a legitimate overlap of such a pair (possible only after ``BITS``
``shard()`` calls) would be reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from odc_runtime.errors import OdcWindowError

if TYPE_CHECKING:
    from odc_runtime.sharded import ShardedTensor

BITS = 2048  # bits per bitmap: four of at most 258 bytes fit with a debug fingerprint in one exchange payload
_MAX_NAMED = 4  # violations named in one message; the rest are counted


def own_counter(view: torch.Tensor) -> torch.Tensor:
    """The same memory as ``view`` under a tensor with a version counter of its own. Views share their base's
    counter, and every shard is a view of one heap: without this, a write to shard A would bump shard B's."""
    out = torch.empty(0, dtype=view.dtype, device=view.device)
    with torch.no_grad():
        out.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    return out


@dataclass(frozen=True)
class _Rule:
    written: int  # the summary's bitmap of the owner's writes
    touched: int  # the summary's bitmap of the peers' calls
    rule: str
    what: str  # the owner's side
    peer: str  # the peers' side
    fix: str


_RULES = (
    _Rule(0, 2, "rule (a), an owner must not change a shard's values in a window in which a peer fetches it "
          "(the fetch may return a mix of old and new values)",
          "changed st.local (e.g. the optimizer step)", "fetched it",
          "call odc_runtime.sync() after the optimizer step and before the next fetches (the second sync of a "
          "minibatch)"),
    _Rule(1, 3, "rule (b), an owner must not zero or write its accumulator in a window in which a peer pushes "
          "into it (pushes that landed before the zeroing are lost)",
          "zeroed or wrote st.grad (e.g. zero_grad())", "pushed into it",
          "call zero_grad() before the second sync of a minibatch, or odc_runtime.sync() after zero_grad() and "
          "before the next pushes"),
)


def _pack(bitmaps: tuple[int, ...]) -> bytes:
    """Bitmaps as length-prefixed little-endian bytes: a quiet window's summary is a few bytes."""
    return b"".join(len(b).to_bytes(2, "little") + b for b in (m.to_bytes((m.bit_length() + 7) // 8, "little")
                                                               for m in bitmaps))


def _unpack(payload: bytes) -> list[int]:
    """The bitmaps ``_pack`` packed."""
    out, i = [], 0
    while i < len(payload):
        n = int.from_bytes(payload[i : i + 2], "little")
        out.append(int.from_bytes(payload[i + 2 : i + 2 + n], "little"))
        i += 2 + n
    return out


def _versions(st: ShardedTensor) -> tuple[int, int]:
    """The version counters of ``st.local`` and ``st.grad`` (-1 without an accumulator)."""
    grad = st.grad
    return st.local._version, -1 if grad is None else grad._version


class WindowCheck:
    """One runtime's window check: the registry of its live tensors and the verdict at each world sync."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        # shard() sequence number -> (tensor, each rank's owner group as global ranks; None: all ranks)
        self._tensors: dict[int, tuple[ShardedTensor, tuple[tuple[int, ...], ...] | None]] = {}

    def add(self, st: ShardedTensor, partition: list[tuple[int, ...]] | None) -> None:
        """Register a new tensor (``partition``: every rank's group in that ``shard`` call, ``None``: the world)."""
        st._written = _versions(st)
        self._tensors[st.seq] = (st, None if partition is None else tuple(partition))

    def remove(self, seq: int) -> None:
        self._tensors.pop(seq, None)

    def summary(self) -> bytes:
        """This rank's window, packed for the closing sync's round; starts the next window's marks."""
        local = grad = fetched = pushed = 0
        for seq, (st, _) in self._tensors.items():
            bit = 1 << (seq % BITS)
            if st._fetched:
                fetched |= bit
                st._fetched = False
            if st._pushed:
                pushed |= bit
                st._pushed = False
            written = _versions(st)
            if written != st._written:
                # An empty shard (the last owners of a tiny tensor) holds nothing a peer could read torn
                if written[0] != st._written[0] and st.local.numel():
                    local |= bit
                if written[1] != st._written[1] and st.grad is not None and st.grad.numel():
                    grad |= bit
                st._written = written
        return _pack((local, grad, fetched, pushed))

    def resample(self) -> None:
        """Take the version counters again after a sync that writes ``st.grad`` itself (deterministic mode)."""
        for st, _ in self._tensors.values():
            st._written = _versions(st)

    def close_group(self, ranks: tuple[int, ...]) -> None:
        """A group fence of ``ranks`` closed the window of the tensors sharded over them (unchecked)."""
        for st, _ in self._tensors.values():
            if st.group_ranks == ranks:
                st._fetched = st._pushed = False
                st._written = _versions(st)

    def verdict(self, payloads: list[bytes]) -> OdcWindowError | None:
        """The error every rank raises for these summaries (the same on every rank), or ``None``."""
        summaries = [_unpack(p) for p in payloads]
        if not any(s[0] or s[1] for s in summaries):  # the common case: no owner wrote, or nobody reported
            return None
        parts = []
        for rule in _RULES:
            found = []
            for owner, mine in enumerate(summaries):
                if mine[rule.written]:
                    found.extend(self._describe(rule, owner, [
                        (peer, mine[rule.written] & theirs[rule.touched]) for peer, theirs in enumerate(summaries)
                        if peer != owner and mine[rule.written] & theirs[rule.touched]
                    ]))
            if found:
                more = f" (and {len(found) - _MAX_NAMED} more)" if len(found) > _MAX_NAMED else ""
                parts.append(f"Broken {rule.rule}: " + "; ".join(found[:_MAX_NAMED]) + f"{more}. Fix: {rule.fix}.")
        if not parts:
            return None
        return OdcWindowError(
            "odc_runtime.sync(): a window rule was broken between the last two world syncs. " + " ".join(parts)
            + " Why a minibatch has two syncs: docs/core-api.md, \"Why two syncs per minibatch\". This sync "
            "completed on every rank (the runtime stays usable), but the values of that window are not to be trusted"
        )

    def _describe(self, rule: _Rule, owner: int, peers: list[tuple[int, int]]) -> list[str]:
        """One line per shard of ``owner`` that ``peers`` (each with its bits in common with the owner's) touched."""
        out = []
        for seq, (st, partition) in self._tensors.items():
            bit = 1 << (seq % BITS)
            # another group's tensor of the same shard() call is not this owner's shard
            touched = [p for p, bits in peers if bits & bit and (partition is None or p in partition[owner])]
            if touched:
                who = f"rank {touched[0]}" if len(touched) == 1 else f"ranks {touched}"
                out.append(f"shard {st.name!r}: owner rank {owner} {rule.what} in the window in which {who} "
                           f"{rule.peer}")
        return out
