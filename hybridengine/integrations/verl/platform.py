"""A CPU platform for verl, so that verl's trainer runs on a machine without accelerators.

verl 0.9.1 has platforms for CUDA, ROCm and NPU only; on a CPU-only host it falls back to CUDA (device
"cuda", backend NCCL) and its workers fail. This one reports device "cpu" and backend gloo. It is
registered under the name "cpu" and chosen with `VERL_PLATFORM=cpu`, never by detection.

verl's resource pools count Ray's "GPU" resource (`ResourcePoolManager` asks for `use_gpu=True`), so the
platform's Ray resource stays "GPU": on a CPU host give Ray logical GPU slots, one per worker
(`ray_kwargs.ray_init.num_gpus=N`); nothing runs on them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

__all__ = ["CPUPlatform", "register_platform"]

NAME = "cpu"


def _nothing(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


def _device_module() -> types.ModuleType:
    """torch.cpu with the memory calls verl makes on its device module (empty_cache, memory_allocated, ...),
    which torch.cpu lacks: no-ops and zeros."""
    module = types.ModuleType("hybridengine_verl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(module, name, getattr(torch.cpu, name))
    for name in ("empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated", "ipc_collect",
                 "set_per_process_memory_fraction"):
        setattr(module, name, _nothing)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(module, name, _zero)
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.mem_get_info = lambda *args: (0, 0)
    module.memory_stats = lambda *args: {}
    module.get_device_name = lambda *args: "cpu"
    return module


_DEVICE_MODULE = _device_module()


class CPUPlatform(PlatformBase):
    """verl's platform interface on the CPU: gloo, no device memory, no profiler."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # chosen with VERL_PLATFORM=cpu only, never detected

    def current_device(self) -> str:
        # verl moves tensors with `.to(get_device_id())`; `.to(0)` would mean cuda:0.
        return "cpu"

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
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def register_platform() -> None:
    """Register `CPUPlatform` as verl platform "cpu" (idempotent); when VERL_PLATFORM=cpu chooses it, make
    verl's process-group initialisation default to gloo alone."""
    if PlatformRegistry.get(NAME) is not CPUPlatform:
        PlatformRegistry.register(platform=NAME)(CPUPlatform)
    if os.environ.get("VERL_PLATFORM", "").strip().lower() == NAME:
        _default_backend_gloo()


def _default_backend_gloo() -> None:
    from verl.utils import distributed

    init = distributed.initialize_global_process_group_ray
    if getattr(init, "_hybridengine_cpu", False):
        return

    @functools.wraps(init)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return init(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    initialize_global_process_group_ray._hybridengine_cpu = True
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
