"""FSDP2 (``torch.distributed.fsdp.fully_shard``) in ODC mode.

Users keep their FSDP2 model, optimizer and checkpoints and add a few lines::

    fully_shard(block) for each block; fully_shard(model)      # as usual
    odc_runtime.init()
    odc_runtime.fsdp.enable(model)
    for minibatch in data:
        with odc_runtime.fsdp.minibatch(model):              # or begin_minibatch / end_minibatch
            for micro_batch in my_share_of(minibatch):        # any count per rank, zero included
                model(micro_batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # optional, DTensor grads as with FSDP
        optimizer.step()
        optimizer.zero_grad()

How. ``enable`` installs, on every FSDP module (the setters are not recursive), a custom all-gather and a
custom reduce-scatter through FSDP2's public hooks ``set_custom_all_gather`` / ``set_custom_reduce_scatter``;
nothing of torch is patched. To lay out the rows exactly as FSDP does, it *reads* (never writes) each module's
FSDP parameter-group metadata (parameter order, mixed-precision and offload policies, meshes), as FSDPModule's own
setters do; every such read lives in ``odc_runtime.fsdp._compat``, which also detects what this torch offers
(torch 2.9 to 2.14 are tested). The layout is re-checked at run time (row sizes and dtypes on every call, the
published values against FSDP's all-gather input on the first call), so a change in torch's internals gives a
clear error instead of wrong gradients. For each FSDP parameter group (one FSDP module, or the modules of one
grouped ``fully_shard([a, b])`` call, which FSDP communicates together) it creates ODC sharded tensors of shape
``(W, I)`` for the parameters and ``(W, R)`` for the gradients, where ``I`` is FSDP's per-rank all-gather input
numel and ``R`` its per-rank reduce-scatter output numel (both padded as FSDP pads), so ODC owner ``r`` holds
exactly row ``r`` (``_layout``). When ``R == I`` (no frozen parameter in the module) one sharded tensor serves both:
its parameter buffer holds the published row and its fp32 accumulator the gradient row.

- All-gather (in place; FSDP's input is row ``rank`` of the output): inside a minibatch the output rows are
  fetched from the owners' published rows (one-sided; the owners do nothing). Outside a minibatch (an evaluation
  forward run by all ranks together, under ``torch.no_grad()``) it falls back to the ordinary collective
  all-gather; a forward with gradients enabled there is refused before FSDP's pre-forward (``OdcUsageError``
  naming ``odc_runtime.fsdp.minibatch``), as the ranks of a training step run different micro-batch counts.
- Reduce-scatter (the input is laid out so ``input.view(W, -1)[r]`` is rank ``r``'s shard): one ``odc.push`` of
  the whole input adds row ``r`` into owner ``r``'s fp32 accumulator; the output is returned as zeros, so what
  FSDP adds into ``sharded_param.grad`` during the minibatch is zero (and FSDP's reduce op and post-division,
  which differ across torch versions, act on zeros). Parameters that got no gradient in a backward keep their
  columns: ``set_reduce_scatter_unused_params(True)`` where torch has it (>= 2.13), ODC's own tracking before
  and for mixed-precision reduce dtypes (``_hooks``). A reduce-scatter outside a minibatch raises ``OdcUsageError``.
- ``begin_minibatch`` reshards every FSDP module (so the next forward gathers again; after a refused
  backward outside a minibatch it first resets FSDP and drops that backward's partial gradients), writes this rank's
  sharded parameters, cast to the all-gather dtype exactly as FSDP casts them (``MixedPrecisionPolicy
  .param_dtype``), into its row of the parameter buffers, and runs ``odc.sync()``.
- ``end_minibatch`` returns every FSDP module to FSDP's normal sharded state (an explicit ``unshard()`` no
  forward consumed, ``reshard_after_forward=False`` after a forward-only pass), runs ``odc.sync()``, agrees with
  every rank in one 6-number all-reduce that no rank changed its parameters inside the minibatch (bitwise against
  the published rows), reset its gradients after a backward or left gradients in FSDP with gradient sync off, that
  ``divide_factor`` is the same everywhere and that dividing by it overflows nowhere (else
  every rank raises ``OdcUsageError``, the minibatch is discarded, the model stays usable), writes
  ``accumulator / divide_factor`` (cast to the parameter dtype) into every ``sharded_param.grad`` (a DTensor, as
  FSDP makes it; added to an existing ``.grad`` as FSDP adds), and zeroes the accumulators.
- ``optimizer.step()`` (a global optimizer step pre-hook) and ``load_state_dict()`` (a pre-hook on the model) on an
  ODC-enabled model inside a minibatch raise ``OdcUsageError`` at the call.

HSDP (2-D mesh ``(replicate, shard)``). FSDP's rows span the shard group, so each module's ODC buffers are sharded
over it (``odc.shard(group=shard group)``: every rank calls it with its own shard group) and fetches and pushes stay
inside the shard group (one node, typically). FSDP's cross-replica all-reduce after every backward is turned off
(``set_requires_all_reduce(False)``: it would be a collective per micro-batch, which ranks with different
micro-batch counts cannot meet, and it would only see ODC's zeros). ``end_minibatch`` instead runs, after
``odc.sync()``, one ``all_reduce`` (SUM) of all accumulators across the replicate group, so the slow inter-node
links carry one collective per minibatch, then divides by the whole data-parallel size as FSDP2 HSDP does. Load
balancing: plan LB-Mini over *all* ranks (``balance.plan(..., policy="lb_mini")`` with the world size): inside the
minibatch no rank waits for any other, and the only cross-replica step is that one all-reduce at the end, so what
must be balanced is each rank's total work in the minibatch, across replicas as much as within a shard group. HPZ
(``reshard_after_forward=<int>``) is refused (see ``enable``).

Scaling. FSDP2 averages over the data-parallel ranks in every backward and *sums* over the micro-batches of a
gradient-accumulation window. The accumulator holds the plain sum over all ranks and micro-batches, so the
default ``divide_factor`` is the world size (or the module's ``set_gradient_divide_factor`` value if one was
set): with equal micro-batch counts this is exactly FSDP2's gradient. With unequal counts choose the divisor
that matches your loss, e.g. sum the token losses and pass the global token count of the minibatch.

Ordering (why two syncs per minibatch suffice). Let minibatch ``k`` be ``publish_k; S1_k; micro-batches; S2_k;
read + zero``. (a) Every fetch in ``k`` happens after ``S1_k``, hence after every owner's ``publish_k``.
(b) ``publish_{k+1}`` on owner ``o`` happens after ``o`` left ``S2_k``, hence after every rank entered ``S2_k``,
hence after every fetch of ``k`` (fetches are complete when they return), so no rank reads a half-updated row.
(c) Every push of ``k`` precedes its rank's ``S2_k``, so it is in the accumulator when the owner reads it.
(d) The owner zeroes its accumulator after ``S2_k`` (all pushes of ``k`` landed, none is lost) and before
``S1_{k+1}``; every push of ``k+1`` comes after ``S1_{k+1}``, so none is wiped. Hence the zeroing needs no third
sync: ``S1_{k+1}`` is its fence.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

import odc_runtime as odc
from odc_runtime.errors import OdcUsageError

from . import _compat, _grads, _guards, _hooks, _telemetry, _verdict
from ._compat import CAPABILITIES, has_capability
from ._layout import OWNER as _OWNER
from ._layout import STATES as _STATES
from ._layout import State as _State
from ._layout import Unit as _Unit
from ._layout import build_unit as _build_unit

if TYPE_CHECKING:  # annotations only
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

log = logging.getLogger(__name__)

# Tests only: use ODC's own unused-parameter tracking even where torch has set_reduce_scatter_unused_params, so the
# fallback that older torch releases need is exercised on every version.
_FORCE_UNUSED_TRACKING = False

__all__ = [
    "CAPABILITIES",
    "begin_minibatch",
    "disable",
    "enable",
    "end_minibatch",
    "has_capability",
    "is_enabled",
    "minibatch",
    "stats",
]


def is_enabled(model: nn.Module) -> bool:
    """Whether ``enable`` is active on ``model``."""
    return model in _STATES


def _state(model: nn.Module, what: str) -> _State:
    state = _STATES.get(model)
    if state is None:
        hint = ""
        if model in _OWNER:
            hint = " (it is enabled on an enclosing model: pass that root model)"
        raise OdcUsageError(
            f"odc_runtime.fsdp.{what}() on a model without ODC{hint}: call odc_runtime.fsdp.enable(model) after "
            "fully_shard() and odc_runtime.init()"
        )
    return state


def _fsdp_modules(model: nn.Module, fsdp_module_cls: type) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, fsdp_module_cls)]


def _param_group(module: nn.Module, fqn: str) -> FSDPParamGroup | None:
    """The module's single FSDP parameter group, or None if it manages no parameters."""
    groups = _compat.param_groups(module)
    if len(groups) > 1:
        raise OdcUsageError(
            f"odc_runtime.fsdp: FSDP module {fqn or '<root>'!r} has {len(groups)} parameter groups (per-parameter "
            "meshes via shard_placement_fn); FSDP2's custom comm hooks and ODC support one group per module"
        )
    return groups[0] if groups else None


