#!/usr/bin/env bash
# One call on the lent H200: the whole test suite (kernel tests then run their Triton kernels on the GPU,
# bit-exact where the references are; `gpu`-marked tests run too), then the benchmarks. Output under $OUT.
#   bash benchmarks/gpu_session.sh [benches: comma-separated, default all] [pytest args, default tests]
#   TEST_TIMEOUT / BENCH_TIMEOUT (seconds) bound the two stages; BENCH_ARGS adds e.g. --quick.
#   .git does not travel to the device: pass MLA_QUANT_COMMIT=<hash> so the results name their commit.
#   The suite is bound by Triton compiles (CPU work): carry pytest-xdist to spread it over the 16 cores —
#   here: pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl pytest-xdist execnet
#   and name ".whl" in the device call's carry.
#   The whole suite outlasts one 600 s device call (session 16: ~915 tests in 540 s on 15 workers, ~1340 in all):
#   TEST_SHARD=k/n runs every n-th test file from the k-th (sorted paths), so n calls cover it.
#   TEST_DIST=load spreads single tests instead of whole files over the workers (default loadfile): a file of ~180 GPU
#   tests (test_fused_moe.py) on one worker outlasts a call. A quiet log names no passing test: pass -rA in the
#   pytest args to list them.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
XDIST=""
if ls .whl/pytest_xdist-*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site \
    && XDIST="-n ${TEST_WORKERS:-8} --dist ${TEST_DIST:-loadfile}"
fi
TESTS=${2:-tests}
if [ -n "${TEST_SHARD:-}" ]; then
  TESTS=$(find tests -name 'test_*.py' | sort | awk -v k="${TEST_SHARD%/*}" -v n="${TEST_SHARD#*/}" '(NR - k) % n == 0')
fi
timeout -s INT -k 20 "${TEST_TIMEOUT:-300}" python -m pytest -v -p no:cacheprovider $XDIST $TESTS >"$OUT/gpu_tests.log" 2>&1 \
  || true
grep -cE " PASSED" "$OUT/gpu_tests.log"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
grep -E "(FAILED|ERROR)" "$OUT/gpu_tests.log" | grep -v "^E " | head -60
timeout "${BENCH_TIMEOUT:-400}" python -m benchmarks ${1:+--only $1} ${BENCH_ARGS:-} --out "$OUT/h200.json" \
  >"$OUT/bench.log" 2>&1
grep -E "^\[|ceilings|wrote|Error|error" "$OUT/bench.log" | tail -40
