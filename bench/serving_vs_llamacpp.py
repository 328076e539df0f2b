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

    flock /tmp/infer-tune-cpu.lock python bench/serving_vs_llamacpp.py --threads 2 --rates 0.5,1,2,4,8 \\
        --repeats 3 --native-step --activations int8
    python bench/serving_vs_llamacpp.py --table [--markdown]   # the table of the last run (the state file)

The table lists every (rate, repeat, engine) row in the order they ran, then per rate infer-tune / llama.cpp
of output throughput, goodput (requests within both SLOs per second), TTFT p50 and TPOT p50: the geometric
mean of the per-repeat ratios (each repeat ran both servers back to back) with its 95% t-interval on the logs,
and each engine's mismatches; then whether each rate met the targets (throughput and goodput >= 1x, TTFT p50
<= 1.2x, 0 mismatches). The state file also records the command, the commit, the llama.cpp build and
every format's llama-bench figures.

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
    cmd += list(getattr(args, "serve_args", []))  # more `serve` options (bench/serve_speculate.py: --speculate K)
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


def reference_gguf(args, state: dict) -> Path:
    """The GGUF llama-server serves (`--gguf`): `best` is chosen by llama-bench at the suite prompts' own
    lengths (capped at --max-prompt-tokens) and --max-new-tokens; printed with every format's figures and
    recorded in the state (`reference`: the format, every format's llama-bench figures, the build)."""
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
    state["reference"] = {"gguf": str(gguf), "described": engine.describe(gguf, chosen),
                          "llama_cpp": engine._version_facts(engine.build_info()),
                          "chosen": chosen.to_dict() if chosen is not None else None}
    print(f"llama.cpp reference: {state['reference']['described']}", flush=True)
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
    gguf = reference_gguf(args, state)
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


METRICS = (("throughput_tok_s", "output tok/s", True), ("goodput_req_s", "goodput req/s", True),
           ("ttft_p50", "TTFT p50 ms", False), ("tpot_p50", "TPOT p50 ms", False))


def paired_ratios(rows: list[dict], rate: float, ours: str, theirs: str) -> dict:
    """infer-tune / llama.cpp per metric at `rate`, paired by repeat (the two ran back to back): the geometric
    mean over the repeats and its 95% t-interval on the logs (infer_tune.metrics.stats.log_ratio_interval).
    A repeat where llama.cpp's figure is 0 (no request within the SLOs) and infer-tune's is not counts as
    `inf` (said, not averaged); 0 / 0 leaves the repeat out."""
    from infer_tune.metrics.stats import log_ratio_interval

    pairs: dict = {}
    for r in rows:
        if r["rate"] == rate:
            pairs.setdefault(r["repeat"], {})[r["engine"]] = r
    both = [p for _, p in sorted(pairs.items()) if ours in p and theirs in p]
    out = {}
    for key, _, _ in METRICS:
        ratios = []
        for p in both:
            a, b = p[ours].get(key), p[theirs].get(key)
            if a is None or b is None or (not a and not b):
                continue
            ratios.append(math.inf if not b else a / b)
        finite = [x for x in ratios if math.isfinite(x) and x > 0]
        interval = log_ratio_interval(finite)
        point = interval["point"] if interval else (finite[0] if len(finite) == 1 else None)
        out[key] = {"per_repeat": ratios, "point": point, "ci95": interval["ci95"] if interval else None,
                    "infinite": sum(1 for x in ratios if math.isinf(x))}
    out["repeats"] = len(both)
    return out


