"""The per-call fast path of ``fetch`` / ``push``: plan keys and the per-tensor plan cache.

The first fetch/push of a ShardedTensor with a given ``PlanKey`` (tensor type, shape, dtype, device, layout,
contiguity in plain memory (no negative bit), requires_grad (fetch only: a push accepts either), transport stream key)
runs every check and builds a
``TransferPlan`` (which peer gets which slice, plus whatever the transport
precomputes: peer pointers, kernel arguments). Later calls with the same key skip straight to ``plan.run()``. A
key that was rejected is never cached, so every rejected call takes the checked path and raises there. A plan is
used only while its runtime generation is current and its buffer is not freed (the caller checks the generation,
``PlanCache.get`` the buffer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from odc_runtime.transport.base import TransferPlan

PLAN_CACHE_SIZE = 8  # plans per ShardedTensor (keys differ only by dtype and stream in normal use)


class PlanKey(NamedTuple):
    """What a cached plan was validated for. ``tensor_type`` is ``None`` for a fetch that allocates its output;
    ``requires_grad`` is ``False`` in every push key (the checked path accepts a gradient either way, and a push's
    plan does not depend on it: one plan serves both).

    The fast path builds keys as plain tuples in this field order (``tensor_key``, ``output_key``): they
    hash and compare equal to the named tuple, and skip its constructor, a third of the per-call cost."""

    op: str
    tensor_type: type | None
    shape: torch.Size | None
    dtype: torch.dtype | None
    device: torch.device | None
    contiguous: bool
    requires_grad: bool
    stream: object

    @classmethod
    def for_output(cls, op: str, stream: object) -> PlanKey:
        """The key of a fetch without ``out=`` (it allocates a fresh contiguous tensor)."""
        return cls(*output_key(op, stream))

    @classmethod
    def for_tensor(cls, op: str, t: torch.Tensor, stream: object) -> PlanKey | None:
        """The key of ``t``; ``None`` for tensors no plan is ever made for (not strided, nested)."""
        key = tensor_key(op, t, stream)
        return None if key is None else cls(*key)


_STRIDED = torch.strided


def output_key(op: str, stream: object) -> tuple:
    """``PlanKey.for_output`` as a plain tuple."""
    return (op, None, None, None, None, True, False, stream)


def tensor_key(op: str, t: torch.Tensor, stream: object) -> tuple | None:
    """``PlanKey.for_tensor`` as a plain tuple (``key[CONTIGUOUS]`` is the contiguity)."""
    if t.layout is not _STRIDED or t.is_nested:
        return None  # the checked path refuses these; some have no shape or is_contiguous()
    # "contiguous" means plain memory a plan may address directly: torch's negative bit (torch._neg_view) leaves the
    # values un-negated in memory, so such a tensor is copied (push, ``dense``) or refused (fetch's out) like a
    # non-contiguous one
    plain = t.is_contiguous() and not t.is_neg()
    if op == "push":  # a push takes a gradient whether it requires grad or not, through the same plan
        return (op, type(t), t.shape, t.dtype, t.device, plain, False, stream)
    return (op, type(t), t.shape, t.dtype, t.device, plain, t.requires_grad, stream)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in plain contiguous memory, for a tensor whose key is not ``CONTIGUOUS``: a copy (of a
    non-contiguous view, or of one with torch's negative bit, resolved)."""
    return t.detach().contiguous().resolve_neg()


CONTIGUOUS = PlanKey._fields.index("contiguous")


class PlanCache:
    """A few plans of one ShardedTensor, the oldest evicted first."""

    __slots__ = ("_plans",)

    def __init__(self) -> None:
        self._plans: dict[tuple, TransferPlan] = {}

    def __len__(self) -> int:
        return len(self._plans)

    def plans(self) -> list[TransferPlan]:
        """Every cached plan (for introspection)."""
        return list(self._plans.values())

    def get(self, key: tuple | None) -> TransferPlan | None:
        """The plan stored for ``key`` (a ``PlanKey`` or its plain tuple) unless its buffer was freed."""
        plan = self._plans.get(key)  # type: ignore[arg-type]  # None is never stored (see put)
        if plan is None or plan.buf.freed:
            return None
        return plan

    def put(self, key: tuple | None, plan: TransferPlan) -> None:
        if key is None:
            return
        while len(self._plans) >= PLAN_CACHE_SIZE:
            del self._plans[next(iter(self._plans))]  # oldest first
        self._plans[key] = plan
