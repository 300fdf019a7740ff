"""Transports: symmetric memory with one-sided fetch / push (see :mod:`odc_runtime.transport.base`), and the
registry that ``odc.init``, the FSDP integration and the benchmarks pick them from.

A new transport is one module with ``create(*, timeout, heap_size) -> Transport`` and ``is_available() -> bool``,
plus one :func:`register` line below. Modules are imported only when a transport is created or asked whether it is
available, so importing the package never loads CUDA or the compiled extension.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType

from odc_runtime.errors import OdcUsageError
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
    "auto_select",
    "available",
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
        priority: ``init(backend=None)`` picks the available transport with the highest priority.
    """

    name: str
    module: str
    device_type: str
    priority: int

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def is_available(self) -> bool:
        """Whether this transport can run here (never raises; a module that fails to import is unavailable)."""
        try:
            return bool(self.load().is_available())
        except Exception as e:  # an optional dependency missing or broken: not available, say why in the log
            log.debug("odc transport %s unavailable: %s", self.name, e)
            return False

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


def auto_select() -> TransportSpec:
    """The preferred available transport (what ``init(backend=None)`` uses without ``ODC_BACKEND``)."""
    for name in names():
        if _REGISTRY[name].is_available():
            return _REGISTRY[name]
    raise OdcUsageError(f"no ODC transport is available here (registered: {', '.join(names())})")


def nvshmem_available() -> bool:
    """Whether the nvshmem transport can run here (kept for callers of the pre-registry API)."""
    return get("nvshmem").is_available()


register(TransportSpec("host", "odc_runtime.transport.host", device_type="cpu", priority=0))
register(TransportSpec("nvshmem", "odc_runtime.transport.nvshmem", device_type="cuda", priority=10))
# The one-node Triton transport: on GPUs over PyTorch symmetric memory, and on CPU ranks under the Triton
# interpreter (never chosen automatically: it exists to execute the GPU data plane in CI).
register(TransportSpec("symm", "odc_runtime.transport.symm.cuda", device_type="cuda", priority=5))
register(TransportSpec("symm-cpu", "odc_runtime.transport.symm.cpu", device_type="cpu", priority=-1))
