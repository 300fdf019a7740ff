"""The sharded gradients (``sharded_param.grad``) of an ODC model inside a minibatch.

With plain FSDP2 every backward reduce-scatters at once, so inside a gradient-accumulation window ``.grad`` holds
the sum over every rank of the micro-batches so far: ``optimizer.zero_grad()`` after a backward drops those
micro-batches, and ``clip_grad_norm_`` clips that partial sum. In ODC mode the gradients arrive in the owners'
accumulators one-sidedly, from every rank at its own pace, and only ``end_minibatch`` turns them into ``.grad``:
inside a minibatch there is no partial sum to drop or clip (what arrived at an owner depends on the other ranks'
timing, and this rank's own contributions sit in the other owners' accumulators). Doing nothing would silently
train on a different gradient than FSDP2 (the issue this module fixes), so ODC refuses these uses:

- ``hold`` (at ``begin_minibatch``) sets every trainable sharded parameter's ``.grad`` to a *placeholder*: a
  DTensor whose local tensor is a ``PendingGrad``. FSDP's own accumulation of ODC's zero reduce-scatter output
  into it (``grad._local_tensor += ...``, an ``add_``) is a no-op; any other operation on it, a read included
  (``clip_grad_norm_``, ``zero_grad(set_to_none=False)``, a gradient norm per micro-batch), raises
  ``OdcUsageError`` at the call, on every rank alike (each holds placeholders), so a collective inside the
  caller (the norm's all-reduce) is never entered by some ranks only.
- ``zero_grad()`` with ``set_to_none=True`` (the default) touches no tensor: it replaces the placeholder by
  ``None``. Before this rank's first backward of the minibatch that is what FSDP2 does too (it drops the gradients
  of earlier minibatches, e.g. ``with minibatch(model): optimizer.zero_grad(); ...``), and ODC does the same. After
  one, ``release`` reports it and ``end_minibatch`` refuses the minibatch on every rank (its agreement step).
- ``release`` (at ``end_minibatch``, or when a minibatch is abandoned) puts back what ``.grad`` held before.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from odc_runtime.errors import OdcUsageError

from ._layout import Param, State

_ADD = torch.ops.aten.add_.Tensor
_VIEWS = {torch.ops.aten.alias.default, torch.ops.aten.view.default, torch.ops.aten.detach.default,
          torch.ops.aten._unsafe_view.default, torch.ops.aten.as_strided.default}


class PendingGrad(torch.Tensor):
    """Local tensor of a placeholder gradient: no storage; ``add_`` into it is a no-op, views stay placeholders,
    anything else raises ``OdcUsageError`` (module docstring). ``owner`` is the parameter it stands in for (held
    weakly: the parameter keeps its placeholder), so that the error names it and says what actually happened."""

    _owner: weakref.ref[Param] | None

    @staticmethod
    def __new__(
        cls: type[PendingGrad], like: torch.Tensor, device: torch.device | None = None, owner: Param | None = None
    ) -> PendingGrad:
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=device or like.device,
            requires_grad=False,
        )
        t._owner = None if owner is None else weakref.ref(owner)
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _ADD and type(args[0]) is cls:  # FSDP adds ODC's zero reduce-scatter output
            return args[0]
        if func in _VIEWS and type(args[0]) is cls:  # a view of a placeholder is a placeholder of its shape
            t = args[0]
            meta = func(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"), *args[1:],
                        **(kwargs or {}))
            return cls(meta, t.device, t._owner and t._owner())
        placeholder = next((a for a in args if type(a) is cls), None)
        owner = placeholder._owner() if placeholder is not None and placeholder._owner is not None else None
        raise OdcUsageError(_misuse(func, owner))

    __torch_function__ = torch._C._disabled_torch_function_impl


def _misuse(func: Any, owner: Param | None) -> str:
    """What an operation on a placeholder means: a use of ``.grad`` inside the minibatch (the usual case), a
    placeholder kept from inside the minibatch and used after it, or one ODC failed to replace (a defect)."""
    if owner is not None and not owner.held:  # the minibatch ended (release() emptied ``held``)
        if owner.sharded_param.grad is owner.placeholder:
            return (
                f"odc_runtime.fsdp: the gradient (.grad) of {owner.fqn!r} still holds ODC's in-minibatch placeholder "
                f"after the minibatch ended ({func}): end_minibatch did not put the minibatch's gradient there. This "
                "is a defect of odc_runtime: report it with the model's fully_shard calls and the torch version; "
                "meanwhile train this model with plain FSDP2 (odc_runtime.fsdp.disable(model))"
            )
        return (
            f"odc_runtime.fsdp: a gradient of {owner.fqn!r} taken from .grad inside a minibatch was used after the "
            f"minibatch ended ({func}). Inside a minibatch .grad holds a placeholder (the gradient only exists "
            "after end_minibatch); read .grad again after the `with odc_runtime.fsdp.minibatch(model):` block"
        )
    named = "" if owner is None else f" ({owner.fqn!r})"
    return (
        f"odc_runtime.fsdp: the gradients (.grad) of an ODC-enabled model were used inside a minibatch{named} ({func}: "
        "e.g. clip_grad_norm_(), zero_grad(set_to_none=False), or a gradient norm per micro-batch). In ODC mode "
        "this minibatch's gradients only exist after end_minibatch (the owners receive them one-sidedly from "
        "every rank), so FSDP2's partial sum of the micro-batches so far does not exist. Clip, inspect or zero "
        "the gradients after the `with odc_runtime.fsdp.minibatch(model):` block (or after end_minibatch)"
    )


def _placeholder(p: Param) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    sp = p.sharded_param
    local = sp.to_local()
    return DTensor.from_local(PendingGrad(local, owner=p), sp.device_mesh, sp.placements, run_check=False,
                              shape=sp.shape, stride=sp.stride())


def hold(state: State) -> None:
    """Begin a minibatch: keep every trainable sharded parameter's ``.grad`` aside and put a placeholder there."""
    with torch.no_grad():
        for unit in state.units:
            unit.reduced = False
            for p in unit.params:
                if p.rs_offset is None:
                    continue
                sp = p.sharded_param
                p.held = (sp.grad,)
                if p.placeholder is None or p.placeholder.shape != sp.shape:  # made once: it holds no data
                    p.placeholder = _placeholder(p)
                sp.grad = p.placeholder


