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

from odc_runtime import config
from odc_runtime.transport import nvshmem

REQUIRE = config.require_extension()
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
                     "PLAN_FETCH_STAGED", "PLAN_PUSH_ATOMIC", "PLAN_PUSH_LOCKED",
                     "nvshmem_version_compiled", "nvshmem_version_runtime"):
            assert hasattr(C, name), name
        for name in ("barrier", "quiet", "put_signal", "wait_signal", "wait_gave_up", "wait_seen", "set_abort"):
            assert hasattr(C.Engine, name), f"Engine.{name}"
        for gone in ("barrier_all_on_stream", "quiet_on_stream", "free", "finalize", "buffer_register"):
            assert not hasattr(C, gone), f"{gone}: no NVSHMEM host call after init"
        assert issubclass(C.NvshmemError, RuntimeError)
        print("devices", C.device_count())
        # The loaded libnvshmem_host.so.3 answers without init or GPU; it must be the release _C was built for.
        from odc_runtime.transport.nvshmem import check_version
        v = check_version(C)
        assert len(v) == 3 and v[0] == 3 and v >= (3, 3, 0), v
        print("nvshmem", v)
        print("OK")
        """
    )
    _assert_ok(proc)


def test_event_query_classifies_capture_returns_as_pending(extension):
    # Issue 33, finding 2: the deadline thread and the watchdog query events in the thread-local capture mode; a
    # return a graph capture produces must read as "not yet", never as a failure of the watched work (which would
    # abort a healthy job). Codes from CUDA's driver_types.h (stable ABI values).
    proc = _run(
        """
        from odc_runtime.transport.nvshmem import load_extension
        C = load_extension()
        for code in range(900, 909):  # cudaErrorStreamCaptureUnsupported .. cudaErrorStreamCaptureWrongThread
            assert C.capture_related(code) and C.event_state(code) == C.EVENT_PENDING, code
        assert C.event_state(0) == C.EVENT_DONE  # cudaSuccess
        assert not C.capture_related(600) and C.event_state(600) == C.EVENT_PENDING  # cudaErrorNotReady
        for code in (1, 700, 719, 909, 999):  # invalid value, illegal address, launch failure, ..., unknown
            assert not C.capture_related(code) and C.event_state(code) == C.EVENT_FAILED, code
        assert hasattr(C.Engine, "watching") and callable(C.query_event)
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
                     lambda: C.Engine(0, 1, 4096, 8192, 1024, 16384, 1, 65536, True, 1 << 30, 1 << 20)):
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


# --- NVSHMEM version check and library lookup (no extension needed) -------------------------------------


class _FakeExt:
    def __init__(self, compiled, runtime) -> None:
        self.nvshmem_version_compiled = lambda: compiled
        self.nvshmem_version_runtime = lambda: runtime


def test_check_version_match_returns_version():
    assert nvshmem.check_version(_FakeExt((3, 4, 5), (3, 4, 5))) == (3, 4, 5)


@pytest.mark.parametrize(
    ("compiled", "runtime"), [((3, 8, 0), (3, 4, 5)), ((3, 4, 5), (3, 4, 6)), ((3, 3, 24), (4, 0, 0))]
)
def test_check_version_mismatch_names_both_and_how_to_rebuild(compiled, runtime):
    from odc_runtime.errors import OdcBackendError

    with pytest.raises(OdcBackendError) as ei:
        nvshmem.check_version(_FakeExt(compiled, runtime))
    msg = str(ei.value)
    built, running = ".".join(map(str, compiled)), ".".join(map(str, runtime))
    assert f"compiled against NVSHMEM {built}" in msg and f"runs NVSHMEM {running}" in msg
    assert f"Rebuild the extension against NVSHMEM {running}" in msg
    assert "pip install" in msg and f"=={running}" in msg and "NVSHMEM_HOME" in msg


def test_check_version_old_extension_without_query():
    from odc_runtime.errors import OdcBackendError

    with pytest.raises(OdcBackendError, match="no NVSHMEM version query"):
        nvshmem.check_version(object())


