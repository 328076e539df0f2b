"""Serving under load on the same clock: `infer-tune serve` (the slot engine: int4 weights, the native step
where the model is one it runs) and llama.cpp's `llama-server` with as many parallel slots, both started
here on loopback and driven by the same load generator (infer_tune/endpoint: `trace_document`, the client
`bench --endpoint` uses), over the same seeded traces (docs/endpoint.md, "Serving").

Per rate: one seeded Poisson trace of `--requests` chat prompts, each asking for `--max-new-tokens` tokens
with `ignore_eos` (both servers decode the same number of tokens). The two servers alternate which goes
first (repeat r, rate k: infer-tune first when r + k is even), `--repeats` times (>= 3 for a result).
Each engine's outputs under load are compared with its own outputs for each prompt sent alone (mismatches),
and `usage.prompt_tokens` of every prompt is checked equal across the two servers (the same prompt, the
same tokens: a chat template that renders differently would make the comparison unfair).

    flock /tmp/infer-tune-cpu.lock python bench/serving_vs_llamacpp.py --threads 2 --rates 1,2,4 \\
        --repeats 3 --native-step --activations int8
    python bench/serving_vs_llamacpp.py --table            # the table of the last run (the state file)

`--gguf` says what llama-server runs: `best` (the default) is the fastest of Q4_0 / Q4_K_M / Q8_0 made from
the same checkpoint by the pinned llama.cpp build (scripts/build-llama-cpp.sh), timed by llama-bench at the
trace prompts' lengths and --max-new-tokens first (infer_tune/engines/llamacpp.py; the line printed says
which, with every format's figures and the commit); `shipped` is the model's own GGUF (SmolLM2's Q4_1,
llama.cpp's slowest 4-bit path on x86); a type (q4_0, q8_0, ...) or a .gguf path. Not a test: read the table
of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infer_tune.scenarios.common import RunSpec  # noqa: E402
from infer_tune.workload import Protocol, Workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Server:
    name: str
    url: str
    served_model: str


def spec_of(args) -> RunSpec:
    workload = Workload(suite=args.suite, limit=args.prompts, max_new_tokens=args.max_new_tokens,
                        max_prompt_tokens=args.max_prompt_tokens)
    return RunSpec(model=args.model, workload=workload, protocol=Protocol(warmup=1, min_iterations=1, min_duration_s=0),
                   threads=args.threads, out_dir=Path(args.out), measure_ppl=False)


@contextlib.contextmanager
def infer_tune_server(args):
    """`python -m infer_tune serve` on a free loopback port; always stopped (SIGTERM, then kill)."""
    cmd = [sys.executable, "-m", "infer_tune", "serve", "--model", args.model, "--method", args.method,
           "--activations", args.activations, "--slots", str(args.batch), "--port", "0",
           "--context", str(args.context)]
    cmd += ["--native-step"] if args.native_step else []
    cmd += ["--threads", str(args.threads)] if args.threads else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    log = Path(tempfile.mkdtemp(prefix="infer-tune-serve-")) / "serve.log"
    with open(log, "w") as err:
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + args.startup_timeout
        line = ""
        while time.monotonic() < deadline and not line.startswith("READY"):
            line = process.stdout.readline()
            if not line and process.poll() is not None:
                raise SystemExit(f"infer-tune serve exited with {process.returncode}: {log.read_text()[-800:]}")
        if not line.startswith("READY"):
            raise SystemExit(f"infer-tune serve not ready within {args.startup_timeout} s (log: {log})")
        url = line.split()[1]
        import urllib.request

        with urllib.request.urlopen(f"{url}/models", timeout=10) as response:  # noqa: S310 (loopback)
            served = json.loads(response.read())["data"][0]["id"]
        print(f"infer-tune serve: {url} ({served}); log {log}", flush=True)
        yield Server("infer-tune serve", url, served)
    finally:
        from infer_tune.endpoint.servers import stop

        stop(process)


def reference_gguf(args) -> Path:
    """The GGUF llama-server serves (`--gguf`): `best` is chosen by llama-bench at the suite prompts' own
    lengths (capped at --max-prompt-tokens) and --max-new-tokens; printed with every format's figures."""
    from infer_tune.engines import llamacpp as engine
    from infer_tune.scenarios.endpoint import load_tokenizer
    from infer_tune.workload import Workload, load_prompts

    lengths = [64]
    if args.gguf == "best":
        tokenizer = load_tokenizer(args.model)
        prompts = load_prompts(Workload(suite=args.suite, limit=args.prompts))[:args.prompts]
        counts = [min(len(tokenizer.apply_chat_template([{"role": "user", "content": p.text}],
                                                        add_generation_prompt=True, return_dict=True)["input_ids"]),
                      args.max_prompt_tokens) for p in prompts]
        lengths = engine.prompt_lengths(counts)
    gguf, chosen = engine.reference_gguf(args.model, args.gguf, lengths, args.max_new_tokens, args.threads or 1)
    print(f"llama.cpp reference: {engine.describe(gguf, chosen)}", flush=True)
    return gguf


