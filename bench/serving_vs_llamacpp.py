"""Serving under load, one seeded trace, two engines: infer-tune's batched stack (int4 weights + the lean slot
engine: static per-slot cache, compiled prefill buckets, compiled batched decode step; docs/batch.md) and
llama.cpp's own C++ server with as many parallel slots, on the model's own GGUF (docs/endpoint.md).

By default the slot engine compiles one graph (the step over all slots; prefill eager), which bounds the
compile time on a busy host; `--step-buckets all --compiled-prefill` runs the whole engine.

The trace: `--requests` ShareGPT prompts (seeded picks, the same at every rate), Poisson arrivals per rate,
each request's output length = its prompt's single-request greedy length under infer-tune's int4 weights
(capped at --max-new-tokens). llama.cpp gets the same prompts, arrivals and lengths (`ignore_eos`, so both
engines generate the same number of tokens). Output throughput, TTFT / TPOT percentiles, goodput under the
same SLOs, `roofline_fraction`, and mismatches: infer-tune's against single-request greedy on its weights
(checked by the trace runner), llama.cpp's against its own outputs for each prompt sent alone.

`--phase both` (the default) measures rate by rate, infer-tune then llama.cpp on the same trace (so a host
whose speed drifts moves both rows of a rate alike), `--repeats` times over. The phases can also run apart,
sharing a state file; the table is printed from whatever the state holds:

    flock /tmp/infer-tune-cpu.lock python bench/serving_vs_llamacpp.py --threads 2 --rates 0.5,1,2,4 --repeats 2
    flock /tmp/infer-tune-cpu.lock python bench/serving_vs_llamacpp.py --phase infer-tune --threads 2
    flock /tmp/infer-tune-cpu.lock python bench/serving_vs_llamacpp.py --phase llama.cpp --threads 2
    python bench/serving_vs_llamacpp.py --phase table

llama.cpp's server is built by scripts/build-llama-server.sh. Not a test: read the table of one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infer_tune.scenarios.common import RunSpec  # noqa: E402
from infer_tune.workload import Protocol, Workload  # noqa: E402


def spec_of(args) -> RunSpec:
    workload = Workload(suite="chat", limit=args.requests, max_new_tokens=args.max_new_tokens,
                        max_prompt_tokens=args.max_prompt_tokens)
    return RunSpec(model=args.model, workload=workload, protocol=Protocol(warmup=1, min_iterations=1, min_duration_s=0),
                   threads=args.threads, out_dir=Path(args.out), measure_ppl=False)


def row_of(engine: str, rate: float, doc: dict, goodput: dict, mismatches, extra: dict | None = None) -> dict:
    m = doc["metrics"]
    return {"engine": engine, "rate": rate, "throughput_tok_s": m["output_throughput_tok_s"],
            "ttft_p50": m["ttft_ms"]["p50"], "ttft_p90": m["ttft_ms"]["p90"], "ttft_p99": m["ttft_ms"]["p99"],
            "tpot_p50": m["tpot_ms"]["p50"], "tpot_p90": m["tpot_ms"]["p90"], "tpot_p99": m["tpot_ms"]["p99"],
            "goodput_req_s": goodput.get("goodput_req_s"), "slo_attainment": goodput.get("slo_attainment"),
            "mismatches": mismatches, "roofline_fraction": m.get("roofline_fraction"),
            "duration_s": m.get("trace_duration_s"), "run_id": doc.get("run_id"), **(extra or {})}


def progress(started: float):
    """Print each stage of a measurement when it completes (a run cut by its time limit still says where)."""
    def report(what: str, done: int, total: int) -> None:
        if done == total:
            print(f"  {what}: {total} done at {time.perf_counter() - started:.0f} s", flush=True)
    return report


def infer_tune_side(args, state: dict):
    """A function measuring infer-tune's batched stack at one rate (the model loaded once)."""
    from infer_tune.metrics.saturation import SLO, goodput
    from infer_tune.scenarios.common import open_run
    from infer_tune.session import Row, measure_prepared, save_rows
    from infer_tune.tuners import apply
    from infer_tune.tuners.batch import BatchConfig
    from infer_tune.tuners.quantize import QuantizeConfig
    from infer_tune.tuners.stack import StackConfig

    spec = spec_of(args)
    slo = SLO(ttft_ms=args.slo_ttft, tpot_ms=args.slo_tpot)
    run = open_run(spec)

    def measure(scheduler: str, rate: float) -> None:
        started = time.perf_counter()
        batch = BatchConfig(scheduler=scheduler, batch_size=args.batch, rate=rate, requests=args.requests,
                            seed=args.seed, engine="lean", compile_prefill=args.compile_prefill,
                            step_buckets=args.step_buckets, native_step=args.native_step)
        config = StackConfig(configs=[QuantizeConfig(method=args.method, activations=args.activations), batch])
        prepared = apply(run.loaded, config, run.ctx)
        doc, outputs = measure_prepared(run.loaded, prepared, run.inputs, spec.workload, spec.protocol,
                                        technique="stack", config=config.to_dict(), env=run.ctx.env,
                                        runner="trace", measure_ppl=False, progress=progress(started))
        sched, factory = prepared.runner_options["scheduler"], prepared.runner_options["trace"]
        good = goodput(sched.timings, slo, doc["metrics"]["trace_duration_s"])
        doc["metrics"].update(good)
        save_rows(spec.out_dir, [Row(doc, outputs)])  # the engine's writer, under the runs folder's lock
        m = doc["metrics"]
        state["trace"][str(rate)] = [r.to_dict() for r in factory.rows]
        state["rows"].append(row_of(f"infer-tune {config.label()}", rate, doc, good, m.get("output_mismatches"),
                                    {"mean_batch_size": m.get("mean_batch_size"),
                                     "setup_s": m.get("scheduler_setup_s"),
                                     "engine_reused": m.get("slot_engine_reused", False)}))
        print(f"infer-tune {scheduler} @ {rate} req/s: {m['output_throughput_tok_s']:.1f} tok/s, "
              f"mismatches {m.get('output_mismatches')}, setup {m.get('scheduler_setup_s') or 0:.1f} s, "
              f"{time.perf_counter() - started:.1f} s in all", flush=True)
        save(args, state)
    return measure


