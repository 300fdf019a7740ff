"""Starting ranks on one machine: the launch helper shared by the examples, the benchmarks and the tests.

Under a launcher (``torchrun``: ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set) ``launch`` runs the function
in this process; otherwise it spawns ``nproc`` processes with ``torch.multiprocessing``, each with the
environment ``torch.distributed.init_process_group()`` reads (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free local port).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable


def under_launcher() -> bool:
    """Whether this process was started by a launcher that set the rendezvous environment (``torchrun``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous of ranks on this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_process() -> None:
    """End this rank's process now, after flushing its output, skipping C++ static destructors at interpreter
    exit: with torch 2.14.1's CUDA wheels about one FSDP2 + gloo run in ten aborts there ("terminate called
    without an active exception"; reproduced with plain FSDP2 and no odc_runtime), which would turn a finished run
    into a failure. Call it only after a clean shutdown (``destroy_process_group``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gloo_rank(fn: Callable[..., None], *args: object) -> None:
    """One CPU rank's body: one torch thread (ranks share the machine's cores), the default process group on
    gloo, ``fn(rank, world_size, *args)``, and the group destroyed however ``fn`` ends. Launch it with
    ``launch(gloo_rank, nproc, fn, *args)`` (``fn`` module-level, as for ``launch``)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        fn(dist.get_rank(), dist.get_world_size(), *args)
    finally:
        dist.destroy_process_group()


def _entry(local_rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple, exit_after: bool) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    fn(*args)
    if exit_after:
        exit_process()


def launch(fn: Callable[..., None], nproc: int, *args: object, exit_after: bool = False) -> None:
    """Run ``fn(*args)`` on every rank: in this process under a launcher, else in ``nproc`` spawned processes.

    ``fn`` must be a module-level function (it is pickled); it reads its rank from the environment and calls
    ``torch.distributed.init_process_group()``. ``exit_after`` ends each spawned rank with ``exit_process``
    once ``fn`` returned (under a launcher, this process too). A rank that raises fails the whole launch.
    """
    if under_launcher():
        fn(*args)
        if exit_after:
            exit_process()
        return
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(fn, nproc, free_port(), args, exit_after), nprocs=nproc, join=True)
