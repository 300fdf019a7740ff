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

How. :func:`enable` installs, on every FSDP module (the setters are not recursive), a custom all-gather and a
custom reduce-scatter through FSDP2's public hooks ``set_custom_all_gather`` / ``set_custom_reduce_scatter``;
nothing of torch is patched. To lay out the rows exactly as FSDP does, it *reads* (never writes) each module's
FSDP parameter-group metadata (``_get_fsdp_state()._fsdp_param_groups``: parameter order, mixed-precision and
offload policies, meshes), as FSDPModule's own setters do; the layout is re-checked at run time (row sizes and
dtypes on every call, the published values against FSDP's all-gather input on the first call), so a change in
torch's internals gives a clear error instead of wrong gradients. For each FSDP module (one parameter group)
it creates ODC sharded tensors of shape ``(W, I)`` for the parameters and ``(W, R)`` for the gradients, where
``I`` is FSDP's per-rank all-gather input numel and ``R`` its per-rank reduce-scatter output numel (both padded
as FSDP pads), so ODC owner ``r`` holds exactly row ``r``. When ``R == I`` (no frozen parameter in the
module) one sharded tensor serves both: its parameter buffer holds the published row and its fp32 accumulator
the gradient row.

- All-gather (in place; FSDP's input is row ``rank`` of the output): inside a minibatch the output rows are
  fetched from the owners' published rows (one-sided; the owners do nothing). Outside a minibatch (e.g. an
  evaluation forward run by all ranks together) it falls back to the ordinary collective all-gather.
