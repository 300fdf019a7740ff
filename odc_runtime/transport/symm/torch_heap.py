"""The ``symm`` transport's memory on GPUs: one block per rank, mapped into every peer (one node).

``open_heap`` is collective over the default ``torch.distributed`` group and returns a ``CudaPeerHeap``, the
CUDA implementation of the transport's ``PeerHeap`` shape (``odc_runtime.transport.symm.heap``): ``local`` is this
rank's ``uint8[nbytes]`` heap, ``peer_bases`` an ``int64[world]`` CUDA tensor of every rank's heap address *in this
process* (what the Triton kernels load and cast to pointers), ``peer_view(p)`` a tensor view of rank ``p``'s heap
(what copy-engine fetches read).

The blocks come from one of two providers (``choose_provider``; ``ODC_SYMM_HEAP`` forces one):

* ``symmetric-memory``: PyTorch's SymmetricMemory (its CUDA backend), where every rank has a GPU of its own. Every
  touch of its private API goes through ``_torch_symm``.
* ``ipc``: CUDA IPC through torch's storage sharing (``_torch_ipc``), where ranks share a GPU (SymmetricMemory
  refuses allocations from overlapping devices) or SymmetricMemory is missing. Each rank allocates its block,
  exports one handle per peer, and the handles travel through the bootstrap's agreement rounds. Several ranks on
  one GPU need CUDA MPS, as for nvshmem (``gpu_sharing``).

Creation, step by step, each step agreed by every rank (``gather_checked``: a failure anywhere raises on every rank,
within ``timeout``) before the next, so no rank enters a rendezvous or maps a peer while a peer has already given up:

1. local checks: a CUDA device, what each provider lacks here, ``ODC_SYMM_HEAP``, the host name, GPU and MPS state
   of each rank;
2. topology: every rank on one host (else OdcBackendError: this transport is one node; use ``nvshmem``), every
   pair of distinct GPUs that this process can see reaches each other by P2P (``cudaDeviceCanAccessPeer``) with
   native peer atomics (``cudaDevP2PAttrNativeAtomicSupported``: push's system-scope adds), ranks
   sharing a GPU under MPS, and the provider chosen from these facts (every rank decides alike);
3. allocation (``ipc``: and export, the handles gathered);
4. mapping: torch's rendezvous (``symmetric-memory``, its own collective) or opening every peer's handle (``ipc``,
   agreed);
5. the heap is zeroed and the ranks agree once more, so no rank reads a peer's heap before that peer zeroed it.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from odc_runtime import config
from odc_runtime.agree import gather_checked, ranks_by_value
from odc_runtime.errors import (
    OdcBackendError,
    OdcMismatchError,
    OdcNotInitializedError,
    OdcUsageError,
)
from odc_runtime.transport import cudart, gpu_sharing
from odc_runtime.transport.symm import _torch_ipc, _torch_symm

__all__ = ["CudaPeerHeap", "Facts", "check_topology", "choose_provider", "is_available", "open_heap",
           "unavailable_reason"]

log = logging.getLogger(__name__)


def is_available() -> bool:
    """Whether this process could create a ``CudaPeerHeap`` (a CUDA device, and SymmetricMemory or CUDA IPC)."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why no provider can make the heap in this process (``None``: one can). Never raises."""
    symm, ipc = _torch_symm.unavailable_reason(), _torch_ipc.unavailable_reason()
    if symm is None or ipc is None:
        return None
    return symm if symm == ipc else f"SymmetricMemory: {symm}; CUDA IPC: {ipc}"


