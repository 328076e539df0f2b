"""Repeatability of one config: run it N times (each a full measurement with its own noise figure) and
report the CV of p50 TPOT and p50 TTFT across the runs, next to what each run's noise figure said.

Target: on an idle machine, CV <= 5% for both, and the noise figure flags the runs where the machine
was not idle. Run under the CPU lock (the point is to see what other processes do to the numbers):

    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/tune_noise.py --repeats 5 --method int4-rtn

Not a test: it measures the host.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import parser  # noqa: E402


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--method", default="int4-rtn", help="quantize method, or 'baseline'")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from infer_tune.scenarios.bench import run_bench
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.tuners.quantize import QuantizeConfig
    from infer_tune.workload import Protocol, Workload

    configs = [] if args.method == "baseline" else [QuantizeConfig(method=args.method)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tune-noise-") as out:
        for i in range(args.repeats):
            spec = RunSpec(model=args.model, workload=Workload(suite=args.suite, limit=args.limit,
                                                               max_new_tokens=args.max_new_tokens),
                           protocol=Protocol(warmup=1, min_iterations=3, min_duration_s=2.0), threads=args.threads,
                           out_dir=Path(out) / str(i), measure_ppl=False)
            outcome = run_bench(spec, configs)
            doc = outcome.docs[0] if configs else outcome.baseline
            m = doc["metrics"]
            rows.append((m["tpot_ms"]["p50"], m["ttft_ms"]["p50"], m["noise"]))
            n = m["noise"]
            print(f"run {i + 1}: TPOT p50 {m['tpot_ms']['p50']:.2f} ms, TTFT p50 {m['ttft_ms']['p50']:.1f} ms; "
                  f"noise: tpot cv {n['tpot_p50_cv'] or 0:.1%}, ttft cv {n['ttft_p50_cv'] or 0:.1%}, other CPU "
                  f"{n['other_cpu_share']:.0%}, load {n['loadavg_before']:.2f}->{n['loadavg_after']:.2f}, "
                  f"{'NOISY: ' + '; '.join(n['why']) if n['noisy'] else 'quiet'}", flush=True)
    tpots, ttfts = [r[0] for r in rows], [r[1] for r in rows]
    print(f"across {len(rows)} runs: CV of p50 TPOT {statistics.stdev(tpots) / statistics.fmean(tpots):.1%}, "
          f"CV of p50 TTFT {statistics.stdev(ttfts) / statistics.fmean(ttfts):.1%}; "
          f"{sum(r[2]['noisy'] for r in rows)} of {len(rows)} runs flagged noisy")


if __name__ == "__main__":
    main()