def phase_infer_tune(args, state: dict) -> None:
    measure = infer_tune_side(args, state)
    for scheduler in args.schedulers.split(","):
        for rate in args.rates:
            measure(scheduler, rate)


class LlamaSide:
    """llama.cpp's server with `--batch` parallel slots, replaying the traces infer-tune measured."""

    def __init__(self, args, state: dict, stack) -> None:
        from infer_tune.endpoint.config import EndpointConfig
        from infer_tune.endpoint.servers import local_server
        from infer_tune.metrics.saturation import SLO
        from infer_tune.scenarios.endpoint import open_endpoint, served_weight_bytes

        self.args, self.state, self.spec = args, state, spec_of(args)
        self.slo = SLO(ttft_ms=args.slo_ttft, tpot_ms=args.slo_tpot).to_dict()
        server = stack.enter_context(local_server("llama.cpp", args.model, threads=args.threads, parallel=args.batch))
        config = EndpointConfig(url=server.url, served_model=server.served_model, api="chat", ignore_eos=True,
                                concurrency=max(64, args.requests), label=f"llama.cpp server x{args.batch}")
        self.run = open_endpoint(self.spec, config, model_given=True)
        self.run.weight_bytes = served_weight_bytes(server)
        self.server = server
        self.expected: dict = {}

    def probe(self) -> None:
        if self.args.ttft_rounds:
            self.state["ttft_llamacpp"] = ttft_probe(self.server.url, self.run.model.tokenizer, self.args.ttft_rounds)

    def replay(self, rate: float) -> None:
        from infer_tune.runners.trace import TraceRequest
        from infer_tune.scenarios.endpoint import trace_document

        rows = self.state["trace"].get(str(rate))
        if rows is None:
            return
        lengths = {r["prompt_index"]: r["output_tokens"] for r in rows}
        missing = sorted(p for p in lengths if p not in self.expected)
        if missing:  # each prompt alone, once: what its outputs under load are compared with
            alone = dataclasses.replace(self.run, config=dataclasses.replace(self.run.config, concurrency=1))
            _, single = trace_document(alone, self.spec, [TraceRequest(p, 0.0, lengths[p]) for p in missing], {}, {},
                                       None)
            self.expected.update({o["prompt_id"]: o["output"] for o in single})
        trace = [TraceRequest(r["prompt_index"], r["arrival_s"], r["output_tokens"]) for r in rows]
        doc, outputs = trace_document(self.run, self.spec, trace, self.slo, {"rate_req_s": rate, "seed": self.args.seed},
                                      None)
        mismatches = sum(1 for o in outputs if o["output"] != self.expected.get(o["prompt_id"]))
        from infer_tune.session import Row, save_rows

        # beside infer-tune's rows (one leaderboard of both), through the engine's writer under the lock
        save_rows(self.spec.out_dir, [Row(doc, outputs)])
        m = doc["metrics"]
        good = {"goodput_req_s": m.get("goodput_req_s"), "slo_attainment": m.get("slo_attainment")}
        self.state["rows"].append(row_of(f"llama.cpp server x{self.args.batch}", rate, doc, good, mismatches,
                                         {"requests_ok": m.get("requests_ok")}))
        print(f"llama.cpp @ {rate} req/s: {m['output_throughput_tok_s']:.1f} tok/s, mismatches {mismatches}", flush=True)
        save(self.args, self.state)