class CudaPeerHeap:
    """One rank's symmetric heap on its GPU and its peers' heaps as mapped here. Build it with ``open_heap``.

    ``bases[p]`` is rank ``p``'s heap address in this process and ``view(p)`` a ``uint8[nbytes]`` tensor there
    (mapped on first use); ``keep`` is what keeps the mappings alive (the provider's handle or the views)."""

    def __init__(
        self, *, rank: int, world: int, local: torch.Tensor, bases: list[int], view: Callable[[int], torch.Tensor],
        keep: Any, provider: str,
    ) -> None:
        self.rank = rank
        self.world = world
        self.nbytes = local.numel()
        self.device = local.device
        self.local = local
        self.provider = provider  # "symmetric-memory" or "ipc"
        self._keep: Any = keep
        self._view = view
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self._views: dict[int, torch.Tensor] = {rank: local}

    def peer_view(self, peer: int) -> torch.Tensor:
        """``uint8[nbytes]`` view of rank ``peer``'s heap in this process (this rank's own: ``local``)."""
        if self._keep is None:
            raise OdcBackendError("symm heap: used after close()")
        if not 0 <= peer < self.world:
            raise OdcUsageError(f"symm heap: peer {peer} is not a rank of a world of {self.world}")
        view = self._views.get(peer)
        if view is None:
            view = self._views[peer] = self._view(peer)
        return view

    def close(self) -> None:
        """Release this rank's references to the heap and the peer mappings (local; idempotent).

        The caller has synchronised with its peers first (the transport's final barrier): the provider unmaps the
        peers' blocks and frees this one once the last reference goes, so no kernel of any rank may still use them.
        """
        if self._keep is None:
            return
        torch.cuda.synchronize(self.device)  # this rank's kernels on the heap have finished
        self._views.clear()
        self._keep = None
        del self.local, self.peer_bases, self._view


def symmetric_memory_heap(rank: int, world: int, local: torch.Tensor, handle: Any) -> CudaPeerHeap:
    """The heap over a SymmetricMemory rendezvous ``handle`` of ``local``."""
    nbytes = local.numel()
    return CudaPeerHeap(
        rank=rank, world=world, local=local, bases=_torch_symm.peer_addresses(handle, nbytes),
        view=lambda peer: _torch_symm.peer_buffer(handle, peer, nbytes), keep=handle, provider="symmetric-memory",
    )


def ipc_heap(rank: int, world: int, views: list[torch.Tensor]) -> CudaPeerHeap:
    """The heap over every rank's block as mapped here (``views[rank]``: this rank's own)."""
    return CudaPeerHeap(
        rank=rank, world=world, local=views[rank], bases=[v.data_ptr() for v in views], view=views.__getitem__,
        keep=views, provider="ipc",
    )


class Facts(NamedTuple):
    """What a rank tells its peers before the heap is made (JSON: exchanged as a list)."""

    host: str
    gpu: str  # the GPU's uuid (its index where torch has no uuid)
    index: int
    nbytes: int
    mode: str  # ODC_SYMM_HEAP here: "auto" or a provider
    symm_reason: str | None  # why SymmetricMemory cannot be used here (None: it can)
    ipc_reason: str | None  # why CUDA IPC cannot be used here (None: it can)
    mps: int  # CUDA MPS on this rank's GPU: 1 on, 0 off, -1 unknown


def _local_facts(nbytes: int) -> Facts:
    mode = config.symm_heap()
    if not torch.cuda.is_available():
        raise OdcBackendError("symm transport: no CUDA device is available (use backend='host' or 'symm-cpu' on "
                              "CPU ranks)")
    index = torch.cuda.current_device()
    try:
        props = torch.cuda.get_device_properties(index)
    except RuntimeError as e:
        raise OdcBackendError(f"symm transport: cannot query CUDA device {index}: {e}") from e
    return Facts(socket.gethostname(), str(getattr(props, "uuid", index)), index, nbytes, mode,
                 _torch_symm.unavailable_reason(), _torch_ipc.unavailable_reason(), gpu_sharing.mps_state(index))


def _visible_gpus() -> dict[str, int]:
    """GPU uuid -> device index, for the GPUs this process can see."""
    return {str(getattr(torch.cuda.get_device_properties(i), "uuid", i)): i for i in range(torch.cuda.device_count())}


