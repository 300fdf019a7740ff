"""The symm heap from CUDA IPC (several ranks on one GPU), on CPU: the provider choice, torch's storage-sharing shape,
the MPS rule, native peer atomics, and the collective set-up on 2-3 ranks with POSIX shared memory standing in for
the GPU's memory.

The real ``cudaIpcOpenMemHandle`` needs a GPU (``tests/gpu/test_symm_shared_gpu.py``, in ``.ci/gpu``'s plan). Here
only torch's own CUDA calls (``torch.empty`` on a CUDA device, ``UntypedStorage._share_cuda_`` /
``_new_shared_cuda``, ``torch.cuda``'s device queries) and the CUDA runtime's attribute queries are replaced: every
rank's block is a real shared-memory segment that its peers map by the handle it exported, and every function of
``odc_runtime`` on the way (``_torch_ipc.export`` / ``open_export``, the agreement rounds, the facts, the topology)
is the code that runs on the GPU, executed.
"""

from __future__ import annotations

import ctypes
import json

import pytest
import torch
from _cuda_fake import fake_cuda
from _dist import run_ranks

from odc_runtime import config
from odc_runtime.errors import OdcBackendError, OdcMismatchError, OdcUsageError
from odc_runtime.transport import cudart, gpu_sharing
from odc_runtime.transport.symm import _torch_ipc
from odc_runtime.transport.symm.torch_heap import Facts, choose_provider

pytestmark = pytest.mark.timeout(60)


def _facts(gpus: list[str], *, mode: str = "auto", symm: str | None = None, ipc: str | None = None,
           mps: int = 1) -> list[Facts]:
    return [Facts("h", g, i, 64, mode, symm, ipc, mps) for i, g in enumerate(gpus)]


# -- which provider -----------------------------------------------------------------------------------------------
def test_auto_takes_symmetric_memory_with_a_gpu_per_rank_and_ipc_where_ranks_share_one() -> None:
    assert choose_provider(_facts(["g0", "g1", "g2"])) == "symmetric-memory"
    assert choose_provider(_facts(["g0", "g0"])) == "ipc"
    assert choose_provider(_facts(["g0", "g1", "g0", "g1"])) == "ipc"  # two per GPU
    assert choose_provider(_facts(["g0", "g1"], symm="torch 9.9 has no SymmetricMemory")) == "ipc"


def test_a_forced_provider_is_taken_or_refused_saying_why() -> None:
    assert choose_provider(_facts(["g0", "g1"], mode="ipc")) == "ipc"
    with pytest.raises(OdcBackendError, match=r"ODC_SYMM_HEAP=symmetric-memory, but ranks \[\[0, 1\]\] share a "
                       r"GPU.*ODC_SYMM_HEAP=ipc"):
        choose_provider(_facts(["g0", "g0"], mode="symmetric-memory"))
    with pytest.raises(OdcBackendError, match="ODC_SYMM_HEAP=ipc, but CUDA IPC cannot be used: rank 0: no way"):
        choose_provider(_facts(["g0", "g1"], mode="ipc", ipc="no way"))


def test_neither_provider_is_a_clear_refusal() -> None:
    with pytest.raises(OdcBackendError, match=r"neither provider.*share a GPU.*CUDA IPC: rank 0: old torch.*nvshmem"):
        choose_provider(_facts(["g0", "g0"], ipc="old torch"))


def test_ranks_that_set_odc_symm_heap_differently_are_a_mismatch() -> None:
    facts = _facts(["g0", "g1"])
    facts[1] = facts[1]._replace(mode="ipc")
    with pytest.raises(OdcMismatchError, match=r"ODC_SYMM_HEAP differently: \['auto', 'ipc'\]"):
        choose_provider(facts)


def test_odc_symm_heap_is_parsed_in_config() -> None:
    assert config.symm_heap({}) == "auto"
    assert config.symm_heap({"ODC_SYMM_HEAP": "IPC"}) == "ipc"
    with pytest.raises(OdcUsageError, match="ODC_SYMM_HEAP"):
        config.symm_heap({"ODC_SYMM_HEAP": "cuda"})


