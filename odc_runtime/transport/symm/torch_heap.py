"""The ``symm`` transport's memory on GPUs: one SymmetricMemory block per rank, mapped into every peer (one node).

``open_heap`` is collective over the default ``torch.distributed`` group and returns a ``CudaPeerHeap``, the
CUDA implementation of the transport's ``PeerHeap`` shape (``odc_runtime.transport.symm.heap``): ``local`` is this
rank's ``uint8[nbytes]`` heap, ``peer_bases`` an ``int64[world]`` CUDA tensor of every rank's heap address *in this
process* (what the Triton kernels load and cast to pointers), ``peer_view(p)`` a tensor view of rank ``p``'s heap
(what copy-engine fetches read). Every touch of torch's private SymmetricMemory API goes through
``_torch_symm``.

Creation, step by step, each step agreed by every rank (``gather_checked``: a failure anywhere raises on every rank,
within ``timeout``) before the next, so no rank enters torch's rendezvous (which waits on the store without our
deadline) while a peer has already given up:

1. local checks: a CUDA device, SymmetricMemory's API, the host name and GPU of each rank;
2. topology: every rank on one host (else OdcBackendError: this transport is one node; use ``nvshmem``), and every
   pair of distinct GPUs that this process can see reaches each other by P2P (``cudaDeviceCanAccessPeer``);
   peers hidden by ``CUDA_VISIBLE_DEVICES`` are checked by the rendezvous itself, whose failure says so;
3. allocation with the CUDA backend;
4. rendezvous (torch's collective), then the heap is zeroed and the ranks agree once more, so no rank reads a
   peer's heap before that peer zeroed it.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import torch
import torch.distributed as dist

from odc_runtime import config
from odc_runtime.agree import gather_checked
from odc_runtime.errors import OdcBackendError, OdcMismatchError, OdcNotInitializedError, OdcUsageError
from odc_runtime.transport.symm import _torch_symm

__all__ = ["CudaPeerHeap", "check_topology", "is_available", "open_heap"]

log = logging.getLogger(__name__)


def is_available() -> bool:
    """Whether this process could create a ``CudaPeerHeap`` (CUDA device and SymmetricMemory present)."""
    return _torch_symm.unavailable_reason() is None


class CudaPeerHeap:
    """One rank's symmetric heap on its GPU and its peers' heaps as mapped here. Build it with ``open_heap``."""

    def __init__(self, *, rank: int, world: int, local: torch.Tensor, handle: Any) -> None:
        self.rank = rank
        self.world = world
        self.nbytes = local.numel()
        self.device = local.device
        self.local = local
        self._handle: Any = handle
        self.peer_bases = torch.tensor(
            _torch_symm.peer_addresses(handle, self.nbytes), dtype=torch.int64, device=self.device
        )
        self._views: dict[int, torch.Tensor] = {rank: local}

    def peer_view(self, peer: int) -> torch.Tensor:
        """``uint8[nbytes]`` view of rank ``peer``'s heap in this process (this rank's own: ``local``)."""
        if self._handle is None:
            raise OdcBackendError("symm heap: used after close()")
        if not 0 <= peer < self.world:
            raise OdcUsageError(f"symm heap: peer {peer} is not a rank of a world of {self.world}")
        view = self._views.get(peer)
        if view is None:
            view = self._views[peer] = _torch_symm.peer_buffer(self._handle, peer, self.nbytes)
        return view

    def close(self) -> None:
        """Release this rank's references to the heap and the peer mappings (local; idempotent).

        The caller has synchronised with its peers first (the transport's final barrier): torch unmaps the peers'
        blocks and frees this one once the last reference goes, so no kernel of any rank may still use them.
        """
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device)  # this rank's kernels on the heap have finished
        self._views.clear()
        self._handle = None
        del self.local, self.peer_bases


def _local_facts(nbytes: int) -> tuple[str, str, int, int]:
    reason = _torch_symm.unavailable_reason()
    if reason is not None:
        raise OdcBackendError(f"symm transport: {reason} (use backend='host' on CPU, 'nvshmem' across nodes)")
    index = torch.cuda.current_device()
    try:
        props = torch.cuda.get_device_properties(index)
    except RuntimeError as e:
        raise OdcBackendError(f"symm transport: cannot query CUDA device {index}: {e}") from e
    return socket.gethostname(), str(getattr(props, "uuid", index)), index, nbytes


def _visible_gpus() -> dict[str, int]:
    """GPU uuid -> device index, for the GPUs this process can see."""
    return {str(getattr(torch.cuda.get_device_properties(i), "uuid", i)): i for i in range(torch.cuda.device_count())}


def check_topology(facts: list[tuple[str, str, int, int]], rank: int, visible: dict[str, int]) -> None:
    """Raise OdcBackendError unless every rank is on one host and this rank's GPU reaches every visible peer GPU.

    ``facts[r]`` is rank ``r``'s ``(host, gpu uuid, device index, nbytes)``; ``visible`` maps the uuids this process
    sees to device indices.
    """
    hosts: dict[str, list[int]] = {}
    for r, (host, *_rest) in enumerate(facts):
        hosts.setdefault(host, []).append(r)
    if len(hosts) > 1:
        listing = "; ".join(f"{h}: ranks {rs}" for h, rs in hosts.items())
        raise OdcBackendError(
            f"symm transport: the job spans {len(hosts)} hosts ({listing}); it maps peers' GPU memory by CUDA IPC, "
            "so it runs on one node only: use backend='nvshmem' across nodes"
        )
    mine = facts[rank][1]
    for peer, (_, uuid, _, _) in enumerate(facts):
        if uuid == mine or uuid not in visible:
            continue
        if not torch.cuda.can_device_access_peer(visible[mine], visible[uuid]):
            raise OdcBackendError(
                f"symm transport: rank {rank}'s GPU {mine} cannot access rank {peer}'s GPU {uuid} by P2P "
                "(`nvidia-smi topo -p2p r` shows the pairs); use backend='nvshmem' or GPUs linked by NVLink"
            )


def open_heap(
    rank: int, world: int, nbytes: int, device: torch.device, *, timeout: float | None = None
) -> CudaPeerHeap:
    """Collective over the default group (``rank``/``world`` are this rank's there): allocate and map one
    ``nbytes`` heap per rank on ``device`` (this rank's GPU); zeroed on return.

    ``timeout`` bounds each agreement step (default ``ODC_TIMEOUT``). Raises (on every rank together, within it
    except inside torch's rendezvous): OdcBackendError when torch lacks SymmetricMemory, there is no CUDA device,
    the job spans several hosts, peers are not P2P reachable or the rendezvous fails; OdcMemoryError when a GPU
    cannot hold the heap; OdcMismatchError when another rank failed or ranks asked for different sizes;
    OdcUsageError for bad arguments.
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
    facts = gather_checked("symm heap (devices)", lambda: _local_facts(nbytes), timeout=timeout)
    sizes = {f[3] for f in facts}
    if len(sizes) > 1:
        raise OdcMismatchError(f"symm heap: ranks asked for different heap sizes: {[f[3] for f in facts]}")
    gather_checked("symm heap (topology)", lambda: check_topology(facts, rank, _visible_gpus()), timeout=timeout)

    symm = _torch_symm.api()
    device = torch.device("cuda", torch.cuda.current_device())
    box: list[torch.Tensor] = []

    def allocate() -> None:
        _torch_symm.use_cuda_backend(symm, device)
        box.append(_torch_symm.allocate(symm, nbytes, device))

    gather_checked("symm heap (allocate)", allocate, timeout=timeout)
    local = box[0]
    handle = _torch_symm.rendezvous(symm, local, dist.group.WORLD.group_name)  # type: ignore[union-attr]
    heap = CudaPeerHeap(rank=rank, world=world, local=local, handle=handle)

    def zero() -> None:
        local.zero_()
        torch.cuda.synchronize(device)

    gather_checked("symm heap (zeroed)", zero, timeout=timeout)
    log.debug("symm heap: rank %d/%d, %d bytes on %s", rank, world, nbytes, device)
    return heap