@contextlib.contextmanager
def llama_server(args, gguf: Path):
    from infer_tune.endpoint.servers import local_server

    with local_server("llama.cpp", str(gguf), threads=args.threads, parallel=args.batch) as server:
        print(f"llama-server: {server.url} ({server.served_model}, {' '.join(server.command[:3])} ...)", flush=True)
        yield Server(f"llama-server x{args.batch} {gguf.name}", server.url, server.served_model)


class Side:
    """One server driven by the load generator: its endpoint run and its single-request outputs."""

    def __init__(self, server: Server, args, spec: RunSpec) -> None:
        from infer_tune.endpoint.config import EndpointConfig
        from infer_tune.scenarios.endpoint import open_endpoint

        self.server, self.args, self.spec = server, args, spec
        config = EndpointConfig(url=server.url, served_model=server.served_model, api="chat", ignore_eos=True,
                                stream_usage=True, concurrency=max(64, args.requests), label=server.name)
        self.run = open_endpoint(spec, config, model_given=True)
        self.alone: dict = {}
        self.prompt_tokens: dict = {}
        self.done: set[int] = set()

    def references(self, prompts: list[int]) -> None:
        """Each prompt alone (one request in flight): what its outputs under load are compared with."""
        import dataclasses

        from infer_tune.runners.trace import TraceRequest
        from infer_tune.scenarios.endpoint import trace_document

        missing = [p for p in prompts if p not in self.done]
        if not missing:
            return
        self.done.update(missing)
        run = dataclasses.replace(self.run, config=dataclasses.replace(self.run.config, concurrency=1))
        trace = [TraceRequest(p, float(i) * 1e-3, self.args.max_new_tokens) for i, p in enumerate(missing)]
        _, outputs = trace_document(run, self.spec, trace, {}, {}, None)
        for o in outputs:  # keyed by the suite's prompt id (outputs need not come back in trace order)
            self.alone[o["prompt_id"]] = o["output"]
            self.prompt_tokens[o["prompt_id"]] = o.get("prompt_tokens")

    def measure(self, trace, rate: float, repeat: int, slo: dict) -> dict:
        from infer_tune.scenarios.endpoint import trace_document
        from infer_tune.sweep import Row, save_rows

        doc, outputs = trace_document(self.run, self.spec, trace, slo, {"rate_req_s": rate, "seed": self.args.seed},
                                      None)
        mismatches = sum(1 for o in outputs if o["output"] != self.alone.get(o["prompt_id"]))
        doc = save_rows(self.spec.out_dir, [Row(doc, outputs)])[0]  # the engine's writer, under the runs lock
        m = doc["metrics"]
        return {"engine": self.server.name, "rate": rate, "repeat": repeat,
                "throughput_tok_s": m["output_throughput_tok_s"], "ttft_p50": m["ttft_ms"]["p50"],
                "ttft_p90": m["ttft_ms"]["p90"], "tpot_p50": m["tpot_ms"]["p50"], "tpot_p90": m["tpot_ms"]["p90"],
                "goodput_req_s": m.get("goodput_req_s"), "slo_attainment": m.get("slo_attainment"),
                "requests_ok": m.get("requests_ok"), "mismatches": mismatches, "run_id": doc.get("run_id")}


