"""What ODC asks of the CUDA runtime that torch does not expose, through the ``libcudart`` torch already loaded
(ctypes): a device attribute (MPS's state), a peer attribute (native peer atomics), and the calling thread's
stream-capture mode. Nothing here raises: an answer the runtime cannot give is ``None`` / ``-1`` / ``False``, and
the runtime's last error is cleared so torch does not report it later. ``loaded`` is the one place the library is
found (the tests' boundary: they replace it with a fake runtime).
"""

from __future__ import annotations

import ctypes

__all__ = ["device_attribute", "loaded", "peer_native_atomics", "use_thread_local_capture_mode"]

_P2P_NATIVE_ATOMICS = 3  # cudaDevP2PAttrNativeAtomicSupported (cudaDeviceP2PAttr), every runtime since CUDA 8
_CAPTURE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal (cudaStreamCaptureMode), every runtime since CUDA 10.1


def loaded() -> ctypes.CDLL | None:
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


def _int_query(name: str, *args: int) -> int | None:
    """``cuda<Name>(int *value, *args)``'s value, or ``None`` where the runtime or the function cannot answer."""
    runtime = loaded()
    if runtime is None:
        return None
    value = ctypes.c_int(0)
    try:
        err = getattr(runtime, name)(ctypes.byref(value), *args)
    except AttributeError:
        return None
    if err != 0:
        runtime.cudaGetLastError()
        return None
    return value.value


def device_attribute(attribute: int, device: int) -> int | None:
    """``cudaDeviceGetAttribute(attribute, device)``, or ``None`` where it cannot be read."""
    return _int_query("cudaDeviceGetAttribute", attribute, device)


def peer_native_atomics(device: int, peer: int) -> int:
    """1 if atomics from GPU ``device`` on GPU ``peer``'s memory are native over their link (NVLink; PCIe only
    where the platform supports them), 0 if not (a peer atomic is then undefined), -1 if this process cannot tell.
    Device indices as this process sees them."""
    value = _int_query("cudaDeviceGetP2PAttribute", _P2P_NATIVE_ATOMICS, device, peer)
    return -1 if value is None else int(bool(value))


def use_thread_local_capture_mode() -> bool:
    """Put the calling thread in thread-local stream-capture mode: its CUDA calls (event queries) then ignore
    another thread's capture, where the default (global) mode would make them fail and invalidate that capture.
    For a helper thread that never captures (a watchdog); whether the runtime took it."""
    runtime = loaded()
    if runtime is None:
        return False
    mode = ctypes.c_int(_CAPTURE_THREAD_LOCAL)
    try:
        err = runtime.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode))
    except AttributeError:
        return False
    if err != 0:
        runtime.cudaGetLastError()
        return False
    return True