def _by_param_group(
    modules: list[tuple[str, nn.Module]],
) -> list[tuple[FSDPParamGroup, list[tuple[str, nn.Module]]]]:
    """The FSDP parameter groups of ``modules`` (named FSDP modules, in model order), each with its modules.

    ``fully_shard([a, b, ...])`` gives several modules one FSDP state and one parameter group: FSDP all-gathers and
    reduce-scatters them together, so ODC lays out one unit for them (one set of hooks, rows and gradient
    placeholders), not one per module. Modules that manage no parameters are left out."""
    found: dict[int, tuple[FSDPParamGroup, list[tuple[str, nn.Module]]]] = {}
    for fqn, m in modules:
        group = _param_group(m, fqn)
        if group is not None:
            found.setdefault(id(group), (group, []))[1].append((fqn, m))
    return list(found.values())


def enable(model: nn.Module, *, validate: bool = False) -> nn.Module:
    """Put an FSDP2 model in ODC mode (collective: call on every rank, after ``fully_shard`` and ``odc.init``).

    Installs ODC's all-gather and reduce-scatter on every FSDP module of ``model``, keeps the reduce-scatter
    layout fixed for parameters without a gradient (``set_reduce_scatter_unused_params(True)`` where torch has it,
    ODC's own tracking otherwise and under a mixed-precision reduce dtype), and allocates the ODC buffers (one set
    per FSDP parameter group). Every parameter of ``model`` that requires a gradient must be managed by FSDP.

    Args:
        model: the root module (normally itself passed to ``fully_shard``).
        validate: compare FSDP's all-gather input with the published parameters (bit patterns, NaN-safe) at the
            first all-gather of every module in every minibatch (default: only once after ``enable``). Catches
            parameters modified inside a minibatch at the next forward (``end_minibatch`` catches them anyway, at
            the end); costs one comparison of the local shard per module per minibatch.

    HSDP (``fully_shard(mesh=<2-D mesh (replicate, shard)>)``) is supported: ODC shards each module's buffers over
    the shard group (``odc.shard(group=...)``), turns FSDP's per-backward cross-replica all-reduce off
    (``set_requires_all_reduce(False)``, restored by ``disable``) and all-reduces the accumulators across the
    replicate group once in ``end_minibatch``.

    Returns ``model``. Raises ``OdcUsageError`` for a torch without FSDP2's custom comm hooks (naming the
    oldest torch that has them), for unsupported configurations (2-D meshes other than HSDP's, HSDP with one-rank
    shard groups, CPU offload, ``reshard_after_forward=<int>`` (HPZ), FSDP all-gather extensions, mixed dtypes in a
    module, parameters outside FSDP) and if ODC is already enabled on the model or one of its FSDP modules.
    """
    api = _compat.fsdp_api()
    if not odc.is_initialized():
        raise OdcUsageError("odc_runtime.fsdp.enable() needs odc_runtime.init() first")
    if not isinstance(model, nn.Module):
        raise OdcUsageError(f"odc_runtime.fsdp.enable() expects an nn.Module, got {type(model).__name__}")
    if model in _STATES:
        raise OdcUsageError("odc_runtime.fsdp.enable() called twice on the same model; call disable() first")
    modules = _fsdp_modules(model, api.fsdp_module)
    if not modules:
        raise OdcUsageError(
            "odc_runtime.fsdp.enable(): no FSDP module found; apply torch.distributed.fsdp.fully_shard to the "
            "blocks and the root first"
        )
    for fqn, m in modules:
        if m in _OWNER:
            raise OdcUsageError(
                f"odc_runtime.fsdp.enable(): FSDP module {fqn or '<root>'!r} already belongs to an ODC-enabled "
                "model; call disable() on that model first"
            )
    world_size, rank = odc.world_size(), odc.rank()
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise OdcUsageError("odc_runtime.fsdp: the ODC runtime and the default process group disagree on ranks")
    if world_size < 2:
        # FSDP2 (torch >= 2.11) skips the reduce-scatter hook on one rank and writes the gradients itself, so
        # divide_factor could not be honoured; and there is no communication to replace.
        raise OdcUsageError(
            "odc_runtime.fsdp.enable() on a single rank: FSDP2 communicates nothing there, so ODC mode has nothing "
            "to replace; train with plain FSDP2 (or launch at least 2 ranks)"
        )
    device_type = odc.device_type()
    # Reshard so that the sharded parameters are the registered ones and the next forward gathers again.
    for _, m in modules:
        m.reshard()
    units: list[_Unit] = []
    managed: set[int] = set()
    names = {id(p): n for n, p in model.named_parameters()}
    for group, members in _by_param_group(modules):
        unit = _build_unit(members, group, world_size, api, names)
        if unit.device.type != device_type:
            raise OdcUsageError(
                f"odc_runtime.fsdp: FSDP module {unit.fqn!r} runs on {unit.device} but the ODC "
                f"{odc.backend()!r} backend works on {device_type}"
            )
        managed.update(id(p.sharded_param) for p in unit.params)
        if unit.ag_numel > 0:
            units.append(unit)
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in managed]
    if outside:
        raise OdcUsageError(
            f"odc_runtime.fsdp.enable(): parameters {outside[:5]} require gradients but are not managed by FSDP "
            "(apply fully_shard to the root too, and do not use ignored_params with ODC)"
        )
    state = _State(model, units, world_size, rank, validate)
    all_gather_cls = _hooks.make_all_gather(api.all_gather)
    reduce_scatter_cls = _hooks.make_reduce_scatter(api.reduce_scatter)
    model_id = next(_ENABLE_COUNT)  # shard names must be unique per runtime; several models may share one
    try:
        for unit in units:
            shared = unit.rs_numel == unit.ag_numel
            # HSDP: one ODC tensor per shard group (every rank calls shard, each with its own shard group)
            unit.st_ag = odc.shard(
                torch.empty((unit.rows, unit.ag_numel), dtype=unit.ag_dtype, device="meta"),
                name=f"fsdp{model_id}.{unit.fqn}.params",
                requires_grad=shared,  # with frozen parameters the gradients get their own, smaller buffer
                group=unit.shard_pg,
            )
            if shared:
                unit.st_rs = unit.st_ag
            elif unit.rs_numel > 0:
                unit.st_rs = odc.shard(
                    torch.empty((unit.rows, unit.rs_numel), dtype=unit.rs_dtype, device="meta"),
                    name=f"fsdp{model_id}.{unit.fqn}.grads",
                    group=unit.shard_pg,
                )
    except BaseException:
        _free_buffers(units)
        raise
    for unit in units:
        g, m = unit.group, unit.module
        prev_ag, prev_rs = _compat.comms(g)
        unused = _compat.reduce_scatter_unused_params(g)
        unit.prev = {"all_gather": prev_ag, "reduce_scatter": prev_rs, "unused": unused}
        if unit.replicate_pg is not None:
            # HSDP: FSDP's per-backward all-reduce across replicas would be a collective per micro-batch (ranks
            # run different counts) and would only see ODC's zeros; end_minibatch all-reduces the accumulators.
            unit.prev["all_reduce"] = _compat.all_reduce_grads(g)
            m.set_requires_all_reduce(False, recurse=False)
            state.handles.extend(_hooks.keep_all_reduce_off(unit))  # set_requires_gradient_sync(True) re-enables it
        m.set_custom_all_gather(all_gather_cls(state, unit))
        m.set_custom_reduce_scatter(reduce_scatter_cls(state, unit))
        # torch's zeros for unused parameters have the compute dtype, but what FSDP accumulates while gradient sync
        # is off (set_requires_gradient_sync(False), e.g. torchtitan's chunked loss) has the reduce dtype: with mixed
        # precision one reduce-scatter would hold both and torch asserts "uniform gradient dtype". ODC's own
        # tracking passes no zeros through FSDP.
        if api.reduce_scatter_unused_params and not (_FORCE_UNUSED_TRACKING or unit.reduces_in_other_dtype):
            m.set_reduce_scatter_unused_params(True, recurse=False)
        else:
            _hooks.install_unused_tracking(unit)
    state.param_ids = frozenset(id(p.sharded_param) for unit in units for p in unit.params)
    _guards.install(state, model, [m for _, m in modules])
    _STATES[model] = state
    for _, m in modules:
        _OWNER[m] = state
    log.info(
        "odc fsdp enabled: %d FSDP modules, %d parameter elements per rank row",
        len(units),
        sum(u.ag_numel for u in units),
    )
    return model


