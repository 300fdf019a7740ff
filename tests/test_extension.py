"""The NVSHMEM extension ``odc_runtime._C`` on a machine without a GPU.

Every check that could end the interpreter (NVSHMEM calls ``exit()`` on some failures) runs in a child process,
so an exit shows up as a failed return code instead of killing pytest. The extension tests skip when it was not
built, unless ``ODC_REQUIRE_EXTENSION=1`` (CI sets it after ``.ci/build_ext.sh``), which turns that into a failure.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from odc_runtime.transport import nvshmem

REQUIRE = os.environ.get("ODC_REQUIRE_EXTENSION", "0") == "1"
HAS_GPU = torch.cuda.is_available()


def _extension_built() -> bool:
    return importlib.util.find_spec("odc_runtime._C") is not None


def _nvshmem_runtime_installed() -> bool:
    return any(glob.glob(os.path.join(d, "libnvshmem_host.so*")) for d in nvshmem._nvshmem_lib_dirs())


@pytest.fixture
def extension():
    if not _extension_built():
        reason = "odc_runtime._C not built (needs nvcc + an NVSHMEM wheel; see .ci/build_ext.sh)"
    elif not _nvshmem_runtime_installed():
        reason = "odc_runtime._C is built but libnvshmem_host.so.3 is not installed (pip install nvidia-nvshmem-cu13)"
    else:
        return
    if REQUIRE:
        pytest.fail(f"{reason}, and ODC_REQUIRE_EXTENSION=1")
    pytest.skip(reason)


def _run(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def _assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0 and "OK" in proc.stdout, (
        f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )


def test_extension_imports_without_gpu(extension):
    proc = _run(
        """
        from odc_runtime.transport.nvshmem import load_extension
        C = load_extension()
        for name in ("init", "get_unique_id", "malloc", "ptr", "p2p_atomics", "mps_enabled", "Engine", "Plan",
                     "DTYPE_FLOAT32", "DTYPE_BFLOAT16", "DTYPE_FLOAT16", "PLAN_FETCH_COPY", "PLAN_FETCH_KERNEL",
                     "PLAN_FETCH_STAGED", "PLAN_PUSH_ATOMIC", "PLAN_PUSH_LOCKED"):
            assert hasattr(C, name), name
        for gone in ("barrier_all_on_stream", "quiet_on_stream", "free", "finalize", "buffer_register"):
            assert not hasattr(C, gone), f"{gone}: no NVSHMEM host call after init"
        assert issubclass(C.NvshmemError, RuntimeError)
        print("devices", C.device_count())
        print("OK")
        """
    )
    _assert_ok(proc)


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: init would really start NVSHMEM")
def test_init_without_gpu_raises_instead_of_exiting(extension):
    proc = _run(
        """
        from odc_runtime.transport.nvshmem import load_extension
        C = load_extension()
        assert C.device_count() == 0
        assert C.mps_enabled(0) in (-1, 0)
        for call in (lambda: C.init(b"\\0" * 128, 0, 1, 0), C.get_unique_id, lambda: C.malloc(16),
                     lambda: C.ptr(4096, 0), C.p2p_atomics,
                     lambda: C.Engine(0, 1, 4096, 8192, 1024, 16384, 1, 65536, True)):
            try:
                call()
            except C.NvshmemError as e:
                print("raised:", e)
            else:
                raise SystemExit("no exception")
        print("OK")
        """
    )
    _assert_ok(proc)


_CREATE = """
import os, tempfile
import torch.distributed as dist
from odc_runtime.errors import OdcBackendError
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
try:
    {call}
except OdcBackendError as e:
    print("raised:", e)
    print("OK")
finally:
    dist.destroy_process_group()
"""


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present")
def test_create_without_gpu_raises_backend_error(extension):
    call = "from odc_runtime.transport import nvshmem; nvshmem.create(timeout=5.0, heap_size=None)"
    _assert_ok(_run(_CREATE.format(call=call)))


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present")
def test_public_init_nvshmem_without_gpu_raises_backend_error():
    """Through the core API (no extension needed: without a GPU it must fail the same typed way)."""
    call = "import odc_runtime as odc; odc.init(backend='nvshmem')"
    _assert_ok(_run(_CREATE.format(call=call)))


def test_package_works_without_extension():
    """With ``_C`` unimportable: odc_runtime imports, is_available() is False, create() raises OdcBackendError."""
    proc = _run(
        _CREATE.format(
            call="""import sys; sys.modules["odc_runtime._C"] = None
    import odc_runtime
    from odc_runtime.transport import nvshmem, nvshmem_available
    assert not nvshmem.is_available() and not nvshmem_available()
    nvshmem.create(timeout=5.0, heap_size=None)"""
        )
    )
    _assert_ok(proc)


def test_is_available_never_raises():
    assert isinstance(nvshmem.is_available(), bool)
    if not HAS_GPU:
        assert nvshmem.is_available() is False
