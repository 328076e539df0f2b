"""Speculative decoding in `infer-tune serve` (prompt-lookup drafts verified in the native step) against the same
server without it, on the same clock and the same seeded trace (docs/endpoint.md, "Speculative decoding").

Per repeat: `serve --speculate K` and `serve --speculate 0` (int4-rtn weights, int8 activations, the native step,
`--batch` slots), started one after the other (the order alternates by repeat), each replaying one seeded Poisson
trace of `--requests` prompts of `--suite` at `--rate` req/s, `--max-new-tokens` each with `ignore_eos`, through the
load generator of `bench --endpoint` (scenarios/endpoint.py `trace_document`). Reported: TPOT p50 (decode),
TTFT p50, output throughput, each as speculative / plain with a 95% t-interval over the repeats on the logs, the
acceptance the server counted (`/metrics`), and the outputs that differ between the two (greedy: 0 expected).

    flock /tmp/infer-tune-cpu.lock python bench/serve_speculate.py --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_vs_llamacpp import infer_tune_server, spec_of  # noqa: E402


def metrics_of(url: str) -> dict:
    base = url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:  # noqa: S310 (loopback)
        text = response.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line[0] == "#"}


def run_side(args, k: int, rate: float, repeat: int) -> dict:
    from infer_tune.endpoint.arrivals import poisson_trace
    from infer_tune.endpoint.config import EndpointConfig
    from infer_tune.scenarios.endpoint import open_endpoint, trace_document

    side = argparse.Namespace(**vars(args), native_step=True)
    spec = spec_of(side)
    with infer_tune_server(side, extra=("--speculate", str(k))) as server:
        config = EndpointConfig(url=server.url, served_model=server.served_model, api="chat", ignore_eos=True,
                                stream_usage=True, concurrency=max(64, args.requests), label=f"serve k={k}")
        run = open_endpoint(spec, config, model_given=True)
        trace = poisson_trace(args.requests, rate, len(run.inputs.prompts), seed=args.seed + repeat,
                              max_new_tokens=args.max_new_tokens)
        before = metrics_of(server.url)
        doc, outputs = trace_document(run, spec, trace, {}, {"rate_req_s": rate, "seed": args.seed + repeat}, None)
        after = metrics_of(server.url)
    m = doc["metrics"]
    drafted = after.get("infer_tune_spec_draft_tokens_total", 0) - before.get("infer_tune_spec_draft_tokens_total", 0)
    accepted = after.get("infer_tune_spec_accepted_tokens_total", 0) - before.get("infer_tune_spec_accepted_tokens_total", 0)
    return {"k": k, "repeat": repeat, "tpot_p50": m["tpot_ms"]["p50"], "ttft_p50": m["ttft_ms"]["p50"],
            "throughput_tok_s": m["output_throughput_tok_s"], "requests_ok": m.get("requests_ok"),
            "acceptance": accepted / drafted if drafted else None, "drafted": drafted, "accepted": accepted,
            "outputs": {str(o["prompt_id"]) + ":" + str(i): o["output"] for i, o in enumerate(outputs)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="int4-rtn")
    p.add_argument("--activations", default="int8")
    p.add_argument("--suite", default="code-edit")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--k", type=int, default=8, help="draft tokens a step")
    p.add_argument("--batch", type=int, default=4, help="slots")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default="/tmp/infer-tune-serve-speculate")
    p.add_argument("--state", default="/tmp/infer-tune-serve-speculate.json")
    args = p.parse_args()
    from infer_tune.metrics.stats import log_ratio_interval

    rows = []
    for repeat in range(args.repeats):
        for k in ((args.k, 0) if repeat % 2 == 0 else (0, args.k)):
            row = run_side(args, k, args.rate, repeat)
            rows.append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "outputs"}), flush=True)
    Path(args.state).write_text(json.dumps({"args": vars(args), "rows": rows}))
    by = {(r["repeat"], r["k"]): r for r in rows}
    print(f"\nserve --speculate {args.k} / --speculate 0, {args.suite}, {args.rate} req/s, {args.requests} requests, "
          f"{args.max_new_tokens} tokens, {args.batch} slots, {args.repeats} repeats (95% t-interval on the logs):")
    for key in ("tpot_p50", "ttft_p50", "throughput_tok_s"):
        ratios = [by[(r, args.k)][key] / by[(r, 0)][key] for r in range(args.repeats) if by[(r, 0)][key]]
        interval = log_ratio_interval(ratios)
        shown = f"{interval['point']:.3f}x [{interval['ci95'][0]:.3f}, {interval['ci95'][1]:.3f}]" if interval \
            else ", ".join(f"{x:.3f}" for x in ratios)
        print(f"  {key:17s} {shown}   per repeat {[round(x, 3) for x in ratios]}")
    differ = sum(by[(r, args.k)]["outputs"].get(key) != out for r in range(args.repeats)
                 for key, out in by[(r, 0)]["outputs"].items())
    acceptance = [by[(r, args.k)]["acceptance"] for r in range(args.repeats)]
    print(f"  outputs that differ (greedy: 0 expected): {differ}; acceptance by repeat: "
          f"{[round(a, 3) if a is not None else None for a in acceptance]}")
    decode = [by[(r, 0)]["tpot_p50"] / by[(r, args.k)]["tpot_p50"] for r in range(args.repeats)]
    print(f"  decode speedup (plain TPOT / speculative TPOT): {[round(x, 3) for x in decode]}, "
          f"geometric mean {math.exp(sum(map(math.log, decode)) / len(decode)):.3f}x")


if __name__ == "__main__":
    main()
