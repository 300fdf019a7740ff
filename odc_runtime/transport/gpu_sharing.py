"""Several ranks on one GPU: the rule every GPU transport applies (CUDA MPS) and how a process learns MPS's state.

Without MPS the ranks' CUDA contexts time-slice the GPU: a rank's waiting kernel (barrier, lock, signal wait) holds
its time slice while the rank it waits for cannot run, so every wait costs scheduler slices and progress rests on the
driver's time-slicing policy. Under MPS the ranks' kernels run side by side.
"""

from __future__ import annotations

import logging

from odc_runtime.errors import OdcUsageError
from odc_runtime.transport import cudart

log = logging.getLogger("odc_runtime")

_MPS_ENABLED_ATTRIBUTE = 133  # cudaDevAttrMpsEnabled, from CUDA 12.x runtimes on


def check_gpu_sharing(transport: str, sharing: dict[tuple[str, str], list[int]], mps: dict[int, int]) -> None:
    """Refuse several ranks on one GPU without CUDA MPS (``sharing``: (host, GPU uuid) -> ranks; ``mps[r]``: 1
    on, 0 off, -1 unknown). Every rank sees the same data, so every rank raises together, before the transport
    maps any memory. When the runtime cannot tell (``-1``), the job is allowed with a warning."""
    for (host, uuid), ranks in sorted(sharing.items()):
        if len(ranks) < 2:
            continue
        states = {mps[r] for r in ranks}
        if 0 in states:
            raise OdcUsageError(
                f"{transport} transport: ranks {ranks} share GPU {uuid} on {host} without CUDA MPS; several ranks "
                "on one GPU need MPS (their waiting kernels would otherwise time-slice the GPU). Start the MPS "
                "daemon before the job (`nvidia-cuda-mps-control -d`; stop it with `echo quit | "
                "nvidia-cuda-mps-control`), or give every rank its own GPU"
            )
        if states != {1}:
            log.warning(
                "odc %s: ranks %s share GPU %s on %s and this CUDA runtime cannot tell whether MPS is on; "
                "without MPS (nvidia-cuda-mps-control -d) their kernels time-slice (slow).", transport, ranks, uuid,
                host,
            )


def mps_state(device: int) -> int:
    """1 if CUDA MPS shares ``device``'s contexts, 0 if not, -1 if this process cannot tell (no CUDA runtime
    loaded, or one older than the attribute). Never raises."""
    value = cudart.device_attribute(_MPS_ENABLED_ATTRIBUTE, device)
    return -1 if value is None else int(bool(value))