def _fake_nvshmem_home(root, version=(3, 4, 5)):
    (root / "include" / "non_abi").mkdir(parents=True)
    (root / "include" / "nvshmem.h").write_text("")
    (root / "include" / "non_abi" / "nvshmem_version.h").write_text(
        "".join(
            f"#define NVSHMEM_VENDOR_{k}_VERSION {v}\n"
            for k, v in zip(("MAJOR", "MINOR", "PATCH"), version, strict=True)
        )
    )
    (root / "lib").mkdir()
    (root / "lib" / "libnvshmem_host.so.3").write_bytes(b"")
    return root


def test_locate_reads_versions_and_torch_pin(tmp_path, monkeypatch):
    from odc_runtime import _nvshmem_locate as loc

    monkeypatch.delenv("NVSHMEM_HOME", raising=False)
    site = tmp_path / "site-packages"
    home = _fake_nvshmem_home(site / "nvidia" / "nvshmem", (3, 4, 5))
    (site / "nvidia_nvshmem_cu13-3.4.5.dist-info").mkdir()
    meta = site / "torch-2.11.0+cu130.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(
        "Name: torch\nVersion: 2.11.0+cu130\nRequires-Dist: filelock\n"
        'Requires-Dist: nvidia-nvshmem-cu13==3.4.5; platform_system == "Linux"\n'
    )
    (site / "torch").mkdir()
    (site / "torch" / "version.py").write_text("cuda: Optional[str] = '13.0'\n")
    assert loc.header_version(str(home)) == (3, 4, 5)
    assert loc.nvshmem_homes([str(site)], include_sys_path=False) == [str(home)]
    assert loc.installed_wheels([str(site)]) == [("cu13", "3.4.5")]
    assert loc.torch_nvshmem_pin([str(site)]) == ("cu13", "3.4.5")
    assert loc.torch_cuda_major([str(site)]) == 13
    # CPU torch: no pin, no CUDA
    (meta / "METADATA").write_text("Name: torch\nRequires-Dist: filelock\n")
    (site / "torch" / "version.py").write_text("cuda: Optional[str] = None\n")
    assert loc.torch_nvshmem_pin([str(site)]) is None
    assert loc.torch_cuda_major([str(site)]) is None
    # NVSHMEM_HOME comes first, and only real installs count
    other = _fake_nvshmem_home(tmp_path / "nvshmem-3.8.0", (3, 8, 0))
    monkeypatch.setenv("NVSHMEM_HOME", str(other))
    assert loc.nvshmem_homes([str(site)], include_sys_path=False) == [str(other), str(home)]
    assert loc.lib_dirs()[0] == str(other / "lib")
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path / "missing"))
    assert loc.nvshmem_homes([str(site)], include_sys_path=False) == [str(home)]


# --- setup.py's build decision (no compiler run) ----------------------------------------------------------


@pytest.fixture
def setup_ns(monkeypatch, tmp_path):
    """setup.py's globals, loaded without running setup(); the target environment is an empty fake site dir."""
    import runpy

    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # run_path returns a copy of the module's globals: patch the dict the functions really use
    ns = runpy.run_path(os.path.join(root, "setup.py"))["make_plan"].__globals__
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.setattr(ns["locate"], "site_dirs", lambda: [str(site)])
    monkeypatch.setattr(ns["locate"], "_spec_dirs", lambda: [])  # ignore NVSHMEM importable from this venv
    for var in ("ODC_BUILD_EXT", "NVSHMEM_HOME", "CUDA_HOME", "CUDACXX"):
        monkeypatch.delenv(var, raising=False)
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDACXX", str(nvcc))
    ns["_site"] = site
    return ns


def _pip(ns, *argv):
    ns["_ancestor_cmdlines"] = lambda depth=6: [list(argv)] if argv else []


@pytest.mark.parametrize(
    ("argv", "flavor"),
    [
        (("/v/bin/python", "/v/bin/pip", "install", ".[cu13]"), "cu13"),
        (("python", "-m", "pip", "install", "-e", ".[test,cu12]"), "cu12"),
        (("uv", "pip", "install", "odc_runtime[ cu13 , triton]"), "cu13"),
        (("python", "-m", "pip", "install", ".[test,triton]"), None),
        (("bash", "run.sh", "[cu13]"), None),  # not an install command
        ((), None),
    ],
)
def test_setup_reads_requested_extra_from_the_installing_command(setup_ns, argv, flavor):
    _pip(setup_ns, *argv)
    assert setup_ns["_requested_flavor"]() == flavor


