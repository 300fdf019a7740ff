"""Package a built NVSHMEM extension (``_C*.so``) as its wheel: ``odc-runtime-cuXY`` (import package
``odc_runtime_cuXY``, ``odc_runtime._nvshmem_locate.EXTENSION_PACKAGES``), which ``odc_runtime`` finds at run time.

    python .ci/ext_wheel.py --so build/ext-matrix/cu13-3.4.5/odc_runtime/_C.cpython-311-x86_64-linux-gnu.so \\
        --flavor cu13 --nvshmem 3.4.5 --out build/ext-wheels
    auditwheel repair --exclude libnvshmem_host.so.3 -w dist build/ext-wheels/odc_runtime_cu13-*.whl

The wheel requires ``nvidia-nvshmem-cuXY==<the NVSHMEM it was built against>`` (odc_runtime refuses another
release at init) and ``odc_runtime==<this version>``. Nothing is bundled: the module's run path is set to
``$ORIGIN/../nvidia/nvshmem/lib`` only (the NVIDIA wheel's directory next to it in site-packages; the absolute build
directories setup.py adds for source builds are dropped, with ``patchelf`` on ``PATH``); libcudart is linked
statically by CMake's default. The wheel is tagged ``linux_x86_64``; ``auditwheel repair`` (``patchelf`` on ``PATH``)
with ``--exclude libnvshmem_host.so.3`` (provided by the NVIDIA wheel, never bundled) then retags it with the
manylinux tag its symbol versions allow (``manylinux_2_35_x86_64`` when built on Debian 12's glibc 2.36 and GCC 12; a
manylinux container gives an older one) and changes nothing else.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RPATH = "$ORIGIN/../nvidia/nvshmem/lib"


def _load(name: str, path: Path) -> object:
    """A module of the package loaded by path (importing ``odc_runtime`` would import torch)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def package_version() -> str:
    """``odc_runtime.__version__``, read from the source (the one place it is written)."""
    text = (ROOT / "odc_runtime" / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    assert match, "odc_runtime/__init__.py has no __version__"
    return match.group(1)


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def build(so: Path, flavor: str, nvshmem: str, plat: str, out: Path) -> Path:
    """Write the wheel into ``out`` and return its path."""
    locate = _load("_odc_locate", ROOT / "odc_runtime" / "_nvshmem_locate.py")
    packages = locate.EXTENSION_PACKAGES  # type: ignore[attr-defined]
    package = packages[flavor]
    dist = package.replace("_", "-")
    version = package_version()
    tag = f"{sys.implementation.cache_tag.replace('cpython-', 'cp')}"
    wheel_name = f"{package}-{version}-{tag}-{tag}-{plat}.whl"
    if not so.name.endswith(sysconfig.get_config_var("EXT_SUFFIX")):
        raise SystemExit(f"{so} is not an extension module of this Python ({sysconfig.get_config_var('EXT_SUFFIX')})")
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / so.name
        shutil.copy2(so, staged)
        subprocess.run(["patchelf", "--set-rpath", RPATH, str(staged)], check=True)
        init = (
            f'"""The NVSHMEM extension of odc_runtime {version} for CUDA {flavor[2:]}, compiled against NVSHMEM '
            f'{nvshmem}: odc_runtime loads ``{package}._C`` when it has no ``odc_runtime._C`` of its own."""\n'
            f'NVSHMEM_VERSION = "{nvshmem}"\n'
        )
        info = f"{package}-{version}.dist-info"
        metadata = (
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
            f"Summary: odc_runtime's NVSHMEM extension (the nvshmem transport) for CUDA {flavor[2:]}\n"
            "License: Apache-2.0\nRequires-Python: >=3.10\n"
            f"Requires-Dist: odc_runtime=={version}\nRequires-Dist: nvidia-nvshmem-{flavor}=={nvshmem}\n"
            "Description-Content-Type: text/markdown\n\n"
            f"The compiled NVSHMEM extension of odc_runtime {version} (its multi-node `nvshmem` transport) for CUDA "
            f"{flavor[2:]}, built against NVSHMEM {nvshmem}. Install it next to `odc_runtime` and a CUDA {flavor[2:]} "
            "torch; `python -m odc_runtime.doctor` says whether it was found.\n"
        )
        wheel = (
            "Wheel-Version: 1.0\nGenerator: odc_runtime .ci/ext_wheel.py\nRoot-Is-Purelib: false\n"
            f"Tag: {tag}-{tag}-{plat}\n"
        )
        files = {
            f"{package}/__init__.py": init.encode(),
            f"{package}/{so.name}": staged.read_bytes(),
            f"{info}/METADATA": metadata.encode(),
            f"{info}/WHEEL": wheel.encode(),
            f"{info}/top_level.txt": f"{package}\n".encode(),
        }
        record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
        out.mkdir(parents=True, exist_ok=True)
        path = out / wheel_name
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            for name, data in files.items():
                entry = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
                entry.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
                z.writestr(entry, data, zipfile.ZIP_DEFLATED)
            z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--so", type=Path, required=True, help="the built _C*.so (e.g. of .ci/build_ext_matrix.sh)")
    parser.add_argument("--flavor", required=True, choices=["cu12", "cu13"], help="the CUDA major it was built for")
    parser.add_argument("--nvshmem", required=True, help="the NVSHMEM release it was compiled against, e.g. 3.4.5")
    parser.add_argument("--plat", default="linux_x86_64", help="platform tag (auditwheel repair: manylinux)")
    parser.add_argument("--out", type=Path, default=Path("dist"))
    args = parser.parse_args(argv)
    print(build(args.so, args.flavor, args.nvshmem, args.plat, args.out))


if __name__ == "__main__":
    main()
