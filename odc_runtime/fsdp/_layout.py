"""How FSDP2 lays out one FSDP parameter group's all-gather and reduce-scatter rows, read into ODC's per-group state.

FSDP2 flattens each parameter's shard (dim 0 split into ``W`` chunks, each padded to ``ceil(rows / W)`` rows) and
concatenates them in parameter order: rank ``r``'s all-gather input (``I`` elements) is row ``r`` of the
all-gather output, and ``reduce_scatter_input.view(W, -1)[r]`` (``R`` elements, trainable parameters only) is the
gradient rank ``r`` keeps. ``build_unit`` recomputes those offsets and dtypes from the group's parameters and
policies (read through ``_compat``); the hooks re-check them on every call.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

import odc_runtime as odc
from odc_runtime.api import PARAM_DTYPES
from odc_runtime.errors import OdcUsageError

from . import _compat

if TYPE_CHECKING:  # annotations only
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.utils.hooks import RemovableHandle

    from odc_runtime.telemetry import Minibatch


@dataclass
class Param:
    """One FSDP parameter of a unit: where its padded shard sits in the unit's rows."""

    fsdp_param: FSDPParam  # read through _compat only
    fqn: str
    ag_offset: int  # offset of this parameter's padded shard in the all-gather row
    rs_offset: int | None  # offset in the reduce-scatter row; None if frozen
    padded: int  # padded shard numel (the same in both rows)
    used: bool = False  # got a gradient since the last reduce-scatter (only tracked without the torch hook)
    # inside a minibatch (._grads): (what .grad held before it,); the placeholder .grad ODC puts there (kept)
    held: tuple = ()
    placeholder: torch.Tensor | None = None

    @property
    def sharded_param(self) -> nn.Parameter:
        return _compat.sharded_param(self.fsdp_param)


@dataclass
class Unit:
    """One FSDP parameter group under ODC: the modules of one ``fully_shard`` call (usually one module; several for
    ``fully_shard([a, b, ...])``, which gives them one group, all-gathered and reduce-scattered together)."""

    modules: tuple[nn.Module, ...]
    group: FSDPParamGroup  # read through _compat; written only through FSDPModule's setters
    fqn: str  # the module's name, or "[a, b]" for a grouped fully_shard
    params: list[Param]
    ag_numel: int
    ag_dtype: torch.dtype
    rs_numel: int
    rs_dtype: torch.dtype | None  # expected reduce dtype (torch 2.15 reduces in the original dtype instead; the
    # hooks take the dtype FSDP passes and undo its pre-division for that dtype)
    device: torch.device
    st_ag: odc.ShardedTensor | None = None
    st_rs: odc.ShardedTensor | None = None
    prev: dict[str, object] = field(default_factory=dict)
    track_unused: bool = False  # torch lacks set_reduce_scatter_unused_params: ODC tracks gradients itself
    handles: list[RemovableHandle] = field(default_factory=list)  # hook handles removed by disable()
    hooked: set[int] = field(default_factory=set)  # ids of unsharded params with a grad-tracking hook
    checked: bool = False
    reduced: bool = False  # this rank reduce-scattered this unit in the current minibatch (._grads)
    all_gathers: int = 0
    reduce_scatters: int = 0
    # HSDP (2-D mesh (replicate, shard)): FSDP's rows span the shard group only; None/0 for a 1-D mesh
    shard_pg: dist.ProcessGroup | None = None  # ODC shards this unit's buffers over it
    replicate_pg: dist.ProcessGroup | None = None  # end_minibatch all-reduces the accumulators over it
    rows: int = 0  # W: ranks FSDP shards over (the shard group's size under HSDP, else the world size)

    @property
    def reduces_in_other_dtype(self) -> bool:
        """FSDP reduces this group's gradients in another dtype than it computes them in (a mixed-precision
        ``reduce_dtype``, e.g. ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``)."""
        return self.rs_dtype is not None and self.rs_dtype != self.ag_dtype

    @property
    def module(self) -> nn.Module:
        """The first of the group's modules. The modules of a grouped ``fully_shard`` share one FSDP state, so
        FSDPModule's setters and ``reshard()`` called on any of them act on the whole group (once is enough)."""
        return self.modules[0]


