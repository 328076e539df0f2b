#!/usr/bin/env bash
# `tune --engine llama.cpp` and its answer started by hand, as one prepared command (run it under the CPU lock):
#   1. infer-tune tune --engine llama.cpp --model smollm2-135m --max-ppl-delta 5 --budget-minutes $BUDGET (10):
#      the table, the winner, the launch command it prints and the `bench --endpoint` line to measure it by hand
#   2. the printed launch started by hand, exactly as printed (its own process, not infer-tune's launcher), the
#      printed `bench --endpoint` line run against it, and its decode tok/s (TPOT p50) compared with the winner's
#      row of step 1: PASS within 10%
#   3. infer-tune's own winner in process (OUT/own; NO_OWN=1 skips it) and `leaderboard OUT`: one report with
#      infer-tune's rows, llama.cpp's best launch and its default launch
# OUT gets the tune run (OUT/llama.cpp: its rows and recommended.yaml), the by-hand run (OUT/by-hand) and logs.
# docs/tune.md, "Tuning a deployed engine".
#
#   bench/engine_tune_check.sh [OUT] [more tune options...]      # OUT: runs/engine-tune-check
#   BUDGET=4 PYTHON=/path/to/python bench/engine_tune_check.sh /tmp/check --threads 2
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${1:-runs/engine-tune-check}"
[ $# -gt 0 ] && shift
BUDGET="${BUDGET:-10}"
mkdir -p "$OUT"

start=$(date +%s)
echo "== tune --engine llama.cpp ($(date -u +%FT%TZ))"
"$PYTHON" -m infer_tune tune --engine llama.cpp --model smollm2-135m --max-ppl-delta 5 --budget-minutes "$BUDGET" \
  --out "$OUT/llama.cpp" "$@" | tee "$OUT/tune.txt"
rc=${PIPESTATUS[0]}
echo "tune --engine: $(( $(date +%s) - start )) s, exit $rc"
[ "$rc" -eq 0 ] || exit "$rc"

launch=$(sed -n 's/^launch: //p' "$OUT/tune.txt")
hand=$(sed -n 's/^by hand: start the launch above, then infer-tune //p' "$OUT/tune.txt")
if [ -z "$launch" ] || [ -z "$hand" ]; then echo "FAIL: tune printed no launch / by-hand line"; exit 1; fi
port=$(echo "$launch" | sed -n 's/.*--port \([0-9]*\).*/\1/p')

echo "== the printed launch, started by hand: $launch"
bash -c "exec $launch" > "$OUT/by-hand-server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null' EXIT
"$PYTHON" - "$port" <<'EOF' || { echo "FAIL: the printed launch did not answer"; tail -n 5 "$OUT/by-hand-server.log"; exit 1; }
import sys, time, urllib.request
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v1/models", timeout=2).read()
        sys.exit(0)
    except OSError:
        time.sleep(0.5)
sys.exit(1)
EOF
echo "== infer-tune $hand"
# shellcheck disable=SC2086  # the printed line, split as a shell would
# timed passes over at least 30 s, as the tuned row's rounds were (its interval came from many passes)
eval "\"$PYTHON\" -m infer_tune $hand --min-duration 30 --out \"$OUT/by-hand\" --json" > "$OUT/by-hand.json" \
  || { echo "FAIL: bench --endpoint"; exit 1; }
kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; trap - EXIT

"$PYTHON" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
import yaml

out = Path(sys.argv[1])
rec = yaml.safe_load((out / "llama.cpp" / "recommended.yaml").read_text())
tuned = json.loads((Path(rec["result"]) / "result.json").read_text())["metrics"]
hand = json.loads(next((out / "by-hand").glob("*/result.json")).read_text())["metrics"]
ok = True
for name, key in (("decode tok/s (1000 / TPOT p50)", "tpot_ms"), ("TTFT p50", "ttft_ms")):
    a, b = tuned[key]["p50"], hand[key]["p50"]
    a, b = (1000 / a, 1000 / b) if key == "tpot_ms" else (a, b)
    change = 100 * (b / a - 1)
    within = abs(change) <= 10
    ok &= within or key != "tpot_ms"  # the check is on the objective (decode); TTFT is reported beside it
    print(f"{name}: tuned row {a:.2f}, started by hand {b:.2f} ({change:+.1f}%)"
          + (f" {'PASS' if within else 'FAIL'} (within 10%)" if key == "tpot_ms" else ""))
rounds = [1000 / t for t in ((tuned.get("rounds") or {}).get("per_round") or {}).get("tpot_ms") or [] if t]
if rounds:  # the row's own spread: how far its rounds' decode speeds were apart on this host
    print(f"the tuned row's rounds: decode tok/s {min(rounds):.1f} to {max(rounds):.1f} over {len(rounds)} rounds")
print(f"winner: {tuned.get('speedup_vs_baseline')} {tuned.get('speedup_vs_baseline_ci95')} of the default launch, "
      f"ppl {tuned.get('ppl_delta_pct')}%, BLEU drift {tuned.get('bleu_drift')}")
sys.exit(0 if ok else 1)
EOF
check=$?

# 3. infer-tune's own single-stream winner in process (int4-rtn g32 with int8 activations, the lean native step)
#    against its float32 baseline, beside the engine rows: one report over OUT (leaderboard.md)
if [ -z "${NO_OWN:-}" ]; then
  cat > "$OUT/own.yaml" <<'EOF'
description: infer-tune's own single-stream winner, beside tune --engine's rows
model: smollm2-135m
workload: {suite: chat, limit: 4, max_new_tokens: 64}
protocol: {warmup: 1, min_iterations: 3, min_duration_s: 0, max_duration_s: 90}
configs:
  - {technique: stack, configs: [{technique: quantize, method: int4-rtn, activations: int8}, {technique: lean, native_step: true}]}
EOF
  echo "== infer-tune bench --recipe $OUT/own.yaml"
  "$PYTHON" -m infer_tune bench --recipe "$OUT/own.yaml" --out "$OUT/own" > "$OUT/own.txt" 2>&1 || echo "in-process bench failed: $(tail -n 2 "$OUT/own.txt")"
fi
"$PYTHON" -m infer_tune leaderboard "$OUT" -f md > /dev/null && echo "report: $OUT/leaderboard.md"
exit "$check"