_ENABLE_COUNT = itertools.count()  # enable() is collective: the same count on every rank


def _free_buffers(units: list[_Unit]) -> None:
    if not odc.is_initialized():
        return
    for unit in units:
        for st in {id(s): s for s in (unit.st_ag, unit.st_rs) if s is not None}.values():
            with contextlib.suppress(odc.OdcError):
                st.free()
        unit.st_ag = unit.st_rs = None


# --------------------------------------------------------------------------------------------------- slip guards
# The hooks that refuse a slip at the call live in ._guards; end_minibatch catches the other in-place changes here.


def _changed_params(state: _State) -> str | None:
    """The first parameter whose shard differs (bitwise) from what begin_minibatch published, described; or None.
    One device-to-host read when nothing changed (the common case)."""
    checks = []
    for unit in state.units:
        row = unit.st_ag.local
        for p in unit.params:
            local = p.sharded_param.to_local().reshape(-1)
            now = local.to(unit.ag_dtype)
            published = row[p.ag_offset : p.ag_offset + local.numel()]
            checks.append((p, now, published, _hooks.same_bits(now, published)))
    if not checks or bool(torch.stack([same.all() for *_, same in checks]).all()):
        return None
    p, now, published, same = next(c for c in checks if not bool(c[3].all()))
    return _hooks.describe_difference(p.fqn, now, published, same)