def phase_llamacpp(args, state: dict) -> None:
    from contextlib import ExitStack

    if not state["trace"]:
        raise SystemExit("run --phase infer-tune first: llama.cpp replays the trace it measured (lengths)")
    with ExitStack() as stack:
        side = LlamaSide(args, state, stack)
        side.probe()
        for rate in args.rates:
            side.replay(rate)


def phase_both(args, state: dict) -> None:
    """Rate by rate, infer-tune then llama.cpp on the same trace, `--repeats` times over: a host whose
    speed drifts during the run moves both engines' rows of a rate alike."""
    from contextlib import ExitStack

    measure = infer_tune_side(args, state)
    with ExitStack() as stack:
        side = LlamaSide(args, state, stack)
        side.probe()
        for _ in range(args.repeats):
            for rate in args.rates:
                measure(args.schedulers.split(",")[0], rate)
                side.replay(rate)


def ttft_probe(url: str, tokenizer, rounds: int) -> dict:
    """llama.cpp's TTFT on bench/lean_prefill.py's ~20- and ~500-token prompts, one request at a time:
    the client's wall time of a 1-token completion, and the server's own prompt time (`timings.prompt_ms`)."""
    import statistics

    from bench.lean_prefill import prompts, server_completion

    out = {}
    for name, ids in prompts(tokenizer, 20, 500).items():
        text = tokenizer.decode(ids[0])
        answers = [server_completion(url, text, 1) for _ in range(rounds + 1)][1:]  # the first warms the server
        walls = [wall for _, wall in answers]
        server_ms = [answer["timings"]["prompt_ms"] for answer, _ in answers]
        n = answers[-1][0]["timings"].get("prompt_n")
        out[name] = {"prompt_tokens_here": int(ids.shape[1]), "prompt_tokens_llamacpp": n,
                     "client_ms_median": statistics.median(walls), "server_prompt_ms_median": statistics.median(server_ms)}
        print(f"llama.cpp TTFT {name} ({n} tokens): client {out[name]['client_ms_median']:.2f} ms, "
              f"server prompt {out[name]['server_prompt_ms_median']:.2f} ms (median of {rounds})", flush=True)
    # single-stream decode: 128 tokens after the short prompt, end-of-sequence ignored, three passes
    text = tokenizer.decode(prompts(tokenizer, 20, 500)["short"][0])
    speeds = [server_completion(url, text, 128)[0]["timings"]["predicted_per_second"] for _ in range(3)]
    out["decode_tok_s_passes"] = speeds
    print(f"llama.cpp single-stream decode, 128 tokens: {', '.join(f'{v:.1f}' for v in speeds)} tok/s", flush=True)
    return out


