"""Everything ``odc_runtime.fsdp`` knows about torch's FSDP2 beyond its documented surface, in one place.

The public surface ODC uses is ``fully_shard``, ``FSDPModule``'s methods (``set_custom_all_gather``,
``set_custom_reduce_scatter``, ``reshard``, ``set_reduce_scatter_unused_params`` where it exists) and the
``AllGather`` / ``ReduceScatter`` base classes. To lay out the rows of the custom all-gather and reduce-scatter
exactly as FSDP does, ODC must also *read* a few attributes of FSDP's per-module parameter group (parameter order,
mixed-precision and offload policies, meshes, the divide factor) and, to restore a model on ``disable()``, the comm
objects it replaces (and, at ``end_minibatch``, whether FSDP still holds a gradient it has not reduce-scattered:
``held_unsharded_grad``). Two actions FSDP takes itself are needed to bring every module back to FSDP's normal
state at a minibatch boundary: ``finish_unshard`` (consume a pending explicit-prefetch all-gather) and
``drop_unsharded_grad`` (clear what an aborted backward, or a minibatch ended with gradient sync off, left). Those,
and nothing else private, live in this module. Each read goes through ``_attr``, which turns a missing attribute
into an ``OdcUsageError`` naming the torch version and the attribute, and ``tests/test_fsdp.py`` checks the whole
surface (``check_private_surface``) on every torch the compatibility run installs, so a change in torch fails
loudly instead of silently mis-laying gradients.

Capabilities are detected by feature, never by version number. ``CAPABILITIES`` records, for the error
messages (and a test that keeps the table honest), the oldest torch release known to have each one.

What differs across the supported range (torch 2.9 to 2.14, read from the released sources):

- ``FSDPState._fsdp_param_group`` (one group or ``None``; torch <= 2.11) became ``_fsdp_param_groups`` (a list,
  several with per-parameter meshes from ``shard_placement_fn``; torch >= 2.12). ``param_groups`` reads
  whichever exists.
- ``FSDPModule.set_reduce_scatter_unused_params`` (torch >= 2.13) makes FSDP include zero gradients for
  parameters that got none, so the reduce-scatter layout never changes. Without it (and, on any torch, for groups
  with a mixed-precision reduce dtype, whose zeros would not match what FSDP accumulates with gradient sync off)
  ODC tracks which parameters received a gradient itself (``odc_runtime.fsdp._hooks``) and re-expands FSDP's
  shorter input.
- The mixed-precision policy moved from ``FSDPParamGroup.mp_policy`` to each ``FSDPParam.mp_policy`` only in 2.15
  (per-parameter ``param_dtype_override_fn``); every release since 2.9 has the per-parameter one, so ODC reads that.
- ``FSDPModule.reset_iter_state`` (torch >= 2.13) recovers FSDP after an exception mid-iteration; ODC only names
  it in its error messages where it exists (older torch: rebuild the model from a checkpoint).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from odc_runtime.errors import OdcUsageError

if TYPE_CHECKING:  # torch's private classes, for annotations only: nothing here imports them at run time
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

__all__ = [
    "CAPABILITIES",
    "FsdpApi",
    "check_private_surface",
    "fsdp_api",
    "has_capability",
    "param_groups",
    "torch_version",
]


@dataclass(frozen=True)
class Capability:
    """A piece of FSDP2 that ODC uses, how to detect it, and the oldest torch release that has it."""

    description: str
    oldest: tuple[int, int]
    required: bool  # False: ODC provides the behaviour itself when it is missing


# Names -> capability. ``oldest`` is informational (error messages, tests); detection is by feature.
CAPABILITIES: dict[str, Capability] = {
    "custom_comm_hooks": Capability(
        "FSDPModule.set_custom_all_gather / set_custom_reduce_scatter and the AllGather / ReduceScatter base "
        "classes (torch.distributed.fsdp._fully_shard._fsdp_api); torch 2.8 has neither",
        (2, 9),
        True,
    ),
    "reduce_scatter_unused_params": Capability(
        "FSDPModule.set_reduce_scatter_unused_params (zero gradients for unused parameters keep the "
        "reduce-scatter layout fixed)",
        (2, 13),
        False,
    ),
    "param_groups_list": Capability(
        "FSDPState._fsdp_param_groups (several parameter groups per FSDP module); older releases have one "
        "_fsdp_param_group",
        (2, 12),
        False,
    ),
    "reset_iter_state": Capability(
        "FSDPModule.reset_iter_state (recover FSDP after an exception inside forward or backward)",
        (2, 13),
        False,
    ),
}


# The tensor collectives: torch 2.13+ names them all_gather_single / reduce_scatter_single and warns (FutureWarning)
# on every call of the old names, which are all that 2.9-2.12 have. Same signatures: take what this torch offers.
all_gather_tensor: Callable[..., dist.Work | None] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
reduce_scatter_tensor: Callable[..., dist.Work | None] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the running torch, for messages and tests only (never for decisions)."""
    base = torch.__version__.split("+")[0].split(".")
    try:
        return int(base[0]), int(base[1])
    except (IndexError, ValueError):  # pragma: no cover - exotic builds
        return (0, 0)