def test_setup_plan(setup_ns, monkeypatch, tmp_path):
    plan = setup_ns["make_plan"]
    # no extra, no NVSHMEM in the target environment: skipped, nothing fetched
    _pip(setup_ns, "pip", "install", ".")
    p = plan()
    assert not p.build and not p.explicit and "no cu12/cu13 extra" in p.reason
    # the cu13 extra on a CPU-torch environment: build against the newest cu13 wheel, fetched for the build
    _pip(setup_ns, "pip", "install", ".[cu13]")
    p = plan()
    assert p.build and p.explicit and "nvidia-nvshmem-cu13>=3.3,<4" in p.requires
    # torch pins NVSHMEM: that exact version
    meta = setup_ns["_site"] / "torch-2.11.0+cu130.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(
        'Name: torch\nRequires-Dist: nvidia-nvshmem-cu13==3.4.5; platform_system == "Linux"\n'
    )
    assert "nvidia-nvshmem-cu13==3.4.5" in plan().requires
    # NVSHMEM already in the target environment: built against it, no extra needed, nothing fetched
    _pip(setup_ns, "pip", "install", ".")
    _fake_nvshmem_home(setup_ns["_site"] / "nvidia" / "nvshmem", (3, 4, 5))
    p = plan()
    assert p.build and not p.explicit and not any("nvshmem" in r for r in p.requires)
    # the extra without nvcc: an error that says why and what to do
    _pip(setup_ns, "pip", "install", ".[cu13]")
    monkeypatch.setenv("CUDACXX", str(tmp_path / "missing-nvcc"))
    p = plan()
    assert not p.build and p.explicit and "nvcc was not found" in p.reason and "ODC_BUILD_EXT=0" in p.reason
    monkeypatch.setenv("ODC_BUILD_EXT", "0")
    assert not plan().build and not plan().explicit


def test_setup_triton_extra_beside_a_cuda_torch_needs_no_nvcc(setup_ns, monkeypatch, tmp_path):
    """``pip install "odc_runtime[triton]"`` next to a CUDA torch (whose NVSHMEM wheel is installed) on a machine
    without nvcc: the extension is skipped, never an error, so the symm transport (Triton, no build) installs."""
    _pip(setup_ns, "pip", "install", "odc_runtime[triton]")
    _fake_nvshmem_home(setup_ns["_site"] / "nvidia" / "nvshmem", (3, 4, 5))
    monkeypatch.setenv("CUDACXX", str(tmp_path / "missing-nvcc"))
    p = setup_ns["make_plan"]()
    assert not p.build and not p.explicit and "nvcc not found" in p.reason


# -- GIL (issue 22, finding 2) ----------------------------------------------------------------------------------
# Bindings that only read host-mapped words or constants: they cannot wait, so they may keep the GIL.
_NON_BLOCKING = {
    "nvshmem_version_compiled", "nvshmem_version_runtime", "device_count", "mps_enabled", "ptr", "set_abort",
    "aborted", "deadline_passed", "barrier_gave_up", "heard", "wait_gave_up", "wait_seen", "capture_related",
    "event_state",
}


def _bindings() -> dict[str, str]:
    """``csrc/bindings.cpp``'s definitions: qualified name (``Engine.barrier``, ``Plan.__init__``, ``init``) -> the
    source text of its ``def(...)`` call."""
    import re

    with open(os.path.join(os.path.dirname(__file__), "..", "csrc", "bindings.cpp")) as f:
        src = f.read()
    body = src[src.index("PYBIND11_MODULE") :]
    out: dict[str, str] = {}
    cls = ""
    marks = list(re.finditer(r'py::class_<odc::(\w+)|\.def(?:_property_readonly)?\(\s*(?:"(\w+)"|py::init<)', body))
    for i, m in enumerate(marks):
        if m.group(1):
            cls = m.group(1) + "."
            continue
        end = marks[i + 1].start() if i + 1 < len(marks) else len(body)
        name = m.group(2) or "__init__"
        qualified = name if (m.group(0).startswith(".def(\"") and body[m.start() - 1] == "m") else cls + name
        out[qualified] = body[m.start() : end]
    return out