def _to_normal_state(state: _State) -> None:
    """Every FSDP module of the model back in FSDP's normal (sharded) state, whatever this rank ran: an explicit
    prefetch (``unshard()``, ``async_op`` or not) that no forward consumed is finished and resharded, parameters
    kept unsharded (``reshard_after_forward=False`` with a forward-only rank, ``set_reshard_after_backward(False)``)
    are resharded. Local: no communication."""
    for unit in state.units:
        if _compat.pending_unshard(unit.group):
            _compat.finish_unshard(unit.group)
        unit.module.reshard()


def disable(model: nn.Module) -> nn.Module:
    """Return ``model`` to plain FSDP2 (collective): restore the previous comms and settings, free the buffers.

    Not allowed inside a minibatch. Gradients already written to ``.grad`` stay.
    """
    state = _state(model, "disable")
    if state.in_minibatch:
        raise OdcUsageError("odc_runtime.fsdp.disable() inside a minibatch; call it between minibatches")
    for unit in state.units:
        m, prev = unit.module, unit.prev
        m.set_custom_all_gather(prev["all_gather"])
        m.set_custom_reduce_scatter(prev["reduce_scatter"])
        if "all_reduce" in prev:
            m.set_requires_all_reduce(bool(prev["all_reduce"]), recurse=False)
        if unit.track_unused:
            _hooks.remove_unused_tracking(unit)
        else:
            m.set_reduce_scatter_unused_params(prev["unused"], recurse=False)
    for handle in state.handles:
        handle.remove()
    state.handles.clear()
    _free_buffers(state.units)
    del _STATES[model]
    for m in [m for m, s in _OWNER.items() if s is state]:
        del _OWNER[m]
    return model


