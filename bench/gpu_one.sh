#!/usr/bin/env bash
# One device call on nvidia-h200 (1 GPU): build without the CUDA extension ops (Triton paths only),
# run the given pytest files' GPU tests, then each "suite[:models]" bench and "profile:model" step.
# Usage: HE_COMMIT=<sha> bash bench/gpu_one.sh "tests/test_fused.py tests/test_generate.py" profile:qwen2.5-1.5b generate:qwen2.5-1.5b,qwen2-7b
# Rows go to $OUT/results.jsonl, logs to $OUT/bench.log; each step gets at most $STEP_TIMEOUT s (default 240).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
t0=$SECONDS
HYBRIDENGINE_CUDA=0 python3 -m pip install --no-build-isolation --no-deps -e . >/tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $((SECONDS - t0)) s"
tests=$1; shift
if [ -n "$tests" ]; then
  timeout ${STEP_TIMEOUT:-240} python3 -m pytest -q -m gpu $tests -p no:cacheprovider 2>&1 | tail -8 | tee "$out/pytest.log"
fi
for step in "$@"; do
  name=${step%%:*}; models=${step#*:}; [ "$models" = "$step" ] && models=""
  echo "=== $step at $((SECONDS - t0)) s"
  if [ "$name" = profile ]; then
    timeout ${STEP_TIMEOUT:-240} python3 -m bench.profile_decode --model "$models" --batch 64 --new-tokens 128 \
      --out "$out/profile_${models//./_}" 2>&1 | grep -v USDT | head -12
  else
    margs=(); for m in ${models//,/ }; do margs+=(--model "$m"); done
    timeout ${STEP_TIMEOUT:-240} python3 -m bench run --suite "$name" "${margs[@]}" --out "$out/results.jsonl" 2>&1 \
      | tr '\r' '\n' | grep -v ' it/s\]$' > /tmp/step.log
    cat /tmp/step.log >> "$out/bench.log"
    grep -E "^  |GB/s|tok/s|ms|Error|error" /tmp/step.log | grep -v "^  File" | tail -25
  fi
done
echo "done $((SECONDS - t0)) s"
