"""Where NVSHMEM is, and which version is wanted: shared by ``setup.py`` (build time) and the nvshmem transport.

Standard library only, and no import of ``odc_runtime`` or torch: ``setup.py`` loads this file by path (it cannot
import the package's ``__init__``), possibly inside pip's isolated build environment. ``site_dirs`` arguments
are the site-packages directories of the environment being looked at (default: the running interpreter's,
which is also the target environment when pip builds in isolation: pip keeps ``sys.prefix`` and only hides
its site-packages from ``sys.path``).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import sysconfig
from collections.abc import Iterable, Sequence

__all__ = [
    "EXTENSION_PACKAGES",
    "extension_modules",
    "header_version",
    "host_libraries",
    "installed_wheels",
    "is_nvshmem_home",
    "lib_dirs",
    "loaded_host_library",
    "nvshmem_homes",
    "site_dirs",
    "torch_cuda_major",
    "torch_nvshmem_pin",
]

Version = tuple[int, int, int]

_WHEEL_RE = re.compile(r"^nvidia[-_]nvshmem[-_](cu\d+)$", re.I)

#: The NVSHMEM extension's prebuilt wheels, one distribution per CUDA major (``pip install odc-runtime-cu13``), each
#: the import package named here holding ``_C`` (so that it never overwrites a file of the pure wheel's package).
EXTENSION_PACKAGES = {"cu12": "odc_runtime_cu12", "cu13": "odc_runtime_cu13"}


def extension_modules(cuda_major: int | None) -> list[str]:
    """Import names of the NVSHMEM extension, in preference order: ``odc_runtime._C`` (a source build: in place, or
    installed with the package), then the extension wheel of ``cuda_major`` (torch's), then the other ones."""
    flavors = sorted(EXTENSION_PACKAGES, key=lambda f: f != f"cu{cuda_major}")
    return ["odc_runtime._C", *(f"{EXTENSION_PACKAGES[f]}._C" for f in flavors)]


def site_dirs() -> list[str]:
    """``platlib`` and ``purelib`` of the running interpreter's environment (existing ones, no duplicates)."""
    dirs: list[str] = []
    paths = sysconfig.get_paths()
    for key in ("platlib", "purelib"):
        d = paths.get(key)
        if d and d not in dirs and os.path.isdir(d):
            dirs.append(d)
    return dirs


def is_nvshmem_home(d: str) -> bool:
    """``d`` holds ``include/nvshmem.h`` and ``lib/libnvshmem_host.so*`` (an NVSHMEM install or wheel dir)."""
    return os.path.isfile(os.path.join(d, "include", "nvshmem.h")) and bool(host_libraries(os.path.join(d, "lib")))


def host_libraries(lib_dir: str) -> list[str]:
    """``libnvshmem_host.so*`` files in ``lib_dir``, the versioned soname first."""
    libs = glob.glob(os.path.join(lib_dir, "libnvshmem_host.so*"))
    return sorted(libs, key=lambda p: (not p.endswith(".so.3"), p))


def _spec_dirs() -> list[str]:
    """``nvidia/nvshmem`` directories importable from ``sys.path`` (the ``nvidia`` namespace package)."""
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec else []


def nvshmem_homes(target_site_dirs: Sequence[str] | None = None, *, include_sys_path: bool = True) -> list[str]:
    """NVSHMEM installs in preference order: ``$NVSHMEM_HOME``, the wheel in ``target_site_dirs``, then (with
    ``include_sys_path``) any ``nvidia.nvshmem`` importable from ``sys.path`` (e.g. a build requirement in pip's
    isolated build environment). Only directories that really hold headers and the host library."""
    cands: list[str] = []
    if os.environ.get("NVSHMEM_HOME"):
        cands.append(os.environ["NVSHMEM_HOME"])
    for site in site_dirs() if target_site_dirs is None else target_site_dirs:
        cands.append(os.path.join(site, "nvidia", "nvshmem"))
    if include_sys_path:
        cands.extend(_spec_dirs())
    out: list[str] = []
    for d in cands:
        d = os.path.abspath(d)
        if d not in out and is_nvshmem_home(d):
            out.append(d)
    return out


def lib_dirs() -> list[str]:
    """Directories to load ``libnvshmem_host.so.3`` from at run time, in preference order: ``$NVSHMEM_HOME/lib``,
    then the installed ``nvidia-nvshmem`` wheel(s) importable from ``sys.path``. Existing directories only."""
    dirs: list[str] = []
    if os.environ.get("NVSHMEM_HOME"):
        dirs.append(os.path.join(os.environ["NVSHMEM_HOME"], "lib"))
    dirs.extend(os.path.join(d, "lib") for d in _spec_dirs())
    out: list[str] = []
    for d in dirs:
        d = os.path.abspath(d)
        if d not in out and os.path.isdir(d):
            out.append(d)
    return out


def header_version(home: str) -> Version | None:
    """(major, minor, patch) from ``include/non_abi/nvshmem_version.h`` under an NVSHMEM install, else None."""
    for rel in (("include", "non_abi", "nvshmem_version.h"), ("include", "nvshmem_version.h")):
        p = os.path.join(home, *rel)
        if os.path.isfile(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                text = f.read()
            parts = [
                re.search(rf"#define\s+NVSHMEM_VENDOR_{k}_VERSION\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")
            ]
            if all(parts):
                return tuple(int(m.group(1)) for m in parts)  # type: ignore[union-attr,return-value]
    return None


def _dist_infos(dirs: Iterable[str], name_glob: str) -> list[str]:
    out: list[str] = []
    for site in dirs:
        out.extend(sorted(glob.glob(os.path.join(site, name_glob))))
    return out


def installed_wheels(target_site_dirs: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """``[(flavor, version)]`` of installed ``nvidia-nvshmem-cu12/-cu13`` distributions, e.g. ``("cu13", "3.4.5")``."""
    dirs = site_dirs() if target_site_dirs is None else target_site_dirs
    out = []
    for d in _dist_infos(dirs, "nvidia_nvshmem_cu*.dist-info"):
        m = re.match(r"nvidia_nvshmem_(cu\d+)-([^-]+)\.dist-info$", os.path.basename(d), re.I)
        if m:
            out.append((m.group(1).lower(), m.group(2)))
    return out


def _requires(metadata: str) -> list[str]:
    return [ln.split(":", 1)[1].strip() for ln in metadata.splitlines() if ln.lower().startswith("requires-dist:")]


def torch_nvshmem_pin(target_site_dirs: Sequence[str] | None = None) -> tuple[str, str] | None:
    """``(flavor, version)`` of the NVSHMEM wheel the installed torch pins (``Requires-Dist:
    nvidia-nvshmem-cu13==3.4.5; ...`` in its metadata), read from its ``dist-info`` without importing torch.
    None when torch is not installed or pins no NVSHMEM (CPU builds, older releases)."""
    dirs = site_dirs() if target_site_dirs is None else target_site_dirs
    for d in _dist_infos(dirs, "torch-*.dist-info"):
        p = os.path.join(d, "METADATA")
        if not os.path.isfile(p):
            continue
        with open(p, encoding="utf-8", errors="replace") as f:
            reqs = _requires(f.read())
        for req in reqs:
            m = re.match(r"nvidia[-_]nvshmem[-_](cu\d+)\s*(?:\[[^\]]*\])?\s*==\s*([0-9][0-9A-Za-z.+]*)", req, re.I)
            if m:
                return m.group(1).lower(), m.group(2)
        return None
    return None


def torch_cuda_major(target_site_dirs: Sequence[str] | None = None) -> int | None:
    """CUDA major version of the installed torch (``torch/version.py``, read, not imported); None for CPU
    builds or without torch."""
    dirs = site_dirs() if target_site_dirs is None else target_site_dirs
    for site in dirs:
        p = os.path.join(site, "torch", "version.py")
        if os.path.isfile(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                m = re.search(r"^cuda\s*(?::\s*[^=]+)?=\s*['\"](\d+)\.", f.read(), re.M)
            return int(m.group(1)) if m else None
    return None


def loaded_host_library() -> str | None:
    """Path of the ``libnvshmem_host.so*`` mapped into this process (e.g. by ``import torch``), else None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if "libnvshmem_host.so" in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None