def _missing(name: str, detail: str = "") -> OdcUsageError:
    cap = CAPABILITIES[name]
    return OdcUsageError(
        f"odc_runtime.fsdp needs {cap.description}, which torch {torch.__version__} lacks{detail}; it is available "
        f"from torch {cap.oldest[0]}.{cap.oldest[1]} on: upgrade torch, or use FSDP2 without ODC "
        "(--comm collective in examples/sft.py)"
    )


@dataclass(frozen=True)
class FsdpApi:
    """The FSDP2 classes ODC builds on, as this torch provides them."""

    fsdp_module: type
    all_gather: type
    reduce_scatter: type
    cpu_offload_policy: type
    reduce_scatter_unused_params: bool  # FSDPModule.set_reduce_scatter_unused_params exists


@functools.lru_cache(maxsize=1)
def _detect() -> FsdpApi | str:
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    except ImportError as e:  # pragma: no cover - torch without FSDP2 (< 2.6)
        return f" (torch.distributed.fsdp has no FSDPModule: {e})"
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError as e:
        return f" ({e})"
    for method in ("set_custom_all_gather", "set_custom_reduce_scatter", "reshard"):
        if not callable(getattr(FSDPModule, method, None)):
            return f" (FSDPModule.{method} is missing)"
    unused = callable(getattr(FSDPModule, "set_reduce_scatter_unused_params", None))
    return FsdpApi(FSDPModule, AllGather, ReduceScatter, CPUOffloadPolicy, unused)


def fsdp_api() -> FsdpApi:
    """The FSDP2 API of this torch; raises ``OdcUsageError`` (naming what is missing) if ODC cannot work."""
    api = _detect()
    if isinstance(api, str):
        raise _missing("custom_comm_hooks", api)
    return api


def has_capability(name: str) -> bool:
    """Whether this torch has capability ``name`` (a key of ``CAPABILITIES``), by feature detection."""
    if name == "custom_comm_hooks":
        return not isinstance(_detect(), str)
    if name == "reduce_scatter_unused_params":
        api = _detect()
        return not isinstance(api, str) and api.reduce_scatter_unused_params
    if name == "reset_iter_state":
        api = _detect()
        return not isinstance(api, str) and callable(getattr(api.fsdp_module, "reset_iter_state", None))
    if name == "param_groups_list":
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
        except ImportError:  # pragma: no cover
            return False
        return "_fsdp_param_groups" in _init_attr_names(FSDPState)
    raise KeyError(name)


def _init_attr_names(cls: type) -> set[str]:
    """Attribute names assigned as ``self.<name>`` in ``cls.__init__`` (FSDPState sets its groups there)."""
    code = getattr(cls.__init__, "__code__", None)
    return set(code.co_names) if code is not None else set()


# --------------------------------------------------------------------------------------------------- reads


_SENTINEL = object()


def _attr(obj: object, name: str, what: str) -> object:
    value = getattr(obj, name, _SENTINEL)
    if value is _SENTINEL:
        raise OdcUsageError(
            f"odc_runtime.fsdp: torch {torch.__version__} changed FSDP2's internals ({what} has no attribute "
            f"{name!r}); this torch is not supported by this odc_runtime release: report it with the torch version"
        )
    return value


