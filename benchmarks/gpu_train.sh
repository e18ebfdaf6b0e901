#!/usr/bin/env bash
# The prepared GPU training benchmark (benchmarks/gpu_train.py) for one H100/H200, in under 8
# minutes: a random-init Qwen3 1.7B and a small Qwen3-MoE (64 experts, top-8), ~30 steps at
# sequence 4096 in bf16, under the hf backend, native, native + compile and native + flex +
# Triton kernels. Writes gpu_train.md (the table) and gpu_train_*.json to $OUT
# (default outputs/gpu_train). Exit status: non-zero when the rows' losses disagree or a row fails.
#
#   bash benchmarks/gpu_train.sh                 # from the repository root
#   OUT=/tmp/results bash benchmarks/gpu_train.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-outputs/gpu_train}"
mkdir -p "$OUT"
PY="${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/env.txt" 2>&1
timeout 460 "$PY" benchmarks/gpu_train.py --out "$OUT" --row-timeout 110 "$@"
