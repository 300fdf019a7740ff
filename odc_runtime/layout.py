"""Owner layout: where element ``i`` of a sharded tensor lives. The one place every layer asks.

A tensor of ``numel`` elements is split over the ``parts`` owners of its group into shards of
``S = ceil(numel / parts)`` elements; the owner of group rank ``r`` owns ``[r*S, min((r+1)*S, numel))`` (the last
owners may own fewer elements, or none). Every rank of the *world* allocates the same number of elements for a
tensor (the largest ``S`` over the groups of its ``shard`` call), so one offset addresses the buffer on every
peer; element ``i`` is at element offset ``i - r*S`` of owner ``r``'s region. The hierarchical protocol
(``odc_runtime.hierarchy``) keeps this layout and adds node-level rows on top of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from odc_runtime.transport.base import Piece


def shard_size(numel: int, parts: int) -> int:
    """Elements per owner: ``ceil(numel / parts)``."""
    return -(-numel // parts)


def owner_range(numel: int, parts: int, owner: int) -> tuple[int, int]:
    """``(start, stop)`` of the flattened tensor owned by group rank ``owner`` (empty for owners past the end)."""
    size = shard_size(numel, parts)
    start = min(owner * size, numel)
    return start, min(start + size, numel)


def owner_of(numel: int, parts: int, index: int) -> int:
    """The group rank that owns element ``index``."""
    if not 0 <= index < numel:
        raise IndexError(f"element {index} outside a tensor of {numel} elements")
    return index // shard_size(numel, parts)


def transfer_pieces(numel: int, owners: Sequence[int], me: int) -> list[Piece]:
    """One ``Piece`` per owner with data, starting after group rank ``me`` (ranks issuing at once hit
    different owners first). ``owners`` are the group's global ranks in group-rank order; the pieces name them."""
    parts = len(owners)
    pieces = []
    for k in range(1, parts + 1):
        owner = (me + k) % parts
        start, stop = owner_range(numel, parts, owner)
        if stop > start:
            pieces.append(Piece(owners[owner], start, stop - start))
    return pieces
