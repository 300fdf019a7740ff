"""Runtime settings, parsed and validated in one place: explicit arguments win, then environment variables, then
defaults. A bad value is an :class:`~odc_runtime.errors.OdcUsageError` naming the variable; a variable that is set
but empty is an error too (it is never taken as "unset", nor as the current directory).

| env var | meaning | default |
|---|---|---|
| ``ODC_BACKEND`` | transport for ``init(backend=None)`` (a registry name) | first available (nvshmem, host) |
| ``ODC_TIMEOUT`` | seconds any blocking wait of the runtime may take before it fails | ``300`` |
| ``ODC_HEAP_SIZE`` | host transport: symmetric heap bytes per rank (``512M``, ``4G``, ...) | ``1G`` |
| ``ODC_SHM_DIR`` | host transport: directory of the shared-memory segments | ``/dev/shm`` |
| ``ODC_HOST_CHUNK_BYTES`` | host transport: bytes of an accumulate held under one lock | ``4M`` |
| ``ODC_REQUIRE_EXTENSION`` | tests: ``1`` turns "extension not built" skips into failures | ``0`` |

The nvshmem transport's ``ODC_NVSHMEM_*`` settings are parsed below as well (their own block); the build settings
(``ODC_BUILD_EXT``, ``ODC_CUDA_ARCHS``, ``ODC_BUILD_JOBS``) are read by ``setup.py``, which cannot import the package.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable

from odc_runtime.errors import OdcUsageError

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_HOST_HEAP_BYTES = 1 << 30
DEFAULT_HOST_CHUNK_BYTES = 4 << 20
DEFAULT_SHM_DIR = "/dev/shm"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env(name: str) -> str | None:
    """The value of environment variable ``name``, or ``None`` when unset.

    Raises OdcUsageError when it is set but empty (or blank): an empty value is almost always a shell mistake,
    and silently falling back to the default (or, for a path, to the current directory) would hide it.
    """
    raw = os.environ.get(name)
    if raw is None:
        return None
    if not raw.strip():
        raise OdcUsageError(f"{name} is set but empty; unset it to get the default, or give it a value")
    return raw.strip()


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


def resolve_size(arg: str | int | None, env_name: str, default: int) -> int:
    """``arg`` if given, else env var ``env_name`` if set, else ``default``."""
    if arg is not None:
        return parse_size(arg, what=env_name.lower())
    raw = env(env_name)
    if raw is not None:
        return parse_size(raw, what=env_name)
    return default


def resolve_timeout(arg: float | None) -> float:
    """Timeout in seconds from ``arg``, else ``ODC_TIMEOUT``, else the default."""
    if arg is not None:
        raw: object = arg
        what = "timeout"
    else:
        raw = env("ODC_TIMEOUT")
        what = "ODC_TIMEOUT"
        if raw is None:
            return DEFAULT_TIMEOUT_S
    if isinstance(raw, bool):
        raise OdcUsageError(f"{what} must be a number of seconds, got {raw!r}")
    try:
        timeout = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise OdcUsageError(f"{what} must be a number of seconds, got {raw!r}") from None
    if not (timeout > 0 and math.isfinite(timeout)):
        raise OdcUsageError(f"{what} must be a positive, finite number of seconds, got {raw!r}")
    return timeout


def shm_dir() -> str:
    """Directory that holds the host transport's shared-memory segments (``ODC_SHM_DIR``, default ``/dev/shm``).

    Raises OdcUsageError if the variable is set but empty, or names something that exists and is not a directory.
    A directory that does not exist is reported by the transport when it tries to create its segment.
    """
    directory = env("ODC_SHM_DIR") or DEFAULT_SHM_DIR
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise OdcUsageError(
            f"ODC_SHM_DIR={directory!r} is not a directory; point it at a directory on a tmpfs (e.g. /dev/shm)"
        )
    return directory


def host_chunk_bytes() -> int:
    """Bytes of one host accumulate held under one lock (``ODC_HOST_CHUNK_BYTES``)."""
    return resolve_size(None, "ODC_HOST_CHUNK_BYTES", DEFAULT_HOST_CHUNK_BYTES)


def host_heap_bytes(arg: str | int | None) -> int:
    """Host symmetric heap bytes per rank: ``init(heap_size=...)``, else ``ODC_HEAP_SIZE``, else 1 GiB."""
    return resolve_size(arg, "ODC_HEAP_SIZE", DEFAULT_HOST_HEAP_BYTES)


def backend_name(arg: str | None) -> str | None:
    """The requested transport: ``arg``, else ``ODC_BACKEND``, else ``None`` (pick the first available).

    Only the type is checked here; the name is checked against the transport registry by ``init``.
    """
    if arg is not None:
        if not isinstance(arg, str) or not arg.strip():
            raise OdcUsageError(f"backend must be a transport name (str) or None, got {arg!r}")
        return arg.strip()
    return env("ODC_BACKEND")


def env_flag(name: str, default: bool) -> bool:
    """A boolean setting: ``1/true/yes/on`` or ``0/false/no/off`` (case-insensitive)."""
    raw = env(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise OdcUsageError(f"{name} must be 0 or 1 (or true/false), got {raw!r}")


def env_int(name: str, default: int, *, minimum: int = 1) -> int:
    """An integer setting (sizes such as ``64K`` accepted) of at least ``minimum``."""
    raw = env(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = parse_size(raw, what=name)
    if value < minimum:
        raise OdcUsageError(f"{name} must be at least {minimum}, got {raw!r}")
    return value


def env_choice(name: str, choices: Iterable[str], default: str) -> str:
    """A setting with a fixed set of values (compared case-insensitively)."""
    options = tuple(choices)
    raw = env(name)
    if raw is None:
        return default
    if raw.lower() not in options:
        raise OdcUsageError(f"{name} must be one of {', '.join(options)}, got {raw!r}")
    return raw.lower()


def require_extension() -> bool:
    """``ODC_REQUIRE_EXTENSION``: tests fail (instead of skipping) when the compiled extension is missing."""
    return env_flag("ODC_REQUIRE_EXTENSION", False)


# -- nvshmem transport settings (ODC_NVSHMEM_*) ----------------------------------------------------------------
# (block kept for the nvshmem transport; its parsers live here so that every ODC_* variable is validated in one
# place)
