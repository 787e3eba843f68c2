"""Builds hybridengine._C: CPU ops always, CUDA ops when torch and the toolkit allow it.

Environment:
  HYBRIDENGINE_CUDA=1|0          force the CUDA ops on or off (default: on when torch.version.cuda
                                 and CUDA_HOME are both set)
  HYBRIDENGINE_CUDA_ARCH_LIST    arch list in TORCH_CUDA_ARCH_LIST form (default "9.0+PTX": sm_90 + PTX)
  MAX_JOBS                       parallel compile jobs (ninja)
"""

import glob
import os

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def _want_cuda() -> bool:
    forced = os.environ.get("HYBRIDENGINE_CUDA")
    if forced not in (None, "", "0", "1"):
        raise ValueError(f"HYBRIDENGINE_CUDA must be 0 or 1, got {forced!r}")
    if forced == "0":
        return False
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if forced == "1" and not available:
        raise RuntimeError(f"HYBRIDENGINE_CUDA=1 but torch.version.cuda={torch.version.cuda!r} and "
                           f"CUDA_HOME={CUDA_HOME!r}: a CUDA build of torch and the CUDA toolkit are needed")
    return available


def _extension():
    cpu_sources = ["csrc/ops.cpp", "csrc/segment_copy_cpu.cpp"]
    cxx = ["-O3", "-std=c++17"]
    if not _want_cuda():
        print("hybridengine: building CPU ops only")
        return CppExtension("hybridengine._C", cpu_sources, extra_compile_args={"cxx": cxx})
    # torch's build reads TORCH_CUDA_ARCH_LIST; ours defaults to Hopper (sm_90) plus PTX.
    os.environ["TORCH_CUDA_ARCH_LIST"] = os.environ.get("HYBRIDENGINE_CUDA_ARCH_LIST", "9.0+PTX")
    print(f"hybridengine: building CPU + CUDA ops for {os.environ['TORCH_CUDA_ARCH_LIST']}")
    # *_cuda.cpp: torch bindings of the CUDA code (host compiler); *.cu: kernels and driver calls.
    cuda_sources = sorted(glob.glob("csrc/*_cuda.cpp")) + sorted(glob.glob("csrc/*.cu"))
    return CUDAExtension(
        "hybridengine._C", cpu_sources + cuda_sources,
        extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]})


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
