"""Endpoint options for `bench --endpoint`, and the `endpoint` commands: `sim` (a request-rate sweep with
its saturation knee) and `reference` (a reference engine started on loopback and benchmarked)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.document import ResultDocument
from infer_tune.engines.base import REFERENCE_ENGINE
from infer_tune.errors import ConfigError

PANEL = "Endpoint (an OpenAI-compatible server: vLLM, SGLang, TGI, llama.cpp, transformers serve)"


def _opt(*names: str, help: str, **kwargs):  # noqa: A002 (typer's own keyword)
    return typer.Option(*names, help=help, rich_help_panel=PANEL, **kwargs)


Endpoint = Annotated[str | None, _opt("--endpoint", help="API root of the server, http://HOST:PORT/v1: benchmark it over HTTP instead of a model in this process.")]
EndpointRequired = Annotated[str, _opt("--endpoint", help="API root of the server, http://HOST:PORT/v1.")]
ServedModel = Annotated[str | None, _opt("--served-model", help="The `model` name the server serves (default: the only one it lists).")]
ApiKeyEnv = Annotated[str | None, _opt("--api-key-env", help="Name of the environment variable holding the bearer token (the key never goes on the command line or into results).")]
Api = Annotated[str, _opt("--api", help="chat (/chat/completions: the server applies its chat template) or completions (/completions: the prompt rendered by --model's template).")]
Concurrency = Annotated[int, _opt("--concurrency", help="Most requests in flight at once (bench: closed loop; sim: the bound on the open loop).")]
RequestTimeout = Annotated[float, _opt("--request-timeout", help="Seconds a whole request may take before it counts as failed (timeout).")]
IdleTimeout = Annotated[float, _opt("--idle-timeout", help="Seconds the server may stay silent (before its answer, and between events) before the request counts as failed (idle_timeout); apart from --request-timeout.")]
IgnoreEos = Annotated[bool, _opt("--ignore-eos", help="Send `ignore_eos: true` (vLLM, SGLang, llama.cpp) so every request decodes --max-new-tokens.")]
Workers = Annotated[int | None, _opt("--workers", help="Load-generator processes, each with its own event loop (default: one per 128 concurrent streams, at most one per core; 1: a single loop in this process).")]
Label = Annotated[str | None, _opt("--label", help="The result's label in leaderboards (default: MODEL@HOST:PORT).")]
Baseline = Annotated[Path | None, _opt("--baseline", help="A result (run folder or result.json) of the same workload: adds speedup, BLEU drift and faithfulness against it.")]

WPANEL = "Endpoint workload (docs/endpoint.md, 'Workloads')"


def _wopt(*names: str, help: str, **kwargs):  # noqa: A002 (typer's own keyword)
    return typer.Option(*names, help=help, rich_help_panel=WPANEL, **kwargs)


WorkloadKind = Annotated[str, _wopt("--workload", help="poisson (single-turn suite prompts), multi-turn (whole ShareGPT conversations, each turn after the previous answer), shared-prefix (requests share system prompts) or trace (a timed trace file).")]
Sessions = Annotated[int, _wopt("--sessions", help="multi-turn: sessions (conversations) per result; they arrive at --rates sessions/s.")]
MaxTurns = Annotated[int, _wopt("--max-turns", help="multi-turn: most turns sent per session.")]
MinTurns = Annotated[int, _wopt("--min-turns", help="multi-turn: only conversations with at least this many user turns (--min-turns equal to --max-turns: every session sends every turn, so each turn's TTFT comes from all sessions).")]
ThinkTime = Annotated[float, _wopt("--think-time-ms", help="multi-turn: mean think time between an answer and the next turn (exponential, seeded; 0: none).")]
History = Annotated[str, _wopt("--history", help="multi-turn: the answers fed back as history: server (the server's own) or recorded (the conversation's).")]
Prefixes = Annotated[int, _wopt("--prefixes", help="shared-prefix: how many distinct system prompts the requests share.")]
PrefixTokens = Annotated[int, _wopt("--prefix-tokens", help="shared-prefix: tokens of each system prompt.")]
TraceFile = Annotated[Path | None, _wopt("--trace", help="trace: the trace file to replay at its own times.")]
TraceFormat = Annotated[str | None, _wopt("--trace-format", help="trace: mooncake (JSONL, hash_ids), burstgpt (CSV) or jsonl (timestamp ms, prompt or input_length, output_length).")]
TimeScale = Annotated[float, _wopt("--time-scale", help="trace: arrival times multiplied by this (0.5: twice as fast, 2: half as fast).")]
BlockSize = Annotated[int, _wopt("--block-size", help="trace (mooncake): tokens per hash block.")]


def workload_options(workload: str, sessions: int = 8, max_turns: int = 4, think_time_ms: float = 1000.0,
                     history: str = "server", prefixes: int = 4, prefix_tokens: int = 256,
                     trace: Path | None = None, trace_format: str | None = None, time_scale: float = 1.0,
                     block_size: int = 512, min_turns: int = 1):
    """The WorkloadOptions of the parsed options (checked there, with the flags' names)."""
    from infer_tune.endpoint.workloads import WorkloadOptions

    return WorkloadOptions(kind=workload, sessions=sessions, max_turns=max_turns, min_turns=min_turns,
                           think_time_ms=think_time_ms,
                           history=history, prefixes=prefixes, prefix_tokens=prefix_tokens,
                           trace=str(trace) if trace is not None else None, trace_format=trace_format,
                           time_scale=time_scale, block_size=block_size)


def endpoint_config(url: str, served_model: str | None, api_key_env: str | None, api: str, concurrency: int,
                    request_timeout: float, ignore_eos: bool, label: str | None, idle_timeout: float = 60.0,
                    workers: int | None = None):
    """The EndpointConfig of the parsed options (flag ranges checked here, with the flags' names)."""
    from infer_tune.endpoint.config import EndpointConfig

    if concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1, got {concurrency}")
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    for flag, value in (("--request-timeout", request_timeout), ("--idle-timeout", idle_timeout)):
        if not 0 < value < float("inf"):
            raise ConfigError(f"{flag} must be a finite number of seconds > 0, got {value}")
    return EndpointConfig(url=url, served_model=served_model, api=api, api_key_env=api_key_env,
                          concurrency=concurrency, timeout_s=request_timeout, ignore_eos=ignore_eos, label=label,
                          idle_timeout_s=idle_timeout, workers=workers)


def warn_failures(doc: ResultDocument) -> None:
    """One warning line when requests failed: latency figures then describe only the requests that succeeded."""
    m = doc.metrics
    failed, sent = m.get("requests_failed") or 0, m.get("requests_sent") or 0
    if failed:
        kinds = ", ".join(f"{n} {k}" for k, n in (m.get("failures_by_kind") or {}).items())
        output.warn(f"{doc.label or doc.run_id}: {failed} of {sent} requests failed "
                    f"({failed / max(sent, 1):.1%}: {kinds}); the latency figures cover only the "
                    f"{m.get('requests_ok')} that succeeded")
    if m.get("token_count_mismatches"):
        output.warn(f"{doc.label or doc.run_id}: {m['token_count_mismatches']} request(s) streamed a different number "
                    f"of tokens than the server's usage.completion_tokens (token_count_mismatches; first: "
                    f"{(m.get('token_count_failures') or [{}])[0]})")


def render_endpoint(doc: ResultDocument) -> None:
    """The one-result table plus what only an endpoint run has: requests, token counting, the server."""
    from infer_tune.cli.measure import render_result

    render_result(doc, doc.location)
    m, e = doc.metrics, doc.env.get("endpoint", {})
    kinds = ", ".join(f"{n} {k}" for k, n in (m.get("failures_by_kind") or {}).items())
    facts = [("requests", f"{m['requests_ok']} ok, {m['requests_failed']} failed" + (f" ({kinds})" if kinds else "")),
             ("tokens counted from", f"{m.get('token_count_source')} (usage/deltas mismatches: "
                                     f"{m.get('usage_token_mismatches')}, multi-token deliveries: "
                                     f"{m.get('multi_token_deliveries')})"),
             ("token counts checked", f"{m.get('token_count_mismatches')} mismatch(es) against usage, "
                                      f"{m.get('token_count_unverified')} request(s) without usage"),
             ("server", f"{e.get('url')} · {e.get('served_model')} · {e.get('server_header') or 'no Server header'}")]
    if m.get("goodput_req_s") is not None:
        facts.append(("goodput", f"{output.fmt(m['goodput_req_s'])} req/s, SLO attainment "
                                 f"{output.fmt(m.get('slo_attainment'), '.0%')} (SLO {m.get('slo')})"))
    client = m.get("client") or {}
    if client:
        facts.append(("load generator", f"{client.get('workers')} worker(s) on {client.get('cores')} cores, "
                                        + ("SATURATED" if m.get("client_saturated") else "not saturated")))
    for name, value in facts:
        output.out.print(f"  {name:<22} {value}", soft_wrap=True)
    client_line(m)
    turn_table(m)


def turn_table(m: dict, prefix: str = "") -> None:
    """Multi-turn results: TTFT p50 / p90 by turn and by history length (the prefix-reuse curve)."""
    turns = m.get("turns") or {}
    if not turns.get("by_turn"):
        return
    table = Table(title=f"{prefix}TTFT by turn ({m.get('sessions')} sessions, {m.get('turns_sent')} turns sent, "
                        f"{m.get('turns_not_sent')} not sent)")
    for name in ("turn", "requests", "history tokens p50", "TTFT p50", "TTFT p90"):
        table.add_column(name, justify="right")
    for row in turns["by_turn"]:
        table.add_row(str(row["turn"]), str(row["requests"]), output.fmt(row["history_tokens_p50"], ".0f"),
                      output.fmt(row["ttft_ms"]["p50"]), output.fmt(row["ttft_ms"]["p90"]))
    for row in turns.get("by_history") or []:
        lo, hi = row["history_tokens"]
        table.add_row(f"hist {lo}-{hi}", str(row["requests"]), "", output.fmt(row["ttft_ms"]["p50"]),
                      output.fmt(row["ttft_ms"]["p90"]))
    output.out.print(table)


def bench_endpoint(opts: opt.MeasureOptions, config, baseline: Path | None, execute: bool, workload=None,
                   requests: int | None = None) -> None:
    """`bench --endpoint`: one closed-loop result of the server (called by cli/bench.py); with a
    `workload` other than poisson, one replay of it (everything due at once, or a trace at its times)."""
    from infer_tune.cli.measure import run_spec
    from infer_tune.scenarios.endpoint import run_endpoint_bench, run_endpoint_workload

    with output.progress_bar(not opts.json_out) as progress:
        if workload is not None and workload.kind != "poisson":
            if baseline is not None:
                raise ConfigError("--baseline compares the suite's prompts: it applies to --workload poisson")
            doc = run_endpoint_workload(run_spec(opts, execute=execute), config, workload,
                                        model_given="model" in opts.explicit, requests=requests, progress=progress)
        else:
            doc = run_endpoint_bench(run_spec(opts, execute=execute), config, model_given="model" in opts.explicit,
                                     baseline=baseline, progress=progress)
    warn_failures(doc)
    if opts.json_out:
        output.print_json(doc)
        return
    render_endpoint(doc)


app = typer.Typer(help="Benchmark a live OpenAI-compatible server: a rate sweep, or a reference engine on loopback.",
                  no_args_is_help=True)

Rates = Annotated[str, typer.Option("--rates", help="Comma-separated offered rates in requests/s (inf: all at once), one result each.")]
Requests = Annotated[int | None, typer.Option("--requests", help="Requests per rate (prompts taken in turn; default 16). --workload trace: the trace's first N requests, or N synthesized from its statistics when it has fewer (default: all).")]
Burstiness = Annotated[float, typer.Option("--burstiness", help="Gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier, >1 more regular.")]
KneeFactor = Annotated[float, typer.Option("--knee-factor", help="A rate is saturated when its TTFT p50 exceeds this multiple of the lowest rate's.")]


@opt.measuring_command(limit=4, warmup=1)
def sim(
    opts: opt.MeasureOptions,
    endpoint: EndpointRequired,
    rates: Rates = "1,2,4",
    requests: Requests = None,
    burstiness: Burstiness = 1.0,
    slo_ttft_ms: opt.SloTtft = None,
    slo_tpot_ms: opt.SloTpot = None,
    slo_e2e_ms: opt.SloE2e = None,
    knee_factor: KneeFactor = 2.0,
    served_model: ServedModel = None,
    api_key_env: ApiKeyEnv = None,
    api: Api = "chat",
    concurrency: Concurrency = 64,
    request_timeout: RequestTimeout = 300.0,
    idle_timeout: IdleTimeout = 60.0,
    ignore_eos: IgnoreEos = False,
    label: Label = None,
    workers: Workers = None,
    workload: WorkloadKind = "poisson",
    sessions: Sessions = 8,
    max_turns: MaxTurns = 4,
    min_turns: MinTurns = 1,
    think_time_ms: ThinkTime = 1000.0,
    history: History = "server",
    prefixes: Prefixes = 4,
    prefix_tokens: PrefixTokens = 256,
    trace: TraceFile = None,
    trace_format: TraceFormat = None,
    time_scale: TimeScale = 1.0,
    block_size: BlockSize = 512,
) -> None:
    """Replay a seeded Poisson (or gamma) arrival trace at each --rates value against the server, with at
    most --concurrency requests in flight; one result per rate, the saturation knee marked, goodput under
    the SLOs given. --workload multi-turn / shared-prefix change what arrives; --workload trace replays a
    trace file at its own times (one result).

    Example: infer-tune endpoint sim --endpoint http://127.0.0.1:8000/v1 --rates 1,2,4,8 --requests 32
    --slo-ttft-ms 500 --slo-tpot-ms 50 --limit 8 --max-new-tokens 64 --out runs/deploy
    Example: infer-tune endpoint sim --endpoint http://127.0.0.1:8000/v1 --workload multi-turn --rates 0.5
    --sessions 16 --max-turns 4 --think-time-ms 2000
    Example: infer-tune endpoint sim --endpoint http://127.0.0.1:8000/v1 --workload trace --trace
    mooncake.jsonl --trace-format mooncake --time-scale 0.5 --api completions --ignore-eos
    """
    spec = workload_options(workload, sessions, max_turns, think_time_ms, history, prefixes, prefix_tokens, trace,
                            trace_format, time_scale, block_size, min_turns)
    run_sim(opts, endpoint, rates=rates, requests=requests, burstiness=burstiness, slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms, slo_e2e_ms=slo_e2e_ms, knee_factor=knee_factor, served_model=served_model,
            api_key_env=api_key_env, api=api, concurrency=concurrency, request_timeout=request_timeout,
            ignore_eos=ignore_eos, label=label, idle_timeout=idle_timeout, workers=workers, workload=spec)


def run_sim(opts: opt.MeasureOptions, endpoint: str, *, rates: str, requests: int | None, burstiness: float = 1.0,
            slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, slo_e2e_ms: float | None = None,
            knee_factor: float = 2.0, served_model: str | None = None, api_key_env: str | None = None,
            api: str = "chat", concurrency: int = 64, request_timeout: float = 300.0, ignore_eos: bool = False,
            label: str | None = None, idle_timeout: float = 60.0, workers: int | None = None, workload=None) -> None:
    """`endpoint sim` (and `batch serve-sim --endpoint`): the rate sweep against a server, rendered; a
    trace workload: one replay of the trace file."""
    from infer_tune.cli.measure import run_spec
    from infer_tune.endpoint.arrivals import parse_rates
    from infer_tune.metrics.saturation import SLO
    from infer_tune.scenarios.endpoint import run_endpoint_sweep, run_endpoint_workload

    for flag, value in (("--requests", requests if requests is not None else 1), ("--burstiness", burstiness),
                        ("--knee-factor", knee_factor)):
        if not value > 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    slo = SLO(ttft_ms=slo_ttft_ms, tpot_ms=slo_tpot_ms, e2e_ms=slo_e2e_ms).to_dict()
    config = endpoint_config(endpoint, served_model, api_key_env, api, concurrency, request_timeout, ignore_eos, label,
                             idle_timeout, workers)
    if workload is not None and workload.kind == "trace":
        with output.progress_bar(not opts.json_out) as progress:
            doc = run_endpoint_workload(run_spec(opts), config, workload, model_given="model" in opts.explicit,
                                        requests=requests, slo=slo, progress=progress)
        warn_failures(doc)
        if opts.json_out:
            output.print_json(doc)
            return
        render_endpoint(doc)
        return
    with output.progress_bar(not opts.json_out) as progress:
        outcome = run_endpoint_sweep(run_spec(opts), config, parse_rates(rates), requests=requests or 16,
                                     model_given="model" in opts.explicit, burstiness=burstiness, slo=slo,
                                     knee_factor=knee_factor, progress=progress, workload=workload)
    for doc in outcome.docs:
        warn_failures(doc)
    if opts.json_out:
        output.print_json(outcome.docs)
        return
    knee = {"beyond": "beyond the swept rates", "below": "below the lowest rate (already saturated)"}.get(
        outcome.knee_status, f"{outcome.knee_rate:g} req/s" if outcome.knee_rate is not None else "not found")
    per_rate = (f"{workload.sessions} sessions" if workload is not None and workload.kind == "multi-turn"
                else f"{requests or 16} requests")
    kind = f" · {workload.kind}" if workload is not None and workload.kind != "poisson" else ""
    table = Table(title=f"{config.display_label()}{kind} · {per_rate} per rate · knee {knee}")
    for name in ("rate", "done/s", "ok", "fail", "TTFT p50", "TTFT p99", "TPOT p50", "queue p50", "tok/s", "goodput",
                 "SLO met", "sat."):
        table.add_column(name, justify="right")
    for doc in outcome.docs:
        m = doc.metrics
        table.add_row(output.fmt(m["offered_rate_req_s"], "g", "inf"), output.fmt(m["request_throughput_req_s"]),
                      str(m["requests_ok"]), str(m["requests_failed"]), output.fmt(m["ttft_ms"]["p50"]),
                      output.fmt(m["ttft_ms"]["p99"]), output.fmt(m["tpot_ms"]["p50"]),
                      output.fmt((m.get("queue_ms") or {}).get("p50")), output.fmt(m["output_throughput_tok_s"]),
                      output.fmt(m.get("goodput_req_s")), output.fmt(m.get("slo_attainment"), ".0%"),
                      "yes" if m["saturated"] else "no")
    output.out.print(table)
    for doc in outcome.docs:
        rate = f"rate {output.fmt(doc.metrics['offered_rate_req_s'], 'g', 'inf')}: "
        client_line(doc.metrics, rate)
        turn_table(doc.metrics, rate)
    output.out.print(f"  results: {', '.join(str(p) for p in outcome.run_dirs)} (rates.png beside each)", soft_wrap=True)


def client_line(m: dict, prefix: str = "") -> None:
    """A saturated client is said out loud: its TTFT / ITL include the client's own queue."""
    if m.get("client_saturated"):
        output.err.print(f"warning: {prefix}the load generator saturated ({m.get('client_saturation_reason')}); "
                         f"its latencies include the client's own delay: raise --workers or use more cores",
                         soft_wrap=True)


Engine = Annotated[str, typer.Option("--engine", help="The engine started as the reference server: any engine of the registry that can be started here (its entry's `serve_here`: engines/base.py; a name it cannot start lists those it can).")]
ContinuousBatching = Annotated[bool, typer.Option("--continuous-batching/--no-continuous-batching", help="An engine that batches only when asked (transformers serve): serve with continuous batching.")]
EngineArg = Annotated[list[str] | None, typer.Option("--engine-arg", help="An argument passed to the engine as is, repeatable (e.g. --engine-arg=--cb-num-blocks --engine-arg=64).")]
Parallel = Annotated[int, typer.Option("--parallel", help="Server slots decoding as one batch, for an engine that has them (llama-server: build it with scripts/build-llama-cpp.sh).")]
StartupTimeout = Annotated[float, typer.Option("--startup-timeout", help="Seconds the engine may take to load before the run fails.")]


@opt.measuring_command(limit=4)
def reference(
    opts: opt.MeasureOptions,
    engine: Engine = REFERENCE_ENGINE,
    continuous_batching: ContinuousBatching = False,
    engine_arg: EngineArg = None,
    startup_timeout: StartupTimeout = 300.0,
    concurrency: Concurrency = 1,
    request_timeout: RequestTimeout = 300.0,
    idle_timeout: IdleTimeout = 60.0,
    label: Label = None,
    parallel: Parallel = 1,
) -> None:
    """Start a reference engine on 127.0.0.1 with --model's weights, benchmark it like any endpoint, stop it:
    one more leaderboard row beside infer-tune's in-process configs.

    Example: infer-tune endpoint reference --engine llama.cpp --model smollm2-135m --limit 4 --max-new-tokens 32
    Example: infer-tune endpoint reference --engine llama.cpp --parallel 4 --concurrency 4 --limit 8
    """
    from infer_tune.cli.measure import run_spec
    from infer_tune.scenarios.endpoint import run_reference

    if not startup_timeout > 0:
        raise ConfigError(f"--startup-timeout must be > 0 seconds, got {startup_timeout}")
    if parallel < 1:
        raise ConfigError(f"--parallel must be >= 1, got {parallel}")
    config = endpoint_config("http://127.0.0.1:1/v1", None, None, "chat", concurrency, request_timeout, False, label,
                             idle_timeout)
    with output.progress_bar(not opts.json_out) as progress:
        doc = run_reference(run_spec(opts), engine, config, continuous_batching=continuous_batching,
                            extra_args=engine_arg or [], startup_timeout_s=startup_timeout, parallel=parallel,
                            progress=progress)
    warn_failures(doc)
    if opts.json_out:
        output.print_json(doc)
        return
    render_endpoint(doc)


app.command("sim")(sim)
app.command("reference")(reference)
