"""Per-token latency at position ~512 vs ~32, without a cache and with the dynamic cache (SmolLM2-135M).

The issue's targets: `none` at ~512 >= 3x its latency at ~32 (every step recomputes the whole
sequence), while `dynamic` stays within 1.5x (one new token per step). A benchmark of the toolkit,
never a timed test: numbers depend on the machine and on what else runs on it.

Each position is measured with its own prompt of real suite text (24 and 504 tokens) and 16 pinned
new tokens, so the decode steps land at positions 26..40 and 506..520; the step latencies are
averaged over those positions and over the timed iterations.

    .venv/bin/python bench/kv_positions.py [--model smollm2-135m] [--threads 2] [--out /tmp/kv-bench]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from infer_tune.metrics import kv
from infer_tune.scenarios.common import RunSpec, open_run
from infer_tune.scenarios.kv_cache import KVSweepSpec, run_kv_sweep
from infer_tune.workload import Protocol

SHORT, LONG, NEW_TOKENS = 24, 504, 16
TARGETS = {"none": (">=", 3.0), "dynamic": ("<=", 1.5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/infer-tune-kv-bench"))
    args = parser.parse_args()

    spec = KVSweepSpec(impls=["none", "dynamic"], context_lengths=[SHORT, LONG], max_new_tokens=NEW_TOKENS)
    protocol = Protocol(warmup=1, min_iterations=args.iterations, min_duration_s=0.0)
    run = open_run(RunSpec(model=args.model, threads=args.threads, out_dir=args.out), load_suite=False)
    threads = run.ctx.threads
    sweep = run_kv_sweep(run.loaded, spec, protocol, run.ctx)

    step_ms = {(d["config"]["impl"], d["metrics"]["prompt_tokens"]): statistics.mean(d["metrics"]["per_position_ms"])
               for d in sweep.docs}
    report = {"model": args.model, "threads": threads, "new_tokens": NEW_TOKENS, "rows": []}
    for impl, (op, target) in TARGETS.items():
        short, long = step_ms[(impl, SHORT)], step_ms[(impl, LONG)]
        ratio = long / short
        met = ratio >= target if op == ">=" else ratio <= target
        report["rows"].append({"impl": impl, "step_ms_at_32": short, "step_ms_at_512": long, "ratio": ratio,
                               "target": f"{op} {target}", "met": met})
        print(f"{impl:<8} step at ~32: {short:7.2f} ms   at ~512: {long:7.2f} ms   ratio {ratio:5.2f}x "
              f"(target {op} {target}x): {'met' if met else 'NOT met'}")
    for line in kv.claim_lines(sweep.claims):
        print(f"claim: {line}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
