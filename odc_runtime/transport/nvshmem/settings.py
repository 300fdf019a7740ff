"""The nvshmem transport's settings and the facts every rank must agree on at init: protocol settings and heap
size (parsed by ``odc_runtime.config.nvshmem_settings``), GPU sharing (MPS), and the node layout derived from
peer-pointer reach. Pure functions of the exchanged data, so every rank takes the same decision."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import fields

from odc_runtime import config
from odc_runtime.agree import require_same
from odc_runtime.errors import OdcUsageError
from odc_runtime.transport import gpu_sharing

log = logging.getLogger("odc_runtime")

DEFAULT_HEAP = 1 << 30  # heap when neither heap_size nor NVSHMEM_SYMMETRIC_SIZE is given
NLOCKS = 1024  # ticket locks per PE (two uint32 words each) guarding the locked protocol's cells
ALIGN = 512  # NVSHMEM rounds every allocation to this; used to size NVSHMEM_SYMMETRIC_SIZE
SLACK = 2 << 20  # extra NVSHMEM_SYMMETRIC_SIZE beyond our own allocations

SETTING_ENV = {
    "push": "ODC_NVSHMEM_PUSH",
    "fetch": "ODC_NVSHMEM_FETCH",
    "cell_bytes": "ODC_NVSHMEM_CELL_BYTES",
    "scratch_slots": "ODC_NVSHMEM_SCRATCH_SLOTS",
    "vector_atomics": "ODC_NVSHMEM_VECTOR_ATOMICS",
}


def round_up(n: int) -> int:
    """``n`` rounded up to NVSHMEM's allocation granularity."""
    return -(-n // ALIGN) * ALIGN


def local_settings(heap_size: int | str | None) -> tuple[config.NvshmemSettings, int]:
    """This rank's protocol settings and heap bytes (``heap_size``, else ``NVSHMEM_SYMMETRIC_SIZE``, else 1 GiB)."""
    settings = config.nvshmem_settings()
    if heap_size is not None:
        capacity = config.parse_size(heap_size, what="heap_size")
    elif os.environ.get("NVSHMEM_SYMMETRIC_SIZE"):
        capacity = config.parse_size(os.environ["NVSHMEM_SYMMETRIC_SIZE"], what="NVSHMEM_SYMMETRIC_SIZE")
    else:
        capacity = DEFAULT_HEAP
    return settings, capacity


def agree_settings(infos: Sequence[tuple[config.NvshmemSettings, int, int]]) -> tuple[config.NvshmemSettings, int, int]:
    """From every rank's ``(settings, heap bytes, SM count)`` (indexed by rank, the same list on every rank):
    raise ``OdcMismatchError`` naming the first setting that differs and every rank's
    value, else return ``(settings, heap bytes, scratch slots)``. Mixed push protocols would lose updates and the
    scratch and heap are symmetric allocations, so nothing here may differ; the default scratch slot count is one
    per SM of the largest GPU."""
    for f in fields(config.NvshmemSettings):
        require_same(
            "init:", [getattr(info[0], f.name) for info in infos],
            rule=f"setting {f.name} ({SETTING_ENV[f.name]}) must resolve to the same value on every rank",
        )
    require_same(
        "init:", [info[1] for info in infos],
        rule="the heap size (init(heap_size=...) / NVSHMEM_SYMMETRIC_SIZE) must resolve to the same bytes everywhere",
    )
    settings, capacity = infos[0][0], infos[0][1]
    return settings, capacity, settings.scratch_slots or max(info[2] for info in infos)


def check_gpu_sharing(sharing: dict[tuple[str, str], list[int]], mps: dict[int, int]) -> None:
    """``gpu_sharing.check_gpu_sharing`` for NVSHMEM PEs (the rule and its reason are there)."""
    gpu_sharing.check_gpu_sharing("nvshmem", sharing, mps)


def network_transport(environ: dict[str, str] | None = None, ib_dir: str = "/sys/class/infiniband") -> bool:
    """Whether NVSHMEM has a network transport on this host for the operations no load/store path carries: UCX or
    libfabric when ``NVSHMEM_REMOTE_TRANSPORT`` asks for them, else (its default, the IB transports) an
    InfiniBand/RoCE device under ``ib_dir``; ``NVSHMEM_REMOTE_TRANSPORT=none`` has none."""
    environ = os.environ if environ is None else environ
    remote = environ.get("NVSHMEM_REMOTE_TRANSPORT", "ibrc").strip().lower()
    if remote == "none":
        return False
    if remote in ("ucx", "libfabric"):
        return True
    try:
        return any(True for _ in os.scandir(ib_dir))
    except OSError:
        return False


def check_atomics_path(p2p_atomics: bool, reach: Sequence[Sequence[int]], network: Sequence[bool]) -> None:
    """Refuse a node whose GPUs reach each other by peer pointer but without load/store atomics (PCIe, no NVLink)
    when the node has no network transport (``network[r]``: ``network_transport`` on rank ``r``).

    There NVSHMEM routes every atomic (the locked push's ticket locks, the signal adds) through the network
    transport, which does not exist, and NVSHMEM 3.4.5's signal add falls back to a system-scope atomic through
    the peer pointer over PCIe: the first push or signal hangs or traps. Every rank sees the same data, so every
    rank raises together (after NVSHMEM started: it cannot be started again in this process)."""
    if p2p_atomics:
        return
    stuck = sorted(r for r, peers in enumerate(reach) if len(peers) > 1 and not network[r])
    if stuck:
        raise OdcUsageError(
            f"nvshmem transport: ranks {stuck} share a node whose GPUs reach each other without load/store atomics "
            "(PCIe peer-to-peer, no NVLink), and that node has no network transport for NVSHMEM's atomics (no "
            "InfiniBand/RoCE device, NVSHMEM_REMOTE_TRANSPORT not ucx/libfabric): the locked push and the "
            "signalled puts would hang or trap at their first atomic. What works: one rank per node, GPUs joined "
            "by NVLink, or an InfiniBand/RoCE NIC (or NVSHMEM_REMOTE_TRANSPORT=ucx with UCX) on the node; or the "
            "host transport (odc.init('host'))"
        )


def node_layout(reach: Sequence[Sequence[int]]) -> int | str:
    """The node size from every rank's peer-pointer reach (``reach[r]`` = the ranks rank ``r`` reaches by
    ``nvshmem_ptr``, itself included), or the text of the error ``NvshmemTransport.node_size`` raises when
    the reach is not consecutive blocks of one size (the hierarchy's ``r // n`` numbering would be wrong)."""
    world = len(reach)
    n = len(reach[0]) if world else 0
    bad = []
    for r, peers in enumerate(reach):
        first = (r // n) * n if n else 0
        if n == 0 or world % n or sorted(peers) != list(range(first, first + n)):
            bad.append(f"rank {r}: {sorted(peers)}")
    if not bad:
        return n
    return (
        "nvshmem node_size: the ranks reachable by peer pointer (NVLink / same host) are not consecutive blocks of "
        f"one size, so the node cannot be derived ({'; '.join(bad[:4])}{'; ...' if len(bad) > 4 else ''}). "
        "Number the ranks node by node, or declare the node size with ODC_NODE_SIZE (or odc.init(node_size=...))"
    )
