"""A CUDA machine on CPU ranks for the symm heap's set-up tests: only torch's own CUDA calls and the CUDA runtime's
attribute queries are replaced, never a function of ``odc_runtime`` (``tests/test_symm_ipc.py``,
``tests/test_symm_torch.py``)."""

from __future__ import annotations

import ctypes
import math
import socket

import torch


class FakeRuntime:
    """The CUDA runtime's two queries ODC makes through ctypes: MPS's state and native peer atomics."""

    def __init__(self, mps: int, atomics: int) -> None:
        self.mps, self.atomics = mps, atomics

    def cudaDeviceGetAttribute(self, ref, attribute: int, device: int) -> int:
        assert attribute == 133  # cudaDevAttrMpsEnabled
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = self.mps
        return 0

    def cudaDeviceGetP2PAttribute(self, ref, attribute: int, device: int, peer: int) -> int:
        assert attribute == 3 and device != peer  # cudaDevP2PAttrNativeAtomicSupported, between two GPUs
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = self.atomics
        return 0

    def cudaGetLastError(self) -> int:
        return 0


def fake_cuda(rank: int, gpus: list[str], calls: list[tuple], *, mps: int = 1, atomics: int = 1,
              fail_open: bool = False, host: str | None = None) -> None:
    """In a rank's process (``tests._dist.run_ranks``): stand POSIX shared memory in for this process's GPU,
    below everything ODC calls. ``torch.empty`` on a CUDA device makes a segment, ``UntypedStorage._share_cuda_``
    exports its name (as the IPC handle) and ``_new_shared_cuda`` maps a peer's segment by it; torch.cuda's device
    queries see ``gpus`` (rank -> uuid); ``host`` replaces the host name."""
    import types as _types
    from multiprocessing import resource_tracker, shared_memory

    from odc_runtime.transport import cudart

    uuids = sorted(set(gpus))
    segments: dict[int, shared_memory.SharedMemory] = {}  # a block's address -> its segment
    real_empty = torch.empty

    def empty(*size, dtype=None, device=None, **kwargs):
        if device is None or torch.device(device).type != "cuda":
            return real_empty(*size, dtype=dtype, device=device, **kwargs)
        n = math.prod(size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size)
        if n == 0:
            return real_empty(0, dtype=dtype)
        seg = shared_memory.SharedMemory(create=True, size=n)
        block = torch.frombuffer(seg.buf, dtype=torch.uint8)
        block.fill_(7)  # what a fresh allocation may hold: the set-up zeroes it
        segments[block.data_ptr()] = seg
        calls.append(("allocate", n))
        return block

    def share(storage: torch.UntypedStorage) -> tuple:
        calls.append(("export",))
        seg = segments[storage.data_ptr()]
        return (uuids.index(gpus[rank]), seg.name.encode(), storage.nbytes(), 0, b"/refs", 0, b"event", False)

    def new_shared(device, handle, size, offset, ref_handle, ref_offset, event, sync) -> torch.UntypedStorage:
        calls.append(("open", handle.decode(), device))
        if fail_open:
            raise RuntimeError("CUDA error: invalid resource handle (test)")
        seg = shared_memory.SharedMemory(name=handle.decode())
        resource_tracker.unregister(seg._name, "shared_memory")  # the owner unlinks it, not this process
        segments[-len(segments) - 1] = seg  # kept mapped
        return torch.frombuffer(seg.buf, dtype=torch.uint8).untyped_storage()

    torch.empty = empty
    torch.UntypedStorage._share_cuda_ = share
    torch.UntypedStorage._new_shared_cuda = staticmethod(new_shared)
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: len(uuids)
    torch.cuda.current_device = lambda: uuids.index(gpus[rank])
    torch.cuda.get_device_properties = lambda i: _types.SimpleNamespace(uuid=uuids[i])
    torch.cuda.can_device_access_peer = lambda d, p: True
    torch.cuda.synchronize = lambda device=None: None
    runtime = FakeRuntime(mps, atomics)
    cudart.loaded = lambda: runtime  # the loaded libcudart (ctypes), the lowest boundary
    if host is not None:
        socket.gethostname = lambda: host
