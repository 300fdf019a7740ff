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