- Reduce-scatter (the input is laid out so ``input.view(W, -1)[r]`` is rank ``r``'s shard): one ``odc.push`` of
  the whole input adds row ``r`` into owner ``r``'s fp32 accumulator; the output is returned as zeros, so what
  FSDP adds into ``sharded_param.grad`` during the minibatch is zero. ``set_force_sum_reduction_for_comms(True)``
  makes FSDP hand us a plain ``SUM`` (no ``AVG``/``PREMUL_SUM`` op that one-sided adds could not honour; its
  division is applied to our zero output) and ``set_reduce_scatter_unused_params(True)`` makes FSDP include
  zero gradients for parameters that got none, so the input layout never depends on which parameters a
  micro-batch used. A reduce-scatter outside a minibatch raises :class:`OdcUsageError`.
- :func:`begin_minibatch` reshards every FSDP module (so the next forward gathers again), writes this rank's
  sharded parameters, cast to the all-gather dtype exactly as FSDP casts them (``MixedPrecisionPolicy
  .param_dtype``), into its row of the parameter buffers, and runs ``odc.sync()``.
- :func:`end_minibatch` runs ``odc.sync()``, writes ``accumulator / divide_factor`` (cast to the parameter dtype)
  into every ``sharded_param.grad`` (a DTensor, as FSDP makes it; added to an existing ``.grad`` as FSDP adds),
  and zeroes the accumulators.

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
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

import odc_runtime as odc
from odc_runtime.api import PARAM_DTYPES
from odc_runtime.errors import OdcUsageError

log = logging.getLogger(__name__)

__all__ = ["begin_minibatch", "disable", "enable", "end_minibatch", "is_enabled", "minibatch", "stats"]

MIN_TORCH = (2, 13)


def _torch_version() -> tuple[int, int]:
    base = torch.__version__.split("+")[0].split(".")
    try:
        return int(base[0]), int(base[1])
    except (IndexError, ValueError):  # pragma: no cover - exotic builds
        return (0, 0)


def _fsdp_api():
    """Import the FSDP2 classes we need, refusing torch builds without the hooks we rely on."""
    if _torch_version() < MIN_TORCH:
        raise OdcUsageError(
            f"odc_runtime.fsdp needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (FSDP2 custom comm hooks); "
            f"found torch {torch.__version__}"
        )
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise OdcUsageError(f"odc_runtime.fsdp: this torch build lacks FSDP2's custom comm API ({e})") from e
    for name in (
        "set_custom_all_gather",
        "set_custom_reduce_scatter",
        "set_force_sum_reduction_for_comms",
        "set_reduce_scatter_unused_params",
    ):
        if not hasattr(FSDPModule, name):  # pragma: no cover
            raise OdcUsageError(f"odc_runtime.fsdp: FSDPModule.{name} missing in torch {torch.__version__}")
    return FSDPModule, AllGather, ReduceScatter, CPUOffloadPolicy


# --------------------------------------------------------------------------------------------------- state


@dataclass
class _Param:
    fsdp_param: object  # torch's FSDPParam (read only: .sharded_param)
    fqn: str
    ag_offset: int  # offset of this parameter's padded shard in the all-gather row
    rs_offset: int | None  # offset in the reduce-scatter row; None if frozen

    @property
    def sharded_param(self):
        return self.fsdp_param.sharded_param


@dataclass
class _Unit:
    """One FSDP module (one FSDP parameter group) under ODC."""

    module: nn.Module
    group: object  # torch's FSDPParamGroup (read only, except through FSDPModule's public setters)
    fqn: str
    params: list[_Param]
    ag_numel: int
    ag_dtype: torch.dtype
    rs_numel: int
    rs_dtype: torch.dtype | None
    rs_input_scale: float  # undoes FSDP's fp16 pre-division, so the accumulator holds plain sums
    st_ag: odc.ShardedTensor | None = None
    st_rs: odc.ShardedTensor | None = None
    prev: dict = field(default_factory=dict)
    checked: bool = False
    all_gathers: int = 0
    reduce_scatters: int = 0


@dataclass
class _State:
    model: nn.Module
    units: list[_Unit]
    world_size: int
    rank: int
    validate: bool
    in_minibatch: bool = False
    broken: str | None = None
    minibatches: int = 0


_STATES: weakref.WeakKeyDictionary[nn.Module, _State] = weakref.WeakKeyDictionary()
_OWNER: weakref.WeakKeyDictionary[nn.Module, _State] = weakref.WeakKeyDictionary()  # FSDP module -> state


def is_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable` is active on ``model``."""
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


# --------------------------------------------------------------------------------------------------- comms


class _CommBase:
    def __init__(self, state: _State, unit: _Unit) -> None:
        self._state = weakref.ref(state)
        self._unit = unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check_group(self, group: dist.ProcessGroup, what: str) -> _State:
        state = self._state()
        if state is None:  # pragma: no cover - the model was garbage collected
            raise OdcUsageError(f"odc_runtime.fsdp {what}: the ODC state of this model is gone")
        if group.size() != state.world_size:
            raise OdcUsageError(
                f"odc_runtime.fsdp {what} for {self._unit.fqn!r}: process group of size {group.size()} but ODC "
                f"runs on {state.world_size} ranks (reshard_after_forward=int and HSDP are not supported)"
            )
        return state


def _make_all_gather(base):
    class OdcAllGather(_CommBase, base):
        """All-gather that fetches the published rows from their owners (see module docstring)."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            state = self._check_group(group, "all-gather")
            unit = self._unit
            if not state.in_minibatch:
                # Outside a minibatch every rank runs this forward together (e.g. evaluation): collective.
                return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
            w, n = state.world_size, unit.ag_numel
            if input_tensor.numel() != n or output_tensor.numel() != w * n or input_tensor.dtype != unit.ag_dtype:
                raise OdcUsageError(
                    f"odc_runtime.fsdp all-gather for {unit.fqn!r}: FSDP passed {input_tensor.numel()} elements of "
                    f"{input_tensor.dtype} per rank but ODC laid out {n} of {unit.ag_dtype} at enable() time; "
                    "parameters (or their dtypes / requires_grad) changed after enable(): disable() and enable() "
                    "again"
                )
            if state.validate or not unit.checked:
                _check_published(unit, input_tensor)
                unit.checked = True
            odc.fetch(unit.st_ag, out=output_tensor.view(w, n))
            unit.all_gathers += 1
            return None

    return OdcAllGather


def _check_published(unit: _Unit, input_tensor: torch.Tensor) -> None:
    row = unit.st_ag.local
    for p in unit.params:
        n = p.sharded_param.to_local().numel()
        a, b = input_tensor[p.ag_offset : p.ag_offset + n], row[p.ag_offset : p.ag_offset + n]
        if not torch.equal(a, b):
            raise OdcUsageError(
                f"odc_runtime.fsdp: FSDP's all-gather input for {p.fqn!r} differs from the parameters published at "
                "the start of the minibatch; parameters must not change inside a minibatch (optimizer.step() "
                "and load_state_dict() belong between minibatches)"
            )


def _make_reduce_scatter(base):
    class OdcReduceScatter(_CommBase, base):
        """Reduce-scatter that pushes row r of the input into owner r's accumulator (see module docstring)."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            state = self._check_group(group, "reduce-scatter")
            unit = self._unit
            if not state.in_minibatch:
                raise OdcUsageError(
                    "odc_runtime.fsdp: backward() ran outside a minibatch on an ODC-enabled model; wrap the "
                    "micro-batches in `with odc_runtime.fsdp.minibatch(model):` (or begin_minibatch/end_minibatch). "
                    "FSDP's iteration state is now undefined: call model.reset_iter_state() before going on"
                )
            if op != dist.ReduceOp.SUM:
                raise OdcUsageError(
                    f"odc_runtime.fsdp reduce-scatter for {unit.fqn!r}: got reduce op {op}, expected SUM; do not "
                    "call set_force_sum_reduction_for_comms(False) on an ODC-enabled model"
                )
            w, n = state.world_size, unit.rs_numel
            if input_tensor.numel() != w * n or input_tensor.dtype != unit.rs_dtype or unit.st_rs is None:
                raise OdcUsageError(
                    f"odc_runtime.fsdp reduce-scatter for {unit.fqn!r}: FSDP passed {input_tensor.numel()} elements "
                    f"of {input_tensor.dtype} but ODC laid out {w} x {n} of {unit.rs_dtype} at enable() time; "
                    "trainable parameters (requires_grad) or dtypes changed after enable(): disable() and enable() "
                    "again"
                )
            odc.push(unit.st_rs, input_tensor.view(w, n), scale=unit.rs_input_scale)
            output_tensor.zero_()
            unit.reduce_scatters += 1
            return None

    return OdcReduceScatter


# --------------------------------------------------------------------------------------------------- enable


def _fsdp_modules(model: nn.Module, fsdp_module_cls) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, fsdp_module_cls)]


def _param_group(module: nn.Module, fqn: str):
    """The module's single FSDP parameter group, or None if it manages no parameters."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise OdcUsageError(
            f"odc_runtime.fsdp: FSDP module {fqn or '<root>'!r} has {len(groups)} parameter groups (per-parameter "
            "meshes via shard_placement_fn); FSDP2's custom comm hooks and ODC support one group per module"
        )
    return groups[0] if groups else None


def _effective_dtypes(mp_policy, orig_dtype: torch.dtype) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` after FSDP2's clamping (FSDPParam.init_dtype_attrs in torch 2.13)."""
    param_dtype, reduce_dtype = mp_policy.param_dtype, mp_policy.reduce_dtype
    if reduce_dtype == param_dtype:
        reduce_dtype = None
    if param_dtype == orig_dtype or not orig_dtype.is_floating_point:
        param_dtype = None
    return param_dtype, reduce_dtype


def _fp16_pre_factor(reduce_dtype: torch.dtype, factor: float) -> float:
    """FSDP2's pre-division for reduce dtypes with overflow risk (``_get_gradient_divide_factors``)."""
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return 1.0
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre)