# --------------------------------------------------------------------------------------------------- minibatch


_MISSING_AT_BEGIN = (
    "odc_runtime.fsdp.begin_minibatch: a rank named above did not reach this minibatch's start. With FSDP in ODC "
    "mode the usual cause is a forward outside a minibatch (e.g. a validation forward) that not every rank runs: "
    "outside a minibatch the all-gather is torch.distributed's collective, so a rank running it alone waits there "
    "until the process-group timeout. Run such forwards on every rank together, or inside a minibatch, where they "
    "fetch one-sidedly and any count per rank works"
)


def begin_minibatch(model: nn.Module) -> None:
    """Start a minibatch (collective): publish the current parameters, then ``odc.sync()``.

    Between ``begin_minibatch`` and ``end_minibatch`` a rank may run any number of forward/backward
    micro-batches (zero included); parameters must not change in between.
    """
    state = _state(model, "begin_minibatch")
    if state.in_minibatch:
        raise OdcUsageError(
            "odc_runtime.fsdp: minibatch already open (nested minibatch() or begin_minibatch() twice); end it first"
        )
    if state.broken is not None:
        raise OdcUsageError(
            f"odc_runtime.fsdp: a previous minibatch failed ({state.broken}); the ranks' accumulators are no longer "
            "consistent. Restart training from a checkpoint"
        )
    for unit in state.units:
        if not _compat.reduce_grads(unit.group):
            raise OdcUsageError(
                f"odc_runtime.fsdp: set_requires_gradient_sync(False) is active on {unit.fqn!r} at the start of a "
                "minibatch; ODC accumulates across micro-batches itself, keep gradient sync on (turning it off "
                "inside a minibatch works if it is back on for the module's last backward of the minibatch, as "
                "torchtitan's chunked loss does)"
            )
    _telemetry.open_window(state)  # the minibatch's figures (stats()["last_minibatch"]): its publishing and S1 included
    try:
        if state.aborted_backward and _compat.has_capability("reset_iter_state"):
            state.model.reset_iter_state()  # the refused backward left FSDP mid-iteration
        state.aborted_backward = False
        _to_normal_state(state)  # and so the next forward must all-gather the newly published rows
        with torch.no_grad():
            for unit in state.units:
                for p in unit.params:  # what an aborted backward left: unused-parameter marks, unsharded grads
                    p.used = False
                    _compat.drop_unsharded_grad(p.fsdp_param)
                row = unit.st_ag.local
                for p in unit.params:
                    local = p.sharded_param.to_local().reshape(-1)
                    row[p.ag_offset : p.ag_offset + local.numel()].copy_(local)
        _device_sync(state)
        # S1: every row is published before anyone fetches; every accumulator was zeroed before it. Nothing was
        # pushed since S2, so across nodes only the parameters move (gradients=False).
        try:
            odc.sync(gradients=False)
        except odc.OdcTimeoutError as e:
            raise type(e)(f"{e}\n{_MISSING_AT_BEGIN}") from e
    except BaseException as e:
        state.broken = f"begin_minibatch: {type(e).__name__}: {e}"
        _telemetry.close_window(state)
        raise
    _grads.hold(state)  # .grad holds no gradient until end_minibatch: using it inside raises (._grads)
    state.in_minibatch = True
    state.minibatches += 1


