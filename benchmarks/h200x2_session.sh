#!/usr/bin/env bash
# One call on nvidia-h200-x2 that keeps both GPUs busy (device time is the scarce resource):
#   GPU 0: the fidelity pipeline (benchmarks/fidelity_session.sh, FID=1) or the NCCL parallel tests first
#          (PARALLEL=1, both GPUs, before the split), then the GPU test suite (TESTS=1) beside it;
#   GPU 1: the benchmarks alone, so their timings are not disturbed.
# The device returns at most 8 files: everything lands in $OUT/session.tgz; the logs' tails go to stdout.
# Usage: MLA_QUANT_COMMIT=<hash> bash benchmarks/h200x2_session.sh [benches, comma-separated] [pytest args]
#   FID, TESTS, PARALLEL (0/1); BENCH0 (benches for GPU 0 after the tests) and GPU0_CMD (a command for GPU 0 after
#   them, $R = the results folder), GPU1_CMD (the same for GPU 1 after its benches); TEST_GPU=1 runs the tests on GPU 1 before the benches (TEST_TIMEOUT) instead of
#   beside the fidelity run; STAGE_S bounds each parallel stage (seconds, default 540); BENCH_ARGS.
#   Carry .whl (pytest-xdist, execnet) to spread the compile-bound test suite over the CPU cores.
#   Test stages end with SIGINT (then SIGKILL 20 s later): pytest still prints the failures' tracebacks and the
#   short summary of what ran, which a plain SIGTERM at the time limit lost (twice in session 5).
set -uo pipefail
OUT=${OUT:-/tmp/out}
R=$(mktemp -d /tmp/session.XXXX)
mkdir -p "$OUT" "$R/fid"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STAGE_S=${STAGE_S:-540}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$R/gpu.txt"
XDIST=""
if ls .whl/pytest_xdist-*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site \
    && XDIST="-n ${TEST_WORKERS:-12} --dist load"
fi
start=$(date +%s)
if [ "${PARALLEL:-0}" = 1 ]; then
  MLA_QUANT_DIST_BACKEND=nccl MLA_QUANT_SLOW=1 timeout 200 python -m pytest -q -p no:cacheprovider -rs tests/parallel \
    >"$R/parallel_tests_nccl.log" 2>&1
  echo "parallel tests: exit $? after $(( $(date +%s) - start ))s"; tail -2 "$R/parallel_tests_nccl.log"
  STAGE_S=$(( STAGE_S - ($(date +%s) - start) ))
fi
pids=()
if [ "${FID:-0}" = 1 ]; then
  (CUDA_VISIBLE_DEVICES=0 OUT="$R/fid" timeout "$STAGE_S" bash benchmarks/fidelity_session.sh >"$R/fid/session.log" 2>&1) &
  pids+=($!)
fi
if [ "${TESTS:-1}" = 1 ] && [ "${TEST_GPU:-0}" = 0 ]; then
  # GPU 0: the tests (TEST_TIMEOUT, default the stage), then the benches named in BENCH0 and the command GPU0_CMD
  # (e.g. a sweep) in what is left of the stage; their JSON goes to h200_gpu0.json
  (t0=$(date +%s)
   CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 20 "${TEST_TIMEOUT:-$STAGE_S}" python -m pytest -v -p no:cacheprovider --tb=short \
     $XDIST ${2:-tests} >"$R/gpu_tests.log" 2>&1
   left=$(( STAGE_S - ($(date +%s) - t0) ))
   if [ -n "${BENCH0:-}" ] && [ "$left" -gt 10 ]; then
     CUDA_VISIBLE_DEVICES=0 timeout "$left" python -m benchmarks --only "$BENCH0" ${BENCH_ARGS:-} \
       --out "$R/h200_gpu0.json" >"$R/bench_gpu0.log" 2>&1
     left=$(( STAGE_S - ($(date +%s) - t0) ))
   fi
   if [ -n "${GPU0_CMD:-}" ] && [ "$left" -gt 10 ]; then
     CUDA_VISIBLE_DEVICES=0 R="$R" timeout "$left" bash -c "$GPU0_CMD" >"$R/gpu0_cmd.log" 2>&1
   fi) &
  pids+=($!)
fi
bench_s=$STAGE_S
if [ "${TESTS:-1}" = 1 ] && [ "${TEST_GPU:-0}" = 1 ]; then  # tests first on GPU 1, then the benches alone there
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=1 timeout -s INT -k 20 "${TEST_TIMEOUT:-150}" python -m pytest -v -p no:cacheprovider --tb=short $XDIST \
    ${2:-tests} >"$R/gpu_tests.log" 2>&1
  echo "tests: exit $? after $(( $(date +%s) - start ))s"
  bench_s=$(( STAGE_S - ($(date +%s) - t0) ))
fi
t1=$(date +%s)
CUDA_VISIBLE_DEVICES=1 timeout "$bench_s" python -m benchmarks ${1:+--only $1} ${BENCH_ARGS:-} --out "$R/h200.json" \
  >"$R/bench.log" 2>&1
echo "benches: exit $? after $(( $(date +%s) - start ))s"
left=$(( bench_s - ($(date +%s) - t1) ))
if [ -n "${GPU1_CMD:-}" ] && [ "$left" -gt 10 ]; then  # a command for GPU 1 after its benches (e.g. a sweep)
  CUDA_VISIBLE_DEVICES=1 R="$R" timeout "$left" bash -c "$GPU1_CMD" >"$R/gpu1_cmd.log" 2>&1
  echo "GPU 1 command: exit $? after $(( $(date +%s) - start ))s"
fi
for p in "${pids[@]}"; do wait "$p"; done
echo "all stages done after $(( $(date +%s) - start ))s"
tar czf "$OUT/session.tgz" -C "$R" .
grep -E "^\[|ceilings|wrote|Error|error" "$R/bench.log" "$R/bench_gpu0.log" 2>/dev/null | tail -30
tail -5 "$R/gpu0_cmd.log" "$R/gpu1_cmd.log" 2>/dev/null
grep -E "passed|failed" "$R/gpu_tests.log" 2>/dev/null | tail -2
grep -E "(FAILED|ERROR)" "$R/gpu_tests.log" 2>/dev/null | grep -v "^E " | head -30
tail -6 "$R/fid/session.log" 2>/dev/null
