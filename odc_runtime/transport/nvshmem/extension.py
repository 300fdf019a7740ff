"""Loading ``odc_runtime._C`` and checking its NVSHMEM version; the process-wide NVSHMEM state.

Importing this module never needs a GPU or the extension. NVSHMEM is initialised at most once per process and
never torn down (its teardown is a collective a dead peer would hang), so the engines made at init live for the
process; at interpreter exit every engine's abort word is raised, once its watched operations completed or ran
past their deadlines, so that no kernel of ours keeps the CUDA teardown waiting.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import importlib.util
import logging
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from odc_runtime import _nvshmem_locate as _locate
from odc_runtime.errors import OdcBackendError

INSTALL_HINT = (
    "install the extension wheel of your torch's CUDA major (pip install odc-runtime-cu13, or -cu12) where one is "
    'built, or build it with a CUDA toolkit and an NVSHMEM wheel: pip install -e ".[cu13]" (or ".[cu12]"), '
    "or run .ci/build_ext.sh"
)

log = logging.getLogger("odc_runtime")

_ext: ModuleType | None = None
_ext_error: str | None = None
started = False  # NVSHMEM was initialised in this process (it cannot be initialised again)
_engines: list[object] = []  # live for the process (see the module docstring)


def _nvshmem_lib_dirs() -> list[str]:
    """Where ``libnvshmem_host.so.3`` is looked for: ``$NVSHMEM_HOME/lib``, then the installed wheel(s)."""
    return _locate.lib_dirs()


def _import_first(names: Sequence[str]) -> ModuleType | None:
    """The first of ``names`` that is installed, imported; ``None`` when none is, the error of the first one that is
    installed but does not import."""
    for name in names:
        if sys.modules.get(name) is not None:  # already imported (or put there by a test)
            return sys.modules[name]
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ImportError:  # its parent package (an extension wheel's) is not installed
            continue
        return importlib.import_module(name)
    return None


def load_extension() -> ModuleType:
    """Import the NVSHMEM extension; raise ``OdcBackendError`` saying why it is not usable.

    ``odc_runtime._C`` (a source build) when present, else the extension wheel of torch's CUDA major
    (``odc_runtime_cu13._C`` from ``pip install odc-runtime-cu13``), else another one
    (``_nvshmem_locate.extension_modules``). ``libnvshmem_host.so.3`` is preloaded from ``NVSHMEM_HOME`` or the
    installed ``nvidia-nvshmem`` wheel unless the process already has one (``import torch`` loads its own in torch
    CUDA builds; the same soname is then reused, which is why ``check_version`` compares versions before init).
    """
    global _ext, _ext_error
    if _ext is not None:
        return _ext
    if _ext_error is not None:
        raise OdcBackendError(_ext_error)
    major = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None
    try:
        if _locate.loaded_host_library() is None:
            for d in _nvshmem_lib_dirs():
                libs = _locate.host_libraries(d)
                if libs:
                    ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
                    break
        names = _locate.extension_modules(major)
        C = _import_first(names)
    except (ImportError, OSError) as exc:
        _ext_error = f"the NVSHMEM extension is not usable ({exc}); {INSTALL_HINT}"
        raise OdcBackendError(_ext_error) from exc
    if C is None:
        _ext_error = f"the NVSHMEM extension is not usable (none of {', '.join(names)} is installed); {INSTALL_HINT}"
        raise OdcBackendError(_ext_error)
    _ext = C
    return C


def _fmt(v: Sequence[int]) -> str:
    return ".".join(str(x) for x in v)


def check_version(C: ModuleType) -> tuple[int, int, int]:
    """Return the NVSHMEM version in use; raise ``OdcBackendError`` if it is not the one ``C`` was built for.

    ``C`` (``odc_runtime._C``) links NVSHMEM's device library statically but uses whichever
    ``libnvshmem_host.so.3`` the process loaded first (torch's, in torch CUDA builds); device and host halves of
    different releases share internal state layouts, so a mismatch is refused instead of run.
    """
    try:
        built = tuple(int(x) for x in C.nvshmem_version_compiled())
        running = tuple(int(x) for x in C.nvshmem_version_runtime())
    except AttributeError as exc:
        raise OdcBackendError(
            "odc_runtime._C has no NVSHMEM version query (it was built from an older odc_runtime): rebuild it "
            f"from this source tree; {INSTALL_HINT}"
        ) from exc
    if built != running:
        lib = _locate.loaded_host_library() or "libnvshmem_host.so.3"
        flavors = sorted({f for f, _ in _locate.installed_wheels()})
        cu = flavors[0] if len(flavors) == 1 else "cu13"  # the wheel flavour installed here, if unambiguous
        raise OdcBackendError(
            f"odc_runtime._C was compiled against NVSHMEM {_fmt(built)}, but this process runs NVSHMEM "
            f"{_fmt(running)} ({lib}; torch CUDA builds load the NVSHMEM they pin). Device code and host library "
            f"must be the same release. Rebuild the extension against NVSHMEM {_fmt(running)}: in this environment, "
            "with nvcc available, reinstall odc_runtime from its source tree (`pip install --force-reinstall "
            f'--no-deps ".[{cu}]"`, or `pip install -e ".[{cu}]"`, or `.ci/build_ext.sh`); the build uses the NVSHMEM '
            f"wheel installed here, so make sure it is {_fmt(running)} (pip install nvidia-nvshmem-{cu}=="
            f"{_fmt(running)}), or point NVSHMEM_HOME at an NVSHMEM {_fmt(running)} install."
        )
    return running  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why the nvshmem transport cannot run here (``None``: it can): it needs a CUDA device and an
    ``odc_runtime._C`` that imports and runs the NVSHMEM release it was built for. Never raises."""
    try:
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        check_version(load_extension())
        return None
    except Exception as e:
        return str(e) or type(e).__name__


def is_available() -> bool:
    """CUDA is present, ``odc_runtime._C`` imports and runs the NVSHMEM release it was built for (what
    ``odc.init(backend="nvshmem")`` would refuse is not available: the automatic choice falls back to ``symm``).
    Never raises."""
    return unavailable_reason() is None


def backend_call(op: str, fn: Callable, *args: object) -> object:
    """``fn(*args)`` with the extension's errors (``_C.NvshmemError``, CUDA errors) as OdcBackendError."""
    try:
        return fn(*args)
    except RuntimeError as exc:
        raise OdcBackendError(f"nvshmem {op}: {exc}") from exc


def dtype_codes(ext: ModuleType) -> dict[torch.dtype, int]:
    """torch dtype -> the extension's dtype code (exported by bindings.cpp, never duplicated here). ``int64``:
    deterministic mode's fixed-point pushes (int64 into an int64 accumulator, scale 1) and int64 buffers' fetches."""
    return {
        torch.float32: ext.DTYPE_FLOAT32, torch.bfloat16: ext.DTYPE_BFLOAT16, torch.float16: ext.DTYPE_FLOAT16,
        torch.int64: ext.DTYPE_INT64,
    }


def keep_engine(engine: object) -> None:
    """Keep ``engine`` for the life of the process (its abort word is raised at exit)."""
    _engines.append(engine)


@atexit.register
def _abort_at_exit() -> None:
    """At interpreter exit nothing will wait for our kernels any more: raise every abort word, so that a barrier or
    lock spin still waiting for a dead peer leaves and the CUDA teardown does not wait for it.

    Not while operations are still watched (a process that exits without ``finalize()`` right after a sync): the
    abort would cut a queued push short while the barrier after it on the stream is still to run. The barrier
    kernel would then not announce (csrc/barrier.cu), so the peers would time out instead of finishing a step
    that is complete. So the exit first lets the watched work finish; the engine's deadline thread bounds that
    wait (it raises the abort itself when the oldest operation is late)."""
    for engine in _engines:
        waiting = engine.watching()  # type: ignore[attr-defined]
        if waiting and not engine.aborted():  # type: ignore[attr-defined]
            log.warning(
                "odc: the process exits with %d operation(s) of the nvshmem transport still on the GPU; waiting for "
                "them (bounded by ODC_TIMEOUT) before exit. Call odc_runtime.finalize() before exiting.", waiting
            )
        while engine.watching() and not engine.aborted():  # type: ignore[attr-defined]
            time.sleep(1e-3)
        engine.set_abort()  # type: ignore[attr-defined]
