"""GPU transport on NVSHMEM (through the compiled extension ``odc_runtime._C``), split by concern:

* ``extension`` — loading ``_C``, NVSHMEM versions, the process-wide NVSHMEM state;
* ``settings`` — settings, heap size, GPU sharing and node layout agreed at init;
* ``bootstrap`` — ``create`` (collective init);
* ``transport`` — ``NvshmemTransport``, the transport contract, owning:
* ``memory`` — the symmetric heap (arena, views, free quarantine, symmetric offsets);
* ``plans`` — extension plans (near: peer pointers; far: symmetric offsets) and the streams they run on;
* ``watchdog`` — deadlines, abort, the error messages and the failure state.

Importing this package never needs a GPU or the extension. The device protocols and their ordering arguments
are in ``csrc/`` (``csrc/kernels.h`` lists them) and ``docs/design.md``.
"""

from odc_runtime.transport.nvshmem.bootstrap import create
from odc_runtime.transport.nvshmem.extension import (
    _nvshmem_lib_dirs,
    check_version,
    is_available,
    load_extension,
    unavailable_reason,
)
from odc_runtime.transport.nvshmem.settings import (
    agree_settings,
    check_atomics_path,
    check_gpu_sharing,
    local_settings,
    node_layout,
)
from odc_runtime.transport.nvshmem.transport import NvshmemTransport
from odc_runtime.transport.nvshmem.watchdog import missing_peers, timeout_message, wait_timeout_message

__all__ = [
    "NvshmemTransport",
    "_nvshmem_lib_dirs",
    "agree_settings",
    "check_atomics_path",
    "check_gpu_sharing",
    "check_version",
    "create",
    "is_available",
    "load_extension",
    "local_settings",
    "missing_peers",
    "node_layout",
    "timeout_message",
    "unavailable_reason",
    "wait_timeout_message",
]
