#!/usr/bin/env bash
# Issue 11 on one multi-GPU host (nvidia-h200-x2: 2 GPUs, NCCL) in ONE call: ~4 min, at most 7 (stage timeouts):
#   1. the parallel test suite on NCCL (TP, EP, TP+EP logits = one GPU's; 4-rank cases skip on 2 GPUs);
#   2. the parallel_decode bench (real-width Kimi K2.6 slice, TP / EP / TP+EP against one GPU)
#      -> $OUT/h200x2.json (copy it to benchmarks/results/h200x2.json);
#   3. examples/08_tensor_parallel.py under torchrun (TP+EP, tokens checked against one process).
# Usage: bash benchmarks/multi_gpu.sh      (BENCH_ARGS adds e.g. "--layers 4 --ctx 4096")
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# NVLink multicast stays off on the lent machines (device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
NGPU=$(nvidia-smi -L | wc -l)
KIND=h200x${NGPU}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"

echo "== 1. tests/parallel on NCCL ($NGPU GPUs)"
MLA_QUANT_DIST_BACKEND=nccl MLA_QUANT_SLOW=1 timeout "${TEST_TIMEOUT:-150}" \
  python -m pytest -q -p no:cacheprovider -rs tests/parallel >"$OUT/parallel_tests_nccl.log" 2>&1
echo "pytest exit $?"
grep -E "passed|failed|error" "$OUT/parallel_tests_nccl.log" | tail -3
grep -E "^(FAILED|ERROR)|rel err|Error" "$OUT/parallel_tests_nccl.log" | head -30

echo "== 2. bench parallel_decode"
timeout "${BENCH_TIMEOUT:-210}" torchrun --standalone --nproc_per_node "$NGPU" -m benchmarks.bench_parallel \
  --out "$OUT/$KIND.json" ${BENCH_ARGS:-} >"$OUT/bench_parallel.log" 2>&1
echo "bench exit $?"
grep -vE "^W[0-9]{4}|^\*+$|OMP_NUM_THREADS" "$OUT/bench_parallel.log" | tail -30

echo "== 3. examples/08_tensor_parallel.py --mode tp_ep"
timeout "${EXAMPLE_TIMEOUT:-60}" torchrun --standalone --nproc_per_node "$NGPU" examples/08_tensor_parallel.py \
  --mode tp_ep >"$OUT/example08.log" 2>&1
echo "example exit $?"
grep -vE "^W[0-9]{4}|^\*+$|OMP_NUM_THREADS" "$OUT/example08.log" | tail -8
