"""Runtime settings, parsed and validated in one place: explicit arguments win, then environment variables, then
defaults. A bad value is an ``OdcUsageError`` naming the variable; a variable that is set
but empty is an error too (it is never taken as "unset", nor as the current directory).

Every setting (variable, meaning, default, accepted values) is listed once, in the configuration table of
docs/configuration.md; tests/test_config.py checks that every ``ODC_*`` name that the package, setup.py, the tests
and .ci read is in it.

The nvshmem transport's ``ODC_NVSHMEM_*`` settings are parsed below as well (their own block); the build settings
(``ODC_BUILD_EXT``, ``ODC_CUDA_ARCHS``, ``ODC_BUILD_JOBS``) are read by ``setup.py``, which cannot import the package.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from odc_runtime.errors import OdcUsageError

DEFAULT_TIMEOUT_S = 300.0
# A wait longer than this is not a deadline (a year: "never" in practice). Python's own waits refuse more than
# threading.TIMEOUT_MAX (about 292 years as a C time_t of nanoseconds): a larger ODC_TIMEOUT made every wait raise
# OverflowError instead of waiting.
MAX_TIMEOUT_S = 365.0 * 24 * 3600
DEFAULT_HOST_HEAP_BYTES = 1 << 30
DEFAULT_HOST_CHUNK_BYTES = 4 << 20
DEFAULT_SHM_DIR = "/dev/shm"
MIN_HOST_HEAP_BYTES = 4096  # one page: room for at least one allocation (the heap aligns to 256 bytes)
MIN_HOST_CHUNK_BYTES = 8  # one element of the widest dtype
MAX_BYTES = 1 << 47  # the user address space of 64-bit Linux (4-level page tables): nothing larger can be mapped

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_INT_RE = re.compile(r"^[+]?\d+$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of environment variable ``name`` (in ``environ``, default ``os.environ``), or ``None`` when unset.

    Raises OdcUsageError when it is set but empty (or blank): an empty value is almost always a shell mistake,
    and silently falling back to the default (or, for a path, to the current directory) would hide it.
    """
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return None
    if not raw.strip():
        raise OdcUsageError(f"{name} is set but empty; unset it to get the default, or give it a value")
    return raw.strip()


def parse_size(value: str | int, *, what: str, minimum: int = 1, maximum: int = MAX_BYTES) -> int:
    """Parse a byte count such as ``4096``, ``512M``, ``1.5G`` or ``2GiB`` (binary units) exactly.

    The result must be a whole number of bytes in ``[minimum, maximum]`` (``maximum`` defaults to what a 64-bit
    platform's user address space can map, 128 TiB); every refusal is an OdcUsageError naming ``what`` and the
    accepted form."""
    form = "a whole number of bytes such as 4096, 512M, 1.5G or 2GiB"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise OdcUsageError(f"{what}: expected {form} (int or str), got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE_RE.match(value)
        if m is None:
            raise OdcUsageError(f"{what}: cannot parse size {value!r}; use {form}")
        exact = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]  # no float: exact, and no overflow
        if exact.denominator != 1:
            raise OdcUsageError(f"{what}: {value!r} is not a whole number of bytes; use {form}")
        size = int(exact)
    if size < minimum:
        raise OdcUsageError(f"{what} must be at least {minimum} bytes, got {value!r}; use {form}")
    if size > maximum:
        raise OdcUsageError(f"{what} must be at most {maximum} bytes (2^{maximum.bit_length() - 1}), got {value!r}")
    return size


def resolve_size(
    arg: str | int | None, env_name: str, default: int, *, arg_name: str | None = None, minimum: int = 1
) -> int:
    """``arg`` if given (``arg_name`` in messages), else env var ``env_name`` if set, else ``default``."""
    if arg is not None:
        return parse_size(arg, what=arg_name or env_name.lower(), minimum=minimum)
    raw = env(env_name)
    if raw is not None:
        return parse_size(raw, what=env_name, minimum=minimum)
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
    if timeout > MAX_TIMEOUT_S:
        raise OdcUsageError(
            f"{what} must be at most {MAX_TIMEOUT_S:g} seconds (a year), got {raw!r}; a deadline that long already "
            "means 'never time out'"
        )
    return timeout