def _build_unit(module: nn.Module, fqn: str, group, world_size: int, cpu_offload_cls) -> _Unit:
    name = fqn or "<root>"
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(group.offload_policy, cpu_offload_cls):
        raise OdcUsageError(f"odc_runtime.fsdp: CPU offload (CPUOffloadPolicy) on {name!r} is not supported")
    pf = group.post_forward_mesh_info
    if pf is not None and pf != group.mesh_info:
        raise OdcUsageError(
            f"odc_runtime.fsdp: reshard_after_forward=<int> on {name!r} is not supported (the backward all-gather "
            "would run over a smaller group); use True or False"
        )
    if not getattr(group, "reduce_grads", True):
        raise OdcUsageError(
            f"odc_runtime.fsdp: set_requires_gradient_sync(False) is active on {name!r}; ODC accumulates across "
            "micro-batches itself, keep gradient sync on"
        )
    if getattr(group, "_all_reduce_hook", None) is not None:
        raise OdcUsageError(
            f"odc_runtime.fsdp: an all-reduce hook (set_all_reduce_hook) is set on {name!r}; it would only see "
            "zeros under ODC (gradients arrive at end_minibatch); not supported"
        )
    params: list[_Param] = []
    ag_dtypes, orig_dtypes, rs_dtypes = set(), set(), set()
    ag_off = rs_off = 0
    for fp in group.fsdp_params:
        sp = fp.sharded_param
        pname = f"{fqn + '.' if fqn else ''}{fp._module_info.param_name}"
        if not isinstance(sp, DTensor) or sp.device_mesh.ndim != 1 or tuple(sp.placements) != (Shard(0),):
            raise OdcUsageError(
                f"odc_runtime.fsdp: parameter {pname!r} is not sharded as Shard(0) over a 1-D mesh "
                f"(placements {getattr(sp, 'placements', None)}); HSDP, 2-D meshes, tensor parallelism and "
                "shard_placement_fn are not supported"
            )
        if sp.device_mesh.size() != world_size:
            raise OdcUsageError(
                f"odc_runtime.fsdp: {pname!r} is sharded over {sp.device_mesh.size()} ranks but ODC runs on "
                f"{world_size}; FSDP's mesh must span every ODC rank"
            )
        local = sp.to_local()
        if hasattr(local, "fsdp_pre_all_gather"):
            raise OdcUsageError(f"odc_runtime.fsdp: {pname!r} uses FSDP all-gather extensions; not supported")
        rows = sp.shape[0] if sp.ndim > 0 else 1
        padded = -(-rows // world_size) * (math.prod(sp.shape[1:]) if sp.ndim > 1 else 1)
        orig = sp.dtype
        param_dtype, reduce_dtype = _effective_dtypes(group.mp_policy, orig)
        ag_dtypes.add(param_dtype or orig)
        rs_off_this = None
        if sp.requires_grad:
            orig_dtypes.add(orig)
            rs_dtypes.add(reduce_dtype or param_dtype or orig)
            rs_off_this = rs_off
            rs_off += padded
        params.append(_Param(fp, pname, ag_off, rs_off_this))
        ag_off += padded
    if len(ag_dtypes) > 1:
        raise OdcUsageError(
            f"odc_runtime.fsdp: FSDP module {name!r} all-gathers mixed dtypes {sorted(map(str, ag_dtypes))} "
            "(FSDP would fall back to a byte all-gather); give its parameters one dtype"
        )
    ag_dtype = next(iter(ag_dtypes))
    if ag_dtype not in PARAM_DTYPES:
        raise OdcUsageError(f"odc_runtime.fsdp: all-gather dtype {ag_dtype} of {name!r} is not supported by ODC")
    if len(orig_dtypes) > 1 or len(rs_dtypes) > 1:  # FSDP itself asserts this at lazy init
        raise OdcUsageError(f"odc_runtime.fsdp: trainable parameters of {name!r} have mixed dtypes")
    rs_dtype = next(iter(rs_dtypes)) if rs_dtypes else None
    if rs_dtype is not None and rs_dtype not in PARAM_DTYPES:
        raise OdcUsageError(f"odc_runtime.fsdp: reduce dtype {rs_dtype} of {name!r} is not supported by ODC")
    factor = group.gradient_divide_factor or float(world_size)
    scale = _fp16_pre_factor(rs_dtype, factor) if rs_dtype is not None else 1.0
    return _Unit(module, group, name, params, ag_off, ag_dtype, rs_off, rs_dtype, scale)


def enable(model: nn.Module, *, validate: bool = False) -> nn.Module:
    """Put an FSDP2 model in ODC mode (collective: call on every rank, after ``fully_shard`` and ``odc.init``).

    Installs ODC's all-gather and reduce-scatter on every FSDP module of ``model``, turns on
    ``set_force_sum_reduction_for_comms(True)`` and ``set_reduce_scatter_unused_params(True)`` there, and allocates
    the ODC buffers. Every parameter of ``model`` that requires a gradient must be managed by FSDP.

    Args:
        model: the root module (normally itself passed to ``fully_shard``).
        validate: compare FSDP's all-gather input with the published parameters at the first all-gather of every
            module in every minibatch (default: only once after ``enable``). Catches parameters modified inside
            a minibatch; costs one comparison of the local shard per module per minibatch.

    Returns ``model``. Raises :class:`OdcUsageError` for unsupported torch versions or configurations (HSDP and
    other 2-D meshes, CPU offload, ``reshard_after_forward=<int>``, FSDP all-gather extensions, mixed dtypes in a
    module, parameters outside FSDP) and if ODC is already enabled on the model or one of its FSDP modules.
    """
    fsdp_module_cls, all_gather_base, reduce_scatter_base, cpu_offload_cls = _fsdp_api()
    if not odc.is_initialized():
        raise OdcUsageError("odc_runtime.fsdp.enable() needs odc_runtime.init() first")
    if not isinstance(model, nn.Module):
        raise OdcUsageError(f"odc_runtime.fsdp.enable() expects an nn.Module, got {type(model).__name__}")
    if model in _STATES:
        raise OdcUsageError("odc_runtime.fsdp.enable() called twice on the same model; call disable() first")
    modules = _fsdp_modules(model, fsdp_module_cls)
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
    device_type = "cpu" if odc.backend() == "host" else "cuda"
    # Reshard so that the sharded parameters are the registered ones and the next forward gathers again.
    for _, m in modules:
        m.reshard()
    units: list[_Unit] = []
    managed: set[int] = set()
    for fqn, m in modules:
        group = _param_group(m, fqn)
        if group is None:
            continue
        if group.device.type != device_type:
            raise OdcUsageError(
                f"odc_runtime.fsdp: FSDP module {fqn or '<root>'!r} runs on {group.device} but the ODC "
                f"{odc.backend()!r} backend works on {device_type}"
            )
        unit = _build_unit(m, fqn, group, world_size, cpu_offload_cls)
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
    all_gather_cls = _make_all_gather(all_gather_base)
    reduce_scatter_cls = _make_reduce_scatter(reduce_scatter_base)
    model_id = next(_ENABLE_COUNT)  # shard names must be unique per runtime; several models may share one
    try:
        for unit in units:
            shared = unit.rs_numel == unit.ag_numel
            unit.st_ag = odc.shard(
                torch.empty((world_size, unit.ag_numel), dtype=unit.ag_dtype, device="meta"),
                name=f"fsdp{model_id}.{unit.fqn}.params",
                requires_grad=shared,  # with frozen parameters the gradients get their own, smaller buffer
            )
            if shared:
                unit.st_rs = unit.st_ag
            elif unit.rs_numel > 0:
                unit.st_rs = odc.shard(
                    torch.empty((world_size, unit.rs_numel), dtype=unit.rs_dtype, device="meta"),
                    name=f"fsdp{model_id}.{unit.fqn}.grads",
                )
    except BaseException:
        _free_buffers(units)
        raise
    for unit in units:
        g, m = unit.group, unit.module
        unit.prev = {
            "all_gather": g._all_gather_comm,
            "reduce_scatter": g._reduce_scatter_comm,
            "force_sum": g.force_sum_reduction_for_comms,
            "unused": g.reduce_scatter_unused_params,
        }
        m.set_custom_all_gather(all_gather_cls(state, unit))
        m.set_custom_reduce_scatter(reduce_scatter_cls(state, unit))
        m.set_force_sum_reduction_for_comms(True)
        m.set_reduce_scatter_unused_params(True, recurse=False)
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
        m.set_force_sum_reduction_for_comms(prev["force_sum"])
        m.set_reduce_scatter_unused_params(prev["unused"], recurse=False)
    _free_buffers(state.units)
    del _STATES[model]
    for m in [m for m, s in _OWNER.items() if s is state]:
        del _OWNER[m]
    return model


# --------------------------------------------------------------------------------------------------- minibatch


def begin_minibatch(model: nn.Module) -> None:
    """Start a minibatch (collective): publish the current parameters, then ``odc.sync()``.

    Between :func:`begin_minibatch` and :func:`end_minibatch` a rank may run any number of forward/backward
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
        if not getattr(unit.group, "reduce_grads", True):
            raise OdcUsageError(
                f"odc_runtime.fsdp: set_requires_gradient_sync(False) is active on {unit.fqn!r}; ODC accumulates "
                "across micro-batches itself, keep gradient sync on"
            )
    try:
        with torch.no_grad():
            for unit in state.units:
                unit.module.reshard()  # the next forward must all-gather the newly published rows
                row = unit.st_ag.local
                for p in unit.params:
                    local = p.sharded_param.to_local().reshape(-1)
                    row[p.ag_offset : p.ag_offset + local.numel()].copy_(local)
        _device_sync(state)
        odc.sync()  # S1: every row is published before anyone fetches; every accumulator was zeroed before it
    except BaseException as e:
        state.broken = f"begin_minibatch: {type(e).__name__}: {e}"
        raise
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
    if divide_factor is not None and (
        isinstance(divide_factor, bool)
        or not isinstance(divide_factor, (int, float))
        or not math.isfinite(divide_factor)
        or divide_factor <= 0
    ):
        raise OdcUsageError(f"odc_runtime.fsdp: divide_factor must be a positive finite number, got {divide_factor!r}")
    state.in_minibatch = False
    try:
        _device_sync(state)
        odc.sync()  # S2: every push of this minibatch is in its owner's accumulator
        _write_grads(state, divide_factor)
    except BaseException as e:
        state.broken = f"end_minibatch: {type(e).__name__}: {e}"
        raise


def _write_grads(state: _State, divide_factor: float | None) -> None:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for unit in state.units:
            st = unit.st_rs
            if st is None:
                continue
            factor = float(divide_factor or unit.group.gradient_divide_factor or state.world_size)
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
    """``with minibatch(model):`` = :func:`begin_minibatch` … :func:`end_minibatch` (see both).

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
        raise
    end_minibatch(model, divide_factor=divide_factor)


def stats(model: nn.Module) -> dict[str, int]:
    """Counters: minibatches, ODC all-gathers (fetches) and reduce-scatters (pushes) since :func:`enable`."""
    state = _state(model, "stats")
    return {
        "minibatches": state.minibatches,
        "all_gathers": sum(u.all_gathers for u in state.units),
        "reduce_scatters": sum(u.reduce_scatters for u in state.units),
        "row_numel": sum(u.ag_numel for u in state.units),
    }


def _device_sync(state: _State) -> None:
    # FSDP issues pushes on its reduce-scatter stream and waits for them on the current stream at the end of
    # backward; a full device sync keeps the once-per-minibatch fence simple on GPU. No-op on CPU.
    if state.units and state.units[0].group.device.type == "cuda":
        torch.cuda.synchronize()
