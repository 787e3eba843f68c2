"""Compile every CUDA source with nvcc for sm_90 (compile only) and syntax-check the CUDA-only torch
bindings (*_cuda.cpp) against the installed torch headers, so CUDA-side errors fail CI, not a GPU run."""

import os
import pathlib
import shutil
import subprocess

import pytest
import torch.utils.cpp_extension as cpp_ext

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cu"))
BINDINGS = sorted(CSRC.glob("*_cuda.cpp"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_nvcc_compiles(source, tmp_path):
    cmd = ["nvcc", "-c", "-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90", "-Werror=all-warnings",
           f"-I{CSRC}", str(source), "-o", str(tmp_path / (source.stem + ".o"))]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"


def test_there_are_cuda_sources():
    assert SOURCES, f"no .cu files under {CSRC}"


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("g++") is None, reason="nvcc or g++ missing")
@pytest.mark.parametrize("source", BINDINGS, ids=[s.name for s in BINDINGS])
def test_cuda_binding_syntax(source):
    homes = [os.environ.get("CUDA_HOME", ""), cpp_ext.CUDA_HOME or "", "/usr/local/cuda"]
    found = [pathlib.Path(h) / "include" for h in homes if h and (pathlib.Path(h) / "include/cuda_runtime.h").exists()]
    if not found:
        pytest.skip("no CUDA toolkit headers (cuda_runtime.h) under CUDA_HOME or /usr/local/cuda")
    cuda_include = found[0]
    includes = [f"-I{p}" for p in cpp_ext.include_paths()] + [f"-I{cuda_include}", f"-I{CSRC}"]
    cmd = ["g++", "-std=c++17", "-fsyntax-only", *includes, str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
