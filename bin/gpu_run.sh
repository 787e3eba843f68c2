#!/usr/bin/env bash
# One batch of GPU work in one command: build the CUDA extension, then run the named steps in order inside a
# time budget, every log and bench row written under one folder. Made for lent GPU machines where a command
# has a hard limit and the build does not survive between commands.
#
#   OUT=gpu_out STEPS="build tests suite:requests:qwen2.5-1.5b py:my_probe.py" TOTAL_S=560 bash bin/gpu_run.sh
#
# Steps (in the order given):
#   wheels                  pip-install .whl/*.whl into /tmp/site (no index) and put it on PYTHONPATH
#   build                   pip install -e . with the CUDA ops (HYBRIDENGINE_CUDA=1), then `hybridengine info`
#   tests                   bin/test_gpu.sh $TEST_ARGS (default -vv, against its -q: each test's outcome is in the log as it
#                           ends, so a run cut by TEST_S still names its failures), at most TEST_S seconds
#   suite:NAME[:MODEL[:SCALE]]  python -m hybridengine_bench run --suite NAME [--model MODEL] [--scale SCALE]
#   py:FILE[,ARG,...]       python FILE ARG... (the repository root on PYTHONPATH), its whole output in
#                           $OUT/py_<name>.log
#   env:NAME=VALUE          export NAME=VALUE for the steps after it (e.g. a bench knob such as HE_BENCH_TAIL,
#                           after the tests, which must not see it)
# A step starts only with 20 s or more of TOTAL_S left and is cut at the budget's end; the others still run.
# Logs: $OUT/log (the summary of every step), $OUT/build.log, $OUT/tests.log, $OUT/bench_<suite>.log; rows:
# $OUT/results.jsonl (one run id for the whole batch: HE_BENCH_RUN_ID, default the UTC time and RUN_TAG).
# Exit status: non-zero when a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder for logs and rows}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HE_BENCH_RESULTS=$OUT/results.jsonl MAX_JOBS=${MAX_JOBS:-$(nproc)} HYBRIDENGINE_CUDA=1
export HE_BENCH_RUN_ID=${HE_BENCH_RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)-${RUN_TAG:-gpu}}
start=$SECONDS
total=${TOTAL_S:-560}
log=$OUT/log
status=0
note() { echo "$*" | tee -a "$log"; }
note "run id $HE_BENCH_RUN_ID, commit ${HE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
{ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || echo "no nvidia-smi"; } 2>&1 | tee -a "$log"
for step in ${STEPS:?set STEPS}; do
  left=$(( total - (SECONDS - start) ))
  if [ "$left" -lt 20 ]; then note "== skip $step: ${left} s left"; status=1; continue; fi
  t0=$SECONDS
  note "== $step (${left} s left)"
  rc=0
  case $step in
    wheels)
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >>"$log" 2>&1 || rc=$?
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;;
    build)
      "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || rc=$?
      if [ "$rc" -ne 0 ]; then tail -30 "$OUT/build.log" | tee -a "$log"; note "build failed"; exit 1; fi
      "$PYTHON" -m hybridengine info 2>&1 | tee -a "$log" ;;
    tests)
      budget=$(( ${TEST_S:-300} < left - 10 ? ${TEST_S:-300} : left - 10 ))
      # shellcheck disable=SC2086
      timeout "$budget" env PYTHON="$PYTHON" bash bin/test_gpu.sh ${TEST_ARGS:--vv} >"$OUT/tests.log" 2>&1 || rc=$?
      grep -E "(FAILED|ERROR) tests/|^(FAILED|ERROR) |passed|failed|^== " "$OUT/tests.log" | sort -u | tail -40 \
        | tee -a "$log" ;;
    suite:*)
      IFS=: read -r _ name model scale <<<"$step"
      args=(--suite "$name")
      [ -n "${model:-}" ] && args+=(--model "$model")
      [ -n "${scale:-}" ] && args+=(--scale "$scale")
      timeout $(( left - 10 )) "$PYTHON" -m hybridengine_bench run "${args[@]}" >"$OUT/bench_$name.log" 2>&1 || rc=$?
      grep -v "it/s\]" "$OUT/bench_$name.log" | tail -25 | tee -a "$log" ;;
    py:*)
      IFS=, read -r -a argv <<<"${step#py:}"
      file=${argv[0]}
      # the repository root on the path: a probe under hybridengine_bench/ imports hybridengine_bench.common
      PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout $(( left - 10 )) "$PYTHON" "${argv[@]}" \
        >"$OUT/py_$(basename "$file" .py).log" 2>&1 || rc=$?
      tail -20 "$OUT/py_$(basename "$file" .py).log" | tee -a "$log" ;;
    env:*=*)
      export "${step#env:}" ;;
    *) note "unknown step $step"; rc=2 ;;
  esac
  [ "$rc" -ne 0 ] && status=1
  note "== $step: exit $rc, $(( SECONDS - t0 )) s"
done
note "== total $(( SECONDS - start )) s, $( [ "$status" -eq 0 ] && echo all steps passed || echo a step FAILED)"
exit "$status"
