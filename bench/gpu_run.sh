#!/usr/bin/env bash
# One device call on the GPU machine (repo root, wheelhouse carried in .whl/): install the wheels,
# build the extension in the background (for segment_copy), run each suite given, rows and logs to $OUT.
# Usage: bash bench/gpu_run.sh "baselines --gpus 2 --model qwen2-7b" "segment_copy --gpus 1"
# The caller sets HE_COMMIT (the copy there has no .git) and the NCCL/NVSHMEM multicast variables.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpus.csv"
build=
if [[ "$*" == *segment_copy* ]]; then
  (MAX_JOBS=16 python3 setup.py build_ext --inplace >"$out/build.log" 2>&1; echo "build rc=$?" >>"$out/build.log") &
  build=$!
fi
for suite in "$@"; do
  [[ $suite == segment_copy* && -n $build ]] && { wait "$build"; tail -2 "$out/build.log"; build=; }
  echo "=== python -m bench run --suite $suite"
  python3 -m bench run --suite $suite --out "$out/results.jsonl" 2>&1 | tr '\r' '\n' | grep -v ' it/s\]$' \
    | tee -a "$out/log"
done
