"""Compile every CUDA source with nvcc for sm_90 (compile only), so CUDA errors fail CI, not a GPU session."""

import pathlib
import shutil
import subprocess

import pytest

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cu"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_nvcc_compiles(source, tmp_path):
    cmd = ["nvcc", "-c", "-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90", "-Werror=all-warnings",
           f"-I{CSRC}", str(source), "-o", str(tmp_path / (source.stem + ".o"))]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"


def test_there_are_cuda_sources():
    assert SOURCES, f"no .cu files under {CSRC}"