def shm_dir() -> str:
    """Directory that holds the host transport's shared-memory segments (``ODC_SHM_DIR``, default ``/dev/shm``).

    Raises OdcUsageError if the variable is set but empty, or names something that exists and is not a directory.
    A directory that does not exist is reported by the transport when it tries to create its segment.
    """
    env("ODC_SHM_DIR")  # set but empty: an error
    directory = shm_dir_as_set()
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise OdcUsageError(
            f"ODC_SHM_DIR={directory!r} is not a directory; point it at a directory on a tmpfs (e.g. /dev/shm)"
        )
    return directory


def shm_dir_as_set() -> str:
    """``ODC_SHM_DIR`` as written, unchecked (for reports about an unusable value), else the default."""
    return os.environ.get("ODC_SHM_DIR", "").strip() or DEFAULT_SHM_DIR


def host_chunk_bytes() -> int:
    """Bytes of one host accumulate held under one lock (``ODC_HOST_CHUNK_BYTES``)."""
    return resolve_size(
        None, "ODC_HOST_CHUNK_BYTES", DEFAULT_HOST_CHUNK_BYTES, minimum=MIN_HOST_CHUNK_BYTES
    )


def host_heap_bytes(arg: str | int | None) -> int:
    """Host symmetric heap bytes per rank: ``init(heap_size=...)``, else ``ODC_HEAP_SIZE``, else 1 GiB."""
    return resolve_size(
        arg, "ODC_HEAP_SIZE", DEFAULT_HOST_HEAP_BYTES, arg_name="init(heap_size=...)", minimum=MIN_HOST_HEAP_BYTES
    )


def trace_dir(arg: str | os.PathLike[str] | None = None) -> str | None:
    """The directory of the per-minibatch trace (``odc_runtime.telemetry``): ``init(trace_dir=...)``, else
    ``ODC_TRACE_DIR``, as an absolute path; ``None`` when neither is set (no trace). Raises OdcUsageError when it
    names something that exists and is not a directory."""
    if arg is not None and not isinstance(arg, (str, os.PathLike)):
        raise OdcUsageError(f"odc_runtime.init(trace_dir=...): expected a path, got {type(arg).__name__}")
    directory = os.fspath(arg) if arg is not None else env("ODC_TRACE_DIR")
    if directory is None:
        return None
    if not directory:
        raise OdcUsageError("odc_runtime.init(trace_dir=...): an empty path; pass a directory or None (no trace)")
    directory = os.path.abspath(os.path.expanduser(directory))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise OdcUsageError(f"trace directory {directory!r} (init(trace_dir=...) / ODC_TRACE_DIR) is not a "
                            "directory; point it at a directory (created if missing) to get one trace file per rank")
    return directory


def backend_name(arg: str | None) -> str | None:
    """The requested transport: ``arg``, else ``ODC_BACKEND``, else ``None`` (``odc_runtime.transport.choose``).

    Only the type is checked here; the name is checked against the transport registry by ``init``.
    """
    if arg is not None:
        if not isinstance(arg, str) or not arg.strip():
            raise OdcUsageError(f"backend must be a transport name (str) or None, got {arg!r}")
        return arg.strip()
    return env("ODC_BACKEND")


def _positive_int(arg: int | None, name: str, env_name: str) -> int | None:
    """``arg`` if given (a positive int, else OdcUsageError naming ``name``), else the ``env_name`` setting, else
    ``None``."""
    if arg is not None:
        if isinstance(arg, bool) or not isinstance(arg, int) or arg < 1:
            raise OdcUsageError(f"{name} must be a positive int or None, got {arg!r}")
        return arg
    if env(env_name) is not None:
        return env_count(env_name, 1)
    return None


def node_size(arg: int | None, world_size: int) -> int | None:
    """Ranks per node: ``init(node_size=...)``, else ``ODC_NODE_SIZE``, else ``None`` (ask the transport).

    Raises OdcUsageError unless it is a positive integer that divides ``world_size``."""
    value = _positive_int(arg, "node_size", "ODC_NODE_SIZE")
    if value is not None and world_size % value:
        what = f"node_size={value}" if arg is not None else f"ODC_NODE_SIZE={value}"
        raise OdcUsageError(
            f"{what} does not divide the world of {world_size} ranks; nodes are blocks of consecutive ranks of one "
            "size (e.g. 8 GPUs per node), so pick a divisor of the world size"
        )
    return value


