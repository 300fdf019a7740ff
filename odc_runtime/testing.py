"""A small public surface for tests, benchmarks and debugging: the live runtime's transport and its state.

Nothing here is needed to train; it exists so that tests and tools do not import private names of the core API.
``install`` / ``uninstall`` run the public API over a transport built by hand (a fake extension, a cost
model); ``abandon`` drops a runtime without the collective ``finalize``.
The transport returned by ``transport`` follows the contract of ``odc_runtime.transport.base`` (its
``failure``, ``capabilities``, ``device_type``, heap accounting and one-sided operations).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

from odc_runtime import state
from odc_runtime.errors import OdcError, OdcUsageError
from odc_runtime.sharded import ShardedTensor
from odc_runtime.transport.base import SymmetricBuffer, TransferPlan, Transport


def transport() -> Transport:
    """The live runtime's transport; OdcNotInitializedError before ``init`` / after ``finalize``."""
    return state.require("testing.transport", read_only=True).transport


def failure() -> OdcError | None:
    """The live runtime's recorded failure (``None`` while healthy or when no runtime is live)."""
    runtime = state.current
    return None if runtime is None else runtime.transport.failure


def install(transport: Transport) -> None:
    """Make ``transport``, built outside ``odc.init`` (a transport over a fake extension, a cost model), the live
    runtime's transport (one node: no hierarchy), so that the public API runs on it. The caller owns it: undo
    with ``uninstall``. OdcUsageError while a runtime is live."""
    if state.current is not None:
        raise OdcUsageError("odc_runtime.testing.install(): a runtime is live; finalize or uninstall it first")
    state.start(transport)


def uninstall() -> Transport | None:
    """Drop the live runtime *locally* without finalizing its transport (the caller owns it, as after
    ``install``); returns that transport, or ``None`` when no runtime was live."""
    runtime = state.take()
    return None if runtime is None else runtime.transport


def abandon() -> None:
    """Release this rank's runtime *locally*, without the collective ``finalize`` (for a rank whose peers may never
    reach it, e.g. a test rank that raised). Does nothing without a live runtime."""
    transport = uninstall()
    if transport is not None:
        transport.finalize()


def buffers(st: ShardedTensor) -> tuple[SymmetricBuffer, SymmetricBuffer | None]:
    """The symmetric buffers behind ``st``: ``(parameters, gradient accumulator or None)`` (their ``handle`` is
    transport-private: the host transport's heap offset)."""
    return st._param, st._grad


def plans(st: ShardedTensor) -> list[TransferPlan]:
    """The fetch/push plans cached for ``st`` (``odc_runtime.plans``)."""
    return st._plans.plans()


def in_forked_child() -> bool:
    """Whether this process is a fork of an initialised rank (where the runtime refuses every mutating call)."""
    return state.in_forked_child


@contextlib.contextmanager
def stubbed_triton_launches(arch: int = 90) -> Iterator[collections.deque[tuple]]:
    """Triton's real launch path on a machine without a GPU, only the driver's launch stubbed: within the block,
    ``kernel[grid](...)`` binds, specialises and compiles for ``sm_<arch>`` (ptxas from the triton wheel) as on a
    GPU, loading the binary does nothing, and the launcher records its arguments (the last 64 launches, in the
    yielded deque) instead of calling ``cuLaunchKernel``. For host-cost benchmarks and tests of launch paths;
    tensors stay on the CPU and no kernel runs."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    launched: collections.deque[tuple] = collections.deque(maxlen=64)
    record = launched.append

    class Launcher:  # what the driver builds per compiled kernel: the launch itself, here a recorder
        def __init__(self, src: object, metadata: object) -> None:
            pass

        def __call__(self, *args: object) -> None:
            record(args)

    class Utils:
        def load_binary(self, name: str, kernel: bytes, shared: int, device: int) -> tuple[int, int, int, int, int]:
            return 1, 1, 0, 0, 1024  # module, function, registers, spills, max threads per block

        def get_device_properties(self, device: int) -> dict[str, int]:
            return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

        def unload_module(self, module: object) -> None:
            pass

    class Driver:
        utils = Utils()
        launcher_cls = Launcher

        def is_active(self) -> bool:
            return True

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

    previous = driver._active
    driver.set_active(Driver())  # type: ignore[arg-type]
    try:
        yield launched
    finally:
        driver._active = previous
