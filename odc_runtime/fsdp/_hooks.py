"""ODC's custom all-gather and reduce-scatter for FSDP2 (installed through ``FSDPModule.set_custom_*``).

- All-gather (in place; FSDP's input is row ``rank`` of the output): inside a minibatch the other rows are fetched
  from the owners' published rows; outside one (an evaluation forward run by all ranks together) it is the ordinary
  collective ``all_gather_into_tensor``.
- Reduce-scatter (``input.view(W, -1)[r]`` is rank ``r``'s shard): one ``odc.push`` adds row ``r`` into owner
  ``r``'s fp32 accumulator; the output is returned as zeros, so whatever FSDP does with it afterwards (divide,
  add into ``sharded_param.grad``) leaves zeros. The reduce op FSDP asks for (``SUM``, ``AVG`` or a pre-multiplied
  sum, depending on the torch version and dtypes) is therefore irrelevant: the accumulator holds the plain sum and
  ``end_minibatch`` applies FSDP's scaling.
- Unused parameters. FSDP leaves parameters that got no gradient in a backward out of the reduce-scatter input,
  which would shift every later parameter's columns. torch >= 2.13 keeps the layout fixed with
  ``set_reduce_scatter_unused_params(True)``. On older torch, and for groups that reduce in another dtype than they
  compute in (mixed precision: torch's bf16 zeros would meet the fp32 gradients FSDP accumulates while gradient
  sync is off, and FSDP asserts a uniform dtype), ODC does the same itself: a post-accumulate-grad hook on each
  unsharded parameter (registered by a forward pre-hook, on every module of the group, that runs after FSDP's
  unshard) marks the parameters that received a gradient; the reduce-scatter maps FSDP's shorter input back onto
  the full row layout (zeros for the unmarked parameters) before pushing. Both give the same accumulator contents.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

import odc_runtime as odc
from odc_runtime.api import PARAM_DTYPES
from odc_runtime.errors import OdcUsageError

from . import _compat, _grads
from ._layout import Param, State, Unit, fp16_pre_factor

if TYPE_CHECKING:  # annotations only
    from torch.utils.hooks import RemovableHandle


class _CommBase:
    def __init__(self, state: State, unit: Unit) -> None:
        self._state = weakref.ref(state)
        self._unit = unit

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check_group(self, group: dist.ProcessGroup, what: str) -> State:
        state = self._state()
        if state is None:  # pragma: no cover - the model was garbage collected
            raise OdcUsageError(f"odc_runtime.fsdp {what}: the ODC state of this model is gone")
        if group.size() != self._unit.rows:
            raise OdcUsageError(
                f"odc_runtime.fsdp {what} for {self._unit.fqn!r}: process group of size {group.size()} but ODC laid "
                f"out {self._unit.rows} rows (FSDP's shard group changed after enable(), or "
                "reshard_after_forward=int, which is not supported)"
            )
        return state


def make_all_gather(base: type) -> type:
    """A subclass of torch's ``AllGather`` (``base``) that fetches the published rows from their owners."""

    class OdcAllGather(_CommBase, base):
        """All-gather that fetches the published rows from their owners (see the module docstring)."""

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            async_op: bool = False,
        ) -> dist.Work | None:
            state = self._check_group(group, "all-gather")
            unit = self._unit
            if not state.in_minibatch:
                # Outside a minibatch every rank runs this forward together (e.g. evaluation): collective.
                return _compat.all_gather_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
            w, n = unit.rows, unit.ag_numel
            if input_tensor.numel() != n or output_tensor.numel() != w * n or input_tensor.dtype != unit.ag_dtype:
                raise OdcUsageError(
                    f"odc_runtime.fsdp all-gather for {unit.fqn!r}: FSDP passed {input_tensor.numel()} elements of "
                    f"{input_tensor.dtype} per rank but ODC laid out {n} of {unit.ag_dtype} at enable() time; "
                    "parameters (or their dtypes / requires_grad) changed after enable(): disable() and enable() "
                    "again"
                )
            if state.validate or not unit.checked:
                check_published(unit, input_tensor)
                unit.checked = True
            odc.fetch(unit.st_ag, out=output_tensor.view(w, n))
            unit.all_gathers += 1
            return None

    return OdcAllGather


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: ``a`` and ``b`` (same dtype and shape) hold the same bit pattern. NaN-safe: a NaN equals itself,
    so a model that trains on NaN (as collective FSDP would) is not mistaken for one whose parameters changed."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.reshape(-1).view(bits) == b.reshape(-1).view(bits)