def node_slots(arg: int | None) -> int | None:
    """Inbox slots per hierarchical tensor: ``init(node_slots=...)``, else ``ODC_NODE_SLOTS``, else ``None`` (one
    per other node). Raises OdcUsageError unless it is a positive integer."""
    return _positive_int(arg, "node_slots", "ODC_NODE_SLOTS")


def deterministic(arg: bool | None) -> bool:
    """Deterministic accumulation: ``init(deterministic=...)``, else ``ODC_DETERMINISTIC``, else off."""
    if arg is None:
        return env_flag("ODC_DETERMINISTIC", False)
    if not isinstance(arg, bool):
        raise OdcUsageError(f"odc_runtime.init(): deterministic must be a bool or None, got {arg!r}")
    return arg


def debug() -> bool:
    """``ODC_DEBUG``: fingerprint every collective call of the core API and compare it across ranks
    (``odc_runtime.debug``); off by default."""
    return env_flag("ODC_DEBUG", False)


def env_flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """A boolean setting: ``1/true/yes/on`` or ``0/false/no/off`` (case-insensitive)."""
    raw = env(name, environ)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise OdcUsageError(f"{name} must be 0 or 1 (or true/false), got {raw!r}")


def env_int(name: str, default: int, *, minimum: int = 1, environ: Mapping[str, str] | None = None) -> int:
    """A byte-size setting (``4096``, ``64K``; see ``parse_size``) of at least ``minimum``."""
    raw = env(name, environ)
    if raw is None:
        return default
    if _INT_RE.match(raw) and int(raw) < minimum:
        raise OdcUsageError(f"{name} must be at least {minimum}, got {raw!r}")
    return parse_size(raw, what=name, minimum=minimum)


def env_count(name: str, default: int, *, minimum: int = 1, environ: Mapping[str, str] | None = None) -> int:
    """A count setting: a plain decimal integer (no unit, no fraction) of at least ``minimum``."""
    raw = env(name, environ)
    if raw is None:
        return default
    if not _INT_RE.match(raw):
        raise OdcUsageError(f"{name} must be a whole number written in decimal digits (e.g. 8), got {raw!r}")
    value = int(raw)
    if value < minimum:
        raise OdcUsageError(f"{name} must be at least {minimum}, got {raw!r}")
    return value


def env_choice(name: str, choices: Iterable[str], default: str, environ: Mapping[str, str] | None = None) -> str:
    """A setting with a fixed set of values (compared case-insensitively)."""
    options = tuple(choices)
    raw = env(name, environ)
    if raw is None:
        return default
    if raw.lower() not in options:
        raise OdcUsageError(f"{name} must be one of {', '.join(options)}, got {raw!r}")
    return raw.lower()


def symm_heap(environ: Mapping[str, str] | None = None) -> str:
    """``ODC_SYMM_HEAP``: where the ``symm`` transport's GPU heap comes from. ``auto`` (default): PyTorch's
    SymmetricMemory where every rank has a GPU of its own, else CUDA IPC; ``symmetric-memory`` or ``ipc`` force
    one (``odc_runtime.transport.symm.torch_heap.choose_provider``)."""
    return env_choice("ODC_SYMM_HEAP", ("auto", "symmetric-memory", "ipc"), "auto", environ)


def require_extension() -> bool:
    """``ODC_REQUIRE_EXTENSION``: tests fail (instead of skipping) when the compiled extension is missing."""
    return env_flag("ODC_REQUIRE_EXTENSION", False)


def require_verl() -> bool:
    """``ODC_REQUIRE_VERL``: the real-veRL tests fail (instead of skipping) when veRL is not importable."""
    return env_flag("ODC_REQUIRE_VERL", False)


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


def nvshmem_settings(environ: Mapping[str, str] | None = None) -> NvshmemSettings:
    """Parse the ``ODC_NVSHMEM_*`` variables (from ``environ``, default ``os.environ``) with the parsers above;
    raise OdcUsageError on bad or set-but-empty values, naming the variable and what it accepts."""
    cell = env_int("ODC_NVSHMEM_CELL_BYTES", DEFAULT_NVSHMEM_CELL_BYTES, environ=environ)
    if cell % 16 or cell > 1 << 30:
        raise OdcUsageError(f"ODC_NVSHMEM_CELL_BYTES must be a multiple of 16 up to 1G; got {cell}")
    slots: int | None = None
    if env("ODC_NVSHMEM_SCRATCH_SLOTS", environ) is not None:
        slots = env_count("ODC_NVSHMEM_SCRATCH_SLOTS", 1, environ=environ)
        if slots > 65536:
            raise OdcUsageError(f"ODC_NVSHMEM_SCRATCH_SLOTS must be an integer in [1, 65536]; got {slots}")
    return NvshmemSettings(
        push=env_choice("ODC_NVSHMEM_PUSH", ("auto", "locked"), "auto", environ),
        fetch=env_choice("ODC_NVSHMEM_FETCH", ("copy", "kernel"), "copy", environ),
        cell_bytes=cell,
        scratch_slots=slots,
        vector_atomics=env_flag("ODC_NVSHMEM_VECTOR_ATOMICS", True, environ),
    )


