"""Transports: symmetric memory with one-sided fetch / push (see ``odc_runtime.transport.base``), and the
registry that ``odc.init``, the FSDP integration and the benchmarks pick them from.

A new transport is one module with ``create(*, timeout, heap_size) -> Transport`` and ``is_available() -> bool``
(and, optionally, ``unavailable_reason() -> str | None``: why not, which ``python -m odc_runtime.doctor`` shows),
plus one ``register`` line below. Modules are imported only when a transport is created or asked whether it is
available, so importing the package never loads CUDA or the compiled extension.

Which transport ``odc.init()`` uses (``choose``, the one place this is decided):

1. ``init(backend=...)``, else ``ODC_BACKEND``: that transport, the same on every rank (else OdcMismatchError).
2. Otherwise the transport with the highest ``priority`` among those with ``auto`` set that are available on every
   rank and, when the ranks run on more than one host, that span hosts (``multi_node``). With the registrations
   below: ``nvshmem`` where its compiled extension is built and works on every rank (on one node too: the faster
   transport as measured, docs/gpu.md "Which transport on one node"; the only one across nodes), else ``symm`` on
   the GPUs of one node (a CUDA torch with SymmetricMemory and triton), else ``host`` (CPU ranks of one machine).
   ``symm-cpu`` is never chosen automatically (the host transport is faster on CPU; it exists to execute the GPU
   kernels in CI).
"""

from __future__ import annotations

import importlib
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from odc_runtime.errors import OdcMismatchError, OdcUsageError
from odc_runtime.transport.base import (
    Capabilities,
    FetchRequest,
    Group,
    Piece,
    PushRequest,
    SymmetricBuffer,
    TransferPlan,
    Transport,
    Work,
)

