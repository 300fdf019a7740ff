"""Building the host transport: settings, segments and mappings, each step one bounded agreement round."""

from __future__ import annotations

import logging
import uuid

import torch.distributed as dist

from odc_runtime import config
from odc_runtime.agree import StoreExchange, gather_checked, pid_namespace, require_same
from odc_runtime.transport.heap import human_bytes
from odc_runtime.transport.host.segments import free_bytes, remove_stale_segments
from odc_runtime.transport.host.transport import HostTransport

log = logging.getLogger("odc_runtime.transport.host")


def create(
    *, timeout: float, heap_size: int | str | None = None, transport_class: type[HostTransport] = HostTransport
) -> HostTransport:
    """Collective: build the host transport over the default ``torch.distributed`` group.

    Every step is one bounded agreement round (``gather_checked`` over the store, with
    ``timeout``): any local failure (bad settings, a segment that cannot be created, sized or mapped, an OS
    error) makes every rank raise together instead of some waiting for the others, and every rank removes the
    segment it created. Once all ranks have mapped all segments each rank unlinks its own file: the memory lives
    exactly as long as the mappings, so a crash cannot leave segments behind except during ``create`` itself;
    those stale files (their process is gone) are removed by the next ``create``. ``transport_class`` builds
    a transport on the same segments and control plane (the one-node Triton transport's CPU variant).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    exchange = StoreExchange(timeout)
    transport: HostTransport | None = None

    def settings() -> tuple[str, int, int, str]:
        directory = config.shm_dir()
        heap = config.host_heap_bytes(heap_size)
        chunk = config.host_chunk_bytes()
        return uuid.uuid4().hex[:12], heap, chunk, directory

    def create_own_segment() -> tuple[int, int, str]:
        nonlocal transport
        remove_stale_segments(directory)
        transport = transport_class(
            rank, world, job, timeout=timeout, heap_size=heap, directory=directory, chunk_bytes=chunk
        )
        return (*transport.create_segment(), pid_namespace())

    try:
        chosen = gather_checked("init (host settings)", settings, exchange=exchange)
        job = chosen[0][0]  # rank 0's job id names every segment of this job
        _, heap, chunk, directory = chosen[rank]
        # Different heaps give different offsets, and a peer's smaller segment cannot be mapped.
        require_same(
            "init:", [c[1] for c in chosen],
            rule="ODC_HEAP_SIZE / init(heap_size=...) must resolve to the same number of bytes on every rank",
        )
        identities = gather_checked("init (host segments)", create_own_segment, exchange=exchange)
        assert transport is not None
        # Returning from this round also means every rank has mapped every segment.
        gather_checked("init (map peers)", lambda: transport.map_peers(identities), exchange=exchange)
        transport.segments.unlink_own()
    except BaseException:
        if transport is not None:
            transport.finalize()
        raise
    free = free_bytes(directory)
    if free is not None and free < heap:
        log.warning(
            "odc host transport: %s has %s free, less than the %s heap of this rank; allocations beyond that "
            "raise OdcMemoryError (give the filesystem more space, e.g. docker --shm-size, or set ODC_SHM_DIR)",
            directory, human_bytes(free), human_bytes(heap),
        )
    log.info(
        "odc host transport: rank %d/%d, job %s, heap %d MiB per rank in %s",
        rank, world, transport.job, transport.heap_capacity() >> 20, transport.directory,
    )
    return transport
