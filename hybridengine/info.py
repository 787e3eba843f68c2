"""`hybridengine info`: versions, the extension's ops, the GPUs, and which implementation runs where."""

from __future__ import annotations

import importlib.metadata
import platform

import torch


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gpus() -> list[str]:
    """GPU lines through NVML (memory as the driver sees it); empty when there is no NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        return ["nvidia-ml-py is not installed"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [f"no NVIDIA driver reachable through NVML ({e})"]
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        lines = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            lines.append(f"{i}: {pynvml.nvmlDeviceGetName(h)}, {mem.total / 2**30:.1f} GiB "
                         f"({mem.used / 2**30:.1f} used), driver {driver}")
        return lines or ["NVML found no GPU"]
    finally:
        pynvml.nvmlShutdown()


def info() -> str:
    from hybridengine import __version__, ops

    ext = "not built: " + ops.EXTENSION_ERROR if ops.EXTENSION_ERROR else (
        "built, CUDA ops: " + ("yes" if ops.extension_has("segment_copy", "cuda") else "no (CPU-only build)"))
    lines = [
        f"hybridengine {__version__}",
        f"python {platform.python_version()} on {platform.machine()}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {_version('triton')}, "
        f"transformers {_version('transformers')}, safetensors {_version('safetensors')}, "
        f"flash-attn {_version('flash-attn')}",
        f"extension hybridengine._C: {ext}",
        f"torch.cuda.is_available(): {torch.cuda.is_available()}",
        "GPUs (NVML):",
        *("  " + g for g in _gpus()),
        "implementations:",
    ]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    from hybridengine.ops import (exact_attention, exact_linear, grouped_gemm, kv_store, paged_attention,
                                  prefill_attention, rms_norm, rope, silu_mul)

    for dev in devices:
        for source in (ops, kv_store, paged_attention, prefill_attention, rms_norm, silu_mul, rope, exact_linear,
                       exact_attention, grouped_gemm):
            for op, impl in source.implementations(dev).items():
                lines.append(f"  {op:<22} {dev:<5} {impl}")
    return "\n".join(lines)
