"""The host path under hostile but fair use (issue 18): no crash, no silent corruption, every wait bounded.

Each test here failed on the code before the fix: a SIGBUS on a full tmpfs, silent cross-tensor corruption after
out-of-order frees, gloo waits that ODC_TIMEOUT did not bound, a second timeout after a dead peer, a forked child
zeroing its parent's accumulator, untyped errors for bad scales and tensors, an empty ODC_SHM_DIR, and stale
segments kept alive by a reused pid. Multi-process tests run through ``_dist.run_ranks`` (bounded, cannot hang).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import testing


def _transport():
    return testing.transport()


# -- 1. a shared-memory filesystem smaller than the heap -------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs, like a too-small Docker /dev/shm (needs root and mount permission)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _rank_small_shm(rank: int, world: int) -> list[float]:
    odc.init("host")  # default 1 GiB heap per rank on a 4 MiB filesystem: fine until it is used
    with pytest.raises(odc.OdcMemoryError, match=r"(cannot reserve|rejected the call).*(shm-size|ODC_SHM_DIR)"):
        odc.shard(torch.zeros(world, 1 << 20))  # 4 MiB parameters + 4 MiB accumulator per rank
    assert _transport().heap_used() == 0, "a failed shard kept heap memory"
    st = odc.shard(torch.zeros(1000), name="fits")  # the runtime is still usable
    odc.push(st, torch.ones(1000))
    odc.sync()
    return st.grad.tolist()


def test_full_shm_filesystem_is_a_memory_error_not_sigbus(small_tmpfs) -> None:
    results = run_ranks(_rank_small_shm, 2, env={"ODC_SHM_DIR": small_tmpfs}, timeout=60)
    assert results == [[2.0] * 500, [2.0] * 500]
    assert os.listdir(small_tmpfs) == []


# -- 2. names: unique, compared in full, with the shard's sequence number ----------------------------------------
def _rank_names(rank: int, world: int) -> list[float]:
    odc.init("host", heap_size="1M")
    a = odc.shard(torch.zeros(100), name="w")
    with pytest.raises(odc.OdcUsageError, match="already used"):  # on every rank: the same names are live
        odc.shard(torch.zeros(100), name="w")
    a.free()
    odc.shard(torch.zeros(100), name="w").free()  # a freed name may be used again

    # Two names equal in their first 70 bytes, freed in different orders: every rank is told.
    prefix = "model.layers.0.self_attn.q_proj.weight/" * 2
    x = odc.shard(torch.zeros(64), name=prefix + "x")
    y = odc.shard(torch.zeros(64), name=prefix + "y")
    first = x if rank == 0 else y
    with pytest.raises(odc.OdcMismatchError, match="collective mismatch"):
        first.free()
    x.free()  # the right order still works and leaves the allocators equal on every rank
    y.free()
    z = odc.shard(torch.zeros(64), name="z")
    odc.push(z, torch.ones(64))
    odc.sync()
    return z.grad.tolist()


def test_duplicate_names_and_out_of_order_free_are_errors_on_every_rank() -> None:
    results = run_ranks(_rank_names, 2, timeout=60)
    assert results == [[2.0] * 32, [2.0] * 32]


# -- 3. collective waits bounded by ODC_TIMEOUT, local errors reach the agreement step -------------------------------
def _rank_shard_vs_sync(rank: int, world: int) -> None:
    odc.init("host", heap_size="1M")
    odc.shard(torch.zeros(10), name="a")
    # Rank 0 shards while rank 1 syncs: before, rank 0 sat in gloo for 30 minutes. Now both see the other's
    # collective at once.
    with pytest.raises(odc.OdcMismatchError, match=r"rank \d is in .* but rank \d is in"):
        if rank == 0:
            odc.shard(torch.zeros(10), name="b")
        else:
            odc.sync()


def test_ranks_in_different_collectives_fail_instead_of_waiting() -> None:
    run_ranks(_rank_shard_vs_sync, 2, env={"ODC_TIMEOUT": "600"}, timeout=60)


def _rank_bad_dir(rank: int, world: int, not_a_dir: str) -> None:
    if rank == 1:
        os.environ["ODC_SHM_DIR"] = not_a_dir
        with pytest.raises(odc.OdcUsageError, match="not a directory"):
            odc.init("host")
    else:
        with pytest.raises(odc.OdcMismatchError, match=r"rank 1 rejected the call \(OdcUsageError"):
            odc.init("host")
    assert not odc.is_initialized()
    os.environ["ODC_SHM_DIR"] = os.path.dirname(not_a_dir)
    # An OS error inside init (a heap no machine can map) is typed and reaches every rank.
    with pytest.raises(odc.OdcError):
        odc.init("host", heap_size="100T")
    assert not odc.is_initialized()
    odc.init("host", heap_size="1M")  # nothing half-initialised was left behind


def test_local_error_inside_init_fails_every_rank_and_leaks_nothing(tmp_path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    run_ranks(_rank_bad_dir, 2, str(not_a_dir), env={"ODC_SHM_DIR": str(tmp_path)}, timeout=60)
    assert os.listdir(tmp_path) == ["file"], "a segment was left behind"


def _rank_absent_at_init(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(1)  # alive, never calls init
        return
    with pytest.raises(odc.OdcTimeoutError, match=r"odc init: rank 0 timed out after 2 s waiting for rank\(s\) \[1\]"
                       r".*may be waiting in a torch.distributed collective"):
        odc.init("host")


def test_init_waits_at_most_odc_timeout() -> None:
    run_ranks(_rank_absent_at_init, 2, env={"ODC_TIMEOUT": "2"}, timeout=60)


# -- 4. kill -9 during init / shard --------------------------------------------------------------------------
def _rank_killed_in_shard(rank: int, world: int) -> None:
    odc.init("host", heap_size="1M")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(odc.OdcTimeoutError, match=r"odc shard\(w#0\): rank \d lost rank\(s\) \[1\].*DEAD") as e:
        odc.shard(torch.zeros(100), name="w")
    assert type(e.value).__name__ == "OdcPeerLostError"
    odc.finalize()  # does not wait for the dead rank again (ODC_TIMEOUT is longer than the harness allows)


def test_peer_killed_during_shard_is_named_once(tmp_path) -> None:
    run_ranks(
        _rank_killed_in_shard, 3, env={"ODC_TIMEOUT": "600", "ODC_SHM_DIR": str(tmp_path)}, expect_exit={1},
        timeout=90,
    )
    assert os.listdir(tmp_path) == []


def _rank_killed_in_init(rank: int, world: int) -> None:
    from odc_runtime.transport import host

    if rank == 1:
        def die(self):
            os.kill(os.getpid(), signal.SIGKILL)

        host.HostTransport.create_segment = die
    with pytest.raises(odc.OdcTimeoutError, match=r"odc init \(host segments\): rank 0 waited for rank 1 \(pid") as e:
        odc.init("host")
    assert type(e.value).__name__ == "OdcPeerLostError"
    assert not odc.is_initialized()


def test_peer_killed_during_init_is_named(tmp_path) -> None:
    run_ranks(
        _rank_killed_in_init, 2, env={"ODC_TIMEOUT": "600", "ODC_SHM_DIR": str(tmp_path)}, expect_exit={1},
        timeout=90,
    )
    assert os.listdir(tmp_path) == [], "rank 0 must remove the segment it created"


def _rank_store_host_killed(rank: int, world: int) -> None:
    from odc_runtime.transport import host

    if rank == 0:  # rank 0 hosts the TCPStore: its death takes the store down with it
        def die(self):
            os.kill(os.getpid(), signal.SIGKILL)

        host.HostTransport.create_segment = die
    # The store lives in rank 0's process: rank 1 may still be reading rank 0's posted settings when rank 0 dies
    # (then the settings round is the one that fails), or already be in the segments round.
    expected = r"odc init \(host (settings|segments)\): rank 1 (waited for rank 0|lost the)"
    with pytest.raises(odc.OdcTimeoutError, match=expected) as e:
        odc.init("host")
    assert type(e.value).__name__ == "OdcPeerLostError"


def test_store_host_killed_during_init_is_a_typed_error(tmp_path) -> None:
    run_ranks(
        _rank_store_host_killed, 2, env={"ODC_TIMEOUT": "600", "ODC_SHM_DIR": str(tmp_path)}, expect_exit={0},
        timeout=90, store="tcp",
    )
    assert os.listdir(tmp_path) == []


def _rank_cycles(rank: int, world: int) -> list[float]:
    for i in range(3):
        odc.init("host", heap_size="1M")
        st = odc.shard(torch.zeros(6), name="w")
        odc.push(st, torch.full((6,), float(i)))
        odc.sync()
        grad = st.grad.tolist()
        odc.finalize()
    return grad


def test_init_over_a_tcp_store_and_repeated_cycles() -> None:
    assert run_ranks(_rank_cycles, 3, store="tcp", timeout=90) == [[6.0, 6.0]] * 3


# -- 5. forked children ---------------------------------------------------------------------------------------
def _rank_fork_mutations(rank: int, world: int) -> list[float]:
    odc.init("host", heap_size="1M")
    st = odc.shard(torch.zeros(4))
    odc.push(st, torch.ones(4))
    odc.sync()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say
        code = 0
        for call in (st.zero_grad, lambda: odc.shard(torch.zeros(4)), odc.sync, odc.finalize,
                     lambda: odc.push(st, torch.ones(4)), st.free):
            try:
                call()
                code = 1
            except odc.OdcUsageError as e:
                code = code or (0 if "forked child" in str(e) or "fork of rank" in str(e) else 2)
            except BaseException:
                code = 3
        assert odc.rank() == rank  # read-only queries are fine
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return st.grad.tolist()


def test_forked_child_refuses_every_mutating_call() -> None:
    results = run_ranks(_rank_fork_mutations, 2, timeout=60)
    assert results == [[2.0, 2.0], [2.0, 2.0]], "the child changed its parent's accumulator"


def test_a_process_forked_before_init_may_become_a_rank() -> None:
    testing.in_forked_child()  # imports the core API in the parent before the fork, as a fork-based launcher would

    pid = os.fork()
    if pid == 0:
        os._exit(int(testing.in_forked_child()))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "a child forked without a runtime was marked as a fork of a rank"


# -- 6. scale and gradient validation -----------------------------------------------------------------------
def _rank_bad_values(rank: int, world: int) -> list[float]:
    odc.init("host", heap_size="1M")
    st = odc.shard(torch.zeros(2, 3))
    dense = torch.ones(2, 3)
    bad = [
        (lambda: odc.push(st, dense, scale=1e39), "overflows float32"),
        (lambda: odc.push(st, dense, scale=1e39, async_op=True), "overflows float32"),
        (lambda: odc.push(st, dense, scale=-1e39), "overflows float32"),
        (lambda: odc.push(st, dense, scale=1e-60), "rounds to 0"),
        (lambda: odc.push(st, dense, scale=1j), "finite real"),
        (lambda: odc.push(st, dense.to_sparse()), "layout"),
        (lambda: odc.push(st, dense.to_sparse_csr()), "layout"),
        (lambda: odc.push(st, torch.nested.nested_tensor([dense[0], dense[1]])), "layout"),
        (lambda: odc.fetch(st, out=torch.nested.nested_tensor([dense[0], dense[1]])), "layout"),
        (lambda: odc.fetch(st, torch.empty(2, 3).to_sparse()), "layout"),
        (lambda: odc.push(dense, dense), "expected a ShardedTensor"),
        (lambda: odc.fetch(dense), "expected a ShardedTensor"),
        (lambda: odc.push(None, dense), "expected a ShardedTensor"),
        (lambda: odc.shard(dense.to_sparse()), "layout"),
    ]
    for call, match in bad:
        with pytest.raises(odc.OdcUsageError, match=match):
            call()
    odc.sync()
    assert not st.grad.any()
    odc.sync()
    odc.push(st, dense, scale=1.0e38)  # large but representable
    odc.sync()
    return st.grad.tolist()


def test_bad_scale_and_gradients_are_usage_errors_with_no_effect() -> None:
    results = run_ranks(_rank_bad_values, 2, timeout=60)
    expected = float(torch.tensor(1.0e38, dtype=torch.float32) * 2)
    assert results == [[expected] * 3] * 2


# -- 7. settings and stale segments -------------------------------------------------------------------------
def _rank_empty_shm_dir(rank: int, world: int) -> None:
    with pytest.raises(odc.OdcUsageError, match="ODC_SHM_DIR is set but empty"):
        odc.init("host")
    assert not odc.is_initialized()


def test_empty_shm_dir_is_an_error(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_ranks(_rank_empty_shm_dir, 2, env={"ODC_SHM_DIR": ""}, timeout=60)
    assert not any(p.name.startswith("odc-") for p in tmp_path.iterdir()), "segments went to the current directory"


def test_stale_segment_whose_pid_was_reused_is_removed(tmp_path) -> None:
    from odc_runtime.transport.host import remove_stale_segments

    pid = os.getpid()  # alive: stands for a new process that reused a dead creator's pid
    with open("/proc/self/stat") as f:
        start = int(f.read().rpartition(")")[2].split()[19])  # start time in clock ticks (field 22)
    reused = tmp_path / f"odc-abc-r0-p{pid}-s{start + 1}.heap"
    mine = tmp_path / f"odc-abc-r1-p{pid}-s{start}.heap"
    for path in (reused, mine):
        path.write_bytes(b"\0" * 16)
    # A segment of a process in another pid namespace (another container sharing /dev/shm): never judged here.
    elsewhere = tmp_path / f"odc-abc-r2-p{pid}-s{start + 1}-n1.heap"
    elsewhere.write_bytes(b"\0" * 16)
    assert remove_stale_segments(str(tmp_path)) == [str(reused)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, elsewhere.name])


# -- hierarchical protocol: a sender that dies between barrier 1 and its put; ranks passing different flags -------
def _rank_killed_before_put(rank: int, world: int) -> None:
    odc.init("host", heap_size="4M", node_size=1)  # every rank its own node: every owner is across nodes
    w = odc.shard(torch.zeros(10), name="w")
    odc.push(w, torch.ones(10))
    if rank == 1:
        transport = testing.transport()

        def die(*args: object, **kwargs: object) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        transport.put_signal = die  # passes barrier 1, then dies instead of sending its staged rows
    with pytest.raises(odc.OdcPeerLostError, match=r"staged pushes from node 1.*rank\(s\) \[1\].*DEAD"):
        odc.sync()
    odc.finalize()


def test_sender_killed_during_sync_flush_is_named() -> None:
    run_ranks(_rank_killed_before_put, 2, env={"ODC_TIMEOUT": "600"}, expect_exit={1}, timeout=60)


def _rank_different_sync_flags(rank: int, world: int) -> None:
    odc.init("host", heap_size="4M", node_size=1)
    odc.shard(torch.zeros(10), name="w")
    with pytest.raises(odc.OdcMismatchError, match="gradients=False"):
        odc.sync(gradients=rank == 0)


def test_different_sync_flags_on_ranks_are_a_mismatch_on_every_rank() -> None:
    run_ranks(_rank_different_sync_flags, 2, env={"ODC_TIMEOUT": "600"}, timeout=60)


def test_an_interrupt_as_a_lock_is_taken_does_not_leak_it(tmp_path, monkeypatch) -> None:
    """A KeyboardInterrupt raised as the lock call returns (a SIGINT handled right after it) must not leave the
    byte-range lock held: a peer waiting for it would time out instead of seeing this rank's failure."""
    import fcntl
    import sys
    import types

    from odc_runtime.transport.host import locks as locks_mod

    path = tmp_path / "segment"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDWR)
    real, armed = fcntl.lockf, [False]

    def lockf(fd_: int, cmd: int, *args: int) -> None:
        real(fd_, cmd, *args)
        if armed[0] and cmd != fcntl.LOCK_UN:
            armed[0] = False
            raise KeyboardInterrupt

    monkeypatch.setattr(locks_mod.fcntl, "lockf", lockf)
    locks = locks_mod.ByteRangeLocks(types.SimpleNamespace(get=lambda peer: types.SimpleNamespace(fd=fd)), 0, 1, 5.0)
    probe = f"import fcntl, os; fcntl.lockf(os.open({str(path)!r}, os.O_RDWR), fcntl.LOCK_EX | fcntl.LOCK_NB, 8, 64)"
    try:
        for take in (lambda: locks.lock(0, fd, 64, 8, exclusive=True, op="push"),
                     lambda: locks.held(0, 64, 8, exclusive=True, op="put_signal").__enter__()):
            armed[0] = True
            with pytest.raises(KeyboardInterrupt):
                take()
            # another process can take the bytes at once: the interrupted call released them
            assert subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0
    finally:
        os.close(fd)
