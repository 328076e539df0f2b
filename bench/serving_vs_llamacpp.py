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

`--workload multi-turn` (issue #52): `--sessions` chat sessions per rate (sessions/s, Poisson arrivals), each the
first `--max-turns` user turns of a ShareGPT conversation of the chat suite, every turn `--think-time-ms` (mean,
exponential) after the previous answer and carrying the whole conversation so far (the sessions driver of
`endpoint sim --workload multi-turn`, infer_tune/endpoint/sessions.py). Three arms per cell (rate, repeat), the
one going first rotating: `infer-tune serve` with its prefix cache (`--cache-mib`), `infer-tune serve
--no-prefix-cache`, and llama-server with its prompt cache at b11434's defaults (`--cache-prompt --cache-ram
8192`, restoring what infer_tune.endpoint.servers turns off; `--cache-reuse N` adds its KV-shift reuse). Every
arm of a cell gets the same conversations and arrivals; each cell takes conversations no earlier cell sent (so
no cache starts warm from an earlier cell), from those whose first turns total <= `--max-history-tokens`.
Per row: output throughput, goodput, TTFT p50 (overall and by turn), TPOT p50, the prefix-cache hit rate (cached
/ prompt tokens from each response's `usage.prompt_tokens_details.cached_tokens`, which both servers report),
failures and token-count mismatches (streamed tokens vs `usage.completion_tokens`); per rate the paired ratios
prefix cache / llama-server, no cache / llama-server and prefix cache / no cache with their 95% intervals, and
how many turns' outputs differ between our two arms.

    flock /tmp/infer-tune-cpu.lock python bench/serving_vs_llamacpp.py --workload multi-turn --threads 2 \
        --batch 2 --native-step --activations int8 --context 2048 --sessions 16 --max-turns 5 --rates 0.5,2

`--no-uncached-arm` leaves out `serve --no-prefix-cache` (two arms: ours with its cache, llama-server).

`--workload trace --trace FILE --trace-format mooncake|burstgpt|jsonl` replays a timed trace (`--time-scale X`
multiplies its arrival times; `--requests N` its first N, or N synthesized from its statistics) on ours with its
prefix cache and on llama-server with its prompt cache, `--repeats` times, the first alternating. Each repeat's
prompt words are seeded anew (seed + repeat, the same on both servers), so no server starts a repeat with the
last repeat's prompts in its cache and the hit rate is the trace's own sharing; `--same-text` sends the same
words every repeat. bench/mooncake_like.py writes a Mooncake-format trace of production shape that fits a small
model's context. Both tables end with the requests within both SLOs per server, summed over the repeats (where
both servers serve the offered load, goodput per second is set by the run's length and its ratio is noise
around 1; the counts of the same offered requests say which met more).
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
def infer_tune_server(args, extra: tuple[str, ...] = (), name: str = "infer-tune serve", root: Path = ROOT):
    """`python -m infer_tune serve` (plus `extra`) of the checkout `root` on a free loopback port; always stopped
    (SIGTERM, then kill)."""
    cmd = [sys.executable, "-m", "infer_tune", "serve", "--model", args.model, "--method", args.method,
           "--activations", args.activations, "--slots", str(args.batch), "--port", "0",
           "--context", str(args.context)]
    cmd += ["--native-step"] if args.native_step else []
    cmd += ["--kv-cache", args.kv_cache] if args.kv_cache != "fp32" else []
    cmd += ["--threads", str(args.threads)] if args.threads else []
    cmd += list(args.serve_arg or ()) + list(extra)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    log = Path(tempfile.mkdtemp(prefix="infer-tune-serve-")) / "serve.log"
    with open(log, "w") as err:
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True,
                                   cwd=root)
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
        print(f"{name}: {url} ({served}, {' '.join(cmd[3:])}); log {log}", flush=True)
        yield Server(name, url, served)
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
def llama_server(args, gguf: Path, extra: tuple[str, ...] = (), context: int | None = None):
    """llama-server on loopback (infer_tune.endpoint.servers: `--no-cache-prompt --cache-ram 0` unless `extra`
    says otherwise, its later flags winning); `context`: tokens per slot (default 2048)."""
    from infer_tune.endpoint.servers import local_server

    kwargs = {"context_tokens": context} if context else {}
    with local_server("llama.cpp", str(gguf), threads=args.threads, parallel=args.batch, extra_args=extra,
                      **kwargs) as server:
        print(f"llama-server: {server.url} ({server.served_model}, {' '.join(server.command)})", flush=True)
        named = " ".join(a for a in (args.llama_arg or ()))  # its own settings in its name, where given
        yield Server(f"llama-server x{args.batch} {gguf.name}" + (f" {named}" if named else ""), server.url,
                     server.served_model)


class Side:
    """One server driven by the load generator: its endpoint run and its single-request outputs."""

    def __init__(self, server: Server, args, spec: RunSpec, workload=None) -> None:
        from infer_tune.endpoint.config import EndpointConfig
        from infer_tune.scenarios.endpoint import open_endpoint

        self.server, self.args, self.spec = server, args, spec
        config = EndpointConfig(url=server.url, served_model=server.served_model, api="chat", ignore_eos=True,
                                stream_usage=True, concurrency=max(64, args.requests), label=server.name)
        self.run = open_endpoint(spec, config, model_given=True, workload=workload)
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
    with infer_tune_server(args) as ours_server, llama_server(args, gguf, tuple(args.llama_arg or ())) as theirs_server:
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


def paired_ratios(rows: list[dict], rate: float, ours: str, theirs: str, metrics=METRICS) -> dict:
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
    for key, _, _ in metrics:
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


def against(r: dict, bound: float, higher: bool) -> str:
    """"met" / "missed" / "inconclusive" for a target ratio >= `bound` (`higher`) or <= `bound`: decided by the 95%
    interval of the paired ratios (paired_ratios), never by the point; one repeat (no interval) is inconclusive.
    Repeats where only ours met the SLOs (`inf`) count for ours; all of them so: met."""
    if r["point"] is None:
        return "met" if r["infinite"] and higher else "inconclusive"
    if not r["ci95"]:
        return "inconclusive"
    low, high = r["ci95"]
    if higher:
        return "met" if low >= bound else "missed" if high < bound else "inconclusive"
    return "met" if high <= bound else "missed" if low > bound else "inconclusive"


def fmt_ratio(r: dict) -> str:
    if r["point"] is None:
        return "inf" if r["infinite"] else "-"
    text = f"{r['point']:.3f}x" + (f" [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if r["ci95"] else "")
    return text + (f" (+{r['infinite']} repeat(s) inf)" if r["infinite"] else "")


def attainment(rows: list[dict]) -> None:
    """Per rate and server, the requests that met both SLOs over all repeats (`good_requests` of the offered ones:
    `slo_attainment` = good / offered): where both servers serve the offered load, goodput per second is set by
    the run's length and its ratio is noise around 1; the counts of the same offered requests say which met more."""
    have = [r for r in rows if r.get("good_requests") is not None]
    if not have:
        return
    parts = []
    for rate in sorted({r["rate"] for r in have}):
        cells = []
        for e in dict.fromkeys(r["engine"] for r in have if r["rate"] == rate):
            mine = [r for r in have if r["rate"] == rate and r["engine"] == e]
            good = sum(r["good_requests"] for r in mine)
            offered = sum((r.get("requests_ok") or 0) + (r.get("requests_failed") or 0) for r in mine)
            cells.append(f"{e} {good}/{offered}")
        parts.append(f"{rate:g}: " + ", ".join(cells))
    print("requests within both SLOs (summed over repeats): " + "; ".join(parts))


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
        judged = {label: against(ratios[k], bound, up) for (k, label, _), (bound, up) in
                  zip(METRICS[:3], ((1.0, True), (1.0, True), (1.2, False)))}
        missed = [f"{label} {fmt_ratio(ratios[k])}" for (k, label, _) in METRICS[:3] if judged[label] == "missed"]
        open_ = [f"{label} {fmt_ratio(ratios[k])}" for (k, label, _) in METRICS[:3] if judged[label] == "inconclusive"]
        if mism[0]:
            missed.append(f"{mism[0]} mismatches")
        verdicts.append(f"{rate:g} req/s: " + ("missed (" + ", ".join(missed) + ")" if missed else
                                               "inconclusive (" + ", ".join(open_) + ")" if open_ else "met"))
    print()
    print("targets (throughput and goodput >= 1x, TTFT p50 <= 1.2x, 0 mismatches; met or missed where the 95% "
          "interval of the paired ratios lies on one side, else inconclusive): " + "; ".join(verdicts))
    attainment(rows)
    hits = {e: [r["hit_rate"] for r in rows if r["engine"] == e and r.get("hit_rate") is not None] for e in engines}
    if any(hits.values()):
        print("prefix-cache hit rate by repeat: " + "; ".join(
            f"{e} {' / '.join(f'{h:.3f}' for h in v)}" for e, v in hits.items() if v))
    print(f"SLOs: {state.get('slo')}; usage.prompt_tokens equal: {state.get('prompt_tokens_equal')}")
    if state.get("reference"):
        print(f"reference: {state['reference'].get('described')}")


# --------------------------------------------------------------------------- multi-turn sessions (issue #52)
# llama-server b11434's own defaults for its prompt cache (on, 8192 MiB of host RAM for idle slots' prompts),
# which infer_tune.endpoint.servers turns off for single-turn comparisons; later flags win in its parser
LLAMA_PROMPT_CACHE = ("--cache-prompt", "--cache-ram", "8192")


def llama_cache_extra(args) -> tuple[str, ...]:
    """llama-server's flags in the cache runs: its prompt cache, `--cache-reuse N` when asked, then every
    `--llama-arg` as given (its n-gram drafting, a q8_0 KV cache: llama-server at its best for the traffic)."""
    reuse = ("--cache-reuse", str(args.cache_reuse)) if args.cache_reuse else ()
    return LLAMA_PROMPT_CACHE + reuse + tuple(args.llama_arg or ())
ARMS = ("infer-tune serve (prefix cache)", "infer-tune serve --no-prefix-cache")


def session_workload(args):
    from infer_tune.endpoint.workloads import WorkloadOptions

    return WorkloadOptions(kind="multi-turn", sessions=args.sessions, max_turns=args.max_turns,
                           min_turns=args.min_turns, think_time_ms=args.think_time_ms, history=args.history)


def fitting_conversations(run, max_turns: int, budget: int, needed: int, min_turns: int = 1) -> tuple[list, int]:
    """The first `needed` of the suite's conversations (its seeded order) of at least `min_turns` user turns
    whose first `max_turns` user turns total at most `budget` tokens by the model's tokenizer (the last turn's
    history then fits `--context` with the answers), and how many were looked at."""
    tokenizer = run.model.tokenizer
    kept, seen = [], 0
    for c in run.conversations:
        if len(kept) == needed:
            break
        seen += 1
        if len(c.users) < min_turns:
            continue
        if sum(len(tokenizer(u, add_special_tokens=False)["input_ids"]) for u in c.users[:max_turns]) <= budget:
            kept.append(c)
    return kept, seen


def conversations_for(side: Side, first: int, count: int):
    """`side`'s endpoint run with the suite's conversations [first, first + count) (same on every side)."""
    import dataclasses

    chosen = side.run.conversations[first:first + count]
    if len(chosen) < count:
        raise SystemExit(f"the suite has {len(side.run.conversations)} conversations, {first + count} needed")
    return dataclasses.replace(side.run, conversations=chosen)


def warm_up(side: Side, args, workload, spec: RunSpec) -> None:
    """Conversation 0 as one session, not recorded: first-call costs paid before any measured cell (the
    cells use conversations from 1 on, so this one's prefix is never reused by them)."""
    import dataclasses

    from infer_tune.scenarios.endpoint import trace_document, workload_material

    run = conversations_for(side, 0, 1)
    _, material = workload_material(run, spec, dataclasses.replace(workload, sessions=1), math.inf, 1, 1.0)
    trace_document(run, spec, None, {}, {"rate_req_s": None, "seed": args.seed}, None, material)


def measure_sessions(side: Side, spec: RunSpec, workload, rate: float, repeat: int, cell: int, slo: dict) -> dict:
    """One cell (rate, repeat) on one server: `--sessions` sessions of conversations 1 + cell * sessions on
    (each server gets the same conversations and arrivals in a cell; no conversation is sent twice to a server,
    so a cell never hits what an earlier cell left in a cache)."""
    from infer_tune.scenarios.endpoint import trace_document, workload_material
    from infer_tune.sweep import Row, save_rows

    run = conversations_for(side, 1 + cell * workload.sessions, workload.sessions)
    _, material = workload_material(run, spec, workload, rate, workload.sessions, 1.0)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    doc, outputs = trace_document(run, spec, None, slo, {"rate_req_s": rate, "seed": spec.workload.seed}, None,
                                  material)
    wall_s = time.perf_counter() - started
    doc = save_rows(spec.out_dir, [Row(doc, outputs, material.files)])[0]
    m = doc["metrics"]
    cache = m.get("prefix_cache") or {}
    row = {"engine": side.server.name, "rate": rate, "repeat": repeat, "cell": cell,
           "throughput_tok_s": m["output_throughput_tok_s"], "ttft_p50": m["ttft_ms"]["p50"],
           "ttft_p90": m["ttft_ms"]["p90"], "tpot_p50": m["tpot_ms"]["p50"], "goodput_req_s": m.get("goodput_req_s"),
           "good_requests": m.get("good_requests"), "slo_attainment": m.get("slo_attainment"),
           "requests_ok": m.get("requests_ok"), "requests_failed": m.get("requests_failed"),
           "failures_by_kind": m.get("failures_by_kind"), "turns_not_sent": m.get("turns_not_sent"),
           "requests_resent": m.get("requests_resent"), "hit_rate": cache.get("hit_rate"),
           "cached_tokens": cache.get("cached_tokens"),
           "cache_prompt_tokens": cache.get("prompt_tokens"), "cache_reports": cache.get("requests_reporting"),
           "token_count_mismatches": m.get("token_count_mismatches"),
           "usage_token_mismatches": m.get("usage_token_mismatches"),
           "token_count_unverified": m.get("token_count_unverified"), "wall_s": wall_s,
           "load1_before_after": [load_before, os.getloadavg()[0]],  # the host's 1-min load (2 cores: ~2 is us)
           "run_id": doc.get("run_id"), "outputs": {o["prompt_id"]: o["output"] for o in outputs}}
    for t in m["turns"]["by_turn"]:
        row[f"ttft_p50_turn{t['turn']}"] = t["ttft_ms"]["p50"]
        row[f"requests_turn{t['turn']}"] = t["requests"]
        row[f"history_p50_turn{t['turn']}"] = t.get("history_tokens_p50")
    return row


def cached_servers(stack: contextlib.ExitStack, args, gguf: Path, llama_extra: tuple[str, ...],
                   without_cache: bool = True) -> list[Server]:
    """The servers of the cache runs, started on `stack`: ours with its prefix cache, ours without it (optional),
    llama-server with `llama_extra` (its prompt cache)."""
    ours = [infer_tune_server(args, ("--prefix-cache", "--cache-mib", str(args.cache_mib)), ARMS[0])]
    if without_cache:
        ours.append(infer_tune_server(args, ("--no-prefix-cache",), ARMS[1]))
    return [stack.enter_context(c) for c in (*ours, llama_server(args, gguf, llama_extra, args.context))]


def record(args, state: dict, row: dict, where: str, mismatches: int | None) -> None:
    """A measured row into the state file (saved at once) and its one-line progress report."""
    state["rows"].append(row)
    hit = "-" if row["hit_rate"] is None else f"{row['hit_rate']:.3f}"
    print(f"{where} {row['engine']}: {row['throughput_tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50']:.1f} ms, TPOT "
          f"p50 {row['tpot_p50']:.2f} ms, hit rate {hit}, failed {row['requests_failed']}, token-count mismatches "
          f"{mismatches}" + (f", resent {row['requests_resent']}" if row.get("requests_resent") else "")
          + f", {row['wall_s']:.1f} s", flush=True)
    save(args, state)


def compare_sessions(args, state: dict) -> None:
    """Three arms per cell (ours with the prefix cache, ours without, llama-server with its prompt cache),
    the first of a cell rotating over the arms (cell = repeat * len(rates) + k)."""
    import dataclasses

    spec = spec_of(args)
    spec = dataclasses.replace(spec, workload=dataclasses.replace(spec.workload, seed=args.seed),
                               protocol=Protocol(warmup=0, min_iterations=1, min_duration_s=0))
    workload = session_workload(args)
    slo = {"ttft_ms": args.slo_ttft, "tpot_ms": args.slo_tpot}
    gguf = reference_gguf(args, state)
    llama_extra = llama_cache_extra(args)
    state["llama_server_extra"] = list(llama_extra)
    with contextlib.ExitStack() as stack:
        servers = cached_servers(stack, args, gguf, llama_extra, without_cache=not args.no_uncached_arm)
        sides = [Side(server, args, spec, workload) for server in servers]
        needed = 1 + args.sessions * args.repeats * len(args.rates)
        kept, seen = fitting_conversations(sides[0].run, args.max_turns, args.max_history_tokens, needed,
                                           args.min_turns)
        state["conversations"] = {"kept": len(kept), "looked_at": seen,
                                  "ids": [c.id for c in kept]}
        print(f"conversations: the first {len(kept)} of the suite's"
              + (f" of at least {args.min_turns} user turns" if args.min_turns > 1 else "")
              + f" whose first {args.max_turns} user turns total "
              f"<= {args.max_history_tokens} tokens ({seen} looked at)", flush=True)
        for side in sides:
            side.run = dataclasses.replace(side.run, conversations=kept)
        for side in sides:
            warm_up(side, args, workload, spec)
        for repeat in range(args.repeat_from, args.repeats):
            for k, rate in enumerate(args.rates):
                cell = repeat * len(args.rates) + k
                for side in sides[cell % len(sides):] + sides[:cell % len(sides)]:
                    row = measure_sessions(side, spec, workload, rate, repeat, cell, slo)
                    record(args, state, row, f"r{repeat} {rate:g} sessions/s", row["token_count_mismatches"])


def compare_trace(args, state: dict) -> None:
    """A timed trace (`--trace FILE --trace-format mooncake|burstgpt|jsonl`, its first `--requests`, or that many
    synthesized from its statistics; arrivals times `--time-scale`) replayed `--repeats` times on ours with the
    prefix cache and on llama-server with its prompt cache, the first of a repeat alternating; each row keyed by
    the time scale (the `rate` column), `mismatches` its token-count mismatches (client against usage)."""
    import dataclasses

    from infer_tune.endpoint.config import EndpointConfig
    from infer_tune.endpoint.workloads import WorkloadOptions
    from infer_tune.scenarios.endpoint import run_endpoint_workload

    spec = spec_of(args)
    spec = dataclasses.replace(spec, workload=dataclasses.replace(spec.workload, seed=args.seed),
                               protocol=Protocol(warmup=0, min_iterations=1, min_duration_s=0))
    workload = WorkloadOptions(kind="trace", trace=args.trace, trace_format=args.trace_format,
                               time_scale=args.time_scale, block_size=args.block_size)
    slo = {"ttft_ms": args.slo_ttft, "tpot_ms": args.slo_tpot}
    gguf = reference_gguf(args, state)
    state["llama_server_extra"] = list(llama_cache_extra(args))
    with contextlib.ExitStack() as stack:
        servers = cached_servers(stack, args, gguf, llama_cache_extra(args), without_cache=False)
        for repeat in range(args.repeat_from, args.repeats):
            for server in (servers if repeat % 2 == 0 else servers[::-1]):
                config = EndpointConfig(url=server.url, served_model=server.served_model, api="chat", ignore_eos=True,
                                        stream_usage=True, concurrency=max(64, args.requests), label=server.name)
                started = time.perf_counter()
                # each repeat's prompt words seeded anew (seed + repeat; the same on both servers): a replay of the
                # words of the repeat before would be served from that repeat's cache, not from the trace's sharing
                text_seed = args.seed + repeat if not args.same_text else args.seed
                mine = dataclasses.replace(spec, workload=dataclasses.replace(spec.workload, seed=text_seed))
                doc = run_endpoint_workload(mine, config, workload, model_given=True, requests=args.requests, slo=slo)
                m = doc["metrics"]
                cache = m.get("prefix_cache") or {}
                row = {"engine": server.name, "rate": args.time_scale, "repeat": repeat, "text_seed": text_seed,
                       "throughput_tok_s": m["output_throughput_tok_s"], "ttft_p50": m["ttft_ms"]["p50"],
                       "ttft_p90": m["ttft_ms"]["p90"], "tpot_p50": m["tpot_ms"]["p50"],
                       "goodput_req_s": m.get("goodput_req_s"), "good_requests": m.get("good_requests"),
                       "slo_attainment": m.get("slo_attainment"), "requests_ok": m.get("requests_ok"),
                       "requests_failed": m.get("requests_failed"), "hit_rate": cache.get("hit_rate"),
                       "mismatches": m.get("token_count_mismatches"), "wall_s": time.perf_counter() - started,
                       "run_id": doc.get("run_id")}
                record(args, state, row, f"r{repeat} trace x{args.time_scale:g}", row["mismatches"])


def turn_keys(rows: list[dict]) -> list[int]:
    return sorted({int(k[len("ttft_p50_turn"):]) for r in rows for k in r if k.startswith("ttft_p50_turn")})


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def outputs_differing(rows: list[dict], cell: int, a: str, b: str) -> int | None:
    """Turns of one cell whose outputs differ between arms a and b (of the turns both answered)."""
    ra = next((r for r in rows if r.get("cell") == cell and r["engine"] == a), None)
    rb = next((r for r in rows if r.get("cell") == cell and r["engine"] == b), None)
    if ra is None or rb is None:
        return None
    return sum(1 for p in set(ra["outputs"]) & set(rb["outputs"]) if ra["outputs"][p] != rb["outputs"][p])


def emit(head: list[str], body: list[list[str]], markdown: bool, text_cols: tuple[int, ...]) -> None:
    """One table: markdown, or aligned text (columns in `text_cols` left-aligned, the rest right-aligned)."""
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "".join("---|" if i in text_cols else "---:|" for i in range(len(head))))
        for cells in body:
            print("| " + " | ".join(cells) + " |")
    else:
        widths = [max(len(c[i]) for c in [head, *body]) for i in range(len(head))]
        for cells in [head, *body]:
            print("  ".join(c.ljust(w) if i in text_cols else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    print()


def table_sessions(state: dict, markdown: bool = False) -> None:
    """Per (rate, repeat, arm) the row; per (rate, arm) the means over repeats with TTFT p50 by turn; per rate
    the paired ratios (prefix cache / llama-server, no cache / llama-server, prefix cache / no cache)."""
    rows = state["rows"]
    rates = sorted({r["rate"] for r in rows})
    turns = turn_keys(rows)
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    engines.sort(key=lambda e: (not e.startswith("infer-tune"), e.endswith("--no-prefix-cache")))
    f = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    head = (["rate sess/s", "repeat", "arm ((1st): ran first)", "output tok/s", "goodput req/s", "TTFT p50 ms",
             "TPOT p50 ms", "hit rate"] + [f"TTFT p50 t{t}" for t in turns] + ["failed", "tok-count mism"])
    body = []
    for rate in rates:
        for cell in sorted({r["cell"] for r in rows if r["rate"] == rate}):
            mine = [r for r in rows if r["cell"] == cell]
            for i, r in enumerate(mine):
                first = " (1st)" if i == 0 and len(mine) > 1 else ""
                body.append([f"{rate:g}", str(r["repeat"]), r["engine"] + first, f(r["throughput_tok_s"]),
                             f(r["goodput_req_s"], ".3f"), f(r["ttft_p50"]), f(r["tpot_p50"], ".2f"),
                             f(r["hit_rate"], ".3f")] + [f(r.get(f"ttft_p50_turn{t}")) for t in turns]
                            + [str(r["requests_failed"]), str(r["token_count_mismatches"])])
    emit(head, body, markdown, (2,))
    head = (["rate sess/s", "arm", "repeats", "output tok/s", "goodput req/s", "TTFT p50 ms", "TPOT p50 ms",
             "hit rate"] + [f"TTFT p50 t{t} (n)" for t in turns] + ["failed", "tok-count mism", "unverified"])
    body = []
    for rate in rates:
        for e in engines:
            mine = [r for r in rows if r["rate"] == rate and r["engine"] == e]
            if not mine:
                continue
            body.append([f"{rate:g}", e, str(len(mine)), f(mean(r["throughput_tok_s"] for r in mine)),
                         f(mean(r["goodput_req_s"] for r in mine), ".3f"), f(mean(r["ttft_p50"] for r in mine)),
                         f(mean(r["tpot_p50"] for r in mine), ".2f"), f(mean(r["hit_rate"] for r in mine), ".3f")]
                        + [f"{f(mean(r.get(f'ttft_p50_turn{t}') for r in mine))} "
                           f"({sum(r.get(f'requests_turn{t}') or 0 for r in mine)})" for t in turns]
                        + [str(sum(r["requests_failed"] or 0 for r in mine)),
                           str(sum(r["token_count_mismatches"] or 0 for r in mine)),
                           str(sum(r["token_count_unverified"] or 0 for r in mine))])
    emit(head, body, markdown, (1,))
    if len(engines) in (2, 3):
        cached, uncached, theirs = engines if len(engines) == 3 else (engines[0], None, engines[1])
        metrics = (METRICS + (("slo_attainment", "SLO attainment", True),)
                   + tuple((f"ttft_p50_turn{t}", f"TTFT p50 t{t}", False) for t in turns))
        head = ["rate sess/s", "ratio", "repeats"] + [label.replace(" ms", "") + " [95%]" for _, label, _ in metrics]
        body = []
        pairs = [(cached, theirs, "prefix cache / llama-server")]
        if uncached is not None:
            pairs += [(uncached, theirs, "no cache / llama-server"), (cached, uncached, "prefix cache / no cache")]
        for rate in rates:
            for a, b, name in pairs:
                ratios = paired_ratios(rows, rate, a, b, metrics)
                body.append([f"{rate:g}", name, str(ratios["repeats"])] + [fmt_ratio(ratios[k]) for k, _, _ in metrics])
        emit(head, body, markdown, (1,))
    if len(engines) == 3:
        differing = {rate: [outputs_differing(rows, c, cached, uncached)
                            for c in sorted({r["cell"] for r in rows if r["rate"] == rate})] for rate in rates}
        print("turns whose output differs, prefix cache vs no cache (per repeat): "
              + "; ".join(f"{rate:g} sessions/s {v}" for rate, v in differing.items()))
    attainment(rows)
    print(f"SLOs: {state.get('slo')}; workload: {state.get('workload')}; llama-server extra flags: "
          f"{' '.join(state.get('llama_server_extra') or [])}")
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
    p.add_argument("--kv-cache", default="fp32", choices=("fp32", "int8"), help="infer-tune serve --kv-cache")
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
    p.add_argument("--workload", default="poisson", choices=("poisson", "multi-turn", "trace"),
                   help="poisson: single-turn requests; multi-turn: sessions (rates in sessions/s), three arms: "
                        "infer-tune serve with and without its prefix cache, llama-server with its prompt cache")
    p.add_argument("--sessions", type=int, default=16, help="multi-turn: sessions per rate and repeat")
    p.add_argument("--max-turns", type=int, default=5, help="multi-turn: first turns of each conversation sent")
    p.add_argument("--min-turns", type=int, default=1,
                   help="multi-turn: only conversations of at least this many user turns (equal to --max-turns: "
                        "every session sends every turn, each turn's figures from all sessions)")
    p.add_argument("--think-time-ms", type=float, default=1000.0, help="multi-turn: mean think time between turns")
    p.add_argument("--history", default="server", choices=("server", "recorded"),
                   help="multi-turn: earlier answers fed back (each server's own, or the recorded ones)")
    p.add_argument("--max-history-tokens", type=int, default=1024,
                   help="multi-turn: only conversations whose first --max-turns user turns total at most this "
                        "many tokens (with the answers and the template, under --context 2048)")
    p.add_argument("--no-uncached-arm", action="store_true",
                   help="multi-turn: leave out our server without its prefix cache (two arms: ours, llama-server)")
    p.add_argument("--cache-mib", type=float, default=1024.0, help="multi-turn, trace: infer-tune serve --cache-mib")
    p.add_argument("--trace", help="trace: the trace file (e.g. tests/data/traces/mooncake_sample.jsonl)")
    p.add_argument("--trace-format", default="mooncake", choices=("mooncake", "burstgpt", "jsonl"))
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: arrival times multiplied by this")
    p.add_argument("--same-text", action="store_true",
                   help="trace: every repeat sends the same words (default: seed + repeat, so the servers' caches "
                        "start cold for each repeat and hit only what the trace shares)")
    p.add_argument("--block-size", type=int, default=512, help="trace: tokens per Mooncake hash block")
    p.add_argument("--cache-reuse", type=int, default=0,
                   help="multi-turn: llama-server --cache-reuse N (0: not passed, its default)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="an argument passed to every infer-tune serve arm as is, repeatable (e.g. --serve-arg=--speculate "
                        "--serve-arg=8)")
    p.add_argument("--llama-arg", action="append", default=[],
                   help="an argument passed to llama-server as is, repeatable (e.g. --llama-arg=--spec-type "
                        "--llama-arg=ngram-simple --llama-arg=-ctk --llama-arg=q8_0)")
    p.add_argument("--repeat-from", type=int, default=0,
                   help="multi-turn and trace: run repeats from this one on, keeping the state file's earlier repeats (a "
                        "repeat that a failure spoiled, measured again, or more repeats added; the state records which "
                        "repeats ran when)")
    p.add_argument("--table", action="store_true", help="print the table of the state file and stop")
    p.add_argument("--markdown", action="store_true", help="with --table: as markdown (docs/results.md)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    if args.table:
        saved = json.loads(Path(args.state).read_text())
        multi = saved.get("args", {}).get("workload") == "multi-turn"
        (table_sessions if multi else table)(saved, markdown=args.markdown)
        return
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1 (3 or more for a result)")
    state = {"rows": [], "slo": {"ttft_ms": args.slo_ttft, "tpot_ms": args.slo_tpot},
             "args": {k: v for k, v in vars(args).items() if k not in ("table", "markdown")},
             "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
             "infer_tune_commit": git_commit()}
    if args.repeat_from:  # the earlier repeats as the state file has them; this run measures the rest again
        if not 0 < args.repeat_from < args.repeats or args.workload not in ("multi-turn", "trace"):
            raise SystemExit("--repeat-from must be 1 .. --repeats - 1, with --workload multi-turn or trace")
        saved = json.loads(Path(args.state).read_text())
        kept = [r for r in saved["rows"] if r["repeat"] < args.repeat_from]
        replaced = [r for r in saved["rows"] if r["repeat"] >= args.repeat_from]  # kept aside, never lost
        state = {**saved, "rows": kept, "replaced_rows": saved.get("replaced_rows", []) + replaced,
                 "rerun": saved.get("rerun", []) + [
            {"repeats_from": args.repeat_from, "command": state["command"], "started": state["started"],
             "infer_tune_commit": state["infer_tune_commit"], "dropped_rows": len(replaced)}]}
    if args.workload == "trace":
        if not args.trace:
            raise SystemExit("--workload trace needs --trace FILE")
        compare_trace(args, state)
        save(args, state)
        table(state)
        return
    if args.workload == "multi-turn":
        from infer_tune.errors import ConfigError

        try:
            state["workload"] = session_workload(args).to_dict()
        except ConfigError as exc:  # one line, before anything starts
            raise SystemExit(str(exc)) from None
        compare_sessions(args, state)
        save(args, state)
        table_sessions(state)
        return
    compare(args, state)
    save(args, state)
    table(state)


if __name__ == "__main__":
    main()
