"""Kernels compiled the way their launchers call them, with no GPU (installed as ``odc_runtime.kernels.launch_check``).

Why: before compiling, Triton specializes a launch's arguments by value: an ``int`` equal to 1 becomes the
constant 1, ints and pointers divisible by 16 get an alignment attribute. The code a GPU runs therefore depends on
the values the callers pass, not only on their types, and ``triton.compile`` with a hand-written signature (the
PTX check's ``PTX_ARGS``) never builds those variants. Example: ``_accumulate_slots_kernel`` with one slot
(``k == 1``) was, on triton 3.5-3.6, a zero-trip loop that failed to compile (``PassManager::run failed``) on every
GPU, while its ``PTX_ARGS`` compiled fine with ``k`` typed ``i32``.

``compiled_launches`` installs a fake CUDA driver for one target (``sm_<arch>``), whose launch does nothing,
runs a kernel module's examples, and returns every kernel they compiled, with its specialization and its PTX (or
the compiler's error). The examples call the module's real launchers with CPU tensors standing for what real
callers pass, so a change of launcher (a new argument, another block size) is compiled as it will run.

The declaration, in the kernel module next to ``ORDERING`` / ``PTX_ARGS``::

    def launch_examples() -> list[tuple[str, str, Callable[[], object]]]:
        # (ORDERING case the call compiles, what it stands for, the call of a launcher of this module)
        return [("_accumulate_slots_kernel", "one slot (k == 1)", lambda: accumulate_slots_(dst, slots, 1.0, None))]

``odc_runtime.kernels.ptx`` checks each compiled launch's PTX against the case's ``ORDERING`` entry, and that
every case of the module is compiled by some example.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = ["Launch", "compiled_launches", "fake_cuda", "launch_examples"]


@dataclass
class Launch:
    """One kernel an example compiled through Triton's launch path (or failed to)."""

    case: str  # the ORDERING case the example names
    what: str  # what the example stands for
    kernel: str  # the @triton.jit function's name ("" when the example failed before any compile)
    signature: dict[str, str] = field(default_factory=dict)  # parameter -> type ("constexpr" when specialized)
    constants: dict[str, Any] = field(default_factory=dict)  # parameter -> value, constexprs and specialized ints
    aligned: list[str] = field(default_factory=list)  # parameters given the divisible-by-16 attribute
    ptx: str | None = None
    error: str | None = None

    @property
    def specialization(self) -> str:
        """The argument specialization in one line: ``k=i32 n=1 dst_ptr=*fp32/16 ...``."""
        parts = []
        for name, ty in self.signature.items():
            if ty == "constexpr":
                parts.append(f"{name}={self.constants.get(name)!s}")
            else:
                parts.append(f"{name}:{ty}" + ("/16" if name in self.aligned else ""))
        return " ".join(parts)


def launch_examples(module: ModuleType) -> list[tuple[str, str, Callable[[], object]]]:
    """The module's ``launch_examples()`` (empty when it declares none)."""
    make = getattr(module, "launch_examples", None)
    return list(make()) if make is not None else []


class _Utils:
    """``driver.active.utils`` of the fake driver: nothing is loaded, the device is as large as any."""

    def load_binary(self, name: str, kernel: bytes, shared: int, device: int) -> tuple[None, int, int, int, int]:
        return None, 0, 0, 0, 1024  # module (None: never unloaded), function, n_regs, n_spills, n_max_threads

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": 1 << 30, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def unload_module(self, module: object) -> None:
        pass


class _FakeCuda:
    """A Triton driver for ``sm_<arch>`` with no GPU: compiling works as on a GPU, launching does nothing but
    hand the compiled kernel to ``on_launch``."""

    utils = _Utils()

    def __init__(self, arch: int, on_launch: Callable[[Any], None]) -> None:
        self.arch = arch
        self.device = -arch  # the JIT caches compiled kernels per device: one key per target, no real device's
        self._on_launch = on_launch

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> int:
        return self.device

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def launcher_cls(self, src: Any, metadata: Any) -> Callable[..., None]:
        from triton.runtime.driver import driver

        kernel = _compiled_kernel(src, metadata, self.device)

        def launch(*args: Any, **kwargs: Any) -> None:
            # The kernel keeps this launcher for its later launches, maybe under another fake_cuda block.
            driver.active._on_launch(kernel)

        return launch


@contextlib.contextmanager
def fake_cuda(arch: int, on_launch: Callable[[Any], None]) -> Iterator[_FakeCuda]:
    """Within the block, Triton compiles for ``sm_<arch>`` and a launch only passes the CompiledKernel to
    ``on_launch``; the previous driver is active again after."""
    from triton.runtime.driver import driver

    saved = getattr(driver, "_active", None)  # not ``driver.active``: that creates the real one, absent on CPU
    fake = _FakeCuda(arch, on_launch)
    driver.set_active(fake)
    try:
        yield fake
    finally:
        driver.set_active(saved)


def _compiled_kernel(src: Any, metadata: Any, device: int) -> Any:
    """The CompiledKernel the JIT cached for this launch (the launcher only gets its source and metadata)."""
    for kernel in src.fn.device_caches[device][0].values():
        if getattr(kernel, "metadata", None) is metadata:
            return kernel
    raise RuntimeError(f"{src.fn.__name__}: the compiled kernel is not in the JIT's cache (triton internals changed?)")


def _record(case: str, what: str, kernel: Any) -> Launch:
    src = kernel.src
    names = src.fn.arg_names
    constants = {names[k[0]] if isinstance(k, tuple) else k: v for k, v in src.constants.items()}
    aligned = sorted(names[k[0]] for k, v in src.attrs.items() if ["tt.divisibility", 16] in map(list, v))
    return Launch(case, what, src.fn.__name__, dict(src.signature), constants, aligned, kernel.asm["ptx"])


def compiled_launches(module: ModuleType, arch: int) -> list[Launch]:
    """Run every example of ``module`` with Triton compiling for ``sm_<arch>``; one ``Launch`` per distinct
    compiled kernel, or one carrying the error when an example raised (e.g. the compiler failed)."""
    out: list[Launch] = []
    for case, what, call in launch_examples(module):
        kernels: list[Any] = []
        with fake_cuda(arch, kernels.append):
            try:
                call()
            except Exception as exc:  # the compiler's error is the finding: report it with the example
                msg = str(exc).strip().splitlines()
                out.append(Launch(case, what, "", error=f"{type(exc).__name__}: {msg[-1] if msg else ''}"))
        unique = {id(k): k for k in kernels}  # a launch of an already compiled specialization reuses its kernel
        out.extend(_record(case, what, k) for k in unique.values())
    return out
