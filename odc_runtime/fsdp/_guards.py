"""The slip guards of FSDP2 ODC mode: hooks that refuse, at the call, what cannot work.

Parameters must not change between begin_minibatch (which publishes them) and end_minibatch: a change would train
one minibatch behind (an optimizer step inside the minibatch uses the previous minibatch's gradients) or mix two
parameter versions across ranks. The two common slips (``optimizer.step()``, ``load_state_dict()``) are refused at
the call; any other in-place change is caught by end_minibatch's bitwise comparison with the published rows. A
training forward outside a minibatch is refused before FSDP's pre-forward (see
``_refuse_training_forward_outside``); an inference forward outside one first checks that every rank runs it
(``_agree_on_forward_outside``).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from odc_runtime import state as odc_state
from odc_runtime.errors import OdcRoundMismatchError, OdcUsageError

from ._layout import STATES as _STATES
from ._layout import State as _State


def install(state: _State, model: nn.Module, modules: list[nn.Module]) -> None:
    """Install the guards of ``state`` (``model`` and its FSDP ``modules``); the per-model hooks' handles go to
    ``state.handles`` (removed by ``disable``), the optimizer step hook is global and installed once."""
    state.handles.append(model.register_load_state_dict_pre_hook(_refuse_load_inside(state)))
    refuse_forward = _refuse_training_forward_outside(state)
    for m in modules:  # first of each module's pre-hooks: before FSDP's, which all-gathers (a collective here)
        state.handles.append(m.register_forward_pre_hook(refuse_forward, prepend=True))
    # The model's own first pre-hook, so once per forward of the model and before any FSDP module's all-gather
    state.handles.append(model.register_forward_pre_hook(_agree_on_forward_outside(state), prepend=True))
    _install_step_guard()


_STEP_GUARD: list[object] = []  # the handle of the one global optimizer step pre-hook (installed at first enable)


def _install_step_guard() -> None:
    if not _STEP_GUARD:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_GUARD.append(register_optimizer_step_pre_hook(_refuse_step_inside))


def _refuse_step_inside(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    open_states = [s for s in list(_STATES.values()) if s.in_minibatch]
    if not open_states:
        return
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for s in open_states:
        if not ids.isdisjoint(s.param_ids):
            raise OdcUsageError(
                f"odc_runtime.fsdp: {type(optimizer).__name__}.step() inside a minibatch of an ODC-enabled model; "
                "the gradients of this minibatch only arrive at end_minibatch, so this step would use the previous "
                "minibatch's (training one minibatch behind). Call optimizer.step() and zero_grad() after the "
                "`with odc_runtime.fsdp.minibatch(model):` block (or after end_minibatch)"
            )


def _refuse_load_inside(state: _State) -> object:
    ref = weakref.ref(state)

    def hook(module: nn.Module, *args: object) -> None:
        s = ref()
        if s is not None and s.in_minibatch:
            raise OdcUsageError(
                "odc_runtime.fsdp: load_state_dict() inside a minibatch of an ODC-enabled model; the parameters "
                "were published at begin_minibatch and must not change until end_minibatch. Load between "
                "minibatches"
            )

    return hook


def _refuse_training_forward_outside(state: _State) -> object:
    """A forward with gradients enabled outside a minibatch would all-gather through torch.distributed (ODC fetches
    only inside one), a collective that ranks running different micro-batch counts never all meet: refused on every
    rank that runs one, before FSDP's own pre-forward (nothing is entered). Inference (``torch.no_grad()``,
    ``torch.inference_mode()``) outside a minibatch stays allowed: every rank runs it together."""
    ref = weakref.ref(state)

    def hook(module: nn.Module, args: object) -> None:
        s = ref()
        if s is None or s.in_minibatch or not torch.is_grad_enabled():
            return
        raise OdcUsageError(
            "odc_runtime.fsdp: a forward with gradients enabled ran outside a minibatch on an ODC-enabled model; "
            "wrap the training micro-batches in `with odc_runtime.fsdp.minibatch(model):` (or begin_minibatch / "
            "end_minibatch), where any count per rank works. Outside a minibatch the all-gather is "
            "torch.distributed's collective, so only inference under torch.no_grad() (or torch.inference_mode()) "
            "run by every rank together is allowed there. Nothing ran: no collective was entered"
        )

    return hook


# The round's name: what a peer's mismatch message calls the forward (the same on every rank; within the 64 bytes a
# barrier round publishes).
_FORWARD_OUTSIDE = "fsdp forward outside a minibatch (every rank must run it)"


def _agree_on_forward_outside(state: _State) -> object:
    """An inference forward outside a minibatch all-gathers through torch.distributed, a collective every rank must
    run: one rank running it alone (an evaluation on rank 0 only) waited there while its peers waited for it in
    ODC's next collective, ODC_TIMEOUT (300 s) and then gloo's raw "Connection closed by peer". So the model's
    forward first meets the other ranks in one ODC round: ranks that all evaluate pass it together; a peer that is in
    an ODC collective instead (a minibatch's sync) makes both raise OdcRoundMismatchError at once, before any
    torch.distributed collective was entered, and the runtime stays usable (an aligned round). A peer that is in no
    ODC collective is waited for up to ODC_TIMEOUT, as by any collective; so is every peer on the nvshmem transport,
    whose rounds go through the store and cannot see its barriers."""
    ref = weakref.ref(state)

    def hook(module: nn.Module, args: object) -> None:
        s = ref()
        if s is None or s.in_minibatch or torch.is_grad_enabled():
            return  # inside a minibatch forwards fetch one-sidedly; with gradients: refused by the other hook
        runtime = odc_state.require("fsdp forward outside a minibatch")
        try:
            runtime.transport.exchange(_FORWARD_OUTSIDE, b"")
        except OdcRoundMismatchError as e:
            raise OdcRoundMismatchError(
                f"{e}. This rank ran an inference forward outside a minibatch while another rank was in ODC's "
                "collective: run evaluation forwards outside a minibatch on every rank together, or inside "
                "`with odc_runtime.fsdp.minibatch(model):`, where each rank may run any number of them. Nothing ran: "
                "no torch.distributed collective was entered"
            ) from None

    return hook
