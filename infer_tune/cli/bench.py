"""`infer-tune bench`: measure the baseline of a model on a suite and write a result."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from infer_tune.cli import endpoint as ep
from infer_tune.cli import executor_opts as xo
from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.cli.measure import render_result, run_spec
from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError, InferTuneError

Engine = Annotated[str | None, typer.Option("--engine", help="Run this engine from its own --set settings against its default: a server launched on loopback (llama.cpp, vllm, sglang) measured like --endpoint (docs/endpoint.md, 'Launching an engine'), or openvino in-process (docs/engines.md).")]
Sets = Annotated[list[str] | None, typer.Option("--set", help="An engine setting KEY=VALUE (repeatable), e.g. gguf=q4_0, cache_type_k=q8_0, parallel=4; openvino: weight_format=int4, kv_cache_precision=f16.")]
Recipe = Annotated[str | None, typer.Option("--recipe", "-r", help="Built-in recipe name or YAML file: baseline + every config in it. Options given on the command line override the recipe's.")]


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
    engine: Engine = None,
    sets: Sets = None,
    workload: ep.WorkloadKind = "poisson",
    sessions: ep.Sessions = 8,
    max_turns: ep.MaxTurns = 4,
    min_turns: ep.MinTurns = 1,
    think_time_ms: ep.ThinkTime = 1000.0,
    history: ep.History = "server",
    prefixes: ep.Prefixes = 4,
    prefix_tokens: ep.PrefixTokens = 256,
    trace: ep.TraceFile = None,
    trace_format: ep.TraceFormat = None,
    time_scale: ep.TimeScale = 1.0,
    block_size: ep.BlockSize = 512,
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
    if engine is not None or sets or (recipe is not None and endpoint is None and _engine_recipe(recipe) is not None):
        return bench_engine(opts, engine, sets or [], recipe)
    if executor != "local" and recipe is None:
        raise ConfigError("--executor applies to the configs of a --recipe (a baseline alone runs here)")
    if endpoint is not None:
        if recipe is not None:
            raise InferTuneError("--recipe configs run in this process; --endpoint measures the server as it is")
        config = ep.endpoint_config(endpoint, served_model, api_key_env, api, concurrency, request_timeout,
                                    ignore_eos, label, idle_timeout, workers)
        spec = ep.workload_options(workload, sessions, max_turns, think_time_ms, history, prefixes, prefix_tokens,
                                   trace, trace_format, time_scale, block_size, min_turns)
        return ep.bench_endpoint(opts, config, baseline, execute, spec)
    if workload != "poisson" or trace is not None:
        raise ConfigError("--workload and --trace apply to --endpoint (a server)")
    from infer_tune.scenarios.bench import run_bench, run_recipe, stages_from_recipe

    spec = run_spec(opts, execute=execute or unsafe_execute, unsafe_execute=unsafe_execute)
    if recipe is None:
        with output.progress_bar(not opts.json_out, out_dir=spec.out_dir) as progress:
            outcome = run_bench(spec, progress=progress)
        if opts.json_out:
            output.print_json(outcome.baseline)
        else:
            render_result(outcome.baseline, outcome.baseline.location)
        return
    stages = stages_from_recipe(recipe, spec, workload_given=opts.given(opts.workload_values()),
                                protocol_given=opts.given(opts.protocol_values()),
                                model_given="model" in opts.explicit)
    with xo.scope(executor, ray_address, opts.device), output.progress_bar(not opts.json_out, out_dir=spec.out_dir) as progress:
        outcomes = run_recipe(stages, progress=progress)
    # a stage compared with a reference measured first (the baseline skipped) has that row as its baseline
    docs = [doc for o in outcomes for doc in ([o.baseline] if o.baseline is not None and o.baseline["run_id"] not in
                                               {d["run_id"] for d in o.docs} else []) + list(o.docs)]
    if opts.json_out:
        output.print_json(docs)
        return
    render_recipe(docs, spec.out_dir)


def _engine_recipe(recipe: str, sets: list[str] | tuple[str, ...] = ()) -> tuple[str, dict] | None:
    """(engine, settings) of a recipe whose engine runs from its own settings (recipe.engine_settings), else None."""
    from infer_tune import recipe as recipes

    return recipes.engine_settings(recipes.load_recipe(recipe), sets)


def bench_engine(opts: opt.MeasureOptions, engine: str | None, sets: list[str], recipe: str | None) -> None:
    """`bench --engine E --set K=V ...` (or `--recipe` a recommended.yaml of `tune --engine`): the engine run
    from those settings, measured by its scenario (engines/base.py `Engine.scenario`: a launch by the endpoint
    runner, OpenVINO in-process) after the engine's default it is compared with."""
    import importlib

    from infer_tune.cli.measure import run_spec
    from infer_tune.engines.base import ENGINES, resolve

    model = opts.model
    if recipe is not None:
        found = _engine_recipe(recipe, sets)
        if found is None:
            raise ConfigError(f"--engine / --set take a recipe that names an engine run from its settings "
                              f"(engine: {', '.join(e.name for e in ENGINES.values() if e.takes_settings)}), "
                              f"got {recipe}")
        if engine is not None and resolve(engine, where="--engine") != found[0]:
            raise ConfigError(f"--engine {engine} and recipe {recipe}'s engine {found[0]} differ")
        from infer_tune import recipe as recipes

        name, settings = found
        model = str(recipes.load_recipe(recipe).model)
    else:
        if engine is None:
            raise ConfigError("--set applies to --engine")
        name = resolve(engine, where="--engine")
        if not ENGINES[name].takes_settings:
            raise ConfigError(f"--engine must be one of {', '.join(e.name for e in ENGINES.values() if e.takes_settings)}"
                              f" (an engine run from its settings), got {engine!r}")
        settings = ENGINES[name].parse_settings(sets)
    scenario = importlib.import_module(ENGINES[name].scenario)
    spec = run_spec(opts)
    if model != spec.model:
        import dataclasses

        spec = dataclasses.replace(spec, model=model)
    with output.progress_bar(not opts.json_out, out_dir=spec.out_dir) as progress:
        docs = scenario.bench(spec, name, settings, progress=progress)
    if opts.json_out:
        output.print_json(docs)
        return
    for doc in docs:
        if doc.get("engine_status") == "crashed":  # engines/crash.py: nothing measured, how to run it again
            crash = doc["crash"]
            output.out.print(f"{doc.label}: {crash['summary']} (row {doc.location})", soft_wrap=True, markup=False)
            for line in crash["log_tail"][-5:]:
                output.out.print(f"  | {line}", soft_wrap=True, markup=False, highlight=False)
            output.out.print(f"reproduce: {crash['reproducer']['line']}", soft_wrap=True, markup=False)
            continue
        render_result(doc, doc.location)  # where it was saved: never a key of the document
        m = doc.metrics
        argv = (doc.config.get("launch") or {}).get("argv")
        if argv:
            output.out.print(f"launch: {' '.join(argv)}", soft_wrap=True, markup=False)
        if m.get("ppl") is not None:
            output.out.print(f"perplexity ({m.get('ppl_source') or 'llama-perplexity, suite text'}): {m['ppl']:.3f}"
                             + (f", {m['ppl_delta_pct']:+.2f}% vs the default" if m.get("ppl_delta_pct") is not None else ""),
                             markup=False)


def render_recipe(docs: list[ResultDocument], out_dir: Path) -> None:
    """The one-screen summary a recipe ends with: its rows (narrow table, each technique's key figures),
    its claims, the recommendation and how to reproduce it, and the report's files."""
    from infer_tune.report import summary

    for line in summary.lines(docs, out_dir):
        output.out.print(line, markup=False, highlight=False, soft_wrap=True)
