"""Run a test function on several ranks: spawned processes, gloo over a FileStore (or a TCPStore hosted by rank 0,
as under ``torch.multiprocessing`` + ``env://``), one torch thread each.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in every rank after
``init_process_group`` and returns the list of per-rank return values. A rank that raises fails the test with its
traceback; ranks that do not finish within ``timeout`` seconds are killed and fail the test (a hang never stalls
the suite).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from odc_runtime.launch import free_port

_CTX = mp.get_context("spawn")


def _entry(
    fn: Callable, rank: int, world: int, store: str, env: dict, args: tuple, results: Any, timeout: float
) -> None:
    # A failing rank leaves its peers waiting in a collective: let them give up well before the harness does.
    os.environ["ODC_TIMEOUT"] = str(max(5, int(timeout / 3)))
    os.environ.update(env)
    # If this rank hangs, print where before the parent gives up on it.
    faulthandler.dump_traceback_later(max(1.0, timeout - 5), exit=False)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        init_method = store if store.startswith("tcp://") else f"file://{store}"
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        import odc_runtime
        import odc_runtime.testing

        try:
            value = fn(rank, world, *args)
        except BaseException:
            odc_runtime.testing.abandon()  # not the collective finalize, which the other ranks may never match
            raise
        odc_runtime.finalize()
        dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 90.0, env: dict[str, str] | None = None,
    expect_exit: set[int] | frozenset[int] = frozenset(), store: str = "file",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return per-rank results.

    Ranks in ``expect_exit`` may die without reporting (their result is ``None``). ``store="tcp"`` rendezvous
    through a TCPStore that rank 0 hosts (so the store dies with rank 0), else through a FileStore.
    """
    with tempfile.TemporaryDirectory() as tmp:
        results = _CTX.Queue()
        address = f"tcp://127.0.0.1:{free_port()}" if store == "tcp" else os.path.join(tmp, "store")
        procs = [
            _CTX.Process(
                target=_entry,
                args=(fn, r, world_size, address, dict(env or {}), args, results, timeout),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        reported: set[int] = set()
        expected = world_size - len(expect_exit)
        deadline = time.monotonic() + timeout
        try:
            while len(out) + len(errors) < expected:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    # A rank that died without reporting (segfault, bus error) fails the test now, not at timeout.
                    dead = [
                        r for r, p in enumerate(procs)
                        if r not in reported and r not in expect_exit and p.exitcode is not None
                    ]
                    if dead and results.empty():
                        errors += [f"rank {r} died with exit code {procs[r].exitcode} without reporting" for r in dead]
                        break
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - reported - set(expect_exit))
                        errors.append(f"ranks {missing} did not finish within {timeout} s")
                        break
                    continue
                reported.add(rank)
                if status == "ok":
                    out[rank] = value
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise AssertionError("\n".join(errors))
        return [out.get(r) for r in range(world_size)]
