"""Argument checks of the core API, each run once, before any allocation or remote effect.

Every public entry point of ``odc_runtime.api`` checks its arguments here (collective calls on every rank,
agreed through ``odc_runtime.agree``), so a rejected call changes nothing anywhere.
"""

from __future__ import annotations

import math
import numbers
import struct
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from odc_runtime import config
from odc_runtime.errors import OdcMismatchError, OdcUsageError

if TYPE_CHECKING:
    from odc_runtime.sharded import ShardedTensor

FP32_MAX = torch.finfo(torch.float32).max
_FP32 = struct.Struct("f")
FP32_TINY = 2.0**-149  # the smallest fp32 subnormal: any |scale| at least this is non-zero in fp32


def group_ranks(what: str, group: object, world: int, rank: int) -> tuple[int, ...] | None:
    """Global ranks of ``group`` in group-rank order; ``None`` for ``None`` or a group of every rank.

    Raises OdcUsageError unless ``group`` is a ``torch.distributed`` process group that this rank belongs to."""
    if group is None:
        return None
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise OdcUsageError(
            f"odc_runtime.{what}: rank {rank} is not a member of the group it passed (torch.distributed.new_group "
            "returns a placeholder to non-members); pass the group this rank belongs to (e.g. "
            "mesh.get_group(dim)), or None for all ranks"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise OdcUsageError(
            f"odc_runtime.{what}: group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}"
        )
    try:
        members = dist.get_process_group_ranks(group)
        ranks = tuple(sorted(members, key=lambda g: dist.get_group_rank(group, g)))
    except (RuntimeError, ValueError) as e:
        raise OdcUsageError(
            f"odc_runtime.{what}: cannot read the ranks of the group ({e}); pass a group made by "
            "torch.distributed.new_group() or a DeviceMesh in this default process group"
        ) from None
    if rank not in ranks:
        raise OdcUsageError(
            f"odc_runtime.{what}: rank {rank} is not a member of the group {list(ranks)}; pass the group this rank "
            "belongs to, or None for all ranks"
        )
    if any(not 0 <= r < world for r in ranks):
        raise OdcUsageError(f"odc_runtime.{what}: group ranks {list(ranks)} are outside the world of {world} ranks")
    if len(ranks) == world:
        return None  # every rank: the same as no group
    return ranks


def check_partition(groups: list[tuple[int, ...]]) -> None:
    """OdcMismatchError (on every rank: all see the same list) unless ``groups[r]``, the group rank ``r`` passed,
    contains ``r`` and every member of it passed the same group: the groups of one call partition the ranks."""
    bad = [r for r, g in enumerate(groups) if r not in g or any(m >= len(groups) or groups[m] != g for m in g)]
    if bad:
        listing = "; ".join(f"rank {r}: {list(g)}" for r, g in enumerate(groups))
        raise OdcMismatchError(
            f"odc shard: the groups passed by the ranks do not partition them (inconsistent at rank(s) {bad}): "
            f"{listing}. Every member of a group must pass that same group (e.g. all pass mesh.get_group(dim)), "
            "or all pass None"
        )


def check_scale(what: str, scale: object) -> float:
    """``scale`` as a float that is finite, and neither overflows nor (when non-zero) vanishes in fp32."""
    try:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise ValueError
        value = float(scale)
    except (ValueError, OverflowError, TypeError):
        raise OdcUsageError(f"odc_runtime.{what}: scale must be a finite real number, got {scale!r}") from None
    if not math.isfinite(value):
        raise OdcUsageError(f"odc_runtime.{what}: scale must be a finite real number, got {scale!r}")
    if abs(value) > FP32_MAX:
        raise OdcUsageError(
            f"odc_runtime.{what}: scale {scale!r} overflows float32 (max {FP32_MAX:.4g}); gradients accumulate in "
            "float32, so every push would add inf"
        )
    if value != 0.0 and _FP32.unpack(_FP32.pack(value))[0] == 0.0:
        raise OdcUsageError(f"odc_runtime.{what}: scale {scale!r} rounds to 0 in float32; the push would add nothing")
    return value


def check_tensor(what: str, t: object, st: ShardedTensor, device: torch.device, dtypes: tuple) -> torch.Tensor:
    """``t`` is a plain dense tensor of ``st``'s shape, one of ``dtypes``, on ``device``; OdcUsageError
    otherwise."""
    plain_tensor(what, t)
    if t.is_nested or t.layout != torch.strided:
        raise OdcUsageError(
            f"odc_runtime.{what}: tensor has layout {t.layout}{' (nested)' if t.is_nested else ''}; pass a dense "
            "tensor (e.g. t.to_dense())"
        )
    if t.shape != st.shape:
        raise OdcUsageError(
            f"odc_runtime.{what}: shape {tuple(t.shape)} does not match {st.name!r}'s shape {tuple(st.shape)}"
        )
    if t.dtype not in dtypes:
        raise OdcUsageError(f"odc_runtime.{what}: dtype {t.dtype} not allowed for {st.name!r}; use {dtypes}")
    if t.device != device:
        raise OdcUsageError(
            f"odc_runtime.{what}: tensor is on device {t.device} but the transport of {st.name!r} works on {device}"
        )
    return t


def scale_value(scale: object) -> float:
    """``check_scale`` with a shortcut for the common case (a float that fp32 represents as non-zero; the push
    fast path of ``odc_runtime.api`` writes the same test out inline)."""
    if type(scale) is float and (FP32_TINY <= scale <= FP32_MAX or -FP32_MAX <= scale <= -FP32_TINY):
        return scale
    return check_scale("push", scale)


def wait_timeout(timeout: object) -> float | None:
    """``Handle.wait``'s ``timeout``: ``None`` or a finite, non-negative number of seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(float(timeout)) or (
        not 0 <= timeout <= config.MAX_TIMEOUT_S
    ):
        raise OdcUsageError(
            "odc_runtime.Handle.wait(timeout=...): expected None or a finite number of seconds in "
            f"[0, {config.MAX_TIMEOUT_S:g}] (a year), got {timeout!r}"
        )
    return float(timeout)


def plain_tensor(what: str, t: object) -> torch.Tensor:
    """``t`` is a plain ``torch.Tensor`` (or ``nn.Parameter``), not a DTensor or another tensor subclass that
    redirects operations (whose data is not the local memory it appears to be); OdcUsageError otherwise."""
    if not isinstance(t, torch.Tensor):
        raise OdcUsageError(f"odc_runtime.{what}: expected a torch.Tensor, got {type(t).__name__}")
    kind = type(t)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter and (
        getattr(kind, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__
        or getattr(kind, "__torch_function__", None) not in (
            torch.Tensor.__torch_function__, torch._C._disabled_torch_function_impl
        )
    ):
        hint = " (call .full_tensor() or .to_local() first)" if kind.__name__ == "DTensor" else ""
        raise OdcUsageError(
            f"odc_runtime.{what}: expected a plain torch.Tensor, got a {kind.__module__}.{kind.__name__}{hint}; odc "
            "reads and writes the tensor's local memory, which a tensor subclass does not hold as such"
        )
    return t