def check_topology(facts: Sequence[Sequence[Any]], rank: int, visible: dict[str, int]) -> None:
    """Raise OdcBackendError unless every rank is on one host and this rank's GPU reaches every visible peer GPU
    by P2P with native peer atomics (unknown: a warning).

    ``facts[r]`` starts with rank ``r``'s ``(host, gpu uuid, ...)`` (``Facts``); ``visible`` maps the uuids this
    process sees to device indices.
    """
    hosts: dict[str, list[int]] = {}
    for r, f in enumerate(facts):
        hosts.setdefault(f[0], []).append(r)
    if len(hosts) > 1:
        listing = "; ".join(f"{h}: ranks {rs}" for h, rs in hosts.items())
        raise OdcBackendError(
            f"symm transport: the job spans {len(hosts)} hosts ({listing}); it maps peers' GPU memory by CUDA IPC, "
            "so it runs on one node only: use backend='nvshmem' across nodes"
        )
    mine = facts[rank][1]
    for peer, f in enumerate(facts):
        uuid = f[1]
        if uuid == mine or uuid not in visible:
            continue
        if not torch.cuda.can_device_access_peer(visible[mine], visible[uuid]):
            raise OdcBackendError(
                f"symm transport: rank {rank}'s GPU {mine} cannot access rank {peer}'s GPU {uuid} by P2P "
                "(`nvidia-smi topo -p2p r` shows the pairs); use backend='nvshmem' or GPUs linked by NVLink"
            )
        # push accumulates with system-scope atomics on the peer's memory: undefined without native peer atomics
        atomics = cudart.peer_native_atomics(visible[mine], visible[uuid])
        if atomics == 0:
            raise OdcBackendError(
                f"symm transport: rank {rank}'s GPU {mine} reaches rank {peer}'s GPU {uuid} by P2P, but without "
                "native peer atomics (a PCIe link; `nvidia-smi topo -p2p a` shows the pairs), and push adds into a "
                "peer's memory atomically: use GPUs linked by NVLink, or put the ranks on one GPU under CUDA MPS "
                "(atomics within a GPU are native)"
            )
        if atomics < 0:
            log.warning("odc symm: cannot tell whether GPUs %s and %s have native peer atomics (no CUDA runtime "
                        "answered); a push between them is undefined without them", mine, uuid)


def _ranks_by_gpu(facts: Sequence[Facts]) -> dict[tuple[str, str], list[int]]:
    return ranks_by_value((r, (f.host, f.gpu)) for r, f in enumerate(facts))


def choose_provider(facts: Sequence[Facts]) -> str:
    """The heap's provider, from every rank's facts (every rank decides alike): ``ODC_SYMM_HEAP`` where set, else
    ``symmetric-memory`` where every rank has a GPU of its own and SymmetricMemory, else ``ipc``. Raises
    OdcMismatchError when ranks set ``ODC_SYMM_HEAP`` differently, OdcBackendError when the provider asked for (or,
    with ``auto``, both) cannot work, saying why."""
    modes = [f.mode for f in facts]
    if len(set(modes)) > 1:
        raise OdcMismatchError(f"symm heap: ranks set ODC_SYMM_HEAP differently: {modes} (rank order)")
    shared = [rs for rs in _ranks_by_gpu(facts).values() if len(rs) > 1]
    symm_missing = next(((r, f.symm_reason) for r, f in enumerate(facts) if f.symm_reason is not None), None)
    ipc_missing = next(((r, f.ipc_reason) for r, f in enumerate(facts) if f.ipc_reason is not None), None)
    if symm_missing is not None:
        symm_why: str | None = f"rank {symm_missing[0]}: {symm_missing[1]}"
    elif shared:
        symm_why = f"ranks {shared} share a GPU, and SymmetricMemory maps one rank per GPU"
    else:
        symm_why = None
    ipc_why = None if ipc_missing is None else f"rank {ipc_missing[0]}: {ipc_missing[1]}"
    mode = modes[0]
    if mode == "symmetric-memory" and symm_why is not None:
        raise OdcBackendError(f"symm heap: ODC_SYMM_HEAP=symmetric-memory, but {symm_why}; unset it (auto) or set "
                              "ODC_SYMM_HEAP=ipc")
    if mode == "ipc" and ipc_why is not None:
        raise OdcBackendError(f"symm heap: ODC_SYMM_HEAP=ipc, but CUDA IPC cannot be used: {ipc_why}")
    if mode != "auto":
        return mode
    if symm_why is None:
        return "symmetric-memory"
    if ipc_why is None:
        return "ipc"
    raise OdcBackendError(
        f"symm transport: neither provider can map the ranks' memory. SymmetricMemory: {symm_why}. CUDA IPC: "
        f"{ipc_why}. Use backend='nvshmem' (several ranks per GPU under CUDA MPS) or backend='host'"
    )


