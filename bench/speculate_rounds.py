"""Where a speculative round's time goes, transformers' assisted generation vs the lean loop (SmolLM2-135M).

Prompt lookup (no draft model, so the round is verify + bookkeeping) and optionally a draft, on
the `code-edit` suite, K in --k, through both engines in one run against the target alone. Targets:

- every row lossless (output_mismatches == 0);
- the lean loop's overhead per round (outside the draft and the target's forward pass) <= 5 ms;
- prompt lookup through the lean loop on code-edit: decode speedup >= 1.5x vs the target alone.

A benchmark of the toolkit, never a timed test: numbers depend on the machine and on what else
runs on it (hold /tmp/infer-tune-cpu.lock on a shared machine).

    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/speculate_rounds.py --threads 1 \
        [--draft drafts/smollm2-135m-self-draft4] [--limit 4] [--max-new-tokens 48] [--k 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from infer_tune.scenarios.common import RunSpec
from infer_tune.scenarios.speculate import SpeculateSweep, run_speculate
from infer_tune.workload import Protocol, Workload

OVERHEAD_MS = 5.0
LOOKUP_SPEEDUP = 1.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft", default=None, help="a draft model as well (e.g. a distilled self-draft)")
    parser.add_argument("--suite", default="code-edit")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", default="4")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("/tmp/infer-tune-speculate-bench"))
    args = parser.parse_args()

    drafts = ["prompt-lookup"] + ([args.draft] if args.draft else [])
    sweep = SpeculateSweep(drafts=drafts, draft_lengths=[int(k) for k in args.k.split(",")], suites=[args.suite],
                           engines=["hf", "lean"])
    spec = RunSpec(model=args.model, workload=Workload(suite=args.suite, limit=args.limit,
                                                       max_new_tokens=args.max_new_tokens),
                   protocol=Protocol(warmup=1, min_iterations=1, min_duration_s=0.0), threads=args.threads,
                   out_dir=args.out, measure_ppl=False)
    outcome = run_speculate(spec, sweep)
    rows = []
    print(f"{'config':<28} {'accept':>7} {'tok/pass':>8} {'draft':>7} {'verify':>7} {'other':>7} {'speedup':>8} "
          f"{'TTFT x':>7}  ms per round")
    for doc in outcome.suites[0].docs:
        m = doc["metrics"]
        row = {"label": doc["label"], "engine": doc["config"]["engine"], "draft": doc["config"]["draft"],
               **{k: m.get(k) for k in ("acceptance_rate", "tokens_per_target_pass", "draft_ms_per_round",
                                        "verify_ms_per_round", "overhead_ms_per_round", "speedup_vs_baseline",
                                        "ttft_speedup_vs_baseline", "output_mismatches")}}
        rows.append(row)
        ttft = m.get("ttft_speedup_vs_baseline")
        print(f"{doc['label']:<28} {m['acceptance_rate'] or 0:7.2f} {m['tokens_per_target_pass']:8.2f} "
              f"{m['draft_ms_per_round']:7.1f} {m['verify_ms_per_round']:7.1f} {m['overhead_ms_per_round']:7.1f} "
              f"{m['speedup_vs_baseline']:7.2f}x {1 / ttft if ttft else float('nan'):7.2f}")
    lean_rows = [r for r in rows if r["engine"] == "lean"]
    lookup_lean = [r for r in lean_rows if r["draft"] == "prompt-lookup"]
    checks = {
        "lossless": all(r["output_mismatches"] == 0 for r in rows),
        f"lean overhead per round <= {OVERHEAD_MS} ms": all(r["overhead_ms_per_round"] <= OVERHEAD_MS for r in lean_rows),
        f"lean prompt lookup speedup >= {LOOKUP_SPEEDUP}x": max(r["speedup_vs_baseline"] for r in lookup_lean)
        >= LOOKUP_SPEEDUP,
    }
    for name, met in checks.items():
        print(f"target {name}: {'met' if met else 'NOT met'}")
    print(json.dumps({"model": args.model, "suite": args.suite, "rows": rows, "checks": checks}))


if __name__ == "__main__":
    main()