@dataclass
class State:
    """ODC state of one enabled root model."""

    model: nn.Module
    units: list[Unit]
    world_size: int
    rank: int
    validate: bool
    in_minibatch: bool = False
    broken: str | None = None
    minibatches: int = 0
    aborted_backward: bool = False  # a backward outside a minibatch was refused: begin_minibatch resets FSDP
    param_ids: frozenset[int] = frozenset()  # ids of the sharded parameters (the optimizer step guard)
    handles: list[RemovableHandle] = field(default_factory=list)  # model-level hooks removed by disable()
    window: Minibatch | None = None  # the open minibatch's telemetry (odc_runtime.telemetry)
    rs_base: list[int] = field(default_factory=list)  # every unit's reduce_scatters when the minibatch began
    last_minibatch: dict[str, Any] | None = None  # the last minibatch's figures (._telemetry)


STATES: weakref.WeakKeyDictionary[nn.Module, State] = weakref.WeakKeyDictionary()
OWNER: weakref.WeakKeyDictionary[nn.Module, State] = weakref.WeakKeyDictionary()  # FSDP module -> state


def effective_dtypes(
    mp_policy: MixedPrecisionPolicy, orig_dtype: torch.dtype
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` after FSDP2's clamping (``FSDPParam.init_dtype_attrs``; 2.15 no longer clamps
    ``reduce_dtype == param_dtype`` to None, which gives the same effective reduce dtype)."""
    param_dtype, reduce_dtype = mp_policy.param_dtype, mp_policy.reduce_dtype
    if reduce_dtype == param_dtype:
        reduce_dtype = None
    if param_dtype == orig_dtype or not orig_dtype.is_floating_point:
        param_dtype = None
    return param_dtype, reduce_dtype


def fp16_pre_factor(reduce_dtype: torch.dtype, factor: float) -> float:
    """FSDP2's pre-division for reduce dtypes with overflow risk (``_get_gradient_divide_factors``, 2.9..2.14)."""
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return 1.0
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre)


def build_unit(
    members: list[tuple[str, nn.Module]],
    group: FSDPParamGroup,
    world_size: int,
    api: _compat.FsdpApi,
    names: dict[int, str],
) -> Unit:
    """Read one FSDP parameter group into a ``Unit`` (offsets, dtypes, scale); refuse what ODC cannot do.

    ``members`` are the group's FSDP modules with their names in the root model (one, or several for a grouped
    ``fully_shard``); ``names`` maps ``id(sharded parameter)`` to its name in the root model.
    """
    fqns = [fqn or "<root>" for fqn, _ in members]
    name = fqns[0] if len(fqns) == 1 else f"[{', '.join(fqns)}]"
    from torch.distributed.tensor import DTensor, Shard

    layout = _compat.group_layout(group)
    if isinstance(layout.offload_policy, api.cpu_offload_policy):
        raise OdcUsageError(f"odc_runtime.fsdp: CPU offload (CPUOffloadPolicy) on {name!r} is not supported")
    if layout.hsdp_or_hpz:
        raise OdcUsageError(
            f"odc_runtime.fsdp: reshard_after_forward=<int> (HPZ: a node-local secondary copy of the parameters) on "
            f"{name!r} is not supported in ODC mode: the backward all-gather would read a second, smaller layout "
            "that ODC does not publish, and fetches inside a node are one-sided already. Use "
            "reshard_after_forward=True (or False to keep the gathered parameters), or HSDP with a 2-D mesh"
        )
    if not _compat.reduce_grads(group):
        raise OdcUsageError(
            f"odc_runtime.fsdp: set_requires_gradient_sync(False) is active on {name!r}; ODC accumulates across "
            "micro-batches itself, keep gradient sync on"
        )
    if layout.all_reduce_hook:
        raise OdcUsageError(
            f"odc_runtime.fsdp: an all-reduce hook (set_all_reduce_hook) is set on {name!r}; it would only see "
            "zeros under ODC (gradients arrive at end_minibatch); not supported"
        )
    params: list[Param] = []
    ag_dtypes: set[torch.dtype] = set()
    orig_dtypes: set[torch.dtype] = set()
    rs_dtypes: set[torch.dtype] = set()
    from torch.distributed.tensor import Replicate

    ag_off = rs_off = 0
    meshes = set()
    for fp in layout.fsdp_params:
        sp = _compat.sharded_param(fp)
        pname = names.get(id(sp), f"{name}.<unnamed>")
        placements = tuple(getattr(sp, "placements", ()))
        flat = isinstance(sp, DTensor) and sp.device_mesh.ndim == 1 and placements == (Shard(0),)
        hsdp = isinstance(sp, DTensor) and sp.device_mesh.ndim == 2 and placements == (Replicate(), Shard(0))
        if not (flat or hsdp):
            raise OdcUsageError(
                f"odc_runtime.fsdp: parameter {pname!r} is not sharded as Shard(0) over a 1-D mesh or as "
                f"(Replicate(), Shard(0)) over a 2-D HSDP mesh (placements {placements or None}); tensor "
                "parallelism and shard_placement_fn are not supported"
            )
        meshes.add(sp.device_mesh)
        if len(meshes) > 1:
            raise OdcUsageError(f"odc_runtime.fsdp: parameters of {name!r} live on different device meshes")
        if sp.device_mesh.size() != world_size:
            raise OdcUsageError(
                f"odc_runtime.fsdp: {pname!r} is sharded over {sp.device_mesh.size()} ranks but ODC runs on "
                f"{world_size}; FSDP's mesh must span every ODC rank"
            )
        if hasattr(sp.to_local(), "fsdp_pre_all_gather"):
            raise OdcUsageError(f"odc_runtime.fsdp: {pname!r} uses FSDP all-gather extensions; not supported")
        rows = sp.shape[0] if sp.ndim > 0 else 1
        width = sp.device_mesh.size(sp.device_mesh.ndim - 1)  # FSDP shards dim 0 over the last mesh dimension
        padded = -(-rows // width) * (math.prod(sp.shape[1:]) if sp.ndim > 1 else 1)
        orig = sp.dtype
        param_dtype, reduce_dtype = effective_dtypes(_compat.mp_policy(fp), orig)
        ag_dtypes.add(param_dtype or orig)
        rs_off_this = None
        if sp.requires_grad:
            orig_dtypes.add(orig)
            rs_dtypes.add(reduce_dtype or param_dtype or orig)
            rs_off_this = rs_off
            rs_off += padded
        params.append(Param(fp, pname, ag_off, rs_off_this, padded))
        ag_off += padded
    if len(ag_dtypes) > 1:
        raise OdcUsageError(
            f"odc_runtime.fsdp: FSDP module {name!r} all-gathers mixed dtypes {sorted(map(str, ag_dtypes))} "
            "(FSDP would fall back to a byte all-gather); give its parameters one dtype"
        )
    ag_dtype = next(iter(ag_dtypes)) if ag_dtypes else torch.float32
    if ag_dtypes and ag_dtype not in PARAM_DTYPES:
        raise OdcUsageError(f"odc_runtime.fsdp: all-gather dtype {ag_dtype} of {name!r} is not supported by ODC")
    if len(orig_dtypes) > 1 or len(rs_dtypes) > 1:  # FSDP itself asserts this at lazy init
        raise OdcUsageError(f"odc_runtime.fsdp: trainable parameters of {name!r} have mixed dtypes")
    rs_dtype = next(iter(rs_dtypes)) if rs_dtypes else None
    if rs_dtype is not None and rs_dtype not in PARAM_DTYPES:
        raise OdcUsageError(f"odc_runtime.fsdp: reduce dtype {rs_dtype} of {name!r} is not supported by ODC")
    modules = tuple(m for _, m in members)
    unit = Unit(modules, group, name, params, ag_off, ag_dtype, rs_off, rs_dtype, layout.device, rows=world_size)
    mesh = next(iter(meshes), None)
    if mesh is not None and mesh.ndim == 2:
        if mesh.size(1) < 2:
            raise OdcUsageError(
                f"odc_runtime.fsdp: {name!r} is sharded over a shard group of one rank (2-D mesh of shape "
                f"{tuple(mesh.shape)}): FSDP2 does no reduce-scatter there, so ODC mode has nothing to replace; "
                "train it with plain FSDP2, or give the mesh's shard dimension at least 2 ranks"
            )
        unit.replicate_pg, unit.shard_pg = mesh.get_group(0), mesh.get_group(1)
        unit.rows = mesh.size(1)
        # FSDP's row index is the mesh coordinate; ODC numbers owners by their rank in the shard group.
        if mesh.get_local_rank(1) != dist.get_group_rank(unit.shard_pg, dist.get_rank()):
            raise OdcUsageError(
                f"odc_runtime.fsdp: {name!r}: this rank's coordinate along the mesh's shard dimension "
                f"({mesh.get_local_rank(1)}) differs from its rank in the shard group "
                f"({dist.get_group_rank(unit.shard_pg, dist.get_rank())}); build the mesh with ascending ranks "
                "along the shard dimension (init_device_mesh does)"
            )
    return unit
