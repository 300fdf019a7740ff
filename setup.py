"""Build script: the pure-Python package always; the CUDA/NVSHMEM extension ``odc_runtime._C`` when possible.

``kernels/`` is installed as ``odc_runtime.kernels`` (never as a top-level ``kernels`` package).

The extension is built with CMake (``CMakeLists.txt``) when ``nvcc`` is found and NVSHMEM (a
``nvidia-nvshmem-cu12``/``-cu13`` wheel, or ``NVSHMEM_HOME``) is installed in the environment being installed
into; otherwise one line is logged and the build continues without it (the host backend still works), so a CPU
user on a machine that happens to have nvcc pays for no CUDA build. Environment:

* ``ODC_BUILD_EXT=0`` never build it; ``ODC_BUILD_EXT=1`` a failed or impossible build is an error; unset: auto.
* ``ODC_CUDA_ARCHS`` CUDA architectures (default ``"80;90"``); ``NVSHMEM_HOME`` an NVSHMEM install to use;
  ``CUDACXX`` / ``CUDA_HOME`` locate nvcc; ``ODC_BUILD_JOBS`` parallel compile jobs.

Build isolation: ``pip install -e .`` builds in an isolated environment. When nvcc is present and the build is
wanted (NVSHMEM installed in the target environment, or ``ODC_BUILD_EXT=1``), this script asks pip (through
``setup_requires``, which setuptools' PEP 517 backend reports as extra build requirements) for ``pybind11`` and
``cmake`` if they are missing, and, with ``ODC_BUILD_EXT=1`` only, for the NVSHMEM wheel matching the installed
torch's CUDA (else nvcc's) if the target environment has none. NVSHMEM found in the target environment is
preferred and its library directory is baked into the rpath; at run time ``odc_runtime.transport.nvshmem``
preloads ``libnvshmem_host.so.3`` from the installed ``nvidia-nvshmem`` wheel, so install the matching extra
(``pip install -e ".[cu13]"``) to run it.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
EXT_NAME = "odc_runtime._C"


def _say(msg: str) -> None:
    print(f"odc_runtime: {msg}", file=sys.stderr, flush=True)


def _build_mode() -> str:
    v = os.environ.get("ODC_BUILD_EXT", "").strip().lower()
    if v in ("0", "false", "no", "off"):
        return "off"
    if v in ("1", "true", "yes", "on"):
        return "required"
    return "auto"


def _find_nvcc() -> str | None:
    for cand in (
        os.environ.get("CUDACXX"),
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None,
        shutil.which("nvcc"),
        "/usr/local/cuda/bin/nvcc",
    ):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _nvcc_major(nvcc: str) -> int | None:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def _target_site_dirs() -> list[str]:
    """site-packages of the environment being installed into (also visible from pip's isolated build env)."""
    dirs = []
    for key in ("platlib", "purelib"):
        d = sysconfig.get_paths().get(key)
        if d and d not in dirs and os.path.isdir(d):
            dirs.append(d)
    return dirs


def _is_nvshmem_home(d: str) -> bool:
    return os.path.isfile(os.path.join(d, "include", "nvshmem.h")) and bool(
        glob.glob(os.path.join(d, "lib", "libnvshmem_host.so*"))
    )


def _find_nvshmem() -> tuple[str | None, bool]:
    """(NVSHMEM_HOME, whether it is in the target environment, i.e. usable at run time)."""
    env = os.environ.get("NVSHMEM_HOME")
    if env and _is_nvshmem_home(env):
        return env, True
    for site in _target_site_dirs():
        d = os.path.join(site, "nvidia", "nvshmem")
        if _is_nvshmem_home(d):
            return d, True
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        spec = None
    for d in (spec.submodule_search_locations or []) if spec else []:
        if _is_nvshmem_home(d):
            return d, False
    return None, False


def _torch_cuda_major() -> int | None:
    """CUDA major version of the torch installed in the target environment (read, not imported)."""
    for site in _target_site_dirs():
        p = os.path.join(site, "torch", "version.py")
        if os.path.isfile(p):
            with open(p) as f:
                m = re.search(r"^cuda\s*(?::\s*[^=]+)?=\s*['\"](\d+)\.", f.read(), re.M)
            return int(m.group(1)) if m else None
    return None


def _cmake_ok() -> bool:
    exe = shutil.which("cmake")
    if not exe:
        return False
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    m = re.search(r"version (\d+)\.(\d+)", out)
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (3, 24)


def _extra_build_requires() -> list[str]:
    """Build requirements pip must add to the isolated build env (empty when nothing is missing)."""
    if _build_mode() == "off":
        return []
    nvcc = _find_nvcc()
    if nvcc is None:
        return []
    home, in_target = _find_nvshmem()
    if _build_mode() == "auto" and not in_target:
        return []  # auto mode builds only against an NVSHMEM the installed package can load at run time
    reqs = []
    if importlib.util.find_spec("pybind11") is None:
        reqs.append("pybind11>=2.12")
    if not _cmake_ok():
        reqs.append("cmake>=3.24")
    if home is None:
        major = _torch_cuda_major() or _nvcc_major(nvcc)
        if major in (12, 13):
            reqs.append(f"nvidia-nvshmem-cu{major}>=3.3")
    return reqs


class CMakeBuildExt(build_ext):
    """Builds ``odc_runtime._C`` with CMake, or skips it with one log line (see module docstring)."""

    def run(self) -> None:
        mode = _build_mode()
        reason = "ODC_BUILD_EXT=0" if mode == "off" else self._missing()
        if reason is not None:
            if mode == "required":
                raise RuntimeError(f"odc_runtime: cannot build the CUDA extension ({reason}) and ODC_BUILD_EXT=1")
            _say(f"skipping the CUDA/NVSHMEM extension odc_runtime._C ({reason}); the host backend still works")
            self.extensions = []
            return
        try:
            super().run()
        except Exception as exc:
            if mode == "required":
                raise
            _say(f"building odc_runtime._C failed ({exc}); continuing without it (set ODC_BUILD_EXT=1 to fail)")
            self.extensions = []

    def _missing(self) -> str | None:
        if _find_nvcc() is None:
            return "nvcc not found; set CUDA_HOME or CUDACXX"
        home, in_target = _find_nvshmem()
        if home is None:
            return "NVSHMEM not found: pip install nvidia-nvshmem-cu13 (or -cu12), or set NVSHMEM_HOME"
        if not in_target and _build_mode() == "auto":
            return (
                "NVSHMEM is not installed in this environment: pip install nvidia-nvshmem-cu13 (or -cu12) first, "
                "or set ODC_BUILD_EXT=1 to build against a wheel fetched for the build"
            )
        if importlib.util.find_spec("pybind11") is None:
            return "pybind11 is not importable"
        if not _cmake_ok():
            return "cmake >= 3.24 not found"
        return None

    def build_extension(self, ext: Extension) -> None:
        import pybind11

        nvcc = _find_nvcc()
        nvshmem_home, in_target = _find_nvshmem()
        out_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        os.makedirs(out_dir, exist_ok=True)
        build_dir = os.path.join(ROOT, "build", f"ext-{sys.implementation.cache_tag}")
        args = [
            f"-DNVSHMEM_HOME={nvshmem_home}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DODC_OUTPUT_DIR={out_dir}",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DODC_EXTRA_RPATH={os.path.join(nvshmem_home, 'lib') if in_target else ''}",
        ]
        if os.environ.get("ODC_CUDA_ARCHS"):
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['ODC_CUDA_ARCHS']}")
        jobs = os.environ.get("ODC_BUILD_JOBS") or str(os.cpu_count() or 2)
        _say(f"building odc_runtime._C with CMake (NVSHMEM at {nvshmem_home}) into {out_dir}")
        configure = ["cmake", "-S", ROOT, "-B", build_dir, *args]
        if subprocess.run(configure).returncode != 0:
            # A cache from another environment (e.g. an old isolated build env) can break configure: retry clean.
            shutil.rmtree(build_dir, ignore_errors=True)
            subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", build_dir, "-j", jobs], check=True)


packages = [*find_packages(include=["odc_runtime", "odc_runtime.*"]), "odc_runtime.kernels"]

setup(
    packages=packages,
    package_dir={"odc_runtime.kernels": "kernels"},
    ext_modules=[Extension(EXT_NAME, sources=[])],
    cmdclass={"build_ext": CMakeBuildExt},
    setup_requires=_extra_build_requires(),
)
