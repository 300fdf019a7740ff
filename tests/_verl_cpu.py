"""CPU stand-ins veRL needs to run its actor worker without a GPU (tests only; imported by veRL itself).

veRL 0.9 picks its device through a platform registry that falls back to "nvidia" when no accelerator is found,
and registers its FSDP engine for ``cuda`` / ``npu`` devices only. Both have hooks, which the real-veRL test uses
instead of patching veRL:

- ``VERL_USE_EXTERNAL_MODULES=_verl_cpu`` makes ``import verl`` import this module, which registers the ``cpu``
  platform below with ``PlatformRegistry.register``; ``VERL_PLATFORM=odc_cpu`` selects it (device ``cpu``, gloo);
- ``VERL_ENGINE_DEVICE=cuda`` makes ``EngineRegistry`` hand out the FSDP engine registered for CUDA, which runs on
  whatever device the platform names (the engine's own code is device-agnostic through the platform).

:data:`ENV` holds these variables; set them before ``verl`` is imported.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

ENV = {
    "VERL_USE_EXTERNAL_MODULES": "_verl_cpu",
    "VERL_PLATFORM": "odc_cpu",
    "VERL_ENGINE_DEVICE": "cuda",
    "VERL_USE_EXTERNAL_PLUGINS": "none",
}


def _zero(*_: Any, **__: Any) -> int:
    return 0


def _none(*_: Any, **__: Any) -> None:
    return None


# What veRL calls on its "device module" (torch.cuda on GPUs): memory statistics and cache control are no-ops here.
_DEVICE_MODULE = types.SimpleNamespace(
    is_available=lambda: True,
    current_device=_zero,
    device_count=lambda: 1,
    set_device=_none,
    synchronize=_none,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    empty_cache=_none,
    max_memory_allocated=_zero,
    max_memory_reserved=_zero,
    memory_allocated=_zero,
    memory_reserved=_zero,
    reset_peak_memory_stats=_none,
    mem_get_info=lambda *_: (0, 0),
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
    is_initialized=lambda: True,
    get_device_name=lambda *_: "CPU",
    Stream=None,
)


@PlatformRegistry.register("odc_cpu")
class CpuPlatform(PlatformBase):
    """veRL's platform interface for a CPU-only process (gloo, no profiler, no IPC)."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"  # veRL moves tensors with ``.to(get_device_id())``

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # read by Ray only; no device is ever selected here

    def nvtx_range(self, msg: str):
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