def fmt_ratio(r: dict) -> str:
    if r["point"] is None:
        return "inf" if r["infinite"] else "-"
    text = f"{r['point']:.3f}x" + (f" [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if r["ci95"] else "")
    return text + (f" (+{r['infinite']} repeat(s) inf)" if r["infinite"] else "")


def engines_of(rows: list[dict]) -> list[str]:
    return sorted({r["engine"] for r in rows}, key=lambda e: not e.startswith("infer-tune"))


def table(state: dict, markdown: bool = False) -> None:
    """Every row (rate, repeat, engine), the per-rate ratios with their intervals, and the targets."""
    rows = state["rows"]
    engines = engines_of(rows)
    rates = sorted({r["rate"] for r in rows})
    fmt_good = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    if markdown:
        print("| rate req/s | repeat | engine ((1st): ran first) | output tok/s | goodput req/s | TTFT p50 ms | "
              "TPOT p50 ms | mismatches |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|")
    else:
        print(f"{'rate':>5}{'rep':>4} {'engine':<44}{'tok/s':>9}{'goodput':>9}{'TTFT p50':>10}{'TPOT p50':>10}"
              f"{'mism':>6}")
    for rate in rates:
        for repeat in sorted({r["repeat"] for r in rows if r["rate"] == rate}):
            mine = [r for r in rows if r["rate"] == rate and r["repeat"] == repeat]
            for i, r in enumerate(mine):  # in the order they ran
                first = " (1st)" if i == 0 and len(mine) > 1 else ""
                if markdown:
                    print(f"| {rate:g} | {repeat} | {r['engine']}{first} | {r['throughput_tok_s']:.1f} | "
                          f"{fmt_good(r['goodput_req_s'])} | {r['ttft_p50']:.1f} | {r['tpot_p50']:.2f} | "
                          f"{r['mismatches']} |")
                else:
                    print(f"{rate:>5g}{repeat:>4} {(r['engine'] + first)[:43]:<44}{r['throughput_tok_s']:>9.1f}"
                          f"{fmt_good(r['goodput_req_s']):>9}{r['ttft_p50']:>10.1f}{r['tpot_p50']:>10.2f}"
                          f"{r['mismatches']:>6}")
    if len(engines) != 2:
        return
    ours, theirs = engines
    print()
    if markdown:
        print("| rate req/s | repeats | " + " | ".join(f"{label} ratio [95%]" for _, label, _ in METRICS)
              + " | mismatches infer-tune / llama.cpp |")
        print("|---:|---:|" + "---|" * len(METRICS) + "---:|")
    verdicts = []
    for rate in rates:
        ratios = paired_ratios(rows, rate, ours, theirs)
        mism = [sum(r["mismatches"] for r in rows if r["rate"] == rate and r["engine"] == e) for e in engines]
        cells = [fmt_ratio(ratios[k]) for k, _, _ in METRICS]
        if markdown:
            print(f"| {rate:g} | {ratios['repeats']} | " + " | ".join(cells) + f" | {mism[0]} / {mism[1]} |")
        else:
            print(f"infer-tune / llama.cpp at {rate:g} req/s, {ratios['repeats']} paired repeats: "
                  + ", ".join(f"{label.split(' ms')[0]} {c}" for (_, label, _), c in zip(METRICS, cells))
                  + f"; mismatches {mism[0]} / {mism[1]}")
        point = {k: (math.inf if ratios[k]["point"] is None and ratios[k]["infinite"] else ratios[k]["point"])
                 for k, _, _ in METRICS}
        missed = [f"{label} {point[k]:.3f}x" for k, label, up in METRICS[:2] if point[k] is not None and point[k] < 1.0]
        if point["ttft_p50"] is not None and point["ttft_p50"] > 1.2:
            missed.append(f"TTFT p50 {point['ttft_p50']:.3f}x > 1.2x")
        if mism[0]:
            missed.append(f"{mism[0]} mismatches")
        verdicts.append(f"{rate:g} req/s: " + ("met" if not missed else "missed (" + ", ".join(missed) + ")"))
    print()
    print("targets (throughput and goodput >= 1x, TTFT p50 <= 1.2x, 0 mismatches; geometric means): "
          + "; ".join(verdicts))
    print(f"SLOs: {state.get('slo')}; usage.prompt_tokens equal: {state.get('prompt_tokens_equal')}")
    if state.get("reference"):
        print(f"reference: {state['reference'].get('described')}")


def save(args, state: dict) -> None:
    path = Path(args.state)
    staged = path.with_suffix(".partial")
    staged.write_text(json.dumps(state, indent=1))
    staged.replace(path)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except OSError:
        return None
    return out.stdout.strip() or None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="the checkpoint infer-tune serves (and the tokenizer)")
    p.add_argument("--gguf", default="best",
                   help="llama-server's GGUF: best (the fastest of q4_0 / q4_k_m / q8_0 made from the same checkpoint, "
                        "by llama-bench here), shipped (the model's own GGUF), a type, or a .gguf path")
    p.add_argument("--method", default="int4-rtn")
    p.add_argument("--activations", default="int8", choices=("bf16", "int8"))
    p.add_argument("--native-step", action="store_true", help="infer-tune serve --native-step")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 2.0, 4.0, 8.0],
                   help="request rates (req/s), up to and past saturation")
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
    p.add_argument("--markdown", action="store_true", help="with --table: as markdown (docs/results.md)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    if args.table:
        table(json.loads(Path(args.state).read_text()), markdown=args.markdown)
        return
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1 (3 or more for a result)")
    state = {"rows": [], "slo": {"ttft_ms": args.slo_ttft, "tpot_ms": args.slo_tpot},
             "args": {k: v for k, v in vars(args).items() if k not in ("table", "markdown")},
             "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
             "infer_tune_commit": git_commit()}
    compare(args, state)
    save(args, state)
    table(state)


if __name__ == "__main__":
    main()
