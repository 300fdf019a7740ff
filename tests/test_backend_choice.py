"""Which transport ``odc.init()`` uses (``odc_runtime.transport.choose``): the documented rule, with the
transports' availability faked, and through ``init`` on real ranks."""

from __future__ import annotations

import pytest
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import transport as registry

GPU_NODE = ("nvshmem", "symm", "host")  # a CUDA node with triton, SymmetricMemory and the extension built


@pytest.mark.parametrize(
    ("candidates", "hosts", "expected"),
    [
        ([GPU_NODE, GPU_NODE], ["a", "a"], "nvshmem"),  # one node with the extension: the faster one, as measured
        ([("symm", "host")] * 2, ["a", "a"], "symm"),  # one node, extension not built (or not working)
        ([GPU_NODE, GPU_NODE], ["a", "b"], "nvshmem"),  # across nodes: the only transport that spans hosts
        ([("nvshmem", "host")] * 2, ["a", "a"], "nvshmem"),  # one node without triton / SymmetricMemory
        ([("host",)] * 2, ["a", "a"], "host"),  # CPU ranks
        ([GPU_NODE, ("symm", "host")], ["a", "a"], "symm"),  # what every rank has, not what rank 0 has
        ([GPU_NODE, ("nvshmem", "host")], ["a", "a"], "nvshmem"),
        ([GPU_NODE, ("host",)], ["a", "a"], "host"),
    ],
)
def test_rule(candidates: list[tuple[str, ...]], hosts: list[str], expected: str) -> None:
    assert registry.choose([None] * len(hosts), candidates, hosts) == expected


def test_no_transport_spans_the_hosts() -> None:
    with pytest.raises(odc.OdcUsageError, match=r"2 hosts \(across hosts only nvshmem"):
        registry.choose([None, None], [("symm", "host"), ("symm", "host")], ["a", "b"])


def test_a_requested_backend_overrides_the_rule() -> None:
    assert registry.choose(["host", "host"], [(), ()], ["a", "a"]) == "host"
    assert registry.choose(["symm", "symm"], [GPU_NODE, GPU_NODE], ["a", "a"]) == "symm"  # over nvshmem's priority
    assert registry.choose(["symm-cpu"], [()], ["a"]) == "symm-cpu"  # never chosen automatically, but selectable
    with pytest.raises(odc.OdcMismatchError, match="rank 0: host; rank 1: automatic"):
        registry.choose(["host", None], [(), ("host",)], ["a", "a"])


def test_candidates_are_the_available_automatic_transports(monkeypatch: pytest.MonkeyPatch) -> None:
    avail = {"symm": True, "nvshmem": False, "host": True, "symm-cpu": True}
    monkeypatch.setattr(registry.TransportSpec, "is_available", lambda self: avail[self.name])
    assert registry.auto_candidates() == ("symm", "host")  # symm-cpu: available, never automatic
    assert registry.auto_select().name == "symm"
    avail["nvshmem"] = True  # the extension built and working: preferred on one node
    assert registry.auto_candidates() == ("nvshmem", "symm", "host")
    assert registry.auto_select().name == "nvshmem"
    avail["nvshmem"] = avail["symm"] = False
    assert registry.auto_select().name == "host"


@pytest.mark.parametrize(
    ("built", "running", "expected"), [((3, 4, 5), (3, 4, 5), True), ((3, 3, 0), (3, 4, 5), False)]
)
def test_nvshmem_is_available_only_where_its_extension_works(
    monkeypatch: pytest.MonkeyPatch, built: tuple, running: tuple, expected: bool
) -> None:
    """An extension built against another NVSHMEM than the one loaded (init would refuse it) is not available, so
    the automatic choice falls back to symm instead of failing init."""
    import types

    from odc_runtime.transport.nvshmem import extension

    fake = types.SimpleNamespace(nvshmem_version_compiled=lambda: built, nvshmem_version_runtime=lambda: running)
    monkeypatch.setattr(extension.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(extension, "load_extension", lambda: fake)
    assert extension.is_available() is expected
    monkeypatch.setattr(extension, "load_extension", lambda: (_ for _ in ()).throw(odc.OdcBackendError("not built")))
    assert extension.is_available() is False


def _init_auto(rank: int, world: int) -> str:
    odc.init(heap_size="1M")
    return odc.backend()


def _init_mixed(rank: int, world: int) -> str:
    import os

    if rank == 1:
        os.environ["ODC_BACKEND"] = "host"
    with pytest.raises(odc.OdcMismatchError, match="rank 0: automatic; rank 1: host"):
        odc.init(heap_size="1M")
    return "refused"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_init_chooses_by_the_rule_on_every_rank() -> None:
    assert run_ranks(_init_auto, 2, timeout=90) == ["host", "host"]  # CPU ranks of one machine
    assert run_ranks(_init_mixed, 2, timeout=90) == ["refused", "refused"]
