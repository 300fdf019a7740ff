"""Several ranks on one GPU: the rule every GPU transport applies (CUDA MPS) and how a process learns MPS's state.

Without MPS the ranks' CUDA contexts time-slice the GPU: a rank's waiting kernel (barrier, lock, signal wait) holds
its time slice while the rank it waits for cannot run, so every wait costs scheduler slices and progress rests on the
driver's time-slicing policy. Under MPS the ranks' kernels run side by side.
"""

from __future__ import annotations

import ctypes
import logging

from odc_runtime.errors import OdcUsageError

log = logging.getLogger("odc_runtime")

_MPS_ENABLED_ATTRIBUTE = 133  # cudaDevAttrMpsEnabled, from CUDA 12.x runtimes on
_P2P_NATIVE_ATOMICS = 3  # cudaDevP2PAttrNativeAtomicSupported (cudaDeviceP2PAttr), every CUDA runtime since 8.0


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


def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process already loaded (torch's), or ``None``."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def mps_state(device: int) -> int:
    """1 if CUDA MPS shares ``device``'s contexts, 0 if not, -1 if this process cannot tell (no CUDA runtime
    loaded, or one older than the attribute). Never raises."""
    cudart = _loaded_cudart()
    if cudart is None:
        return -1
    value = ctypes.c_int(0)
    try:
        err = cudart.cudaDeviceGetAttribute(ctypes.byref(value), _MPS_ENABLED_ATTRIBUTE, device)
    except AttributeError:
        return -1
    if err != 0:
        cudart.cudaGetLastError()  # clear the runtime's last error, so torch does not report it later
        return -1
    return 1 if value.value else 0


def peer_native_atomics(device: int, peer: int) -> int:
    """1 if atomics from GPU ``device`` on GPU ``peer``'s memory are native over their link (NVLink; PCIe only
    where the platform supports them), 0 if not (a peer atomic is then undefined), -1 if this process cannot tell.
    Device indices as this process sees them. Never raises."""
    cudart = _loaded_cudart()
    if cudart is None:
        return -1
    value = ctypes.c_int(0)
    try:
        err = cudart.cudaDeviceGetP2PAttribute(ctypes.byref(value), _P2P_NATIVE_ATOMICS, device, peer)
    except AttributeError:
        return -1
    if err != 0:
        cudart.cudaGetLastError()
        return -1
    return 1 if value.value else 0
