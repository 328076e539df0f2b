"""`infer-tune batch sweep` and `infer-tune batch serve-sim`: batch-size sweeps, and one arrival trace
replayed through a static and a continuous batcher with goodput under SLOs."""

from __future__ import annotations

import re
from typing import Annotated

import typer
from rich.table import Table

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.errors import ConfigError

app = typer.Typer(help="Batching: batch-size sweeps and open-loop serving simulations (static vs continuous).",
                  no_args_is_help=True)

BatchSizes = Annotated[str, typer.Option("--batch-sizes", help="Comma-separated batch sizes to sweep.")]
MemoryLimit = Annotated[str | None, typer.Option("--memory-limit", help="Skip a batch size whose predicted peak RSS "
                                                 "exceeds this (e.g. 8GiB, 500MB, bytes); flag measured excess.")]
Rates = Annotated[str, typer.Option("--rates", help="Comma-separated request rates (requests/s), one trace each.")]
Requests = Annotated[int, typer.Option("--requests", help="Requests per trace.")]
Burstiness = Annotated[float, typer.Option("--burstiness", help="Gamma shape K of the inter-arrival gaps: 1 = Poisson, "
                                           "<1 burstier, >1 more regular (CV = 1/sqrt(K)).")]
TimeoutMs = Annotated[float, typer.Option("--timeout-ms", help="Static batcher: dispatch a partial batch once its "
                                          "oldest request waited this long.")]
MaxBatchTokens = Annotated[int, typer.Option("--max-batch-tokens", help="Continuous batcher: token budget per forward pass.")]
SloTarget = Annotated[float, typer.Option("--slo-target", help="Share of requests that must meet every SLO for a "
                                          "rate to count as meeting them.")]
Schedulers = Annotated[str, typer.Option("--schedulers", help="Comma-separated: static, continuous.")]
AllowRepeat = Annotated[bool, typer.Option("--allow-repeat", help="With more requests than prompts, sample prompts "
                                           "with replacement.")]

UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
         "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str, flag: str = "--memory-limit") -> int:
    """`8GiB`, `500MB`, `2G` (binary), `123456` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ConfigError(f"{flag} must be a size such as 8GiB, 500MB or a number of bytes, got '{text}'")
    value = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if value <= 0:
        raise ConfigError(f"{flag} must be > 0, got '{text}'")
    return value


def parse_list(text: str, flag: str, kind: type) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated {kind.__name__}s, got '{text}'") from None
    if not values:
        raise ConfigError(f"{flag} is empty")
    return values


@opt.measuring_command(min_iterations=1, min_duration=0.0)
def sweep(opts: opt.MeasureOptions, batch_sizes: BatchSizes = "1,2,4,8,16,32", memory_limit: MemoryLimit = None) -> None:
    """Padded static batches of each size on the same prompts (closed loop): output tok/s, latency, TTFT,
    padding waste and peak memory per batch size, and the knee.

    The knee is the first batch size from which one more doubling gains < 5% output throughput. The prompts
    are the first --limit of the suite (default: the largest batch size); outputs are compared with the
    smallest batch size's. A size that runs out of memory, or whose predicted peak exceeds --memory-limit,
    is reported as such and the sweep goes on.

    Example: infer-tune batch sweep --model smollm2-135m --batch-sizes 1,2,4,8,16,32 --max-new-tokens 32 --threads 1
    """
    from infer_tune.cli.measure import run_spec
    from infer_tune.scenarios.batch import SweepSpec, run_sweep
    from infer_tune.workload import Workload

    sizes = parse_list(batch_sizes, "--batch-sizes", int)
    if any(b < 1 for b in sizes):
        raise ConfigError(f"--batch-sizes must be >= 1, got '{batch_sizes}'")
    if "batch_size" in opts.explicit:
        raise ConfigError("batch sweep takes its sizes from --batch-sizes, not --batch-size")
    spec_sweep = SweepSpec(batch_sizes=sizes, memory_limit_bytes=parse_bytes(memory_limit) if memory_limit else None)
    limit = opts.limit if "limit" in opts.explicit else max(sizes)
    if limit < max(sizes):
        raise ConfigError(f"--limit {limit} is smaller than batch size {max(sizes)}; a batch needs as many prompts")
    workload = Workload(**{**opts.workload_values(), "limit": limit, "batch_size": 1})
    with output.progress_bar(not opts.json_out, out_dir=opts.out) as progress:
        result = run_sweep(run_spec(opts, workload=workload, measure_ppl=False), spec_sweep, progress=progress)
    if opts.json_out:
        output.print_json({"results": result.docs, "not_measured": result.skipped, "knee_batch_size": result.knee})
        return
    render_sweep(result)


def render_sweep(result) -> None:
    """One row per batch size (measured or not), the knee marked."""
    docs = result.docs
    first = docs[0] if docs else None
    table = Table(title=f"batch sweep · {first['model']['ref']} · {first['workload']['prompts']} prompts x "
                        f"{first['workload']['max_new_tokens']} tokens" if first else "batch sweep")
    for col in ("batch", "tok/s", "gain/2x", "TTFT ms", "e2e ms", "pad", "peak RSS", "diff"):
        table.add_column(col, justify="left" if col == "batch" else "right")
    rows = [(d.metrics["batch_size"], d) for d in docs] + [(s["batch_size"], s) for s in result.skipped]
    for size, item in sorted(rows, key=lambda r: r[0]):
        if "status" in item:
            table.add_row(f"{size} {item['status'].replace('_', ' ')}", "-", "-", "-", "-", "-",
                          output.fmt_bytes(item["predicted_peak_bytes"]) + "?", "-")
            continue
        m = item.metrics
        gain = m["gain_per_doubling"]
        note = " knee" if m["is_knee"] else ""
        note += " over limit" if m.get("exceeded_memory_limit") else ""
        table.add_row(f"{size}{note}", output.fmt(m["output_throughput_tok_s"], ".1f"),
                      "-" if gain is None else f"{100 * gain:+.0f}%", output.fmt(m["ttft_ms"]["p50"], ".0f"),
                      output.fmt(m["e2e_ms"]["p50"], ".0f"), output.fmt(m["padding_share"], ".0%"),
                      output.fmt_bytes(m["peak_rss_bytes"]), output.fmt(m.get("output_mismatches"), "d"))
    output.out.print(table)
    output.out.print("  gain/2x: output tok/s gained per doubling to the next size; TTFT / e2e: p50 per request; "
                     "pad: padded share of the batch positions; diff: outputs differing from the smallest batch's",
                     soft_wrap=True)
    knee = result.knee
    output.out.print(f"  knee: {knee if knee is not None else 'not reached in this sweep'} (the first batch size from "
                     "which one more doubling gains < 5% output throughput)", soft_wrap=True)
    for item in result.skipped:
        output.out.print(f"  batch {item['batch_size']}: {item['reason']}", soft_wrap=True)
    for run_dir in result.run_dirs:
        output.out.print(f"  result {run_dir}/result.json", soft_wrap=True)


@opt.measuring_command(batch_size=8, max_new_tokens=64, min_iterations=1, min_duration=0.0)
def serve_sim(
    opts: opt.MeasureOptions,
    rates: Rates = "0.5,1,2,4",
    requests: Requests = 32,
    burstiness: Burstiness = 1.0,
    timeout_ms: TimeoutMs = 250.0,
    max_batch_tokens: MaxBatchTokens = 512,
    slo_ttft_ms: opt.SloTtft = None,
    slo_tpot_ms: opt.SloTpot = None,
    slo_e2e_ms: opt.SloE2e = None,
    slo_target: SloTarget = 0.9,
    schedulers: Schedulers = "static,continuous",
    allow_repeat: AllowRepeat = False,
    endpoint: Annotated[str | None, typer.Option("--endpoint", help="Replay the same kind of trace against a live "
                                                 "OpenAI-compatible server instead (e.g. http://127.0.0.1:8000/v1); "
                                                 "the server batches, so --schedulers does not apply. See `endpoint sim`.")] = None,
    served_model: Annotated[str | None, typer.Option("--served-model", help="With --endpoint: the model name the server serves.")] = None,
    api_key_env: Annotated[str | None, typer.Option("--api-key-env", help="With --endpoint: the environment variable holding the API key.")] = None,
    workers: Annotated[int | None, typer.Option("--workers", help="With --endpoint: load-generator processes (default: from the concurrency and the cores).")] = None,
) -> None:
    """Static vs continuous batching on one seeded arrival trace per rate, replayed open loop: TTFT, queueing,
    TPOT, e2e, throughput, goodput under SLOs, the highest rate meeting them, outputs vs greedy.

    Static: requests wait until --batch-size are queued (or the oldest waited --timeout-ms), then the batch
    runs until its longest request ends. Continuous: transformers' continuous-batching manager, where
    requests join and leave at every step (up to --batch-size requests, --max-batch-tokens tokens).
    Arrivals are Poisson (--burstiness 1) or gamma; prompts come from --suite; each request's output length
    is its prompt's natural greedy length, capped at --max-new-tokens.

    Example: infer-tune batch serve-sim --model smollm2-135m --rates 0.4,1.2,3.6 --requests 32
             --max-new-tokens 32 --slo-ttft-ms 5000 --slo-tpot-ms 500 --threads 1
    """
    from infer_tune.cli.measure import run_spec
    from infer_tune.metrics.saturation import SLO
    from infer_tune.scenarios.batch import ServeSpec, run_serve
    from infer_tune.workload import Workload

    if endpoint is not None:  # the server is the batcher: the endpoint runner replays the trace over HTTP
        from infer_tune.cli import endpoint as endpoint_cmd

        return endpoint_cmd.run_sim(opts, endpoint, rates=rates, requests=requests, burstiness=burstiness,
                                    slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, slo_e2e_ms=slo_e2e_ms,
                                    served_model=served_model, api_key_env=api_key_env,
                                    concurrency=max(opts.batch_size, 1) * 8, workers=workers)

    if "limit" in opts.explicit:
        raise ConfigError("batch serve-sim takes the number of requests from --requests, not --limit")
    if requests < 1:
        raise ConfigError(f"--requests must be >= 1, got {requests}")
    rate_list = parse_list(rates, "--rates", float)
    if any(not 0 < r < float("inf") for r in rate_list):
        raise ConfigError(f"--rates must be finite numbers > 0 requests/s, got '{rates}'")
    if not 0 < burstiness < float("inf"):
        raise ConfigError(f"--burstiness must be a finite number > 0 (1 = Poisson), got {burstiness}")
    for flag, value in (("--slo-ttft-ms", slo_ttft_ms), ("--slo-tpot-ms", slo_tpot_ms), ("--slo-e2e-ms", slo_e2e_ms)):
        if value is not None and not 0 < value < float("inf"):
            raise ConfigError(f"{flag} must be a number of milliseconds > 0, got {value}")
    if timeout_ms < 0:
        raise ConfigError(f"--timeout-ms must be >= 0, got {timeout_ms}")
    if max_batch_tokens < 1:
        raise ConfigError(f"--max-batch-tokens must be >= 1, got {max_batch_tokens}")
    names = tuple(dict.fromkeys(parse_list(schedulers, "--schedulers", str)))
    if any(n not in ("static", "continuous") for n in names):
        raise ConfigError(f"--schedulers: choose from static, continuous; got '{schedulers}'")
    serve = ServeSpec(rates=rate_list, requests=requests, batch_size=opts.batch_size, burstiness=burstiness,
                      timeout_ms=timeout_ms, max_batch_tokens=max_batch_tokens,
                      slo=SLO(ttft_ms=slo_ttft_ms, tpot_ms=slo_tpot_ms, e2e_ms=slo_e2e_ms), slo_target=slo_target,
                      schedulers=names, allow_repeat=allow_repeat, seed=opts.seed)
    workload = Workload(**{**opts.workload_values(), "limit": requests, "batch_size": 1})
    with output.progress_bar(not opts.json_out, out_dir=opts.out) as progress:
        result = run_serve(run_spec(opts, workload=workload, measure_ppl=False), serve, progress=progress)
    if opts.json_out:
        output.print_json({"results": result.docs, "summary": result.summary})
        return
    render_serve(result)


def _dist(m: dict, key: str, stats: tuple[str, ...]) -> str:
    return " / ".join(output.fmt(m[key][s], ".0f") for s in stats)


SERVE_ROWS = (
    ("TTFT ms mean/p50/p90/p99", lambda m: _dist(m, "ttft_ms", ("mean", "p50", "p90", "p99"))),
    ("queue ms mean/p50/p90/p99", lambda m: _dist(m, "queue_ms", ("mean", "p50", "p90", "p99"))),
    ("TPOT ms mean/p50/p90/p99", lambda m: _dist(m, "tpot_ms", ("mean", "p50", "p90", "p99"))),
    ("e2e ms mean/p50/p90/p99", lambda m: _dist(m, "e2e_ms", ("mean", "p50", "p90", "p99"))),
    ("output tok/s", lambda m: output.fmt(m["output_throughput_tok_s"], ".1f")),
    ("requests/s (offered)", lambda m: f"{output.fmt(m['request_throughput_req_s'])} ({output.fmt(m['offered_rate'])})"),
    ("goodput req/s", lambda m: output.fmt(m["goodput_req_s"])),
    ("SLO attainment", lambda m: output.fmt(m["slo_attainment"], ".0%")),
    ("mean batch / padding", lambda m: f"{output.fmt(m.get('mean_batch_size'), '.1f')} / "
                                       f"{output.fmt(m.get('padding_share'), '.0%')}"),
    ("output mismatches", lambda m: output.fmt(m.get("output_mismatches"), "d")),
)


def render_serve(result) -> None:
    """One table per rate: a row per metric, a column per scheduler (side by side on the same trace)."""
    from infer_tune.tuners.batch.analysis import claim_line

    by_rate: dict[float, dict[str, dict]] = {}
    for doc in result.docs:
        by_rate.setdefault(doc["config"]["rate"], {})[doc["config"]["scheduler"]] = doc
    first = result.docs[0]
    for rate, docs in sorted(by_rate.items()):
        names = sorted(docs, key=lambda n: n != "static")
        table = Table(title=f"batch serve-sim · {first['model']['ref']} · {rate:g} req/s · "
                            f"{first['workload']['requests']} requests, burstiness {first['workload']['burstiness']:g}, "
                            f"max batch {first['config']['batch_size']}")
        table.add_column("metric")
        for name in names:
            table.add_column(name, justify="right")
        for label, cell in SERVE_ROWS:
            table.add_row(label, *(cell(docs[name].metrics) for name in names))
        output.out.print(table)
    summary = result.summary
    if any(v is not None for v in summary["slo"].values()):
        slo = ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in summary["slo"].items() if v is not None)
        for name, rate in summary["max_rate_meeting_slo"].items():
            output.out.print(f"  highest rate with {summary['slo_target']:.0%} of requests meeting {slo}, {name}: "
                             f"{'none of the rates' if rate is None else f'{rate:g} req/s'}", soft_wrap=True)
    else:
        output.out.print("  no SLO given (--slo-ttft-ms / --slo-tpot-ms / --slo-e2e-ms): goodput not computed")
    cont = next((d.metrics for d in result.docs if d["config"]["scheduler"] == "continuous"), None)
    if cont is not None and cont.get("continuous_impl"):
        output.out.print(f"  continuous batching: {cont['continuous_impl']}, attention {cont['continuous_attn_impl']}, "
                         f"set-up {output.fmt(cont.get('scheduler_setup_s'))} s (before the trace, not in TTFT)",
                         soft_wrap=True)
    if summary["claim_check"] is not None:
        output.out.print(f"claim: {summary['claim_check']['claim']}", soft_wrap=True)
        output.out.print(f"  judged where the machine is loaded: {claim_line(summary['claim_check'])}", soft_wrap=True)
        for other in summary["claim_by_rate"]:
            if other["rate"] != summary["claim_check"]["rate"]:
                output.out.print(f"  also: {claim_line(other)}", soft_wrap=True)
    for run_dir in result.run_dirs:
        output.out.print(f"  result {run_dir}/result.json", soft_wrap=True)

app.command("sweep")(sweep)
app.command("serve-sim")(serve_sim)
