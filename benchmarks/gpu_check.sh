#!/usr/bin/env bash
# GPU check for the kernel registry, for one CUDA machine, in under 8 minutes:
#   1. `titanite kernels verify` on every implementation in bfloat16 and float32 (the Triton
#      kernels compile, autotune and run natively here; on CPU they only ran in the interpreter,
#      which cannot check bfloat16 tl.dot), forward and backward, awkward shapes;
#   2. `titanite kernels bench` on all ops, bfloat16, Qwen3-sized shapes (MoE: 30B-A3B), with the
#      peak memory of one forward + backward (the chunked loss's saving shows there);
#   3. the chunked loss's peak memory at 8192 tokens x hidden 4096 x vocab 151936.
#   Also fla-core's gated_delta (pip install fla-core first to check it; skipped without it).
# Results go to $OUT (default outputs/gpu_check): verify.txt/json, verify_fla.txt/json, bench.txt/json, loss_memory.txt,
# env.txt. Exit status: non-zero when a verify case fails (the rest still runs).
#
#   bash benchmarks/gpu_check.sh               # from the repository root
#   OUT=/tmp/results bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-outputs/gpu_check}"
mkdir -p "$OUT"
PY="${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__, 'device', torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
start=$SECONDS
timeout 240 "$PY" -m titanite.cli kernels verify --device cuda --dtype bfloat16 float32 \
  --json "$OUT/verify.json" > "$OUT/verify.txt" 2>&1 || status=$?
tail -n 60 "$OUT/verify.txt"
echo "verify: exit $status, $((SECONDS - start)) s"

# fla-core's gated delta rule (optional; verify skips it, saying so, when fla-core is missing):
# the reference semantics through its varlen path (cu_seqlens) for packed documents.
start=$SECONDS
timeout 120 "$PY" -m titanite.cli kernels verify gated_delta --impl fla --device cuda --dtype bfloat16 float32 \
  --json "$OUT/verify_fla.json" > "$OUT/verify_fla.txt" 2>&1 || status=$?
cat "$OUT/verify_fla.txt"
echo "verify fla: exit $status, $((SECONDS - start)) s"

start=$SECONDS
timeout 180 "$PY" -m titanite.cli kernels bench --device cuda --dtype bfloat16 --min-seconds 0.3 \
  --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1 || echo "bench: exit $?"
cat "$OUT/bench.txt"
echo "bench: $((SECONDS - start)) s"

start=$SECONDS
timeout 60 "$PY" benchmarks/kernels.py --only loss-memory --device cuda --tokens 8192 --hidden 4096 \
  > "$OUT/loss_memory.txt" 2>&1 || echo "loss memory: exit $?"
cat "$OUT/loss_memory.txt"
echo "loss memory: $((SECONDS - start)) s"
exit $status