def param_groups(module: nn.Module) -> list[FSDPParamGroup]:
    """The FSDP parameter groups (``FSDPParamGroup``) of one FSDP module: ``[]``, one, or several (torch >= 2.12)."""
    state = module._get_fsdp_state()  # FSDPModule's own accessor (private name, present 2.6 .. 2.14)
    groups = getattr(state, "_fsdp_param_groups", _SENTINEL)
    if groups is not _SENTINEL:
        return list(groups or [])
    group = _attr(state, "_fsdp_param_group", "FSDPState")
    return [] if group is None else [group]


@dataclass(frozen=True)
class GroupLayout:
    """What ODC reads from one ``FSDPParamGroup`` at ``enable()`` time."""

    fsdp_params: list[FSDPParam]
    offload_policy: OffloadPolicy
    device: torch.device
    hsdp_or_hpz: bool  # post-forward mesh differs from the main mesh (reshard_after_forward=int)
    all_reduce_hook: bool


def group_layout(group: FSDPParamGroup) -> GroupLayout:
    """Read the layout-relevant attributes of an ``FSDPParamGroup``."""
    pf = _attr(group, "post_forward_mesh_info", "FSDPParamGroup")
    mesh = _attr(group, "mesh_info", "FSDPParamGroup")
    return GroupLayout(
        fsdp_params=list(_attr(group, "fsdp_params", "FSDPParamGroup")),
        offload_policy=_attr(group, "offload_policy", "FSDPParamGroup"),
        device=_attr(group, "device", "FSDPParamGroup"),
        hsdp_or_hpz=pf is not None and pf != mesh,
        all_reduce_hook=_attr(group, "_all_reduce_hook", "FSDPParamGroup") is not None,
    )


def gradient_divide_factor(group: FSDPParamGroup) -> float | None:
    """The group's ``set_gradient_divide_factor`` value (``None`` if never set)."""
    return _attr(group, "gradient_divide_factor", "FSDPParamGroup")


def reduce_grads(group: FSDPParamGroup) -> bool:
    """False while ``set_requires_gradient_sync(False)`` is active."""
    return bool(_attr(group, "reduce_grads", "FSDPParamGroup"))


def comms(group: FSDPParamGroup) -> tuple[AllGather, ReduceScatter]:
    """The group's current all-gather and reduce-scatter comm objects (restored by ``disable()``)."""
    return _attr(group, "_all_gather_comm", "FSDPParamGroup"), _attr(group, "_reduce_scatter_comm", "FSDPParamGroup")


def all_reduce_grads(group: FSDPParamGroup) -> bool:
    """The group's ``set_requires_all_reduce`` value (HSDP: all-reduce across replicas after each backward)."""
    return bool(_attr(group, "all_reduce_grads", "FSDPParamGroup"))


def reduce_scatter_unused_params(group: FSDPParamGroup) -> bool:
    """The group's ``set_reduce_scatter_unused_params`` value (False where torch lacks it)."""
    return bool(getattr(group, "reduce_scatter_unused_params", False))


def sharded_param(fsdp_param: FSDPParam) -> nn.Parameter:
    """The ``FSDPParam``'s sharded parameter (a DTensor registered on the module)."""
    return _attr(fsdp_param, "sharded_param", "FSDPParam")


def mp_policy(fsdp_param: FSDPParam) -> MixedPrecisionPolicy:
    """The parameter's mixed-precision policy. Every FSDPParam keeps the policy it was built with (2.9 .. 2.15);
    up to 2.14 it is the group's policy, from 2.15 it may be resolved per parameter (``param_dtype_override_fn``)."""
    return _attr(fsdp_param, "mp_policy", "FSDPParam")


def unsharded_param(fsdp_param: FSDPParam) -> nn.Parameter | None:
    """The ``FSDPParam``'s unsharded parameter, or None before its first all-gather. The object is created at the
    first all-gather and reused afterwards (its storage is freed and re-allocated), so hooks on it persist."""
    if not hasattr(fsdp_param, "_unsharded_param"):
        return None
    return _attr(fsdp_param, "unsharded_param", "FSDPParam")


def pending_unshard(group: FSDPParamGroup) -> bool:
    """Whether an ``unshard()`` (explicit prefetch, ``async_op=True`` or not yet consumed by a forward) left an
    all-gather result that FSDP's next ``wait_for_unshard`` would copy out. ``reshard()`` does not drop it."""
    return _attr(group, "_all_gather_result", "FSDPParamGroup") is not None


