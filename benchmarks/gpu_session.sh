#!/usr/bin/env bash
# One call on the lent H200: the whole test suite (kernel tests then run their Triton kernels on the GPU,
# bit-exact where the references are; `gpu`-marked tests run too), then the benchmarks. Output under $OUT.
#   device run:  bash benchmarks/gpu_session.sh [comma,separated,benches] [pytest selection]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python -m pytest -q -p no:cacheprovider ${2:-tests} >"$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?"; tail -15 "$OUT/gpu_tests.log"
python -m benchmarks ${1:+--only $1} --out "$OUT/h200.json" 2>&1 | tee "$OUT/bench.log" | tail -60
