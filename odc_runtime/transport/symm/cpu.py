"""``symm-cpu``: the one-node Triton transport on CPU ranks, its kernels executed by the Triton interpreter.

The interpreter is chosen when a kernel is *defined* (``TRITON_INTERPRET=1`` read by ``triton.jit``), so
``create`` sets the variable before it imports ``odc_runtime.kernels.peer``; if that module was already
imported compiled (a process that used the kernels on a GPU first), it raises and says how to start instead.
"""

from __future__ import annotations

import os
import sys

from odc_runtime.errors import OdcBackendError
from odc_runtime.transport import host
from odc_runtime.transport.host import HostTransport
from odc_runtime.transport.symm import common_reason

_KERNELS = "odc_runtime.kernels.peer"


def unavailable_reason() -> str | None:
    """Why ``symm-cpu`` cannot run here (``None``: it can): it needs Triton and the host transport's shared
    memory. Never raises."""
    return common_reason()


def is_available() -> bool:
    """Triton is installed and the host transport's shared memory works here."""
    return unavailable_reason() is None


def use_interpreter() -> None:
    """Make the peer kernels run under the Triton interpreter in this process (OdcBackendError if they were
    already defined compiled)."""
    module = sys.modules.get(_KERNELS)
    if module is not None and not module.INTERPRET:
        raise OdcBackendError(
            "odc symm-cpu: odc_runtime.kernels.peer was imported in this process before TRITON_INTERPRET=1 was set, "
            "so its kernels are compiled for a GPU and cannot run on CPU tensors; start the process with "
            "TRITON_INTERPRET=1 (or initialise symm-cpu before anything imports the kernels)"
        )
    os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when the kernel module is imported below


def create(*, timeout: float, heap_size: int | str | None = None) -> HostTransport:
    """Collective: the host transport's segments and control plane, with the Triton data plane."""
    use_interpreter()
    from odc_runtime.transport.symm.transport import SymmTransport

    return host.create(timeout=timeout, heap_size=heap_size, transport_class=SymmTransport)
