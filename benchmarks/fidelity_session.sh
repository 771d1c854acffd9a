#!/usr/bin/env bash
# Issue 12 in ONE call on the lent H200 (≤ 10 minutes): train the small Kimi K2.6-shaped model on the Python
# standard library's source (≈ 6 min, then a ≈ 35 s INT4 QAT fine-tune of its experts), then measure every
# format's fidelity on held-out stdlib files (≈ 2 min). Each stage has its own timeout; everything lands in
# $OUT (6 files, all small; the 48 M-parameter weights stay on the device: rerun to get them back):
#   train.log, train.json            the training run (settings, data, loss curve, unigram baseline)
#   fidelity.log, fidelity.json,     KL / top-1 / NLL per format and context, KL against position
#   fidelity.md, fidelity.png        the table for docs/fidelity.md and its plot (if matplotlib is there)
# Usage: bash benchmarks/fidelity_session.sh        (TRAIN_S, QAT_S, FID_S: the stages' budgets in seconds)
# CPU smoke of the same pipeline:  SMOKE=1 OUT=/tmp/fid PYTHON=.venv/bin/python bash benchmarks/fidelity_session.sh
set -uo pipefail
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/out}
RUN=${RUN:-$(mktemp -d /tmp/fidelity_run.XXXX)}
mkdir -p "$OUT" "$RUN"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -n "${SMOKE:-}" ]; then
  TRAIN_ARGS="--smoke"; FID_ARGS="--smoke"
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  TRAIN_ARGS="--time-budget ${TRAIN_S:-290} --qat-time ${QAT_S:-35}"
  FID_ARGS="--contexts 1024 2048 4096 8192 --eval-tokens 128 --batch 4 --time-budget ${FID_S:-90}"
fi
start=$(date +%s)
# the stdlib's *.py bytes; an install without sources (a stripped image) falls back to torch's own Python source
SRC=""
n=$("$PY" -c "from mla_quant.eval.train import stdlib_files as f; print(sum(p.stat().st_size for p in f()[1]))" \
  2>/dev/null || echo 0)
if [ "$n" -lt 8000000 ]; then
  SRC="--stdlib $("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
  echo "the stdlib has $n bytes of *.py: training on torch's Python source instead ($SRC)"
fi
# shellcheck disable=SC2086
timeout 390 "$PY" -m mla_quant.eval.train --out "$RUN" $TRAIN_ARGS $SRC >"$OUT/train.log" 2>&1
echo "train: exit $? after $(( $(date +%s) - start ))s"; grep -E "planning|saved|Error|error" "$OUT/train.log" | tail -8
cp "$RUN/train.json" "$OUT/" 2>/dev/null || true
QAT=""; [ -f "$RUN/model_qat/config.json" ] && QAT="--qat-checkpoint $RUN/model_qat"
# The evaluation runs the ops' pure-torch references on the GPU (MLA_QUANT_BACKEND=torch): the formats' numerics
# with no Triton compiles or autotuning in the way (the kernels equal these references: tests/kernels).
# shellcheck disable=SC2086
MLA_QUANT_BACKEND=${FID_BACKEND:-torch} timeout "${FID_TIMEOUT:-170}" "$PY" -m mla_quant.eval.fidelity_run --checkpoint "$RUN/model" $QAT --out "$RUN/fidelity" $FID_ARGS $SRC \
  >"$OUT/fidelity.log" 2>&1
echo "fidelity: exit $? after $(( $(date +%s) - start ))s"; tail -4 "$OUT/fidelity.log"
cp "$RUN"/fidelity/fidelity.{json,md,png} "$OUT/" 2>/dev/null || true
cat "$OUT/fidelity.md" 2>/dev/null
ls -la "$OUT"