def test_every_binding_that_can_wait_releases_the_gil() -> None:
    # A launch (kernel, event record, memcpy) blocks inside the driver when the stream's launch queue is full, e.g.
    # behind a barrier kernel that waits for a dead peer; a binding holding the GIL there stops every Python thread,
    # the watchdog included, and the job hangs. Every binding except pure reads must release it.
    defs = _bindings()
    holding = [
        n for n, text in defs.items()
        if n.split(".")[-1] not in _NON_BLOCKING and n != "Plan.kind" and "release()" not in text
        and "gil_scoped_release" not in text
    ]
    assert not holding, f"bindings that can wait but hold the GIL: {holding}"
    for name in ("init", "malloc", "Engine.barrier", "Engine.quiet", "Engine.put_signal", "Engine.wait_signal",
                 "Engine.watch", "Plan.run", "Engine.__init__", "Plan.__init__", "get_unique_id", "p2p_atomics"):
        assert name in defs, sorted(defs)  # the parse found them (a renamed binding is checked too)


def test_setup_rebuild_without_archs_goes_back_to_the_default(setup_ns, monkeypatch, tmp_path):
    """A build tree configured for one GPU (ODC_CUDA_ARCHS=90-real) and rebuilt without ODC_CUDA_ARCHS gets
    CMakeLists.txt's default architectures again, not the cached ones (which built for that GPU only, silently)."""
    import re
    import shutil

    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "CMakeLists.txt")) as f:
        text = f.read()
    block = text[text.index("if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)") : text.index("project(")]
    default = re.findall(r'set\(CMAKE_CUDA_ARCHITECTURES "([^"$]+)"\)', block)[-1]
    src = tmp_path / "src"
    src.mkdir()
    # CMakeLists.txt's architecture block, without the CUDA toolchain (LANGUAGES NONE: no compiler needed)
    (src / "CMakeLists.txt").write_text(
        f"cmake_minimum_required(VERSION 3.24)\n{block}project(t LANGUAGES NONE)\n"
        'message(STATUS "archs=${CMAKE_CUDA_ARCHITECTURES}")\n'
    )

    def configure() -> str:
        out = subprocess.run([cmake, "-S", str(src), "-B", str(tmp_path / "b"), setup_ns["_arch_arg"]()],
                             capture_output=True, text=True, check=True).stdout
        return re.search(r"archs=(\S*)", out).group(1)

    monkeypatch.setenv("ODC_CUDA_ARCHS", "90-real")
    assert configure() == "90-real"
    monkeypatch.delenv("ODC_CUDA_ARCHS")
    assert configure() == default


# --- the extension wheels (odc-runtime-cu12/-cu13) -------------------------------------------------------------


def test_extension_candidates_prefer_the_source_build_then_torchs_cuda_major():
    from odc_runtime import _nvshmem_locate as loc

    assert loc.extension_modules(13) == ["odc_runtime._C", "odc_runtime_cu13._C", "odc_runtime_cu12._C"]
    assert loc.extension_modules(12) == ["odc_runtime._C", "odc_runtime_cu12._C", "odc_runtime_cu13._C"]
    assert loc.extension_modules(None)[0] == "odc_runtime._C"


def test_an_extension_wheels_module_is_found_when_the_package_has_none(tmp_path, monkeypatch):
    """A package that is not installed is skipped (its parent missing, or the module missing in it); the first
    installed one is imported; none installed is None (load_extension's error then names every candidate)."""
    from odc_runtime.transport.nvshmem import extension

    pkg = tmp_path / "odc_fake_cu13"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_C.py").write_text("WHO = 'wheel'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ["odc_runtime._C_missing", "odc_fake_cu12._C", "odc_fake_cu13._C"]
    assert extension._import_first(names).WHO == "wheel"
    assert extension._import_first(names[:2]) is None