def describe_difference(fqn: str, now: torch.Tensor, published: torch.Tensor, same: torch.Tensor) -> str:
    """What differs between ``now`` and ``published`` (flat, same dtype): count, first index, both values."""
    diff = (~same).nonzero()
    first = int(diff[0])
    return (
        f"{int(diff.numel())} of {same.numel()} elements of {fqn!r} differ in this rank's shard (first at local "
        f"index {first}: {now[first].item()!r} now, {published[first].item()!r} published)"
    )


def check_published(unit: Unit, input_tensor: torch.Tensor) -> None:
    """FSDP's all-gather input must equal, bit for bit, the row published at ``begin_minibatch`` (layout and
    freshness check)."""
    row = unit.st_ag.local
    for p in unit.params:
        n = p.sharded_param.to_local().numel()
        a, b = input_tensor[p.ag_offset : p.ag_offset + n], row[p.ag_offset : p.ag_offset + n]
        same = same_bits(a, b)
        if not bool(same.all()):
            raise OdcUsageError(
                f"odc_runtime.fsdp: FSDP's all-gather input differs from the parameters published at the start of "
                f"the minibatch: {describe_difference(p.fqn, a, b, same)}. Parameters must not change inside a "
                "minibatch: optimizer.step(), load_state_dict() and in-place edits belong between minibatches"
            )


def make_reduce_scatter(base: type) -> type:
    """A subclass of torch's ``ReduceScatter`` (``base``) that pushes row r of the input into owner r."""

    class OdcReduceScatter(_CommBase, base):
        """Reduce-scatter that pushes row r of the input into owner r's accumulator (see the module docstring)."""

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: dist.ReduceOp,
            async_op: bool = False,
        ) -> dist.Work | None:
            state = self._check_group(group, "reduce-scatter")
            unit = self._unit
            if not state.in_minibatch:
                state.aborted_backward = True
                recover = (
                    "ODC resets it (model.reset_iter_state()) and drops this backward's partial gradients at the "
                    "next begin_minibatch, so the next minibatch is exact"
                    if _compat.has_capability("reset_iter_state")
                    else f"torch {torch.__version__} has no FSDPModule.reset_iter_state (torch >= 2.13): rebuild "
                    "the model (e.g. from a checkpoint) before going on"
                )
                raise OdcUsageError(
                    "odc_runtime.fsdp: backward() ran outside a minibatch on an ODC-enabled model; wrap the "
                    "micro-batches in `with odc_runtime.fsdp.minibatch(model):` (or begin_minibatch/end_minibatch). "
                    f"FSDP's iteration state is now undefined: {recover}"
                )
            if unit.replicate_pg is not None and _compat.all_reduce_grads(unit.group):
                raise OdcUsageError(
                    f"odc_runtime.fsdp: FSDP's cross-replica all-reduce is on for the HSDP module {unit.fqn!r} at its "
                    "reduce-scatter: set_requires_gradient_sync(True) (or set_requires_all_reduce(True)) ran between "
                    "its forward and this backward. ODC keeps that all-reduce off (a collective per backward, which "
                    "ranks with different micro-batch counts never all meet; end_minibatch all-reduces once) and "
                    "turns it off again before each forward: turn gradient sync back on before the forward"
                )
            _grads.before_reduce(unit)
            w, n = unit.rows, unit.rs_numel
            if unit.st_rs is None or input_tensor.dtype not in PARAM_DTYPES:
                raise _layout_error(unit, input_tensor, w)
            rows = _full_rows(unit, input_tensor, w) if unit.track_unused else None
            if rows is None:
                if input_tensor.numel() != w * n:
                    raise _layout_error(unit, input_tensor, w)
                rows = input_tensor.view(w, n)
            # FSDP pre-divides reduce dtypes with overflow risk (fp16) before the reduce-scatter; undo it so the
            # accumulator holds plain sums. The reduce dtype is the input's (it differs across torch versions).
            factor = _compat.gradient_divide_factor(unit.group) or float(state.world_size)  # HSDP: all ranks
            odc.push(unit.st_rs, rows, scale=fp16_pre_factor(input_tensor.dtype, factor))
            output_tensor.zero_()
            unit.reduce_scatters += 1
            return None

    return OdcReduceScatter