def finish_unshard(group: FSDPParamGroup) -> None:
    """Consume a pending all-gather result (what FSDP's pre-forward or ``UnshardHandle.wait()`` would do), so that
    a following ``reshard()`` leaves the group in its normal sharded state with nothing stale to copy out later."""
    wait = _attr(group, "wait_for_unshard", "FSDPParamGroup")
    wait()


def held_unsharded_grad(fsdp_param: FSDPParam) -> bool:
    """Whether FSDP holds a gradient of this parameter that it has not reduce-scattered: one accumulated while
    gradient sync was off (``set_requires_gradient_sync(False)``: on the unsharded parameter's ``.grad``, or, up to
    torch 2.14 under mixed precision, upcast into ``unsharded_accumulated_grad``), or one an aborted backward left."""
    if _attr(fsdp_param, "unsharded_accumulated_grad", "FSDPParam") is not None:
        return True
    up = unsharded_param(fsdp_param)
    return up is not None and up.grad is not None


def drop_unsharded_grad(fsdp_param: FSDPParam) -> bool:
    """Drop what ``held_unsharded_grad`` finds (FSDP's next reduce-scatter would otherwise add it in). Returns
    whether there was one."""
    if not held_unsharded_grad(fsdp_param):
        return False
    if "unsharded_accumulated_grad" in vars(fsdp_param):  # FSDP's own attribute up to 2.14; from 2.15 a read-only
        fsdp_param.unsharded_accumulated_grad = None  # property that reads the unsharded parameter's .grad
    up = unsharded_param(fsdp_param)
    if up is not None:
        up.grad = None
    return True


# --------------------------------------------------------------------------------------------------- checks


def check_private_surface(module: nn.Module) -> list[str]:
    """Exercise every private read above on a live FSDP module (after at least one forward). Returns the problems
    found (empty when this torch matches what ODC expects); used by the per-version compatibility test."""
    problems: list[str] = []

    def probe(what: str, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except Exception as e:
            problems.append(f"{what}: {type(e).__name__}: {e}")
            return None

    groups = probe("param_groups", lambda: param_groups(module))
    if not groups:
        return problems or ["param_groups: the FSDP module has no parameter group"]
    detected = has_capability("param_groups_list")
    state = module._get_fsdp_state()
    if detected != hasattr(state, "_fsdp_param_groups"):
        problems.append("param_groups_list: detection disagrees with the live FSDPState")
    for group in groups:
        layout = probe("group_layout", lambda g=group: group_layout(g))
        probe("gradient_divide_factor", lambda g=group: gradient_divide_factor(g))
        probe("reduce_grads", lambda g=group: reduce_grads(g))
        pair = probe("comms", lambda g=group: comms(g))
        api = fsdp_api()
        if pair is not None and not (isinstance(pair[0], api.all_gather) and isinstance(pair[1], api.reduce_scatter)):
            kinds = f"{type(pair[0]).__name__}, {type(pair[1]).__name__}"
            problems.append(f"comms: {kinds} are not AllGather / ReduceScatter")
        if isinstance(layout, GroupLayout):
            for fp in layout.fsdp_params:
                sp = probe("sharded_param", lambda f=fp: sharded_param(f))
                probe("mp_policy", lambda f=fp: mp_policy(f))
                if sp is not None and not any(sp is p for p in module.parameters()):
                    problems.append("sharded_param: not a registered parameter of the FSDP module")
                probe("held_unsharded_grad", lambda f=fp: held_unsharded_grad(f))
                up = probe("unsharded_param", lambda f=fp: unsharded_param(f))
                if up is None:
                    problems.append("unsharded_param: missing after a forward")
                elif not isinstance(up, nn.Parameter) or up.shape != sp.shape:
                    problems.append(f"unsharded_param: unexpected {type(up).__name__} of shape {tuple(up.shape)}")
        probe("pending_unshard", lambda g=group: pending_unshard(g))
        if not callable(getattr(group, "wait_for_unshard", None)):
            problems.append("finish_unshard: FSDPParamGroup.wait_for_unshard is missing")
        if api.reduce_scatter_unused_params and not hasattr(group, "reduce_scatter_unused_params"):
            problems.append("reduce_scatter_unused_params: the setter exists but the group has no such attribute")
    return problems
