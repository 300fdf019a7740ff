"""The end of a minibatch's verdict (``end_minibatch``): the checks each rank makes of its own minibatch (the divide
factor, an overflow, gradients FSDP held back) and the one small all-reduce by which every rank learns whether any
rank failed one, so that all ranks discard the minibatch together and none is left waiting."""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

from odc_runtime.errors import OdcUsageError

from . import _compat
from ._layout import State as _State
from ._layout import Unit as _Unit

__all__ = ["agree_or_explain", "check_divide_factor", "held_back", "overflow", "unit_factor"]


def check_divide_factor(divide_factor: object) -> float | None:
    """``divide_factor`` as a float, or None (the default); any real number type, as ``odc.push(scale=)`` takes."""
    if divide_factor is None:
        return None
    value = None
    if isinstance(divide_factor, numbers.Real) and not isinstance(divide_factor, bool):
        value = float(divide_factor)
    if value is None or not math.isfinite(value) or value <= 0:
        raise OdcUsageError(f"odc_runtime.fsdp: divide_factor must be a positive finite number, got {divide_factor!r}")
    return value


def unit_factor(state: _State, unit: _Unit, divide_factor: float | None) -> float:
    return float(divide_factor or _compat.gradient_divide_factor(unit.group) or state.world_size)


def overflow(state: _State, divide_factor: float | None) -> str | None:
    """Where dividing a finite accumulator by the divide factor gives a non-finite gradient (e.g. a factor of
    1e-45), described; None if nowhere. A non-finite accumulator (a NaN loss) is passed on as FSDP would. One
    device-to-host read."""
    found = []
    with torch.no_grad():
        for unit in state.units:
            st = unit.st_rs
            if st is None or st.grad is None or st.grad.numel() == 0:
                continue
            factor = unit_factor(state, unit, divide_factor)
            amax = st.grad.abs().max()
            dtype = next(p for p in unit.params if p.rs_offset is not None).sharded_param.dtype
            bad = torch.isfinite(amax) & ~torch.isfinite(amax.div(factor).to(dtype))
            found.append((unit, factor, amax, dtype, bad))
    if not found or not bool(torch.stack([bad for *_, bad in found]).any()):
        return None
    unit, factor, amax, dtype, _ = next(f for f in found if bool(f[4]))
    return (
        f"odc_runtime.fsdp: dividing the gradients of {unit.fqn!r} (largest |sum| {float(amax):.4g}) by "
        f"divide_factor {factor!r} overflows {dtype}; pass the divisor of the whole minibatch (e.g. its global "
        "token count, the same on every rank), not a per-rank or tiny value"
    )


def _show_factor(value: float) -> str:
    return "None (the default)" if value == -1.0 else repr(value)


def held_back(state: _State) -> str | None:
    """Where FSDP still holds gradients it has not reduce-scattered, described; or None. With gradient sync off
    (``set_requires_gradient_sync(False)``) FSDP accumulates instead of reduce-scattering, and ODC receives gradients
    only through the reduce-scatter: sync must be back on for each module's last backward of the minibatch."""
    for unit in state.units:
        off = not _compat.reduce_grads(unit.group)
        if off or any(_compat.held_unsharded_grad(p.fsdp_param) for p in unit.params):
            still = " and is still off" if off else ""
            return (
                f"the gradients of {unit.fqn!r} were left in FSDP, not reduce-scattered to their owners: gradient sync "
                f"was off (set_requires_gradient_sync(False)) for its last backward of the minibatch{still}. Turn it "
                "back on before the module's last backward of each minibatch (torchtitan's chunked loss does, for "
                "its last chunk); under ODC deferring the sync saves nothing (a push is one-sided)"
            )
    return None


def agree_or_explain(
    state: _State,
    divide_factor: float | None,
    overflow: str | None,
    changed: str | None,
    reset: str | None = None,
    held: str | None = None,
) -> str | None:
    """One small all-reduce (after S2, so every rank is here): the divide factor must be the same on every rank
    (a per-rank value, e.g. a local token count, would divide each owner's rows differently), and an overflow, a
    parameter changed, a gradient reset inside the minibatch or gradients held back by FSDP on any rank fail the
    minibatch on every rank, so none is left waiting. Returns the error message for this rank, or None."""
    device = state.units[0].device if state.units and state.units[0].device.type == "cuda" else "cpu"
    mine = -1.0 if divide_factor is None else divide_factor
    flags = torch.tensor([mine, -mine, float(overflow is not None), float(changed is not None),
                          float(reset is not None), float(held is not None)], dtype=torch.float64)
    dist.all_reduce(flags_dev := flags.to(device), op=dist.ReduceOp.MAX)
    hi, neg_lo, any_overflow, any_changed, any_reset, any_held = flags_dev.tolist()
    if reset is not None:
        return f"odc_runtime.fsdp: {reset}. This minibatch's gradients were discarded on every rank"
    if any_reset:
        return (
            "odc_runtime.fsdp: another rank reset its gradients (zero_grad) inside the minibatch after a backward "
            "(see its error); this minibatch's gradients were discarded on every rank"
        )
    if held is not None:
        return f"odc_runtime.fsdp: {held}. This minibatch's gradients were discarded on every rank"
    if any_held:
        return (
            "odc_runtime.fsdp: another rank left gradients in FSDP with gradient sync off (see its error); this "
            "minibatch's gradients were discarded on every rank"
        )
    if changed is not None:
        return (
            f"odc_runtime.fsdp: parameters changed inside the minibatch: {changed}. The minibatch computed its "
            "gradients with the parameters published at begin_minibatch; optimizer.step(), load_state_dict() and "
            "in-place edits belong between minibatches. This minibatch's gradients were discarded on every rank"
        )
    if any_changed:
        return (
            "odc_runtime.fsdp: another rank changed its parameters inside the minibatch (see its error); this "
            "minibatch's gradients were discarded on every rank"
        )
    if hi != -neg_lo:
        return (
            "odc_runtime.fsdp: end_minibatch(divide_factor=...) differs between ranks (from "
            f"{_show_factor(-neg_lo)} to {_show_factor(hi)}; this rank passed {_show_factor(mine)}). Each owner "
            "divides the sums it holds, so per-rank values "
            "would scale the parameters' rows differently: pass the same global value on every rank (e.g. "
            "all-reduce the token count). This minibatch's gradients were discarded on every rank"
        )
    if overflow is not None:
        return overflow + ". This minibatch's gradients were discarded on every rank"
    if any_overflow:
        return (
            "odc_runtime.fsdp: the divide factor made another rank's gradients non-finite (see its error); this "
            "minibatch's gradients were discarded on every rank"
        )
    return None
