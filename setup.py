"""Build script: the pure-Python package always; the CUDA/NVSHMEM extension ``odc_runtime._C`` when wanted.

``kernels/`` is installed as ``odc_runtime.kernels`` and ``bench/`` as ``odc_runtime.bench`` (never as top-level
packages): ``odc_runtime.SOURCE_FOLDERS``, read here without importing the package.

When the extension is built (``ODC_BUILD_EXT``: ``0`` never, ``1`` always (an impossible or failed build is an
error), unset = auto):

* auto builds it when nvcc is found and the install is for a GPU: NVSHMEM is already in the environment being
  installed into (torch CUDA builds depend on the NVSHMEM wheel they pin), ``NVSHMEM_HOME`` is set, or the pip
  command asks for the ``cu12``/``cu13`` extra (``pip install ".[cu13]"``; read from pip's command line). With
  the extra but no nvcc, or when such a requested build fails, the install fails with the reason (pip hides
  build output otherwise, so a warning would go unseen). Without any of these, a CPU user who happens to have
  nvcc pays for no CUDA build.
* NVSHMEM version: the one installed in the target environment (what ``import torch`` loads), else the version
  the installed torch pins (``Requires-Dist: nvidia-nvshmem-cu13==3.4.5`` in its metadata, read without
  importing torch), else the newest 3.x of the requested flavour. When the target environment does not hold it
  yet (one-step ``pip install ".[cu13]"``: pip installs the extra's wheel only after building), this script
  asks pip for that wheel as a build requirement (``setup_requires``, which setuptools' PEP 517 backend reports
  from ``get_requires_for_build_wheel``), builds against that copy, and bakes the target environment's
  ``site-packages/nvidia/nvshmem/lib`` into the rpath, where the extra installs the same wheel.
  ``odc_runtime.transport.nvshmem.check_version`` refuses to run on a different NVSHMEM at init.
* ``NVSHMEM_HOME`` an NVSHMEM install to build against (and load at run time); ``CUDACXX`` / ``CUDA_HOME``
  locate nvcc; ``ODC_CUDA_ARCHS`` CUDA architectures (CMake syntax, default ``80-real;90-real;100-real;120-real``);
  ``ODC_BUILD_JOBS`` parallel compile jobs (default: CPU count).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import SetupError

ROOT = os.path.dirname(os.path.abspath(__file__))
EXT_NAME = "odc_runtime._C"
FLAVORS = ("cu12", "cu13")


def _load_locate():
    """odc_runtime/_nvshmem_locate.py, loaded by path: importing odc_runtime would need torch."""
    path = os.path.join(ROOT, "odc_runtime", "_nvshmem_locate.py")
    spec = importlib.util.spec_from_file_location("_odc_nvshmem_locate", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


locate = _load_locate()


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
    """``$CUDACXX``, else ``$CUDA_HOME/bin/nvcc`` (when either is set, only that one), else nvcc on PATH, else
    ``/usr/local/cuda/bin/nvcc``."""
    if os.environ.get("CUDACXX") or os.environ.get("CUDA_HOME"):
        cands = [os.environ.get("CUDACXX") or os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")]
    else:
        cands = [shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]
    for cand in cands:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _nvcc_where() -> str:
    if os.environ.get("CUDACXX"):
        return f"CUDACXX={os.environ['CUDACXX']} is not an executable"
    if os.environ.get("CUDA_HOME"):
        return f"CUDA_HOME={os.environ['CUDA_HOME']} has no bin/nvcc"
    return "not on PATH, not in /usr/local/cuda/bin"


def _nvcc_major(nvcc: str) -> int | None:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


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


def _ancestor_cmdlines(depth: int = 6) -> list[list[str]]:
    """Command lines of this process's ancestors (Linux /proc), nearest first; empty where unreadable."""
    out: list[list[str]] = []
    pid = os.getppid()
    for _ in range(depth):
        if pid <= 1:
            break
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append([a.decode(errors="replace") for a in f.read().split(b"\0") if a])
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def _requested_flavor() -> str | None:
    """``cu12``/``cu13`` when the installing command asks for that extra (``pip install ".[cu13]"``).

    PEP 517 gives a build backend no access to the extras being installed, so this reads the command lines of
    the processes that started the build (pip, uv, a shell). Best effort: a requirement inside a ``-r`` file is
    not seen; ``ODC_BUILD_EXT=1`` is the reliable way to demand the build.
    """
    for argv in _ancestor_cmdlines():
        if not any(a in ("install", "wheel") or a.endswith(("pip", "uv")) for a in argv):
            continue
        for arg in argv:
            for group in re.findall(r"\[([^\]]*)\]", arg):
                extras = {e.strip().lower() for e in group.split(",")}
                for fl in FLAVORS:
                    if fl in extras:
                        return fl
    return None


