#!/usr/bin/env bash
# Issue 12, the FP8 lightning indexer and long contexts, in ONE call on one H200 (≤ 9 minutes): train a small
# GLM 5.2-shaped model (MLA + DSA lightning indexer, IndexShare, top-k 256) on the Python standard library's
# source (≈ 4 min: dense attention with the indexer distilled from it by KL, DeepSeek V3.2's warm-up), then
# measure at contexts 1k-32k (≈ 2.5 min): the sparse model (full-precision indexer) against the dense one, the
# FP8 indexer against the full-precision one (KL, top-1, top-k overlap), INT4 experts / FP8 W8A8 weights and
# FP8 KV pages against the sparse model, KL against position. Everything lands in $OUT (6 small files):
#   glm_train.log, glm_train.json            the training run (settings, data, loss and indexer-KL curves)
#   glm_fidelity.log, glm_fidelity.json      every row, KL by position, top-k overlap, timings
#   glm_fidelity.md, glm_fidelity.png        the table for docs/fidelity.md and its plot (if matplotlib is there)
# If KIMI_CHECKPOINT names a Kimi model/ folder of eval.train (not on a fresh machine), its KV formats are
# also measured at 16k and 32k; that table is appended to glm_fidelity.md and its log to glm_fidelity.log.
# Usage: bash benchmarks/fidelity_glm_session.sh        (TRAIN_S, FID_S: the stages' budgets in seconds)
# CPU smoke of the same pipeline (< 30 s):
#   SMOKE=1 OUT=/tmp/fidglm PYTHON=.venv/bin/python bash benchmarks/fidelity_glm_session.sh
set -uo pipefail
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/out}
RUN=${RUN:-$(mktemp -d /tmp/fidelity_glm.XXXX)}
mkdir -p "$OUT" "$RUN"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -n "${SMOKE:-}" ]; then
  TRAIN_ARGS="--smoke"; FID_ARGS="--smoke"; LONG_ARGS="--smoke"; TRAIN_T=120; FID_T=120
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  TRAIN_ARGS="--time-budget ${TRAIN_S:-195}"; TRAIN_T=275
  # 4 windows per context up to 8k, then max-tokens / L (2 at 16k, 1 at 32k); KV formats at three contexts
  FID_ARGS="--contexts 1024 2048 4096 8192 16384 32768 --kv-contexts 2048 8192 32768 --eval-tokens 128 \
    --batch 4 --max-tokens 32768 --bin 256 --time-budget ${FID_S:-140}"; FID_T=195
  LONG_ARGS="--contexts 16384 32768 --eval-tokens 128 --batch 1 --bin 256 --time-budget 40"
fi
start=$(date +%s)
# the stdlib's *.py bytes; an install without sources (a stripped image) falls back to torch's own Python source
SRC=""
n=$("$PY" -c "from mla_quant.eval.train import stdlib_files as f; print(sum(p.stat().st_size for p in f()[1]))" \
  2>/dev/null || echo 0)
if [ "$n" -lt 8000000 ] && [ -z "${SMOKE:-}" ]; then
  SRC="--stdlib $("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
  echo "the stdlib has $n bytes of *.py: training on torch's Python source instead ($SRC)"
fi
# shellcheck disable=SC2086
timeout "$TRAIN_T" "$PY" -m mla_quant.eval.train --arch glm --out "$RUN" $TRAIN_ARGS $SRC >"$OUT/glm_train.log" 2>&1
echo "train: exit $? after $(( $(date +%s) - start ))s"; grep -E "planning|saved|Error|error" "$OUT/glm_train.log" | tail -8
cp "$RUN/train.json" "$OUT/glm_train.json" 2>/dev/null || true
# The evaluation runs the ops' pure-torch references on the GPU (MLA_QUANT_BACKEND=torch): the formats' numerics
# with no Triton compiles or autotuning in the way (the kernels equal these references: tests/kernels).
# shellcheck disable=SC2086
MLA_QUANT_BACKEND=${FID_BACKEND:-torch} timeout "$FID_T" "$PY" -m mla_quant.eval.fidelity_run --checkpoint "$RUN/model" \
  --out "$RUN/fidelity" $FID_ARGS $SRC >"$OUT/glm_fidelity.log" 2>&1
echo "fidelity: exit $? after $(( $(date +%s) - start ))s"; tail -4 "$OUT/glm_fidelity.log"
for f in json md png; do cp "$RUN/fidelity/fidelity.$f" "$OUT/glm_fidelity.$f" 2>/dev/null || true; done
left=$(( ${TOTAL_S:-530} - ($(date +%s) - start) ))   # the whole call must end within 9 minutes
if [ -n "${KIMI_CHECKPOINT:-}" ] && [ -f "$KIMI_CHECKPOINT/config.json" ] && [ "$left" -gt 60 ]; then
  # shellcheck disable=SC2086
  MLA_QUANT_BACKEND=torch timeout $(( left < 90 ? left : 90 )) "$PY" -m mla_quant.eval.fidelity_run --checkpoint "$KIMI_CHECKPOINT" \
    --out "$RUN/kimi_long" $LONG_ARGS $SRC --variants "kv fp8_ds_mla" "kv fp8_e4m3 per-token" "kv bf16" \
    >>"$OUT/glm_fidelity.log" 2>&1
  echo "kimi long contexts: exit $? after $(( $(date +%s) - start ))s"
  { echo; echo "## Kimi-shaped model, KV formats at long contexts"; echo; cat "$RUN/kimi_long/fidelity.md"; } \
    >>"$OUT/glm_fidelity.md" 2>/dev/null || true
fi
cat "$OUT/glm_fidelity.md" 2>/dev/null
ls -la "$OUT"
