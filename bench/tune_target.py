"""The issue's targets for `infer-tune tune`, checked on one run of it:

- within the budget (default 20 minutes) it finds a config whose decode tok/s >= llama.cpp's on the
  same GGUF measured in the same run, with BLEU drift >= -1.0, and TTFT <= 2x llama.cpp's;
- no quantize result's TTFT above 3x the baseline's without a `ttft_note` saying why;
- int8-static perplexity change <= 15% (when it was measured).

    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/tune_target.py --budget-minutes 20 --out runs/tune-target

Not a test: it measures the host (run it under the CPU lock; read the noise flags).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import parser  # noqa: E402


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--budget-minutes", type=float, default=20.0)
    p.add_argument("--max-ppl-delta", type=float, default=5.0)
    p.add_argument("--out", default="runs/tune-target")
    p.set_defaults(max_new_tokens=64)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.scenarios.tune import run_tune
    from infer_tune.scenarios.tune_plan import TuneSpec
    from infer_tune.workload import Protocol, Workload

    def progress(stage, done, total):
        if stage.startswith("tune"):
            print(f"[{time.strftime('%H:%M:%S')}] {stage}", flush=True)

    spec = RunSpec(model=args.model, workload=Workload(suite=args.suite, limit=args.limit,
                                                       max_new_tokens=args.max_new_tokens),
                   protocol=Protocol(warmup=1, min_iterations=2, min_duration_s=2.0), threads=args.threads,
                   out_dir=Path(args.out))
    outcome = run_tune(spec, TuneSpec(max_ppl_delta=args.max_ppl_delta, budget_s=args.budget_minutes * 60),
                       progress=progress)
    for row in outcome.tried():
        print(f"  {row['label']:<40} {row['status']:<9} {row['decode_tok_s'] or 0:7.1f} tok/s  TTFT "
              f"{row['ttft_p50_ms'] or 0:7.1f} ms  ppl {row['ppl_delta_pct'] if row['ppl_delta_pct'] is not None else float('nan'):+7.2f}%  "
              f"BLEU {row['bleu_drift'] if row['bleu_drift'] is not None else float('nan'):+6.2f}  "
              f"{'noisy ' if row['noisy'] else ''}{row['reason'] or ''}")
    vs = outcome.versus_reference
    w = outcome.winner["metrics"]
    print(f"winner {outcome.winner['label']} in {outcome.elapsed_s / 60:.1f} min; versus llama.cpp: {vs}")
    checks = {
        f"within {args.budget_minutes:g} minutes": outcome.elapsed_s <= args.budget_minutes * 60 * 1.05,
        "decode >= llama.cpp": bool(vs and vs["beat_decode"]),
        "BLEU drift >= -1.0": (w.get("bleu_drift") or 0.0) >= -1.0,
        "TTFT <= 2x llama.cpp": bool(vs and vs["ttft_within_2x"]),
    }
    for cand in outcome.candidates:
        m = (cand.doc or {}).get("metrics") or {}
        ttft = m.get("ttft_speedup_vs_baseline")
        if cand.config.technique == "quantize" and ttft is not None and ttft < 1 / 3:
            checks[f"{cand.label}: TTFT > 3x fp32 explained"] = bool(m.get("ttft_note"))
        if getattr(cand.config, "method", None) == "int8-static" and m.get("ppl_delta_pct") is not None:
            checks["int8-static ppl change <= 15%"] = m["ppl_delta_pct"] <= 15.0
    for name, held in checks.items():
        print(f"{'PASS' if held else 'FAIL'}  {name}")


if __name__ == "__main__":
    main()
