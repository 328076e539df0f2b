"""`infer-tune bench`: measure the baseline of a model on a suite and write a result."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from infer_tune.cli import endpoint as ep
from infer_tune.cli import executor_opts as xo
from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.errors import ConfigError, InferTuneError


def render_result(doc: dict, run_dir: Path | str | None = None) -> None:
    """A one-result summary table (shared by every measuring command)."""
    m = doc["metrics"]
    table = Table(title=f"{doc['technique']} · {doc['model']['ref']} · {doc['workload']['suite']} "
                        f"({doc['workload']['prompts']} prompts x {doc['workload']['max_new_tokens']} tokens)")
    table.add_column("metric")
    table.add_column("p50", justify="right")
    table.add_column("p90", justify="right")
    table.add_column("p99", justify="right")
    table.add_column("n", justify="right")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = m[key]
        table.add_row(key, output.fmt(s["p50"]), output.fmt(s["p90"]), output.fmt(s["p99"]), str(s["n"]))
    output.out.print(table)
    facts = [
        ("output throughput", f"{output.fmt(m['output_throughput_tok_s'])} tok/s"),
        ("roofline", f"{output.fmt(m.get('roofline_tok_s'), '.1f')} tok/s ceiling, achieved "
                     f"{output.fmt(m.get('roofline_fraction'), '.1%')}"),
        ("peak RSS / model", f"{output.fmt_bytes(m['peak_rss_bytes'])} / {output.fmt_bytes(m['model_bytes'])}"),
        ("BLEU / chrF", f"{output.fmt(m.get('bleu'))} / {output.fmt(m.get('chrf'))}"),
        ("perplexity", output.fmt(m.get("ppl"))),
    ]
    if m.get("pass_at_1") is not None:
        facts.append(("pass@1", output.fmt(m["pass_at_1"], ".1%")))
    if m.get("broken"):
        facts.append(("verdict", f"BROKEN, not a speedup: {m.get('broken_why')}"))
    elif m.get("speedup_vs_baseline") is not None:
        facts.append(("speedup vs baseline", f"{output.fmt(m['speedup_vs_baseline'])}x decode, "
                                             f"{output.fmt(m.get('ttft_speedup_vs_baseline'))}x TTFT"))
    if m.get("speedup_vs_baseline") is not None:
        facts.append(("drift", f"BLEU {output.fmt(m.get('bleu_drift'), '+.2f')}, exact match "
                               f"{output.fmt(m.get('exact_match_vs_baseline'), '.0%')}, ppl "
                               f"{output.fmt(m.get('ppl_delta_pct'), '+.2f')}%"))
    if m.get("verdict_evidence"):
        facts.append(("verdict evidence", str(m["verdict_evidence"])))
    noise = m.get("noise") or {}
    if noise.get("noisy"):
        facts.append(("noise", "SHAKY: " + "; ".join(noise.get("why") or [])))
    for name, value in facts:
        output.out.print(f"  {name:<22} {value}", soft_wrap=True)
    if run_dir is not None:
        output.out.print(f"  {'result':<22} {run_dir}/result.json", soft_wrap=True)


Recipe = Annotated[str | None, typer.Option("--recipe", "-r", help="Built-in recipe name or YAML file: baseline + every config in it. Options given on the command line override the recipe's.")]


def run_spec(opts: opt.MeasureOptions, **overrides):
    """The library's RunSpec from the parsed common options."""
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.workload import Protocol, Workload

    values = dict(model=opts.model, workload=Workload(**opts.workload_values()),
                  protocol=Protocol(**opts.protocol_values()), threads=opts.threads, device=opts.device,
                  dtype=opts.dtype, out_dir=opts.out, trust_remote_code=opts.trust_remote_code,
                  measure_ppl=opts.ppl, resume=opts.resume)
    values.update(overrides)
    return RunSpec(**values)


@opt.measuring_command()
def bench(
    opts: opt.MeasureOptions,
    recipe: Recipe = None,
    execute: opt.Execute = False,
    unsafe_execute: opt.UnsafeExecute = False,
    endpoint: ep.Endpoint = None,
    served_model: ep.ServedModel = None,
    api_key_env: ep.ApiKeyEnv = None,
    api: ep.Api = "chat",
    concurrency: ep.Concurrency = 1,
    request_timeout: ep.RequestTimeout = 300.0,
    idle_timeout: ep.IdleTimeout = 60.0,
    ignore_eos: ep.IgnoreEos = False,
    label: ep.Label = None,
    baseline: ep.Baseline = None,
    workers: ep.Workers = None,
    executor: xo.Executor = "local",
    ray_address: xo.RayAddress = None,
) -> None:
    """Measure the baseline (or every config of a --recipe against it): TTFT, ITL, TPOT, e2e, throughput,
    memory, roofline, BLEU/chrF and perplexity.

    Example: infer-tune bench --model smollm2-135m --suite chat --limit 4 --max-new-tokens 32 --json

    With --recipe, the recipe's workload and protocol apply except for options given on the command line.
    With --resume, a baseline of the same measurement already in --out is reused instead of re-measured.
    With --endpoint, the server is measured over HTTP (docs/endpoint.md); --model, when given, names the
    served weights (their tokenizer renders prompts and counts tokens):
    infer-tune bench --endpoint http://127.0.0.1:8000/v1 --model smollm2-135m --limit 4 --max-new-tokens 32
    """
    if executor != "local" and recipe is None:
        raise ConfigError("--executor applies to the configs of a --recipe (a baseline alone runs here)")
    if endpoint is not None:
        if recipe is not None:
            raise InferTuneError("--recipe configs run in this process; --endpoint measures the server as it is")
        config = ep.endpoint_config(endpoint, served_model, api_key_env, api, concurrency, request_timeout,
                                    ignore_eos, label, idle_timeout, workers)
        return ep.bench_endpoint(opts, config, baseline, execute)
    from infer_tune.scenarios.bench import run_bench, run_recipe, stages_from_recipe

    spec = run_spec(opts, execute=execute or unsafe_execute, unsafe_execute=unsafe_execute)
    if recipe is None:
        with output.progress_bar(not opts.json_out, out_dir=spec.out_dir) as progress:
            outcome = run_bench(spec, progress=progress)
        if opts.json_out:
            output.print_json(outcome.baseline)
        else:
            render_result(outcome.baseline, outcome.baseline.get("_path"))
        return
    stages = stages_from_recipe(recipe, spec, workload_given=opts.given(opts.workload_values()),
                                protocol_given=opts.given(opts.protocol_values()),
                                model_given="model" in opts.explicit)
    with xo.scope(executor, ray_address, opts.device), output.progress_bar(not opts.json_out, out_dir=spec.out_dir) as progress:
        outcomes = run_recipe(stages, progress=progress)
    docs = [doc for o in outcomes for doc in (o.baseline, *o.docs)]
    if opts.json_out:
        output.print_json(docs)
        return
    render_recipe(docs, spec.out_dir)


def render_recipe(docs: list[dict], out_dir: Path) -> None:
    """The one-screen summary a recipe ends with: its rows (narrow table, each technique's key figures),
    its claims, the recommendation and how to reproduce it, and the report's files."""
    from infer_tune.report import summary

    for line in summary.lines(docs, out_dir):
        output.out.print(line, markup=False, highlight=False, soft_wrap=True)