def _layout_error(unit: Unit, input_tensor: torch.Tensor, w: int) -> OdcUsageError:
    return OdcUsageError(
        f"odc_runtime.fsdp reduce-scatter for {unit.fqn!r}: FSDP passed {input_tensor.numel()} elements of "
        f"{input_tensor.dtype} but ODC laid out {w} x {unit.rs_numel} floating-point elements at enable() time; "
        "trainable parameters (requires_grad) or dtypes changed after enable(): disable() and enable() again"
    )


def _full_rows(unit: Unit, input_tensor: torch.Tensor, w: int) -> torch.Tensor | None:
    """Without torch's unused-parameter hook: map FSDP's input, which holds only the parameters that received a
    gradient (in order), onto the full ``(W, R)`` layout. Returns None when every parameter is present (the input
    already has the full layout)."""
    present = [p for p in unit.params if p.rs_offset is not None and p.used]
    for p in unit.params:
        p.used = False
    sub = sum(p.padded for p in present)
    if input_tensor.numel() != w * sub:
        raise OdcUsageError(
            f"odc_runtime.fsdp reduce-scatter for {unit.fqn!r}: FSDP passed {input_tensor.numel()} elements, but the "
            f"{len(present)} parameters that received a gradient lay out {w} x {sub}; torch "
            f"{torch.__version__} selects the reduced parameters differently than ODC expects (report this)"
        )
    if sub == unit.rs_numel:
        return None
    src = input_tensor.view(w, sub)
    full = torch.zeros((w, unit.rs_numel), dtype=input_tensor.dtype, device=input_tensor.device)
    col = 0
    for p in present:
        full[:, p.rs_offset : p.rs_offset + p.padded].copy_(src[:, col : col + p.padded])
        col += p.padded
    return full


def keep_all_reduce_off(unit: Unit) -> list[RemovableHandle]:
    """HSDP: ODC turns FSDP's per-backward cross-replica all-reduce off (``enable``), but
    ``set_requires_gradient_sync(True)`` turns it back on with the reduce-scatter (FSDP sets both), e.g. for the
    last chunk of torchtitan's chunked loss. A forward pre-hook on every module of the group turns it off again, so
    the backward of that forward reduce-scatters only (a toggle between a forward and its backward is refused by the
    reduce-scatter). Returns the hooks' handles."""

    def off(module: nn.Module, args: tuple[object, ...]) -> None:
        if _compat.all_reduce_grads(unit.group):
            module.set_requires_all_reduce(False, recurse=False)

    return [m.register_forward_pre_hook(off) for m in unit.modules]


def install_unused_tracking(unit: Unit) -> None:
    """Track which trainable parameters of ``unit`` receive a gradient (torch without the unused-params hook)."""
    unit.track_unused = True
    trainable = sum(p.rs_offset is not None for p in unit.params)

    def after_unshard(module: nn.Module, args: tuple[object, ...]) -> None:
        # Runs after FSDP's own pre-forward hook (registered with prepend=True), which has unsharded and waited.
        if len(unit.hooked) == trainable:
            return
        for p in unit.params:
            up = _compat.unsharded_param(p.fsdp_param)
            if p.rs_offset is None or up is None or id(up) in unit.hooked:
                continue
            unit.handles.append(up.register_post_accumulate_grad_hook(_marker(p)))
            unit.hooked.add(id(up))

    # every module of a grouped fully_shard: a forward may run only some of them (e.g. the head alone, per chunk)
    unit.handles.extend(m.register_forward_pre_hook(after_unshard) for m in unit.modules)


def _marker(p: Param) -> Callable[[torch.Tensor], None]:
    def mark(_: torch.Tensor) -> None:
        p.used = True

    return mark


def remove_unused_tracking(unit: Unit) -> None:
    """Undo ``install_unused_tracking``."""
    for handle in unit.handles:
        handle.remove()
    unit.handles.clear()
    unit.hooked.clear()
    unit.track_unused = False
