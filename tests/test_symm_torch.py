"""The SymmetricMemory wrapper (``odc_runtime.transport.symm._torch_symm``) and the CUDA heap's collective set-up,
on CPU: fake ``torch.distributed._symmetric_memory`` modules of each API shape stand in for torch's.

The real allocation and rendezvous need GPUs of one node (``.ci/gpu``); here the detection, the backend choice,
the handle arithmetic and the agreement between ranks (every rank fails together, before torch's rendezvous) are
checked.
"""

from __future__ import annotations

import types
import warnings
from typing import Any

import pytest
import torch
from _cuda_fake import fake_cuda
from _dist import run_ranks

from odc_runtime.errors import OdcBackendError, OdcMemoryError, OdcUsageError
from odc_runtime.transport.symm import _torch_symm, torch_heap

pytestmark = pytest.mark.timeout(60)


class FakeHandle:
    """A rendezvous handle: ``buffer_ptrs`` are allocation bases, ``get_buffer`` counts from them."""

    def __init__(self, ptrs: list[int], *, offset: int | None = None, size: int | None = None,
                 barrier_timeout: bool = True) -> None:
        self.buffer_ptrs = ptrs
        if offset is not None:
            self.offset = offset
        if size is not None:
            self.buffer_size = size
        self.calls: list[tuple] = []
        self._barrier_timeout = barrier_timeout

    def get_buffer(self, rank: int, sizes: tuple, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        self.calls.append(("get_buffer", rank, tuple(sizes), dtype, storage_offset))
        return torch.full(sizes, rank, dtype=dtype)

    def barrier(self, channel: int = 0, **kw: Any) -> None:
        if kw and not self._barrier_timeout:
            raise TypeError("barrier(): incompatible function arguments")
        self.calls.append(("barrier", channel, kw.get("timeout_ms")))


def fake_module(shape: str, calls: list[tuple], *, backend: str | None = "CUDA", set_fails: bool = False,
                empty_error: BaseException | None = None) -> types.ModuleType:
    """A stand-in for torch.distributed._symmetric_memory.

    ``current``: torch 2.13 / main (``rendezvous(tensor, group)``, deprecated no-op ``enable_symm_mem_for_group``,
    ``set_backend``/``get_backend``); ``older``: ``enable_symm_mem_for_group`` required, no backend selection;
    ``prototype``: ``rendezvous(tensor)`` without a group; ``bare``: no ``empty``.
    """
    mod = types.ModuleType("fake_symmetric_memory")
    state = {"backend": backend}

    def empty(*size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        calls.append(("empty", size, dtype))
        if empty_error is not None:
            raise empty_error
        return torch.full(size, 7, dtype=dtype)  # contents undefined, as torch's

    def rendezvous(tensor: torch.Tensor, group: str) -> FakeHandle:
        calls.append(("rendezvous", group))
        return FakeHandle([tensor.data_ptr(), 0x1000], offset=0, size=tensor.numel())

    def rendezvous_prototype(tensor: torch.Tensor) -> FakeHandle:
        raise AssertionError("never called")

    def enable(group_name: str) -> None:
        calls.append(("enable", group_name))

    def set_backend(name: str) -> None:
        calls.append(("set_backend", name))
        if set_fails:
            raise RuntimeError("SymmetricMemory backend cannot be changed after allocation")
        state["backend"] = name

    def get_backend(device: torch.device) -> str | None:
        return state["backend"]

    if shape != "bare":
        mod.empty = empty
    mod.rendezvous = rendezvous_prototype if shape == "prototype" else rendezvous
    if shape == "current":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from typing_extensions import deprecated

            mod.enable_symm_mem_for_group = deprecated("no need to call this anymore", category=FutureWarning)(enable)
        mod.set_backend = set_backend
        mod.get_backend = get_backend
    elif shape == "older":
        mod.enable_symm_mem_for_group = enable
    return mod


# -- detection ----------------------------------------------------------------------------------------------------
def test_detect_current_shape_skips_the_deprecated_group_registration() -> None:
    calls: list[tuple] = []
    api = _torch_symm.detect(fake_module("current", calls))
    assert api.enable_group is None and api.set_backend is not None and api.get_backend is not None
    _torch_symm.rendezvous(api, torch.zeros(8, dtype=torch.uint8), "0")
    assert calls == [("rendezvous", "0")]


def test_detect_older_shape_registers_the_group_before_rendezvous() -> None:
    calls: list[tuple] = []
    api = _torch_symm.detect(fake_module("older", calls))
    assert api.enable_group is not None and api.set_backend is None and api.get_backend is None
    _torch_symm.rendezvous(api, torch.zeros(8, dtype=torch.uint8), "g1")
    assert calls == [("enable", "g1"), ("rendezvous", "g1")]


@pytest.mark.parametrize(("shape", "words"), [("bare", "has no empty"), ("prototype", "takes no group")])
def test_detect_refuses_a_torch_without_the_needed_api(shape: str, words: str) -> None:
    with pytest.raises(OdcBackendError, match=words) as err:
        _torch_symm.detect(fake_module(shape, []))
    assert torch.__version__ in str(err.value)


def test_the_installed_torch_matches_a_known_shape() -> None:
    """Whatever torch runs this (CI: 2.13; .ci/compat.sh: its older and newer ones), its module detects, and where
    the sources were read, as the wrapper's docstring says."""
    pytest.importorskip(_torch_symm.MODULE)
    api = _torch_symm.api()
    assert api.set_backend is not None and api.get_backend is not None  # 2.9-2.15
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version == (2, 9):
        assert api.enable_group is not None  # a plain function, idempotent
    elif version in ((2, 13), (2, 15)):
        assert api.enable_group is None  # a deprecated no-op


def test_unavailable_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _torch_symm.unavailable_reason() == "no CUDA device is available"
    assert not torch_heap.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken() -> _torch_symm.SymmApi:
        raise OdcBackendError("symm transport: torch X has no usable module")

    monkeypatch.setattr(_torch_symm, "api", broken)
    assert "no usable module" in (_torch_symm.unavailable_reason() or "")


# -- backend selection --------------------------------------------------------------------------------------------
DEV = torch.device("cuda", 0)


@pytest.mark.parametrize("start", ["NVSHMEM", None])
def test_cuda_backend_is_selected_when_another_is_current(start: str | None) -> None:
    calls: list[tuple] = []
    api = _torch_symm.detect(fake_module("current", calls, backend=start))
    _torch_symm.use_cuda_backend(api, DEV)
    assert calls == [("set_backend", "CUDA")]
    assert api.get_backend is not None and api.get_backend(DEV) == "CUDA"


def test_cuda_backend_already_current_or_only_one() -> None:
    calls: list[tuple] = []
    _torch_symm.use_cuda_backend(_torch_symm.detect(fake_module("current", calls)), DEV)
    _torch_symm.use_cuda_backend(_torch_symm.detect(fake_module("older", calls)), DEV)
    assert calls == []


def test_a_fixed_other_backend_is_a_clear_error() -> None:
    api = _torch_symm.detect(fake_module("current", [], backend="NVSHMEM", set_fails=True))
    with pytest.raises(OdcBackendError, match=r"'NVSHMEM' backend to 'CUDA'.*TORCH_SYMMMEM"):
        _torch_symm.use_cuda_backend(api, DEV)


def test_allocation_out_of_memory_is_a_memory_error() -> None:
    api = _torch_symm.detect(fake_module("current", [], empty_error=torch.OutOfMemoryError("CUDA out of memory")))
    with pytest.raises(OdcMemoryError, match="heap_size"):
        _torch_symm.allocate(api, 1 << 20, DEV)
    api = _torch_symm.detect(fake_module("current", [], empty_error=RuntimeError("driver")))
    with pytest.raises(OdcBackendError, match="driver"):
        _torch_symm.allocate(api, 1 << 20, DEV)


def test_rendezvous_failure_names_what_to_check() -> None:
    def failing(tensor: torch.Tensor, group: str) -> None:
        raise RuntimeError("CUDA driver error: invalid device context")

    api = _torch_symm.SymmApi(empty=torch.empty, rendezvous=failing, enable_group=None, set_backend=None,
                              get_backend=None)
    with pytest.raises(OdcBackendError, match="P2P"):
        _torch_symm.rendezvous(api, torch.zeros(1), "0")


# -- the handle ---------------------------------------------------------------------------------------------------
def test_peer_addresses_add_the_tensor_offset_to_each_allocation_base() -> None:
    h = FakeHandle([0x10000, 0x90000], offset=512, size=4096)
    assert _torch_symm.peer_addresses(h, 1024) == [0x10000 + 512, 0x90000 + 512]
    view = _torch_symm.peer_buffer(h, 1, 1024)
    assert view.shape == (1024,) and int(view[0]) == 1
    assert h.calls == [("get_buffer", 1, (1024,), torch.uint8, 512)]
    with pytest.raises(OdcBackendError, match="holds 4096 bytes"):
        _torch_symm.peer_addresses(h, 4096)


def test_a_handle_without_offset_starts_its_allocation() -> None:
    h = FakeHandle([100, 200])
    assert _torch_symm.handle_offset(h) == 0
    assert _torch_symm.peer_addresses(h, 1 << 30) == [100, 200]


def test_barrier_passes_a_timeout_where_torch_takes_one() -> None:
    h = FakeHandle([0])
    _torch_symm.barrier(h, channel=1, timeout_s=2.5)
    _torch_symm.barrier(h)
    old = FakeHandle([0], barrier_timeout=False)
    _torch_symm.barrier(old, channel=2, timeout_s=1.0)
    assert h.calls == [("barrier", 1, 2500), ("barrier", 0, None)]
    assert old.calls == [("barrier", 2, None)]


# -- the heap -----------------------------------------------------------------------------------------------------
def test_heap_views_and_close(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    local = torch.zeros(64, dtype=torch.uint8)
    h = FakeHandle([local.data_ptr(), 0x5000, 0x9000], offset=128, size=4096)
    heap = torch_heap.symmetric_memory_heap(0, 3, local, h)
    assert heap.provider == "symmetric-memory"
    assert heap.nbytes == 64 and heap.peer_bases.dtype == torch.int64
    assert heap.peer_bases.tolist() == [local.data_ptr() + 128, 0x5000 + 128, 0x9000 + 128]
    assert heap.peer_view(0) is local
    assert int(heap.peer_view(2)[0]) == 2 and heap.peer_view(2) is heap.peer_view(2)  # mapped once
    with pytest.raises(OdcUsageError, match="peer 3"):
        heap.peer_view(3)
    heap.close()
    heap.close()
    assert synced == [local.device]
    with pytest.raises(OdcBackendError, match="after close"):
        heap.peer_view(1)


def test_open_heap_checks_its_arguments_before_any_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(OdcUsageError, match="rank 0 of 2 given, but this process is rank 1 of 2"):
        torch_heap.open_heap(0, 2, 64, DEV)
    with pytest.raises(OdcUsageError, match="positive int"):
        torch_heap.open_heap(1, 2, 0, DEV)
    with pytest.raises(OdcUsageError, match="needs a CUDA device"):
        torch_heap.open_heap(1, 2, 64, torch.device("cpu"))


def test_topology_refuses_several_hosts_and_unreachable_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    two_hosts = [("a", "g0", 0, 8), ("b", "g1", 0, 8)]
    with pytest.raises(OdcBackendError, match=r"spans 2 hosts.*nvshmem"):
        torch_heap.check_topology(two_hosts, 0, {"g0": 0})
    one_host = [("a", "g0", 0, 8), ("a", "g1", 1, 8), ("a", "g2", 2, 8)]
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda d, p: (d, p) != (0, 2))
    torch_heap.check_topology(one_host, 0, {"g0": 0, "g1": 1})  # g2 hidden: left to the rendezvous
    with pytest.raises(OdcBackendError, match="rank 0's GPU g0 cannot access rank 2's GPU g2"):
        torch_heap.check_topology(one_host, 0, {"g0": 0, "g1": 1, "g2": 2})


# -- the collective create, on 2 CPU ranks with a fake torch module -----------------------------------------------
def _fake_ranks(rank: int, calls: list[tuple], *, host: str, oom: bool) -> None:
    """Rank ``rank`` of distinct GPUs on ``host``: torch's CUDA calls faked (``tests._cuda_fake``) and torch's
    SymmetricMemory module replaced by a fake of the current shape; ODC's own functions run as they are."""
    import sys

    error = torch.OutOfMemoryError("CUDA out of memory") if oom else None
    fake_cuda(rank, ["gpu0", "gpu1"], [], mps=0, host=host)
    sys.modules[_torch_symm.MODULE] = fake_module("current", calls, empty_error=error)


def _create(rank: int, world: int, hosts: list[str], oom_rank: int) -> dict:
    import torch.distributed as dist

    import odc_runtime.transport.symm.torch_heap as hc

    calls: list[tuple] = []
    _fake_ranks(rank, calls, host=hosts[rank], oom=rank == oom_rank)
    try:
        heap = hc.open_heap(rank, world, 256, torch.device("cuda", rank), timeout=20)
    except Exception as e:
        return {"error": type(e).__name__, "msg": str(e), "calls": calls}
    out = {"bases": heap.peer_bases.tolist(), "local": heap.local.tolist(), "ptr": heap.local.data_ptr(),
           "calls": calls, "group": dist.group.WORLD.group_name}
    heap.close()
    return out


@pytest.mark.slow
def test_create_maps_every_rank_and_zeroes_the_heap() -> None:
    results = run_ranks(_create, 2, ["h", "h"], -1, timeout=60)
    for r in results:
        assert r["local"] == [0] * 256  # torch's block arrived with 7s: zeroed before any peer may read it
        assert r["bases"] == [r["ptr"], 0x1000]
        assert r["calls"] == [("empty", (256,), torch.uint8), ("rendezvous", r["group"])]


@pytest.mark.slow
def test_create_fails_on_every_rank_before_the_rendezvous() -> None:
    results = run_ranks(_create, 2, ["h0", "h1"], -1, timeout=60)
    assert [r["error"] for r in results] == ["OdcBackendError"] * 2
    assert all("spans 2 hosts" in r["msg"] and r["calls"] == [] for r in results)
    results = run_ranks(_create, 2, ["h", "h"], 1, timeout=60)
    assert [r["error"] for r in results] == ["OdcMemoryError"] * 2  # rank 0 allocated, but is told and stops
    assert "rank 1" in results[0]["msg"]
    assert all(c[0] != "rendezvous" for r in results for c in r["calls"])