# -- the settings' registry -----------------------------------------------------------------------------------
# Every ODC_* variable the installed package or its build reads, with the call that parses and checks it alone
# (None: read where it has context: ODC_NODE_SIZE is checked against the world size at init, the build settings
# by setup.py). `python -m odc_runtime.doctor` checks every one that is set; tests/test_config.py checks that this
# holds every name the package and setup.py read.
SETTINGS: dict[str, Callable[[], object] | None] = {
    "ODC_BACKEND": lambda: backend_name(None),
    "ODC_TIMEOUT": lambda: resolve_timeout(None),
    "ODC_HEAP_SIZE": lambda: host_heap_bytes(None),
    "ODC_HOST_CHUNK_BYTES": host_chunk_bytes,
    "ODC_SHM_DIR": shm_dir,
    "ODC_TRACE_DIR": trace_dir,
    "ODC_NODE_SIZE": lambda: _positive_int(None, "node_size", "ODC_NODE_SIZE"),
    "ODC_NODE_SLOTS": lambda: node_slots(None),
    "ODC_DETERMINISTIC": lambda: deterministic(None),
    "ODC_DEBUG": debug,
    "ODC_SYMM_HEAP": symm_heap,
    "ODC_NVSHMEM_PUSH": nvshmem_settings,
    "ODC_NVSHMEM_FETCH": nvshmem_settings,
    "ODC_NVSHMEM_CELL_BYTES": nvshmem_settings,
    "ODC_NVSHMEM_SCRATCH_SLOTS": nvshmem_settings,
    "ODC_NVSHMEM_VECTOR_ATOMICS": nvshmem_settings,
    "ODC_REQUIRE_EXTENSION": require_extension,
    "ODC_REQUIRE_VERL": require_verl,
    "ODC_BUILD_EXT": None,
    "ODC_CUDA_ARCHS": None,
    "ODC_BUILD_JOBS": None,
}
# The ODC_* variables of the project's tests and CI scripts (docs/configuration.md lists them too): known names, not
# settings of the package.
TOOLING = ("ODC_COMPAT_CACHE", "ODC_COMPAT_TORCH", "ODC_GPU_BUDGET_S", "ODC_GPU_PHASE_BUDGET_S", "ODC_GPU_REPORT_DIR",
           "ODC_GPU_TEST_BACKEND", "ODC_NVSHMEM_WHEEL", "ODC_RELEASE_CACHE", "ODC_STRESS_ITERATIONS", "ODC_STRESS_SEED",
           "ODC_TEST_INSTALLED", "ODC_TRITON_CACHE", "ODC_TRITON_LINES", "ODC_VERL_CACHE", "ODC_VERL_VERSION",
           "ODC_WHEEL_CACHE")


def odc_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every ``ODC_*`` variable set (in ``environ``, default ``os.environ``), name to raw value, sorted by name."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in sorted(environ) if name.startswith("ODC_")}


def unknown_variables(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The ``ODC_*`` variables set that odc_runtime reads nowhere (neither in ``SETTINGS`` nor ``TOOLING``), each
    with the setting its name is closest to (``None`` when none is close): a misspelt setting is otherwise ignored
    without a word."""
    unknown: dict[str, str | None] = {}
    for name in odc_variables(environ):
        if name not in SETTINGS and name not in TOOLING:
            close = difflib.get_close_matches(name, SETTINGS, n=1, cutoff=0.75)
            unknown[name] = close[0] if close else None
    return unknown


def describe_unknown(nearest: str | None) -> str:
    """What to say about an unknown ``ODC_*`` variable whose closest setting is ``nearest`` (``unknown_variables``)."""
    return "odc_runtime does not read it" + (f": did you mean {nearest}?" if nearest else "")
