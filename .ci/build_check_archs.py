"""Check which GPU architectures a built ``odc_runtime._C`` can run on (no GPU and no cuobjdump needed).

    python .ci/build_check_archs.py <path to _C*.so> [ARCHS]

Lists the entries of the ``.nv_fatbin`` ELF section (the fatbin the CUDA runtime loads; ``__nv_relfatbin`` is
relocatable input for further device linking and is never loaded) as ``sm_XX`` machine code / ``ptx XX``.
With ARCHS (CMake syntax, e.g. ``"80-real;90-real;100-real;120-real"``; default ``$ODC_CUDA_ARCHS`` or the
CMakeLists default) exits 1 unless machine code for each listed architecture is present. Fatbin layout: a
header (magic 0xBA55ED50, u16 version, u16 header size, u64 payload size) followed by entries (u16 kind
1=PTX 2=ELF, u16, u32 entry header size, u64 payload size, ..., u32 SM number at byte 28).
"""

from __future__ import annotations

import os
import re
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
DEFAULT_ARCHS = "80-real;90-real;100-real;120-real"


def _section(path: str, wanted: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path}: not a 64-bit ELF file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, ...]:
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    names_off = header(shstrndx)[4]
    for i in range(shnum):
        h = header(i)
        start = names_off + h[0]
        if data[start : data.index(b"\0", start)].decode() == wanted:
            return data[h[4] : h[4] + h[5]]
    return b""


def fatbin_entries(path: str) -> set[tuple[str, int]]:
    """``{("sass" | "ptx", sm)}`` of the loadable fatbin of an ELF shared object."""
    blob = _section(path, ".nv_fatbin")
    out: set[tuple[str, int]] = set()
    off = 0
    while off + 16 <= len(blob):
        magic, _version, hsize, size = struct.unpack_from("<IHHQ", blob, off)
        if magic != FATBIN_MAGIC:
            off += 8  # fatbins are 8-byte aligned inside the section
            continue
        p, end = off + hsize, off + hsize + size
        while p + 32 <= end:
            kind, _, ehsize, psize = struct.unpack_from("<HHIQ", blob, p)
            sm = struct.unpack_from("<I", blob, p + 28)[0]
            if kind in (1, 2):
                out.add(("ptx" if kind == 1 else "sass", sm))
            p += ehsize + psize
        off = end
    return out


def wanted_sass(archs: str) -> list[int]:
    """Real architectures of a CMake CUDA_ARCHITECTURES list ("90" and "90-real" both mean sm_90 code)."""
    return [
        int(m.group(1))
        for a in archs.split(";")
        if (m := re.fullmatch(r"\s*(\d+)[a-z]?(-real|-virtual)?\s*", a)) and m.group(2) != "-virtual"
    ]


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    entries = fatbin_entries(argv[1])
    sass = sorted(sm for kind, sm in entries if kind == "sass")
    ptx = sorted(sm for kind, sm in entries if kind == "ptx")
    print(
        f"{os.path.basename(argv[1])}: machine code for {', '.join(f'sm_{s}' for s in sass) or 'nothing'}; "
        f"PTX for {', '.join(f'compute_{s}' for s in ptx) or 'nothing'}"
    )
    archs = argv[2] if len(argv) > 2 else (os.environ.get("ODC_CUDA_ARCHS") or DEFAULT_ARCHS)
    if archs in ("all", "all-major", "native"):
        return 0
    missing = [a for a in wanted_sass(archs) if a not in sass]
    if missing:
        print(
            f"missing machine code for {', '.join(f'sm_{a}' for a in missing)} (asked for {archs!r})", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
