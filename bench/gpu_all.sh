#!/usr/bin/env bash
# One device call (nvidia-h200-x2): build the extension with its CUDA ops, run the GPU tests, the
# NCCL/VMM sharding check and the TP-generation all-reduce check, then the given bench suites. Logs and rows go to $OUT.
# Usage (repo root, wheels carried in .whl/): bash bench/gpu_all.sh "segment_copy --gpus 1" "switch --gpus 2"
# Each bench suite gets at most $SUITE_TIMEOUT seconds (default 300); the GPU tests $PYTEST_TIMEOUT (240) over
# $PYTEST_FILES (default: tests).
# HE_COMMIT=<sha> names the commit in the rows (the copy's .git there can be stale). Write the sha out
# here (HE_COMMIT=abc123...), not HE_COMMIT=$(git rev-parse HEAD): on the device that reads the stale copy.
# HE_BENCH_TG=2 limits the generate bench to those TP degrees; PROFILE_SWITCH=<model> adds bench.profile_switch.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# At most 8 files come back from $OUT: the setup's logs all go to setup.log.
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$out/setup.log"
t0=$SECONDS
MAX_JOBS=16 HYBRIDENGINE_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -e . >/tmp/build.log 2>&1 || { tail -40 /tmp/build.log | tee -a "$out/setup.log"; exit 1; }
echo "build: $((SECONDS - t0)) s"
python3 -m hybridengine info | tee -a "$out/setup.log"
pytest_mark=${PYTEST_MARK-gpu}  # PYTEST_MARK="": every test of PYTEST_FILES (device-fixture tests run on CUDA)
timeout ${PYTEST_TIMEOUT:-240} python3 -m pytest -q ${pytest_mark:+-m "$pytest_mark"} ${PYTEST_FILES:-tests} -p no:cacheprovider 2>&1 | tail -40 > /tmp/pytest_gpu.log
tee -a "$out/setup.log" < /tmp/pytest_gpu.log | tail -3
timeout 120 torchrun --standalone --nproc-per-node 2 tests/dist_sharded.py 2>&1 | tail -12 | tee -a "$out/setup.log"
# the whole output goes to setup.log (a rank that aborted once, session 9, left only torchrun's summary in a tail)
timeout 120 torchrun --standalone --nproc-per-node 2 tests/dist_generate.py 2>&1 | grep -v "^W1\|OMP_NUM\|\*\*\*" > /tmp/dist_generate.log
tee -a "$out/setup.log" < /tmp/dist_generate.log | tail -6
if [ -n "${PROFILE_SWITCH:-}" ]; then  # PROFILE_SWITCH=qwen2-7b: one profiled switch (traces stay on the device)
  timeout 240 torchrun --standalone --nproc-per-node 2 -m bench.profile_switch --model "$PROFILE_SWITCH" \
    --out /tmp/profile_switch 2>&1 | grep -v "^W1\|OMP_NUM\|\*\*\*" | tail -8 | tee -a "$out/setup.log"
  cp /tmp/profile_switch/profile_switch.json "$out/" 2>/dev/null
fi
for suite in "$@"; do
  echo "=== python -m bench run --suite $suite"
  timeout ${SUITE_TIMEOUT:-300} python3 -m bench run --suite $suite --out "$out/results.jsonl" 2>&1 | tr '\r' '\n' \
    | grep -v ' it/s\]$' >> "$out/bench.log"
done
grep -E "^  |GB/s|ms|not_run|Error|error" "$out/bench.log" | tail -60