# -- the MPS rule, shared with nvshmem ----------------------------------------------------------------------------
def test_ranks_sharing_a_gpu_without_mps_are_refused_naming_the_transport(caplog) -> None:
    shared = {("h", "g0"): [0, 1], ("h", "g1"): [2]}
    gpu_sharing.check_gpu_sharing("symm", shared, {0: 1, 1: 1, 2: 0})
    with pytest.raises(OdcUsageError, match=r"symm transport: ranks \[0, 1\] share GPU g0 on h without CUDA MPS"):
        gpu_sharing.check_gpu_sharing("symm", shared, {0: 0, 1: 1, 2: 1})
    with caplog.at_level("WARNING", logger="odc_runtime"):
        gpu_sharing.check_gpu_sharing("symm", shared, {0: -1, 1: -1, 2: 0})
    assert "odc symm" in caplog.text and "cannot tell whether MPS is on" in caplog.text


class _FakeCudart:
    def __init__(self, value: int, err: int = 0) -> None:
        self.value, self.err, self.cleared = value, err, 0

    def cudaDeviceGetAttribute(self, ref, attribute: int, device: int) -> int:
        assert attribute == 133 and device == 3
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = self.value
        return self.err

    def cudaDeviceGetP2PAttribute(self, ref, attribute: int, device: int, peer: int) -> int:
        assert attribute == 3 and (device, peer) == (0, 1)
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = self.value
        return self.err

    def cudaGetLastError(self) -> int:
        self.cleared += 1
        return 0


def test_mps_state_reads_the_runtime_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, want in ((1, 1), (0, 0)):
        monkeypatch.setattr(cudart, "loaded", lambda v=value: _FakeCudart(v))
        assert gpu_sharing.mps_state(3) == want
    old = _FakeCudart(1, err=1)  # a runtime without the attribute: unknown, and its error cleared
    monkeypatch.setattr(cudart, "loaded", lambda: old)
    assert gpu_sharing.mps_state(3) == -1 and old.cleared == 1
    monkeypatch.setattr(cudart, "loaded", lambda: None)
    assert gpu_sharing.mps_state(3) == -1


def test_native_peer_atomics_read_the_runtime_peer_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, want in ((1, 1), (0, 0)):
        monkeypatch.setattr(cudart, "loaded", lambda v=value: _FakeCudart(v))
        assert cudart.peer_native_atomics(0, 1) == want
    failing = _FakeCudart(1, err=101)
    monkeypatch.setattr(cudart, "loaded", lambda: failing)
    assert cudart.peer_native_atomics(0, 1) == -1 and failing.cleared == 1
    monkeypatch.setattr(cudart, "loaded", lambda: None)
    assert cudart.peer_native_atomics(0, 1) == -1


# -- torch's storage sharing --------------------------------------------------------------------------------------
def test_the_installed_torch_has_the_storage_sharing_ipc_uses() -> None:
    assert _torch_ipc.api_reason() is None


def test_a_torch_without_storage_sharing_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", None)
    assert "_new_shared_cuda" in _torch_ipc.api_reason()


def test_an_export_record_travels_as_json_and_opens_on_the_consumers_device(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = (5, b"\x00\xffhandle", 4096, 512, b"/torch_refs_1", 7, b"\x01event", True)
    monkeypatch.setattr(torch.UntypedStorage, "_share_cuda_", lambda self: shared)
    opened: list[tuple] = []

    def new_shared(*fields: object) -> torch.UntypedStorage:
        opened.append(fields)
        return torch.UntypedStorage(4096)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(new_shared))
    record = json.loads(json.dumps(_torch_ipc.export(torch.zeros(4096, dtype=torch.uint8))))
    view = _torch_ipc.open_export(record, torch.device("cpu", 2), 4096)
    assert view.dtype == torch.uint8 and view.numel() == 4096
    assert opened == [(2, *shared[1:])]  # the owner's device index replaced by this rank's
    with pytest.raises(OdcBackendError, match="maps 4096 bytes, expected 8192"):
        _torch_ipc.open_export(record, torch.device("cpu", 2), 8192)
    with pytest.raises(OdcBackendError, match="malformed"):
        _torch_ipc.open_export(record[:3], torch.device("cpu", 2), 4096)
    monkeypatch.setattr(torch.UntypedStorage, "_share_cuda_", lambda self: shared[:6])
    with pytest.raises(OdcBackendError, match="6 fields, expected the 8"):
        _torch_ipc.export(torch.zeros(4096, dtype=torch.uint8))
    with pytest.raises(OdcBackendError, match="whole storage"):
        _torch_ipc.export(torch.zeros(4096, dtype=torch.uint8)[1:])