@dataclass
class Plan:
    """What the build will do; computed identically when pip asks for build requirements and when it builds."""

    build: bool
    explicit: bool  # ODC_BUILD_EXT=1 or a cu12/cu13 extra: failing to build is an error
    reason: str = ""  # why not (when build is False)
    requires: list[str] = field(default_factory=list)  # extra build requirements for pip's build environment


def _nvshmem_requirement(flavor: str | None, nvcc: str) -> str:
    """The NVSHMEM wheel to build against when the target environment has none: torch's pin, else the newest
    3.x of the requested flavour (which is also what the extra installs), else of nvcc's CUDA major."""
    pin = locate.torch_nvshmem_pin()
    if pin is not None and (flavor is None or flavor == pin[0]):
        return f"nvidia-nvshmem-{pin[0]}=={pin[1]}"
    if flavor is None:
        major = locate.torch_cuda_major() or _nvcc_major(nvcc)
        flavor = f"cu{major}" if f"cu{major}" in FLAVORS else "cu13"
    return f"nvidia-nvshmem-{flavor}>=3.3,<4"


def make_plan() -> Plan:
    mode = _build_mode()
    if mode == "off":
        return Plan(False, False, "ODC_BUILD_EXT=0")
    flavor = _requested_flavor()
    explicit = mode == "required" or flavor is not None
    why = "ODC_BUILD_EXT=1" if mode == "required" else f"the {flavor} extra was requested"
    nvcc = _find_nvcc()
    if nvcc is None:
        return Plan(
            False,
            explicit,
            f"{why}, but nvcc was not found ({_nvcc_where()}): install the CUDA toolkit and put nvcc on PATH or "
            "set CUDA_HOME (or CUDACXX); or install without the GPU extension with ODC_BUILD_EXT=0 (the host "
            "backend works)"
            if explicit
            else f"nvcc not found ({_nvcc_where()}); set CUDA_HOME or CUDACXX",
        )
    have = locate.nvshmem_homes(include_sys_path=False)  # NVSHMEM_HOME or the target environment's wheel
    if not have and not explicit:
        return Plan(
            False,
            False,
            "NVSHMEM is not installed in this environment and no cu12/cu13 extra was asked for: "
            'pip install ".[cu13]" (or ".[cu12]"), or set ODC_BUILD_EXT=1 or NVSHMEM_HOME',
        )
    reqs = []
    if importlib.util.find_spec("pybind11") is None:
        reqs.append("pybind11>=2.12")
    if not _cmake_ok():
        reqs.append("cmake>=3.24")
    if not have and not locate.nvshmem_homes(include_sys_path=True):
        reqs.append(_nvshmem_requirement(flavor, nvcc))
    return Plan(True, explicit, requires=reqs)


def _setup_plan() -> Plan | None:
    """``make_plan()`` for ``setup()``, announcing the extra build requirements; None when it failed (never break
    metadata generation: the build step reports the problem)."""
    try:
        plan = make_plan()
    except Exception as exc:
        _say(f"could not work out the extension's build requirements ({exc})")
        return None
    if plan.requires:
        _say(f"asking pip for build requirements of odc_runtime._C: {', '.join(plan.requires)}")
    return plan


def _ext_modules(plan: Plan | None) -> list[Extension]:
    """``odc_runtime._C`` unless the plan skips it without error: with no extension module declared, the wheel is
    pure (``py3-none-any``), as ``ODC_BUILD_EXT=0`` (or a machine that will not build it) makes it."""
    if plan is None or plan.build or plan.explicit:
        return [Extension(EXT_NAME, sources=[])]
    if _build_mode() != "off":
        _say(f"building without the CUDA/NVSHMEM extension odc_runtime._C ({plan.reason}); the host and symm "
             "(Triton) backends still work")
    return []


def _arch_arg() -> str:
    """The CMake argument for the CUDA architectures: ``ODC_CUDA_ARCHS`` when set, else ``-U``, which drops a value
    cached by an earlier configure of the same build tree (e.g. a build for one GPU), so that CMakeLists.txt's
    default applies again instead of silently building for that GPU only."""
    archs = os.environ.get("ODC_CUDA_ARCHS")
    return f"-DCMAKE_CUDA_ARCHITECTURES={archs}" if archs else "-UCMAKE_CUDA_ARCHITECTURES"


