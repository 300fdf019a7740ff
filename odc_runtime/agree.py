"""Collective argument checks over ``torch.distributed``: every rank fails together or none does.

A rank that rejects its arguments locally must not simply raise: its peers would wait forever in the collective
it abandoned. :func:`gather_checked` runs the local checks everywhere, exchanges the outcomes, and then raises on
every rank if any rank failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch.distributed as dist

from odc_runtime.errors import OdcError, OdcMismatchError

T = TypeVar("T")


def gather_checked(what: str, local: Callable[[], T]) -> list[T]:
    """Collective: run ``local()`` on every rank and return every rank's result (indexed by rank).

    If ``local`` raised an :class:`OdcError` on some rank, that rank re-raises it and every other rank raises
    :class:`OdcMismatchError` naming the rank and its error.
    """
    error: OdcError | None = None
    value: T | None = None
    try:
        value = local()
    except OdcError as e:
        error = e
    outcomes: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (value, None if error is None else f"{type(error).__name__}: {error}"))
    if error is not None:
        raise error
    failed = [f"rank {r} rejected the call ({msg})" for r, (_, msg) in enumerate(outcomes) if msg]  # type: ignore[misc]
    if failed:
        raise OdcMismatchError(f"odc {what}: " + "; ".join(failed))
    return [v for v, _ in outcomes]  # type: ignore[misc]


def require_same(
    what: str,
    values: Sequence[object],
    rule: str = "must be called with the same arguments, in the same order, on every rank",
) -> None:
    """Raise OdcMismatchError (on every rank, since every rank sees the same ``values``) unless all are equal."""
    if any(v != values[0] for v in values):
        listing = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise OdcMismatchError(f"odc {what} {rule}; got {listing}")
