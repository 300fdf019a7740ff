"""Runtime settings: explicit arguments win, then environment variables, then defaults.

| env var | meaning | default |
|---|---|---|
| ``ODC_BACKEND`` | backend for ``init(backend=None)`` | ``nvshmem`` with CUDA + extension, else ``host`` |
| ``ODC_TIMEOUT`` | seconds a blocking wait (``sync``, ``finalize``, handles) may take before it fails | ``300`` |
| ``ODC_HEAP_SIZE`` | host transport: symmetric heap bytes per rank (``512M``, ``4G``, ...) | ``1G`` |
| ``ODC_SHM_DIR`` | host transport: directory of the shared-memory segments | ``/dev/shm`` |
| ``ODC_HOST_CHUNK_BYTES`` | host transport: bytes of an accumulate held under one lock | ``4M`` |
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from odc_runtime.errors import OdcUsageError

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_HOST_HEAP_BYTES = 1 << 30
DEFAULT_HOST_CHUNK_BYTES = 4 << 20
DEFAULT_SHM_DIR = "/dev/shm"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: str | int, *, what: str) -> int:
    """Parse a byte count such as ``4096``, ``512M``, ``1.5G`` or ``2GiB`` (binary units)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise OdcUsageError(f"{what}: expected a byte count (int) or a string such as '512M', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE_RE.match(value)
        if m is None:
            raise OdcUsageError(f"{what}: cannot parse size {value!r}; use e.g. 4096, 512M or 2G")
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise OdcUsageError(f"{what} must be positive, got {value!r}")
    return size


def resolve_size(arg: str | int | None, env: str, default: int) -> int:
    """``arg`` if given, else env var ``env`` if set, else ``default``."""
    if arg is not None:
        return parse_size(arg, what=env.lower())
    if os.environ.get(env):
        return parse_size(os.environ[env], what=env)
    return default


def resolve_timeout(arg: float | None) -> float:
    """Timeout in seconds from ``arg``, else ``ODC_TIMEOUT``, else the default."""
    raw: object = arg if arg is not None else os.environ.get("ODC_TIMEOUT", DEFAULT_TIMEOUT_S)
    try:
        timeout = float(raw)  # type: ignore[arg-type]
    except ValueError:
        raise OdcUsageError(f"ODC_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if not (timeout > 0 and math.isfinite(timeout)):
        raise OdcUsageError(f"timeout must be a positive number of seconds, got {raw!r}")
    return timeout


def shm_dir() -> str:
    """Directory that holds the host transport's shared-memory segments."""
    return os.environ.get("ODC_SHM_DIR", DEFAULT_SHM_DIR)


# -- nvshmem transport settings (owned by the GPU transport; agreed across ranks at init) ---------------------
DEFAULT_NVSHMEM_CELL_BYTES = 64 << 10


@dataclass(frozen=True)
class NvshmemSettings:
    """Protocol settings of the nvshmem transport. Every field must be the same on every rank (checked at init:
    mixing push protocols loses updates, and the scratch is a symmetric allocation).

    Attributes:
        push: ``"auto"`` (atomics through peer pointers when every PE reaches every PE with load/store atomics,
            else the locked protocol) or ``"locked"`` (force lock + get + add + put). ``ODC_NVSHMEM_PUSH``.
        fetch: ``"copy"`` (copy engines: ``cudaMemcpyAsync`` on peer pointers) or ``"kernel"`` (an SM copy
            kernel). ``ODC_NVSHMEM_FETCH``.
        cell_bytes: locked protocol's lock granule and scratch slot size. ``ODC_NVSHMEM_CELL_BYTES``.
        scratch_slots: locked protocol's scratch slots (one block each); ``None`` = one per SM (the largest SM
            count of any rank). ``ODC_NVSHMEM_SCRATCH_SLOTS``.
        vector_atomics: 4-wide fp32 atomics on sm_90+. ``ODC_NVSHMEM_VECTOR_ATOMICS``.
    """

    push: str = "auto"
    fetch: str = "copy"
    cell_bytes: int = DEFAULT_NVSHMEM_CELL_BYTES
    scratch_slots: int | None = None
    vector_atomics: bool = True


def nvshmem_settings(env: Mapping[str, str] | None = None) -> NvshmemSettings:
    """Parse the ``ODC_NVSHMEM_*`` variables (from ``env``, default ``os.environ``); raise OdcUsageError on bad
    values, naming the variable and what it accepts."""
    env = os.environ if env is None else env

    def choice(name: str, allowed: tuple[str, ...], default: str) -> str:
        value = env.get(name, "").strip().lower() or default
        if value not in allowed:
            raise OdcUsageError(f"{name} must be one of {', '.join(allowed)}; got {env.get(name)!r}")
        return value

    def flag(name: str, default: bool) -> bool:
        raw = env.get(name, "").strip().lower()
        if not raw:
            return default
        if raw in ("1", "true", "yes", "on"):
            return True
        if raw in ("0", "false", "no", "off"):
            return False
        raise OdcUsageError(f"{name} must be 0/1 (or true/false); got {env.get(name)!r}")

    cell = DEFAULT_NVSHMEM_CELL_BYTES
    if env.get("ODC_NVSHMEM_CELL_BYTES", "").strip():
        cell = parse_size(env["ODC_NVSHMEM_CELL_BYTES"], what="ODC_NVSHMEM_CELL_BYTES")
        if cell % 16 or cell > 1 << 30:
            raise OdcUsageError(f"ODC_NVSHMEM_CELL_BYTES must be a multiple of 16 up to 1G; got {cell}")
    slots: int | None = None
    raw_slots = env.get("ODC_NVSHMEM_SCRATCH_SLOTS", "").strip()
    if raw_slots:
        try:
            slots = int(raw_slots)
        except ValueError:
            slots = 0
        if not 1 <= slots <= 65536:
            raise OdcUsageError(f"ODC_NVSHMEM_SCRATCH_SLOTS must be an integer in [1, 65536]; got {raw_slots!r}")
    return NvshmemSettings(
        push=choice("ODC_NVSHMEM_PUSH", ("auto", "locked"), "auto"),
        fetch=choice("ODC_NVSHMEM_FETCH", ("copy", "kernel"), "copy"),
        cell_bytes=cell,
        scratch_slots=slots,
        vector_atomics=flag("ODC_NVSHMEM_VECTOR_ATOMICS", True),
    )