# -- the collective set-up on 2-3 ranks: only torch's CUDA calls and the CUDA runtime's queries are faked -----------
NBYTES = 4096


def _open(rank: int, world: int, gpus: list[str], mps: int, fail_open_rank: int, atomics: int = 1) -> dict:
    import torch.distributed as dist

    import odc_runtime.transport.symm.torch_heap as hc

    calls: list[tuple] = []
    fake_cuda(rank, gpus, calls, mps=mps, atomics=atomics, fail_open=rank == fail_open_rank)
    try:
        heap = hc.open_heap(rank, world, NBYTES, torch.device("cuda", torch.cuda.current_device()), timeout=20)
    except Exception as e:
        return {"error": type(e).__name__, "msg": str(e), "calls": calls}
    zeroed = heap.local.tolist() == [0] * NBYTES
    heap.local[rank * 8 : rank * 8 + 8] = rank + 1  # each rank writes its own bytes in its own block
    dist.barrier()
    seen = [heap.peer_view(p)[: 8 * world].tolist() for p in range(world)]
    out = {"provider": heap.provider, "zeroed": zeroed, "calls": calls, "seen": seen,
           "bases_are_views": heap.peer_bases.tolist() == [heap.peer_view(p).data_ptr() for p in range(world)]}
    dist.barrier()  # every rank read its peers before any unmaps
    heap.close()
    return out


@pytest.mark.slow
def test_three_ranks_on_one_gpu_map_each_others_blocks() -> None:
    world = 3
    results = run_ranks(_open, world, ["g0"] * world, 1, -1, timeout=60)
    for rank, r in enumerate(results):
        assert "error" not in r, r
        assert r["provider"] == "ipc" and r["zeroed"] and r["bases_are_views"], r
        for p in range(world):  # rank p's block holds p + 1 in its own 8 bytes, zeros elsewhere
            assert r["seen"][p] == [p + 1 if i // 8 == p else 0 for i in range(8 * world)], (rank, p)
        assert [c[0] for c in r["calls"]] == ["allocate", "export", "export", "open", "open"]
        opened = [c for c in r["calls"] if c[0] == "open"]
        assert len({name for _, name, _ in opened}) == 2  # one mapping of each peer, by the handle it exported
        assert {device for *_, device in opened} == {0}  # opened on this rank's own GPU


@pytest.mark.slow
def test_a_rank_that_cannot_map_fails_every_rank_together() -> None:
    results = run_ranks(_open, 2, ["g0", "g0"], 1, 1, timeout=60)
    assert results[1]["error"] == "OdcBackendError" and "cannot map a peer's heap" in results[1]["msg"]
    assert "invalid resource handle" in results[1]["msg"]
    assert results[0]["error"] == "OdcMismatchError" and "rank 1" in results[0]["msg"]


@pytest.mark.slow
def test_ranks_sharing_a_gpu_without_mps_fail_before_any_allocation() -> None:
    results = run_ranks(_open, 2, ["g0", "g0"], 0, -1, timeout=60)
    for r in results:
        assert r["error"] == "OdcUsageError" and "without CUDA MPS" in r["msg"] and r["calls"] == [], r


@pytest.mark.slow
def test_gpus_without_native_peer_atomics_are_refused_before_any_allocation() -> None:
    """Two GPUs reachable by P2P over a link without native atomics (PCIe): push's system-scope adds on the
    peer's memory would be undefined, so every rank refuses at init, naming the pair and the way out."""
    results = run_ranks(_open, 2, ["g0", "g1"], 0, -1, 0, timeout=60)
    for r in results:
        assert r["error"] in ("OdcBackendError", "OdcMismatchError") and r["calls"] == [], r
        assert "native peer atomics" in r["msg"] and "NVLink" in r["msg"] and "MPS" in r["msg"], r
    assert "rank 0's GPU g0 reaches rank 1's GPU g1" in results[0]["msg"]