def table(state: dict) -> None:
    head = (f"{'engine':<58}{'rate':>5}{'tok/s':>8}{'TTFT p50':>10}{'p90':>8}{'p99':>8}{'TPOT p50':>10}"
            f"{'p90':>7}{'p99':>7}{'goodput':>9}{'SLO %':>7}{'mism':>6}{'roofl':>7}")
    print(head)
    for r in sorted(state["rows"], key=lambda r: (r["rate"], r["engine"])):
        att = "-" if r["slo_attainment"] is None else f"{100 * r['slo_attainment']:.0f}"
        good = "-" if r["goodput_req_s"] is None else f"{r['goodput_req_s']:.2f}"
        roof = "-" if r["roofline_fraction"] is None else f"{r['roofline_fraction']:.2f}"
        print(f"{r['engine'][:57]:<58}{r['rate']:>5g}{r['throughput_tok_s']:>8.1f}{r['ttft_p50']:>10.1f}"
              f"{r['ttft_p90']:>8.1f}{r['ttft_p99']:>8.1f}{r['tpot_p50']:>10.2f}{r['tpot_p90']:>7.2f}"
              f"{r['tpot_p99']:>7.2f}{good:>9}{att:>7}{str(r['mismatches']):>6}{roof:>7}")
    print(f"SLOs: {state.get('slo')}")
    if state.get("ttft_llamacpp"):
        print(f"llama.cpp TTFT probe: {json.dumps(state['ttft_llamacpp'])}")


def save(args, state: dict) -> None:
    path = Path(args.state)
    staged = path.with_suffix(".partial")
    staged.write_text(json.dumps(state, indent=1))
    staged.replace(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=("infer-tune", "llama.cpp", "both", "table"), default="both")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="int4-rtn")
    p.add_argument("--activations", default="int8", choices=("bf16", "int8"),
                   help="int8: the w4a8 kernels (quantize's activations: int8); bf16: torch's int4 kernel")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[2.0, 4.0, 8.0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--schedulers", default="continuous")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--slo-ttft", type=float, default=1000.0)
    p.add_argument("--slo-tpot", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    # defaults bound the compile work to one graph (a compile took ~150 s on the shared 2-core host):
    # --step-buckets all --compiled-prefill is the whole engine
    p.add_argument("--step-buckets", choices=("all", "full"), default="full",
                   help="full: one batched step graph; all: one per 1, 2, 4 ... rows")
    p.add_argument("--compiled-prefill", dest="compile_prefill", action="store_true",
                   help="prefill through compiled length buckets (one compile per bucket the prompts need)")
    p.add_argument("--native-step", action="store_true",
                   help="the slot engine's step in one native call (int4 a8 Llama models: infer_tune/native/step.py)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="/tmp/infer-tune-serving-bench")
    p.add_argument("--state", default="/tmp/infer-tune-serving-bench.json")
    p.add_argument("--ttft-rounds", type=int, default=7, help="llama.cpp TTFT probe rounds (0: none)")
    p.add_argument("--repeats", type=int, default=1, help="--phase both: the rates measured this many times over")
    p.add_argument("--fresh", action="store_true", help="forget the rows of earlier phases in the state file")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    path = Path(args.state)
    state = {"trace": {}, "rows": []} if args.fresh or not path.is_file() else json.loads(path.read_text())
    state["slo"] = {"ttft_ms": args.slo_ttft, "tpot_ms": args.slo_tpot}
    if args.phase == "both":
        state["rows"] = []
        phase_both(args, state)
    if args.phase == "infer-tune":
        state["rows"] = [r for r in state["rows"] if not r["engine"].startswith("infer-tune")]
        phase_infer_tune(args, state)
    if args.phase == "llama.cpp":
        state["rows"] = [r for r in state["rows"] if not r["engine"].startswith("llama.cpp")]
        phase_llamacpp(args, state)
    save(args, state)
    table(state)


if __name__ == "__main__":
    main()
