"""The same workload in-process and through OpenAI-compatible servers on loopback, in one run.

infer-tune's in-process baseline, `transformers serve` (default mode, then continuous batching) and,
when llama-cpp-python's server is installed, llama.cpp on the GGUF the model comes from: a closed-loop
bench of each (same prompts, greedy), then one open-loop trace per rate against each server. Prints
one table; every result lands in --out (one leaderboard).

    flock /tmp/infer-tune-cpu.lock python bench/endpoint_engines.py --limit 4 --max-new-tokens 32 \
        --rates 0.5,2 --requests 8 --out runs/engines
"""

from __future__ import annotations

import argparse
from pathlib import Path

from infer_tune.endpoint.arrivals import parse_rates
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.servers import local_server, missing_modules
from infer_tune.scenarios.bench import run_bench
from infer_tune.scenarios.common import RunSpec
from infer_tune.scenarios.endpoint import run_endpoint_bench, run_endpoint_sweep
from infer_tune.workload import Protocol, Workload


def row(name: str, doc: dict) -> str:
    m = doc["metrics"]
    return (f"{name:<34} ttft p50 {m['ttft_ms']['p50']:9.1f} ms  p99 {m['ttft_ms']['p99']:9.1f} ms  tpot p50 "
            f"{m['tpot_ms']['p50'] or float('nan'):7.1f} ms  {m['output_throughput_tok_s']:7.2f} tok/s  "
            f"ok {m.get('requests_ok', '-')}  bleu {m['bleu']:.2f}  exact vs base {m.get('exact_match_vs_baseline')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rates", default="0.5,2")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("runs/engines"))
    args = p.parse_args()
    spec = RunSpec(model=args.model, workload=Workload(limit=args.limit, max_new_tokens=args.max_new_tokens),
                   protocol=Protocol(warmup=1, min_iterations=1, min_duration_s=0), threads=args.threads,
                   out_dir=args.out, measure_ppl=False)
    lines = []
    base = run_bench(spec).baseline
    lines.append(row("in-process baseline", base))
    engines = [("transformers", False), ("transformers", True)]
    if not missing_modules("llama.cpp"):
        engines.append(("llama.cpp", False))
    for engine, cb in engines:
        name = f"{engine}{' (continuous batching)' if cb else ''}"
        with local_server(engine, args.model, continuous_batching=cb, threads=args.threads) as server:
            config = EndpointConfig(url=server.url, served_model=server.served_model, label=name)
            doc = run_endpoint_bench(spec, config, model_given=True, baseline=Path(base.location))
            lines.append(row(f"{name} closed loop", doc))
            sweep = run_endpoint_sweep(spec, EndpointConfig(url=server.url, served_model=server.served_model,
                                                            label=name, concurrency=args.concurrency),
                                       parse_rates(args.rates), requests=args.requests, model_given=True)
            for d in sweep.docs:
                lines.append(row(f"{name} @ {d['metrics']['offered_rate_req_s']} req/s", d))
            lines.append(f"{name}: knee {sweep.knee_rate} req/s ({sweep.knee_status} the sweep; saturated: "
                         f"{sweep.saturated})")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