__all__ = [
    "Capabilities",
    "FetchRequest",
    "Group",
    "Piece",
    "PushRequest",
    "SymmetricBuffer",
    "TransferPlan",
    "Transport",
    "TransportSpec",
    "Work",
    "auto_candidates",
    "auto_select",
    "available",
    "choose",
    "get",
    "names",
    "nvshmem_available",
    "register",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransportSpec:
    """One registry entry.

    Attributes:
        name: what users pass to ``odc.init(backend=...)`` / ``ODC_BACKEND``.
        module: import path of the module that implements ``create`` and ``is_available``.
        device_type: ``torch.device`` type of the tensors it works on (``"cpu"``, ``"cuda"``).
        priority: ``init(backend=None)`` picks the available transport with the highest priority (``choose``).
        multi_node: whether it runs ranks on several hosts (only such transports are chosen for a multi-host job).
        auto: whether ``init(backend=None)`` may choose it at all.
    """

    name: str
    module: str
    device_type: str
    priority: int
    multi_node: bool = False
    auto: bool = True

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def unavailable_reason(self) -> str | None:
        """Why this transport cannot run here, ``None`` where it can. Never raises: a module that fails to import
        is unavailable, with its error as the reason; a module without ``unavailable_reason`` gives a generic one
        when its ``is_available()`` is false."""
        try:
            module = self.load()
            explain = getattr(module, "unavailable_reason", None)
            if explain is not None:
                return explain()
            return None if module.is_available() else f"{self.module}.is_available() is false"
        except Exception as e:  # an optional dependency missing or broken
            return f"{self.module} does not load: {type(e).__name__}: {e}"

    def is_available(self) -> bool:
        """Whether this transport can run here (never raises; the reason why not is logged at DEBUG)."""
        reason = self.unavailable_reason()
        if reason is not None:
            log.debug("odc transport %s unavailable: %s", self.name, reason)
        return reason is None

    def create(self, *, timeout: float, heap_size: int | str | None) -> Transport:
        """Collective: build the transport over the default ``torch.distributed`` group."""
        return self.load().create(timeout=timeout, heap_size=heap_size)


_REGISTRY: dict[str, TransportSpec] = {}


def register(spec: TransportSpec) -> None:
    """Add (or replace) a transport in the registry."""
    _REGISTRY[spec.name] = spec


def names() -> tuple[str, ...]:
    """Every registered transport name, preferred first."""
    return tuple(s.name for s in sorted(_REGISTRY.values(), key=lambda s: -s.priority))


def get(name: str) -> TransportSpec:
    """The registry entry for ``name``; OdcUsageError naming the choices if there is none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise OdcUsageError(f"unknown ODC backend {name!r}; choose one of {', '.join(names())}") from None


def available() -> tuple[str, ...]:
    """Names of the transports that can run here, preferred first."""
    return tuple(n for n in names() if _REGISTRY[n].is_available())


def auto_candidates() -> tuple[str, ...]:
    """This rank's part of the automatic choice: the transports that ``init(backend=None)`` may choose and that are
    available here, preferred first."""
    return tuple(n for n in names() if _REGISTRY[n].auto and _REGISTRY[n].is_available())


def choose(requested: Sequence[str | None], candidates: Sequence[Sequence[str]], hosts: Sequence[str]) -> str:
    """The transport of a job (the rule in this module's docstring), from every rank's facts, indexed by rank.

    ``requested[r]``: rank r's ``init(backend=...)`` / ``ODC_BACKEND`` (None: choose); ``candidates[r]``: its
    ``auto_candidates``; ``hosts[r]``: its host name. Deterministic, so every rank that calls it with the same
    (exchanged) facts gets the same answer or the same error: OdcMismatchError when ranks request different
    backends, OdcUsageError when no transport fits.
    """
    if any(r != requested[0] for r in requested):
        listing = "; ".join(f"rank {i}: {r or 'automatic'}" for i, r in enumerate(requested))
        raise OdcMismatchError(
            f"odc init needs the same backend (init(backend=...) / ODC_BACKEND) on every rank; {listing}"
        )
    if requested[0] is not None:
        return get(requested[0]).name
    spans = len(set(hosts)) > 1
    for name in names():
        spec = _REGISTRY[name]
        if spec.auto and all(name in c for c in candidates) and (spec.multi_node or not spans):
            return name
    where = f"ranks on {len(set(hosts))} hosts" if spans else "one host"
    per_rank = "; ".join(f"rank {i}: {', '.join(c) or 'none'}" for i, c in enumerate(candidates))
    multi = [n for n in names() if _REGISTRY[n].multi_node]
    hint = f" (across hosts only {', '.join(multi)}: is it built and available on every rank?)" if spans else ""
    raise OdcUsageError(f"no ODC transport is available on every rank for {where}{hint}; available: {per_rank}")


def auto_select() -> TransportSpec:
    """The transport ``choose`` picks for ranks on this host alone (what a single-machine launcher such as
    ``bench/comm.py`` starts)."""
    return get(choose([None], [auto_candidates()], [socket.gethostname()]))


def nvshmem_available() -> bool:
    """Whether the nvshmem transport can run here (kept for callers of the pre-registry API)."""
    return get("nvshmem").is_available()


register(TransportSpec("host", "odc_runtime.transport.host", device_type="cpu", priority=0))
# nvshmem above symm on one node too: on the first GPU run (one H200, docs/gpu.md "Which transport on one node")
# symm reached 0.48x / 0.51x of copy_ / add_ at 64 MiB against nvshmem's 1.02x / 0.96x, and a sync of 470 us against
# 36 us. Swap the two once a GPU run shows symm at nvshmem's rows.
register(TransportSpec("nvshmem", "odc_runtime.transport.nvshmem", device_type="cuda", priority=20, multi_node=True))
# The one-node Triton transport: on the GPUs of one node over PyTorch's SymmetricMemory (no compiled extension
# needed: the choice where nvshmem is not built), and on CPU ranks under the Triton interpreter (never automatic:
# it executes the GPU data plane in CI).
register(TransportSpec("symm", "odc_runtime.transport.symm.cuda", device_type="cuda", priority=10))
register(TransportSpec("symm-cpu", "odc_runtime.transport.symm.cpu", device_type="cpu", priority=-10, auto=False))