def open_heap(
    rank: int, world: int, nbytes: int, device: torch.device, *, timeout: float | None = None
) -> CudaPeerHeap:
    """Collective over the default group (``rank``/``world`` are this rank's there): allocate and map one
    ``nbytes`` heap per rank on ``device`` (this rank's GPU); zeroed on return.

    ``timeout`` bounds each agreement step (default ``ODC_TIMEOUT``). Raises (on every rank together, within it
    except inside torch's rendezvous): OdcBackendError when there is no CUDA device, the job spans several hosts,
    peers are not P2P reachable, the provider ``choose_provider`` picks cannot work or its mapping fails;
    OdcMemoryError when a GPU cannot hold the heap; OdcMismatchError when another rank failed, or ranks asked for
    different sizes or set ``ODC_SYMM_HEAP`` differently; OdcUsageError for bad arguments, and for ranks that
    share a GPU without CUDA MPS.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise OdcNotInitializedError("symm transport: call torch.distributed.init_process_group first")
    if (rank, world) != (dist.get_rank(), dist.get_world_size()):
        raise OdcUsageError(
            f"symm heap: rank {rank} of {world} given, but this process is rank {dist.get_rank()} of "
            f"{dist.get_world_size()} in the default group"
        )
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise OdcUsageError(f"symm heap: nbytes must be a positive int, got {nbytes!r}")
    device = torch.device(device)
    if device.type != "cuda":
        raise OdcUsageError(f"symm heap: needs a CUDA device, got {device}")
    if timeout is None:
        timeout = config.resolve_timeout(None)
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return _open(rank, world, nbytes, timeout)
    return _open(rank, world, nbytes, timeout)


def _open(rank: int, world: int, nbytes: int, timeout: float) -> CudaPeerHeap:
    facts = [Facts(*f) for f in gather_checked("symm heap (devices)", lambda: _local_facts(nbytes), timeout=timeout)]
    sizes = {f.nbytes for f in facts}
    if len(sizes) > 1:
        raise OdcMismatchError(f"symm heap: ranks asked for different heap sizes: {[f.nbytes for f in facts]}")
    provider: list[str] = []

    def agree_on_the_layout() -> None:
        check_topology(facts, rank, _visible_gpus())
        gpu_sharing.check_gpu_sharing("symm", _ranks_by_gpu(facts), {r: f.mps for r, f in enumerate(facts)})
        provider.append(choose_provider(facts))

    gather_checked("symm heap (topology)", agree_on_the_layout, timeout=timeout)
    device = torch.device("cuda", torch.cuda.current_device())
    if provider[0] == "ipc":
        heap = _open_ipc(rank, world, nbytes, device, timeout)
    else:
        heap = _open_symmetric_memory(rank, world, nbytes, device, timeout)

    def zero() -> None:
        heap.local.zero_()
        torch.cuda.synchronize(device)

    gather_checked("symm heap (zeroed)", zero, timeout=timeout)
    log.debug("symm heap: rank %d/%d, %d bytes on %s from %s", rank, world, nbytes, device, heap.provider)
    return heap


def _open_symmetric_memory(rank: int, world: int, nbytes: int, device: torch.device, timeout: float) -> CudaPeerHeap:
    symm = _torch_symm.api()
    box: list[torch.Tensor] = []

    def allocate() -> None:
        _torch_symm.use_cuda_backend(symm, device)
        box.append(_torch_symm.allocate(symm, nbytes, device))

    gather_checked("symm heap (allocate)", allocate, timeout=timeout)
    local = box[0]
    handle = _torch_symm.rendezvous(symm, local, dist.group.WORLD.group_name)  # type: ignore[union-attr]
    return symmetric_memory_heap(rank, world, local, handle)


def _open_ipc(rank: int, world: int, nbytes: int, device: torch.device, timeout: float) -> CudaPeerHeap:
    """Allocate, export one handle per peer (gathered), then map every peer's handle for this rank (agreed)."""
    box: list[torch.Tensor] = []

    def allocate_and_export() -> list[object]:
        box.append(_torch_ipc.allocate(nbytes, device))
        return [None if peer == rank else _torch_ipc.export(box[0]) for peer in range(world)]

    exports = gather_checked("symm heap (allocate, export)", allocate_and_export, timeout=timeout)
    views: list[torch.Tensor] = []

    def map_peers() -> None:
        for peer in range(world):
            views.append(box[0] if peer == rank else _torch_ipc.open_export(exports[peer][rank], device, nbytes))  # type: ignore[index]

    gather_checked("symm heap (map peers)", map_peers, timeout=timeout)
    return ipc_heap(rank, world, views)
