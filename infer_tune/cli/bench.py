"""`infer-tune bench`: measure the baseline of a model on a suite and write a result."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.cli.common import handle_errors, resolve_device, setup_threads


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
    if m.get("speedup_vs_baseline") is not None:
        facts.append(("speedup vs baseline", f"{output.fmt(m['speedup_vs_baseline'])}x decode, "
                                             f"{output.fmt(m.get('ttft_speedup_vs_baseline'))}x TTFT"))
        facts.append(("drift", f"BLEU {output.fmt(m.get('bleu_drift'), '+.2f')}, exact match "
                               f"{output.fmt(m.get('exact_match_vs_baseline'), '.0%')}, ppl "
                               f"{output.fmt(m.get('ppl_delta_pct'), '+.2f')}%"))
    for name, value in facts:
        output.out.print(f"  {name:<22} {value}", soft_wrap=True)
    if run_dir is not None:
        output.out.print(f"  {'result':<22} {run_dir}/result.json", soft_wrap=True)


def _field_defaults(cls: type) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


@handle_errors
def bench(
    recipe: Annotated[str | None, typer.Option("--recipe", "-r", help="Built-in recipe name or YAML file: baseline + every config in it.")] = None,
    resume: opt.Resume = False,
    model: opt.Model = "smollm2-135m",
    suite: opt.Suite = "chat",
    limit: opt.Limit = 8,
    max_new_tokens: opt.MaxNewTokens = 64,
    batch_size: opt.BatchSize = 1,
    threads: opt.Threads = None,
    seed: opt.Seed = 0,
    warmup: opt.Warmup = 1,
    min_iterations: opt.MinIterations = 2,
    min_duration: opt.MinDuration = 5.0,
    out: opt.Out = Path("runs"),
    lang: opt.Lang = "en",
    prompt_field: opt.PromptField = "prompt",
    reference_field: opt.ReferenceField = None,
    chat_template: opt.ChatTemplate = True,
    max_prompt_tokens: opt.MaxPromptTokens = 512,
    dtype: opt.Dtype = "auto",
    device: opt.Device = "cpu",
    trust_remote_code: opt.TrustRemoteCode = False,
    ppl: opt.Ppl = True,
    execute: opt.Execute = False,
    json_out: opt.Json = False,
    debug: opt.Debug = False,
) -> None:
    """Measure the baseline (or every config of a --recipe against it): TTFT, ITL, TPOT, e2e, throughput,
    memory, roofline, BLEU/chrF and perplexity.

    Example: infer-tune bench --model smollm2-135m --suite chat --limit 4 --max-new-tokens 32 --json

    With --recipe, command-line workload options that differ from their defaults override the recipe's.
    """
    from infer_tune import env as envinfo
    from infer_tune import models, results
    from infer_tune.errors import ConfigError
    from infer_tune.runners import Protocol
    from infer_tune.runners.prepared import PreparedModel
    from infer_tune.session import measure_prepared, prepare_inputs
    from infer_tune.workload import Workload, load_prompts

    cli_workload = dict(suite=suite, limit=limit, seed=seed, max_new_tokens=max_new_tokens, batch_size=batch_size,
                        chat_template=chat_template, max_prompt_tokens=max_prompt_tokens, lang=lang,
                        prompt_field=prompt_field, reference_field=reference_field)
    cli_protocol = dict(warmup=warmup, min_iterations=min_iterations, min_duration_s=min_duration)
    configs = []
    if recipe is not None:
        from infer_tune import recipe as recipes

        workload_defaults, protocol_defaults = _field_defaults(Workload), _field_defaults(Protocol)
        loaded_recipe = recipes.load_recipe(recipe)
        workload = recipes.build_workload(loaded_recipe, {k: v for k, v in cli_workload.items() if v != workload_defaults[k]})
        protocol = recipes.build_protocol(loaded_recipe,
                                          {k: v for k, v in cli_protocol.items() if v != protocol_defaults[k]})
        configs = recipes.build_configs(loaded_recipe)
        if loaded_recipe.model and model == "smollm2-135m":
            model = loaded_recipe.model
    else:
        workload = Workload(**cli_workload)
        protocol = Protocol(**cli_protocol)
    n_threads = setup_threads(threads)
    device = resolve_device(device)
    prompts = load_prompts(workload)
    if execute and not any(p.extra.get("test") for p in prompts):
        raise ConfigError(f"--execute needs a suite with tests (e.g. --suite code); '{workload.suite}' has none")
    loaded = models.load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    inputs = prepare_inputs(loaded, workload, prompts)
    env = envinfo.collect_env(n_threads)
    if configs:
        from infer_tune.session import run_configs

        with output.progress_bar(not json_out) as progress:
            baseline, docs = run_configs(loaded, inputs, workload, protocol, configs, env=env, out_dir=out,
                                         device=device, resume=resume, measure_ppl=ppl, execute=execute,
                                         progress=progress)
        if json_out:
            output.print_json([baseline, *docs])
        else:
            for doc in (baseline, *docs):
                render_result(doc, doc.get("_path"))
        return
    prepared = PreparedModel(model=loaded.model, tokenizer=loaded.tokenizer, label="baseline", device=device)
    with output.progress_bar(not json_out) as progress:
        doc, outs = measure_prepared(loaded, prepared, inputs, workload, protocol, technique="baseline",
                                     config={}, env=env, measure_ppl=ppl, execute=execute, progress=progress)
    saved = results.save_run(out, doc, outs)
    if json_out:
        output.print_json(doc)
    else:
        render_result(doc, saved.run_dir)