def compare(args, state: dict) -> None:
    from infer_tune.endpoint.arrivals import poisson_trace

    spec = spec_of(args)
    slo = {"ttft_ms": args.slo_ttft, "tpot_ms": args.slo_tpot}
    gguf = reference_gguf(args)
    with infer_tune_server(args) as ours_server, llama_server(args, gguf) as theirs_server:
        ours, theirs = Side(ours_server, args, spec), Side(theirs_server, args, spec)
        n_prompts = len(ours.run.inputs.prompts)
        traces = {rate: poisson_trace(args.requests, rate, n_prompts, seed=args.seed,
                                      max_new_tokens=args.max_new_tokens) for rate in args.rates}
        used = sorted({r.prompt_index for t in traces.values() for r in t})
        for side in (ours, theirs):
            side.references(used)
        ids = sorted(set(ours.prompt_tokens) | set(theirs.prompt_tokens))
        unequal = {p: (ours.prompt_tokens.get(p), theirs.prompt_tokens.get(p)) for p in ids
                   if ours.prompt_tokens.get(p) != theirs.prompt_tokens.get(p)}
        state["prompt_tokens_equal"] = not unequal
        state["prompt_tokens_unequal"] = {str(p): v for p, v in unequal.items()}
        print(f"usage.prompt_tokens equal on {len(ids) - len(unequal)}/{len(ids)} prompts"
              + (f"; differ (infer-tune, llama.cpp): {unequal}" if unequal else ""), flush=True)
        for repeat in range(args.repeats):
            for k, rate in enumerate(args.rates):
                order = (ours, theirs) if (repeat + k) % 2 == 0 else (theirs, ours)
                for side in order:
                    row = side.measure(traces[rate], rate, repeat, slo)
                    state["rows"].append(row)
                    print(f"r{repeat} {rate:g} req/s {row['engine']}: {row['throughput_tok_s']:.1f} tok/s, TTFT p50 "
                          f"{row['ttft_p50']:.1f} ms, TPOT p50 {row['tpot_p50']:.2f} ms, mismatches "
                          f"{row['mismatches']}", flush=True)
                    save(args, state)


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def table(state: dict) -> None:
    rows = state["rows"]
    engines = sorted({r["engine"] for r in rows}, key=lambda e: not e.startswith("infer-tune"))
    print(f"{'engine':<44}{'rate':>5}{'n':>3}{'tok/s':>9}{'TTFT p50':>10}{'TPOT p50':>10}{'goodput':>9}{'mism':>6}")
    for rate in sorted({r["rate"] for r in rows}):
        for engine in engines:
            mine = [r for r in rows if r["rate"] == rate and r["engine"] == engine]
            if not mine:
                continue
            med = {k: statistics.median(r[k] for r in mine) for k in ("throughput_tok_s", "ttft_p50", "tpot_p50")}
            good = [r["goodput_req_s"] for r in mine if r["goodput_req_s"] is not None]
            print(f"{engine[:43]:<44}{rate:>5g}{len(mine):>3}{med['throughput_tok_s']:>9.1f}{med['ttft_p50']:>10.1f}"
                  f"{med['tpot_p50']:>10.2f}{(statistics.median(good) if good else float('nan')):>9.2f}"
                  f"{sum(r['mismatches'] for r in mine):>6}")
        if len(engines) == 2:  # paired by repeat: infer-tune / llama.cpp, geometric mean over the repeats
            pairs = {}
            for r in rows:
                if r["rate"] == rate:
                    pairs.setdefault(r["repeat"], {})[r["engine"]] = r
            both = [p for p in pairs.values() if len(p) == 2]
            ratio = {k: geomean([p[engines[0]][k] / p[engines[1]][k] for p in both if p[engines[1]][k]])
                     for k in ("throughput_tok_s", "ttft_p50", "tpot_p50")}
            print(f"  infer-tune / llama.cpp at {rate:g} req/s over {len(both)} paired repeats: throughput "
                  f"{ratio['throughput_tok_s'] or float('nan'):.3f}x, TTFT p50 {ratio['ttft_p50'] or float('nan'):.3f}x, "
                  f"TPOT p50 {ratio['tpot_p50'] or float('nan'):.3f}x")
    print(f"SLOs: {state.get('slo')}; usage.prompt_tokens equal: {state.get('prompt_tokens_equal')}")


def save(args, state: dict) -> None:
    path = Path(args.state)
    staged = path.with_suffix(".partial")
    staged.write_text(json.dumps(state, indent=1))
    staged.replace(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="the checkpoint infer-tune serves (and the tokenizer)")
    p.add_argument("--gguf", default="best",
                   help="llama-server's GGUF: best (the fastest of q4_0 / q4_k_m / q8_0 made from the same checkpoint, "
                        "by llama-bench here), shipped (the model's own GGUF), a type, or a .gguf path")
    p.add_argument("--method", default="int4-rtn")
    p.add_argument("--activations", default="int8", choices=("bf16", "int8"))
    p.add_argument("--native-step", action="store_true", help="infer-tune serve --native-step")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 4.0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompts", type=int, default=16, help="prompts of the suite the traces draw from")
    p.add_argument("--suite", default="chat")
    p.add_argument("--batch", type=int, default=4, help="slots of both servers (llama-server --parallel)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--context", type=int, default=1024, help="infer-tune serve --context (cache positions per slot)")
    p.add_argument("--slo-ttft", type=float, default=1000.0)
    p.add_argument("--slo-tpot", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default="/tmp/infer-tune-serving-bench")
    p.add_argument("--state", default="/tmp/infer-tune-serving-bench.json")
    p.add_argument("--table", action="store_true", help="print the table of the state file and stop")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    if args.table:
        table(json.loads(Path(args.state).read_text()))
        return
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1 (3 or more for a result)")
    state = {"rows": [], "slo": {"ttft_ms": args.slo_ttft, "tpot_ms": args.slo_tpot},
             "args": {k: v for k, v in vars(args).items() if k not in ("table",)}}
    compare(args, state)
    save(args, state)
    table(state)


if __name__ == "__main__":
    main()
