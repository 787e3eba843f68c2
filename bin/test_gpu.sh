#!/usr/bin/env bash
# The whole test suite on your own GPU machine, with the CUDA extension built.
#
#   make test-gpu                         # in .venv (make setup first installs torch and the dev extras)
#   bash bin/test_gpu.sh [PYTEST ARGS]  # in the active environment; e.g. -x, or tests/test_fused.py alone
#
# Needs: a CUDA build of torch and the CUDA toolkit (nvcc; CUDA_HOME or nvcc on PATH). The package and its
# dev extras (pytest, pytest-timeout, pytest-xdist) are installed editable when not yet there.
#
# Steps:
#   1. Build hybridengine._C in place with its CUDA ops (HYBRIDENGINE_CUDA=1: the build fails, rather than
#      silently dropping them, when torch or the toolkit has no CUDA; ninja rebuilds only what changed).
#   2. `hybridengine info`: versions, GPUs, and which implementation each op uses.
#   3. pytest (tests/, or the arguments given) in TEST_WORKERS pytest-xdist processes, all but the tests marked
#      `whole_gpu`. Most tests are small and many spawn 2-8 gloo processes on the CPU, so workers run side by
#      side on the one GPU; each gets cores / workers CPU threads, and every test returns its cached device
#      memory (tests/conftest.py). pytest's per-test timeout (pyproject.toml) turns a hang into a failure.
#   4. The `whole_gpu` tests (most of the GPU's memory, or a timing bound that other workers' copies break)
#      after that, in one process, one at a time.
#   5. With 2 or more GPUs: the NCCL checks under torchrun (tests/dist_sharded.py: the sharded buffer and its
#      switch over NCCL with the VMM generation buffer; tests/dist_generate.py: tensor-parallel generation).
#      With one GPU they are reported as skipped.
# Exit status: non-zero when the build or any test fails. Budget: under 8 minutes on 1 x H200 with 16 cores.
#
# Environment:
#   PYTHON                      interpreter (default: .venv/bin/python when present, else python3)
#   TEST_WORKERS                pytest-xdist workers (default: half the CPU cores, at most 8)
#   MAX_JOBS                    parallel compile jobs of the build (default: the CPU cores)
#   HYBRIDENGINE_CUDA_ARCH_LIST CUDA archs of the build (default 9.0+PTX: sm_90 plus PTX)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
cores=$(nproc)
workers=${TEST_WORKERS:-$(( cores / 2 > 8 ? 8 : (cores / 2 > 0 ? cores / 2 : 1) ))}
threads=$(( cores / workers > 0 ? cores / workers : 1 ))
# NVLink SHARP (multicast) stays off: NCCL and torch's symmetric memory use plain NVLink transfers.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
start=$SECONDS

"$PYTHON" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"test_gpu.sh: torch {torch.__version__} sees no CUDA GPU; on a CPU machine run `make test`")
EOF
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")

echo "== build hybridengine._C with CUDA ops (MAX_JOBS=${MAX_JOBS:-$cores})"
log=$(mktemp)
export MAX_JOBS=${MAX_JOBS:-$cores} HYBRIDENGINE_CUDA=1
if "$PYTHON" -c "import hybridengine.kernels, xdist, pytest_timeout" 2>/dev/null; then
  build=("$PYTHON" setup.py build_ext --inplace)  # installed (editable): rebuild the extension in place
else  # the package or a dev extra is missing: install them, which builds the extension
  build=("$PYTHON" -m pip install --no-build-isolation -e ".[dev]")
fi
if ! "${build[@]}" >"$log" 2>&1; then
  tail -40 "$log"
  echo "test_gpu.sh: build failed (full log: $log)"
  exit 1
fi
echo "built in $(( SECONDS - start )) s"
"$PYTHON" -m hybridengine info

# pytest exits 5 when the selection holds no test of a phase (say, one file without whole_gpu tests).
status=0
phase() {  # phase NAME PYTEST-ARGS...: runs pytest, sets status on a failure
  local name=$1 rc=0
  shift
  echo "== pytest, $name"
  "$PYTHON" -m pytest -q -p no:cacheprovider -rfE "$@" || rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
}
OMP_NUM_THREADS=$threads phase "parallel part: $workers workers x $threads CPU threads, $gpus GPU(s)" \
  -n "$workers" --dist worksteal -m "not whole_gpu" "$@"
phase "serial part: the whole_gpu tests, one process" -m whole_gpu "$@"

for check in dist_sharded dist_generate; do
  if [ "$gpus" -ge 2 ]; then
    echo "== torchrun --nproc-per-node 2 tests/$check.py"
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 "tests/$check.py" || status=1
  else
    echo "== tests/$check.py: skipped (needs 2 GPUs, this machine has $gpus)"
  fi
done

echo "== test_gpu.sh: $( [ "$status" -eq 0 ] && echo passed || echo FAILED ) in $(( SECONDS - start )) s"
exit "$status"
