"""Bootstrap of the nvshmem transport (``create``, collective).

Every rank validates its side and parses its settings, the ranks agree on all of them over ``torch.distributed``
(a mismatch raises on every rank, naming the setting and the values), several PEs on one GPU without CUDA MPS are
refused, rank 0's NVSHMEM unique id reaches every rank through the bounded store exchange (``ODC_TIMEOUT``), and
every rank initialises NVSHMEM as PE ``rank`` on its current CUDA device; the outcome of every rank's init is
agreed before anyone enters the next NVSHMEM collective, so a failed init raises on every rank instead of hanging
the others in ``nvshmem_malloc``.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import asdict
from types import ModuleType

import torch

from odc_runtime import config
from odc_runtime.agree import gather_checked, ranks_by_value, require_same
from odc_runtime.errors import OdcBackendError, OdcMismatchError, OdcNotInitializedError
from odc_runtime.transport.nvshmem import extension, memory, settings
from odc_runtime.transport.nvshmem.transport import NvshmemTransport

log = logging.getLogger("odc_runtime")


def create(*, timeout: float, heap_size: int | str | None = None) -> NvshmemTransport:
    """Initialise NVSHMEM on every rank of the default ``torch.distributed`` group; collective.

    Every rank validates its side and parses its settings first; the ranks agree on all of them before anyone
    enters NVSHMEM's bootstrap, which has no timeout. NVSHMEM's init and the init-time allocations (control
    buffers and the heap arena, each a collective ending in a barrier) are the only NVSHMEM collectives of the
    job; a rank that dies inside them hangs the others (torch.distributed's own timeout applies to the steps
    before).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise OdcNotInitializedError("nvshmem transport: call torch.distributed.init_process_group first")
    rank, world = dist.get_rank(), dist.get_world_size()
    ext_box: list[ModuleType] = []

    def local_checks() -> tuple[dict, int, int, str, str, int]:
        if extension.started:
            raise OdcBackendError(
                "nvshmem transport: NVSHMEM cannot be initialised twice in one process; start a new process"
            )
        if not torch.cuda.is_available():
            raise OdcBackendError("nvshmem transport: no CUDA device is available (use backend='host')")
        ext = extension.load_extension()
        extension.check_version(ext)  # before NVSHMEM is touched: a mismatch fails on every rank, not inside init
        ext_box.append(ext)
        mine, capacity = settings.local_settings(heap_size)
        try:
            index = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            mps = int(ext.mps_enabled(index))
        except RuntimeError as exc:
            raise OdcBackendError(f"nvshmem transport: cannot query the current CUDA device: {exc}") from exc
        uuid = str(getattr(props, "uuid", index))  # older torch: no uuid, the index then stands for the GPU
        # The exchange carries JSON: the settings travel as a dict and are rebuilt below.
        return asdict(mine), capacity, props.multi_processor_count, socket.gethostname(), uuid, mps

    infos = [
        (config.NvshmemSettings(**info[0]), *info[1:])
        for info in gather_checked("init (nvshmem)", local_checks, timeout=timeout)
    ]
    agreed, capacity, scratch_slots = settings.agree_settings([info[:3] for info in infos])
    sharing = ranks_by_value((r, (info[3], info[4])) for r, info in enumerate(infos))  # (host, GPU) -> its ranks
    settings.check_gpu_sharing(sharing, {r: info[5] for r, info in enumerate(infos)})
    ext = ext_box[0]
    device = torch.device("cuda", torch.cuda.current_device())
    epochs_bytes, locks_bytes = world * 8, 2 * settings.NLOCKS * 4
    scratch_bytes = scratch_slots * agreed.cell_bytes
    # NVSHMEM's heap must hold our control buffers and the arena (its internal buffers come on top of it).
    r = settings.round_up
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(
        r(epochs_bytes) + r(locks_bytes) + r(scratch_bytes) + r(capacity) + settings.SLACK
    )

    # Rank 0's unique id reaches every rank through the bounded store exchange (ODC_TIMEOUT, a dead rank named);
    # a failure on rank 0 raises on every rank.
    def unique_id() -> str | None:
        return bytes(extension.backend_call("get_unique_id", ext.get_unique_id)).hex() if rank == 0 else None  # type: ignore[arg-type]

    uid = bytes.fromhex(gather_checked("init (nvshmem unique id)", unique_id, timeout=timeout)[0])  # type: ignore[arg-type]

    # Every rank's init outcome is agreed (bounded exchange) before the first nvshmem_malloc, a collective that a
    # rank whose init failed would never enter: a failure anywhere raises OdcBackendError on every rank.
    def init() -> None:
        extension.backend_call("init", ext.init, uid, rank, world, device.index)
        extension.started = True

    try:
        gather_checked("init (nvshmem)", init, timeout=timeout)
    except OdcMismatchError as exc:  # another rank's init failed: the same kind of error here, naming it
        raise OdcBackendError(f"nvshmem init: {exc}") from exc

    # Each nvshmem_malloc ends in a barrier: the zeroing of one buffer is complete on every PE before any PE
    # returns from the next malloc, so no PE announces a barrier epoch or takes a ticket into unzeroed words.
    epochs = int(extension.backend_call("malloc", ext.malloc, epochs_bytes))  # type: ignore[call-overload]
    memory.zero(epochs, epochs_bytes, device)
    locks = int(extension.backend_call("malloc", ext.malloc, locks_bytes))  # type: ignore[call-overload]
    memory.zero(locks, locks_bytes, device)
    torch.cuda.synchronize(device)
    scratch = int(extension.backend_call("malloc", ext.malloc, scratch_bytes))  # type: ignore[call-overload]
    arena = int(extension.backend_call("malloc", ext.malloc, capacity))  # type: ignore[call-overload]
    peer_bases = [int(extension.backend_call("ptr", ext.ptr, arena, pe)) for pe in range(world)]  # type: ignore[call-overload]
    # One push protocol for the whole job, never a mix (see docs/design.md): atomics through peer pointers only
    # when NVSHMEM found that every PE reaches every PE with load/store atomics; otherwise the locked protocol.
    p2p = bool(extension.backend_call("p2p_atomics", ext.p2p_atomics))
    atomic = agreed.push == "auto" and p2p and all(peer_bases)
    reach = [q for q, base in enumerate(peer_bases) if base]
    layout = gather_checked("init (push protocol, node layout)",
                            lambda: (atomic, reach, settings.network_transport()))
    require_same(
        "init:", [a for a, _, _ in layout],
        rule="push protocol (atomic through peer pointers vs locked) must be the same on every rank",
    )
    settings.check_atomics_path(p2p, [r for _, r, _ in layout], [n for _, _, n in layout])  # PCIe without NVLink
    node = settings.node_layout([r for _, r, _ in layout])  # the same on every rank: computed from the same lists
    engine = extension.backend_call(
        "init", ext.Engine, rank, world, epochs, locks, settings.NLOCKS, scratch, scratch_slots, agreed.cell_bytes,
        agreed.vector_atomics, arena, capacity,
    )
    extension.keep_engine(engine)
    transport = NvshmemTransport(
        ext, rank, world, device, timeout, settings=agreed, scratch_slots=scratch_slots, capacity=capacity,
        arena=arena, peer_bases=peer_bases, engine=engine, atomic_push=atomic, node=node,
    )
    log.info(
        "odc nvshmem transport: rank %d/%d on %s, heap %d MiB, push=%s, fetch=%s, scratch %d x %d KiB, node=%s",
        rank, world, device, capacity >> 20, "atomic" if atomic else "locked", agreed.fetch, scratch_slots,
        agreed.cell_bytes >> 10, node if isinstance(node, int) else "not derivable (set ODC_NODE_SIZE)",
    )
    return transport