def before_reduce(unit: Any) -> None:
    """In ODC's reduce-scatter, before FSDP accumulates: a placeholder that ``zero_grad()`` replaced by ``None``
    before this unit's first backward of the minibatch means "drop the earlier gradients" (as FSDP2); put a new
    placeholder back so FSDP adds into it. After a backward, the replacement is left for ``release`` to
    report."""
    if not unit.reduced:
        for p in unit.params:
            sp = p.sharded_param if p.rs_offset is not None else None
            if sp is not None and p.held and sp.grad is None:
                p.held = (None,)
                sp.grad = p.placeholder
        unit.reduced = True


def release(state: State) -> str | None:
    """End (or abandon) a minibatch: put back what ``.grad`` held before it (or ``None`` where ``zero_grad()``
    dropped it before this rank's first backward). Returns the first parameter whose placeholder was replaced after
    a backward of this rank (``zero_grad()`` between micro-batches), described; or None."""
    found = None
    for unit in state.units:
        for p in unit.params:
            if p.rs_offset is None or not p.held:
                continue
            sp, (held,) = p.sharded_param, p.held
            now = sp.grad
            if now is not p.placeholder:  # zero_grad(): before a backward of this rank as FSDP2, after refused
                if unit.reduced and found is None:
                    found = p.fqn
                held = now
            sp.grad = held
            p.held = ()
        unit.reduced = False
    if found is None:
        return None
    return (
        f"the gradient of {found!r} was reset (optimizer.zero_grad() or model.zero_grad()) inside the minibatch after "
        "a backward on this rank. FSDP2 would drop the micro-batches before it, but in ODC mode this minibatch's "
        "gradients only exist after end_minibatch; zero the gradients before the minibatch (or before this rank's "
        "first backward in it), or split the micro-batches into two minibatches"
    )