def end_minibatch(model: nn.Module, *, divide_factor: float | None = None) -> None:
    """End a minibatch (collective): ``odc.sync()``, write the gradients into ``sharded_param.grad``, zero.

    Args:
        divide_factor: the accumulated (summed over ranks and micro-batches) gradient is divided by this. Default:
            the module's ``set_gradient_divide_factor`` value, else the world size, i.e. FSDP2's mean over ranks
            (and sum over micro-batches). Pass e.g. the minibatch's global token count when the loss is a sum.
    """
    state = _state(model, "end_minibatch")
    if not state.in_minibatch:
        raise OdcUsageError("odc_runtime.fsdp.end_minibatch() without begin_minibatch()")
    factor = _verdict.check_divide_factor(divide_factor)
    state.in_minibatch = False
    reset = _grads.release(state)  # .grad as before the minibatch; a zero_grad() after a backward is refused
    try:
        held = _verdict.held_back(state)
        _to_normal_state(state)
        changed = _changed_params(state)
        _device_sync(state)
        # S2: every push of this minibatch is in its owner's accumulator. The parameters were published before S1
        # and do not change inside the minibatch, so across nodes only the gradients move (parameters=False).
        odc.sync(parameters=False)
        _all_reduce_replicas(state)
        overflow = _verdict.overflow(state, factor)
        problem = _verdict.agree_or_explain(state, factor, overflow, changed, reset, held)
        if problem is None:
            _write_grads(state, factor)
    except odc.OdcOverflowError:  # deterministic mode: every rank discarded the minibatch; a retry is clean
        _telemetry.close_window(state)
        raise
    except BaseException as e:
        state.broken = f"end_minibatch: {type(e).__name__}: {e}"
        _telemetry.close_window(state)
        raise
    _telemetry.close_window(state, ended=True)  # its closing sync passed, even if its gradients are refused below
    if problem is not None:  # every rank raises it together; the accumulators are zeroed, nothing was written
        for unit in state.units:
            if unit.st_rs is not None:
                unit.st_rs.zero_grad()
        raise OdcUsageError(problem)


