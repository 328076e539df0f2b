#!/usr/bin/env bash
# A prepared check of infer-tune's CUDA paths, a few minutes on one GPU machine (CI stays CPU-only):
#   1. quantized kernels: torch's int4 weight-only matmul and int8 x int8 matmul on CUDA, against the
#      dequantized fp32 product; infer-tune's own quantize pipeline on a tiny model on the device
#   2. a compiled step: the lean decode path (static cache, captured compiled step, compiled prefill)
#      on a tiny random Llama on CUDA, greedy tokens equal to the eager path's
#   3. CUDA-event timing next to host timing around the same step
#   4. nccl: an all_reduce across two ranks when the machine has two devices (skipped otherwise)
#   5. engine launches: `bench --engine vllm` and `bench --engine sglang` on a small checkpoint (fp8 KV cache,
#      a slot limit) where the engine is installed (skipped otherwise): the launch path of
#      infer_tune/engines/launch.py against the real server (tests/test_engine_launch.py runs it against a fake)
#   6. real sizes through the CLI: `infer-tune quantize --weights random --device cuda --sweep int8-dynamic,int4-rtn`
#      on the presets in SIZE_MODELS (default llama-3.2-1b and llama-3.1-8b): the bf16 reference, then each
#      method with the backend `auto` picks on CUDA; one line per row (decode tok/s, TTFT, speedup [95%],
#      bytes against 16-bit, quantized layers, GPU peak memory). Set SIZE_MODELS= (empty) to skip. Each model's sweep
#      is measured in interleaved rounds: allow minutes (one method at 1B took 1m33s at --max-round-seconds 60)
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

timeout "${CHECK_TIMEOUT:-900}" "$PYTHON" bench/gpu_check.py
rc=$?

# 5. engine launches (ENGINE_MODEL: a small checkpoint or hub id the engines can load offline)
ENGINE_MODEL="${ENGINE_MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}"
engine_check() {  # name, python module, settings...
  local name=$1 module=$2; shift 2
  if ! "$PYTHON" -c "import $module" 2>/dev/null; then echo "SKIP engine $name: $module is not installed"; return; fi
  local sets=(); for s in "$@"; do sets+=(--set "$s"); done
  if timeout 900 "$PYTHON" -m infer_tune bench --engine "$name" --model "$ENGINE_MODEL" --limit 2 \
       --max-new-tokens 16 --out runs/gpu-check-engines "${sets[@]}" > "/tmp/gpu-check-$name.log" 2>&1; then
    echo "PASS engine $name ($*)"
  else
    echo "FAIL engine $name ($*): $(tail -n 2 "/tmp/gpu-check-$name.log" | tr '\n' ' ')"; rc=1
  fi
}
engine_check vllm vllm kv_cache_dtype=fp8 max_num_seqs=8 max_num_batched_tokens=2048
engine_check sglang sglang kv_cache_dtype=fp8_e4m3 max_num_seqs=8

# 6. real sizes through the CLI
SIZE_OUT="${SIZE_OUT:-runs/gpu-check-sizes}"
for model in ${SIZE_MODELS-llama-3.2-1b llama-3.1-8b}; do
  log="$SIZE_OUT/$model.log"; mkdir -p "$SIZE_OUT"
  if timeout "${SIZE_TIMEOUT:-420}" "$PYTHON" -m infer_tune quantize --model "$model" --weights random --device cuda \
       --sweep "${SIZE_METHODS:-int8-dynamic,int4-rtn}" --limit 4 --max-new-tokens 64 --min-duration 2 \
       --max-round-seconds 30 --out "$SIZE_OUT" --json > "$SIZE_OUT/$model.json" 2> "$log"; then
    "$PYTHON" bench/gpu_check.py --summarize "$SIZE_OUT/$model.json" "$model" || rc=1
  else
    status=$?; why=$(grep -v '^\s*$' "$log" | tail -n 3 | tr '\n' ' ')
    [ "$status" = 124 ] && why="timed out after ${SIZE_TIMEOUT:-420} s (SIZE_TIMEOUT) $why"
    echo "FAIL sizes $model: $why"; rc=1
  fi
done
exit $rc
