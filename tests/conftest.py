"""Test device policy, decided once: CUDA when present, else CPU with Triton's interpreter; tests that need
hybridengine._C fail without it (skip only with HE_ALLOW_NO_EXTENSION=1)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any Triton kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# A test marked `needs_extension` errors when hybridengine._C did not build (a broken build must not pass as a
# run of skips); with this variable set to 1 it is skipped instead, for a checkout built without the extension.
ALLOW_NO_EXTENSION = "HE_ALLOW_NO_EXTENSION"


# A `whole_gpu` test needs the GPU to itself: beside other pytest-xdist workers on the same GPU it runs out of
# memory or misses its timing bound. bin/test_gpu.sh runs them after the parallel part, in one process; a run
# with several workers on a GPU skips them, saying so, rather than letting them fail at random.
SERIAL_PHASE = "needs the GPU to itself: bin/test_gpu.sh runs it after the parallel part (or run pytest without -n)"


def _xdist_workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        if _xdist_workers() > 1:
            for item in items:
                if "whole_gpu" in item.keywords:
                    item.add_marker(pytest.mark.skip(reason=SERIAL_PHASE))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Where each test's peak device memory goes (one JSON line per test) when HE_TEST_GPU_MEMORY_LOG names a file:
# how a test earns the `whole_gpu` mark. Subprocesses a test starts are not counted.
GPU_MEMORY_LOG = os.environ.get("HE_TEST_GPU_MEMORY_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if not (GPU_MEMORY_LOG and torch.cuda.is_available()):
        yield
        return
    import json
    import time

    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    yield
    row = {"test": item.nodeid, "seconds": round(time.perf_counter() - start, 3),
           "max_allocated_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 3),
           "max_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 3),
           "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(GPU_MEMORY_LOG, "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_runtest_setup(item):
    if "needs_extension" not in item.keywords:
        return
    from hybridengine.ops import EXTENSION_ERROR  # here, after TRITON_INTERPRET is set

    if EXTENSION_ERROR is None:
        return
    if os.environ.get(ALLOW_NO_EXTENSION) == "1":
        pytest.skip(f"{ALLOW_NO_EXTENSION}=1: hybridengine._C is not built ({EXTENSION_ERROR})")
    pytest.fail(f"hybridengine._C is not built ({EXTENSION_ERROR}); build it (make setup, or pip install "
                f"--no-build-isolation -e .) or set {ALLOW_NO_EXTENSION}=1 to skip the tests that need it",
                pytrace=False)


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness of fit of integer `samples` to the distribution `probs`: the chance that draws from
    `probs` give a chi-square statistic at least this large (len(probs) - 1 degrees of freedom)."""
    expected = samples.numel() * probs.double().cpu()
    assert expected.min() >= 5, "the chi-square approximation needs >= 5 expected draws in every bin"
    counts = torch.bincount(samples.flatten().cpu(), minlength=len(probs)).double()
    assert len(counts) == len(probs), "a sample outside the distribution's support"
    statistic = ((counts - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2, dtype=torch.float64), statistic / 2).item()


cpu_harness = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the CPU harness check of a bench probe (tiny model, Triton interpreter); on a GPU the probe itself runs")
"""For tests of a probe's harness: on CUDA the probe takes the real shapes, and the Triton interpreter cannot be
switched on in a process whose kernels are already compiled."""


throws_in_extension = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="calls an extension op that throws: a C++ exception out of hybridengine._C segfaulted the GPU machine's "
           "torch 2.11 process (custom-class methods and ops alike, ../shared/device/NOTES.md); CPU CI runs it")
"""For tests of the C++ ops' own argument checks (the Python wrappers check first and never reach them)."""


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _release_gpu_cache():
    """On a GPU, every test hands the blocks its process's caching allocator keeps back to the driver: workers
    share one GPU, and blocks one worker keeps cached after its test are memory the next test of another
    worker cannot have (nor can the engine's KV sizing, which counts them as used)."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
