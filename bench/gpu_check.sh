#!/usr/bin/env bash
# A prepared check of infer-tune's CUDA paths, a few minutes on one GPU machine (CI stays CPU-only):
#   1. quantized kernels: torch's int4 weight-only matmul and int8 x int8 matmul on CUDA, against the
#      dequantized fp32 product; infer-tune's own quantize pipeline on a tiny model on the device
#   2. a compiled step: the lean decode path (static cache, captured compiled step, compiled prefill)
#      on a tiny random Llama on CUDA, greedy tokens equal to the eager path's
#   3. CUDA-event timing next to host timing around the same step
#   4. nccl: an all_reduce across two ranks when the machine has two devices (skipped otherwise)
# The checks live in bench/gpu_check.py. Prints one line per check (PASS / FAIL / SKIP) and a summary; exits 1 if a check failed. On a machine
# without CUDA it says so and exits 0.
#
#   bench/gpu_check.sh                 # uses .venv/bin/python when present, else python3
#   PYTHON=/path/to/python bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to torch here ($("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda build", torch.version.cuda)' 2>/dev/null || echo 'torch not importable')); nothing to check."
  exit 0
fi

exec timeout 900 "$PYTHON" bench/gpu_check.py