def _all_reduce_replicas(state: _State) -> None:
    """HSDP: sum the accumulators across the replicate dimension, one all-reduce per replicate group.

    After S2 every accumulator holds the sum over its shard group's micro-batches; rank (i, r) and rank (j, r)
    hold the same row r for replicas i and j, so a SUM over the replicate group gives the sum over every rank, which
    ``_write_grads`` divides like FSDP2 HSDP does (by the whole data-parallel size). The accumulators of all units
    go through one flat buffer: one collective per minibatch, on the slow inter-node links only.
    """
    by_group: dict[tuple[int, ...], tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
    for unit in state.units:
        if unit.replicate_pg is None or unit.st_rs is None or unit.st_rs.grad is None:
            continue
        key = tuple(dist.get_process_group_ranks(unit.replicate_pg))
        by_group.setdefault(key, (unit.replicate_pg, []))[1].append(unit.st_rs.grad)
    for pg, accs in by_group.values():
        flat = torch.cat(accs)
        dist.all_reduce(flat, group=pg)
        offset = 0
        for acc in accs:
            acc.copy_(flat[offset : offset + acc.numel()])
            offset += acc.numel()


def _write_grads(state: _State, divide_factor: float | None) -> None:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for unit in state.units:
            st = unit.st_rs
            if st is None:
                continue
            factor = _verdict.unit_factor(state, unit, divide_factor)
            acc = st.grad
            for p in unit.params:
                if p.rs_offset is None:
                    continue
                sp = p.sharded_param
                local = sp.to_local()
                g = acc[p.rs_offset : p.rs_offset + local.numel()].view(local.shape)
                g = g.div(factor) if factor != 1.0 else g.clone()  # FSDP divides in the reduce dtype, then casts
                g = g.to(sp.dtype)
                if sp.grad is None:
                    sp.grad = DTensor.from_local(
                        g, sp.device_mesh, sp.placements, run_check=False, shape=sp.shape, stride=sp.stride()
                    )
                else:  # FSDP adds into an existing sharded gradient (no zero_grad between steps)
                    sp.grad.to_local().add_(g)
            st.zero_grad()  # fenced by the next begin_minibatch's sync (see the module docstring)


@contextlib.contextmanager
def minibatch(model: nn.Module, *, divide_factor: float | None = None) -> Iterator[None]:
    """``with minibatch(model):`` = ``begin_minibatch`` … ``end_minibatch`` (see both).

    If the body raises, the minibatch is abandoned without the closing sync (peers waiting in it time out after
    ``ODC_TIMEOUT``) and later minibatches on this model refuse to start.
    """
    begin_minibatch(model)
    try:
        yield
    except BaseException as e:
        state = _STATES.get(model)
        if state is not None and state.in_minibatch:
            state.in_minibatch = False
            state.broken = f"{type(e).__name__}: {e}"
            _grads.release(state)
            _telemetry.close_window(state)
        raise
    end_minibatch(model, divide_factor=divide_factor)


def stats(model: nn.Module) -> dict[str, object]:
    """Counters: minibatches, ODC all-gathers (fetches) and reduce-scatters (pushes) since ``enable``; and
    ``last_minibatch``: this rank's figures of its last minibatch (``None`` before one; ``._telemetry``)."""
    state = _state(model, "stats")
    return {
        "minibatches": state.minibatches,
        "all_gathers": sum(u.all_gathers for u in state.units),
        "reduce_scatters": sum(u.reduce_scatters for u in state.units),
        "row_numel": sum(u.ag_numel for u in state.units),
        "last_minibatch": None if state.last_minibatch is None else dict(state.last_minibatch),
    }


def _device_sync(state: _State) -> None:
    # FSDP issues pushes on its reduce-scatter stream and waits for them on the current stream at the end of
    # backward; a full device sync keeps the once-per-minibatch fence simple on GPU. No-op on CPU.
    if state.units and state.units[0].device.type == "cuda":
        torch.cuda.synchronize()