class CMakeBuildExt(build_ext):
    """Builds ``odc_runtime._C`` with CMake, or skips it with one log line (see the module docstring)."""

    def run(self) -> None:
        plan = make_plan()
        reason = plan.reason if not plan.build else self._missing()
        if reason:
            if plan.explicit:
                # A setuptools error: setup() reports it as one line (no traceback), what is missing and the way out.
                raise SetupError(f"odc_runtime: cannot build the CUDA extension odc_runtime._C: {reason}")
            _say(f"skipping the CUDA/NVSHMEM extension odc_runtime._C ({reason}); the host and symm (Triton) "
                 "backends still work")
            self._drop_stale_output()
            return
        try:
            super().run()
        except Exception as exc:
            if plan.explicit:
                raise
            _say(f"building odc_runtime._C failed ({exc}); continuing without it (set ODC_BUILD_EXT=1 to fail)")
            self._drop_stale_output()

    def _drop_stale_output(self) -> None:
        """Build no extension, and remove a ``_C`` left in ``build/lib*`` by an earlier build: pip builds local
        directories in place, and the wheel would otherwise ship that stale module (built against some other
        NVSHMEM) without a word. In-place (editable) outputs are the developer's and stay."""
        if not self.inplace:
            for ext in self.extensions:
                path = self.get_ext_fullpath(ext.name)
                if os.path.exists(path):
                    _say(f"removing the stale {path} of an earlier build")
                    os.remove(path)
        self.extensions = []

    @staticmethod
    def _missing() -> str | None:
        if not locate.nvshmem_homes():
            return (
                "NVSHMEM not found: pip install nvidia-nvshmem-cu13 (or -cu12), or set NVSHMEM_HOME "
                "to a directory with include/nvshmem.h and lib/libnvshmem_host.so.3"
            )
        if importlib.util.find_spec("pybind11") is None:
            return "pybind11 is not importable (pip install pybind11)"
        if not _cmake_ok():
            return "cmake >= 3.24 not found (pip install cmake)"
        return None

    def build_extension(self, ext: Extension) -> None:
        import pybind11

        nvcc = _find_nvcc()
        home = locate.nvshmem_homes()[0]
        version = locate.header_version(home)
        vtag = ".".join(map(str, version)) if version else "unknown"
        # Runtime lookup of libnvshmem_host.so.3 (after $ORIGIN/../nvidia/nvshmem/lib, set in CMakeLists.txt):
        # the target environment's wheel directory, where the cu12/cu13 extra installs the wheel even if it is
        # not there yet (editable installs keep _C in the source tree), and NVSHMEM_HOME. Never a directory of
        # pip's temporary build environment.
        rpath = [os.path.join(site, "nvidia", "nvshmem", "lib") for site in locate.site_dirs()]
        if os.environ.get("NVSHMEM_HOME"):
            rpath.append(os.path.join(os.path.abspath(os.environ["NVSHMEM_HOME"]), "lib"))
        out_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        os.makedirs(out_dir, exist_ok=True)
        # One CMake tree per NVSHMEM version: switching versions (CI builds two) stays incremental.
        build_dir = os.path.join(ROOT, "build", f"ext-{sys.implementation.cache_tag}-nvshmem{vtag}")
        args = [
            f"-DNVSHMEM_HOME={home}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DODC_OUTPUT_DIR={out_dir}",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DODC_EXTRA_RPATH={';'.join(dict.fromkeys(rpath))}",
        ]
        args.append(_arch_arg())
        jobs = os.environ.get("ODC_BUILD_JOBS") or str(os.cpu_count() or 2)
        _say(f"building odc_runtime._C with CMake against NVSHMEM {vtag} at {home} into {out_dir}")
        configure = ["cmake", "-S", ROOT, "-B", build_dir, *args]
        if subprocess.run(configure).returncode != 0:
            # A cache from another environment (e.g. an old isolated build env) can break configure: retry clean.
            shutil.rmtree(build_dir, ignore_errors=True)
            subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", build_dir, "-j", jobs], check=True)


def _source_folders() -> dict[str, str]:
    """``odc_runtime.SOURCE_FOLDERS`` (sub-package -> top-level folder), read from the source without importing it."""
    with open(os.path.join(ROOT, "odc_runtime", "__init__.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["SOURCE_FOLDERS"]:
            return ast.literal_eval(node.value)
    raise RuntimeError("odc_runtime/__init__.py defines no SOURCE_FOLDERS")


source_folders = _source_folders()
packages = [*find_packages(include=["odc_runtime", "odc_runtime.*"]), *source_folders]
plan = _setup_plan()

setup(
    packages=packages,
    package_dir=source_folders,
    ext_modules=_ext_modules(plan),
    cmdclass={"build_ext": CMakeBuildExt},
    setup_requires=plan.requires if plan else [],
)
