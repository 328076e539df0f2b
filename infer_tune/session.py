"""One measured run, end to end: prepared model -> its runner -> metrics -> result document.

`measure_prepared` turns a runner's raw timings into a result document; `run_configs` is the one
sweep loop every scenario uses: resolve and preflight every config, measure (or reuse) the baseline
of the same workload, then prepare, measure, annotate and save each config in turn, so speedups
and drift are ratios taken side by side on one machine. See docs/architecture.md.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict
from pathlib import Path

from infer_tune import env as envinfo
from infer_tune import models, results, suites
from infer_tune.errors import ConfigError
from infer_tune.metrics import deltas, kv, noise, quality, roofline
from infer_tune.metrics.perplexity import reference_perplexity
from infer_tune.metrics.stats import summarize
from infer_tune.runners import GenerationRun, PreparedModel, get_runner
from infer_tune.runners.base import Progress
from infer_tune.tuners.base import TECHNIQUES, RunContext, TechniqueConfig, load_techniques, technique_for
from infer_tune.workload import Inputs, Protocol, Workload, prepare_inputs, workload_block

__all__ = ["Inputs", "ensure_baseline", "measure_prepared", "prepare_inputs", "run_configs", "run_fingerprint"]


def run_fingerprint(loaded: models.LoadedModel, technique: str, config: dict, workload: Workload, env: dict,
                    execute: bool | str = False, *, protocol: Protocol | None = None, measure_ppl: bool = True) -> str:
    """What makes two runs the same measurement: the model's bytes (weights, config, tokenizer) and the
    suite's, dtype, device, technique, config, workload, protocol, what is measured, threads, machine,
    and the tool's version. Paths are left out: the same bytes elsewhere are the same measurement."""
    work = workload.to_dict()
    work["suite"] = suites.content_id(workload.suite)
    return results.fingerprint(models.content_id(loaded), loaded.dtype, loaded.device, technique, config, work,
                               asdict(protocol) if protocol else None, measure_ppl, env["threads"], env["machine"],
                               execute, envinfo.tool_info()["version"])


def timing_metrics(run: GenerationRun) -> tuple[dict, dict]:
    """Distribution metrics and raw samples from the runner's per-token timestamps."""
    timed = [r for r in run.requests if r.token_ns]
    ttft = [r.ttft_ms for r in timed]
    tpot = [r.tpot_ms for r in timed if r.tpot_ms is not None]
    e2e = [r.e2e_ms for r in timed]
    itl = [gap for r in run.requests for gap in r.itl_ms]
    metrics = {"ttft_ms": summarize(ttft), "itl_ms": summarize(itl), "tpot_ms": summarize(tpot),
               "e2e_ms": summarize(e2e)}
    wall = run.measured_wall_s or float("nan")
    metrics["output_throughput_tok_s"] = run.generated_tokens / wall
    metrics["request_throughput_req_s"] = len(run.requests) / wall
    # prompt_index pairs each ttft/e2e (and tpot, when every request has 2+ tokens) sample with its prompt
    samples = {"ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": e2e, "itl_ms": itl,
               "prompt_index": [r.prompt_index for r in timed]}
    if any(r.start_ns is not None for r in timed):  # a scheduler queued requests
        queue = [r.queue_ms for r in timed]
        metrics["queue_ms"] = summarize(queue)
        samples["queue_ms"] = queue
    return metrics, samples


def kv_bytes_read(prepared: PreparedModel, mean_context: float, batch_size: int) -> float:
    """KV-cache bytes a decode step reads at `mean_context` tokens, at the cache's real width
    (the technique's `kv_bits` when it sets one, else the model's floating dtype)."""
    model = prepared.model
    if model is None or "kv_bits" in prepared.metrics and prepared.metrics["kv_bits"] is None:
        return 0.0
    try:
        shape = kv.ModelShape.from_config(model.config)
    except (ConfigError, AttributeError):
        return 0.0
    bits = prepared.metrics.get("kv_bits") or next(
        (p.element_size() * 8 for p in model.parameters() if p.is_floating_point()), 32)
    return float(kv.kv_bytes(shape, 1, bits)) * mean_context * batch_size


def measure_prepared(
    loaded: models.LoadedModel,
    prepared: PreparedModel,
    inputs: Inputs,
    workload: Workload,
    protocol: Protocol,
    *,
    technique: str,
    config: dict,
    env: dict,
    runner: str = "generation",
    baseline: dict | None = None,
    baseline_outputs: list[dict] | None = None,
    measure_ppl: bool = True,
    execute: bool | str = False,
    per_position: bool = False,
    progress: Progress | None = None,
) -> tuple[dict, list[dict]]:
    """Run the workload on `prepared` through `runner` and build its result document and outputs rows.

    `per_position=True` adds `per_position_ms` (mean latency of each decode step, in order);
    `execute=True` also runs the code suite's tests on the outputs (pass@1) in the OS sandbox
    (metrics/sandbox.py); `execute="unsafe"` runs them without it (only where the user allowed that).
    """
    before = noise.HostSnapshot.take()
    run = get_runner(runner)(prepared, inputs, workload, protocol, progress)
    after = noise.HostSnapshot.take()
    metrics, samples = timing_metrics(run)
    metrics["noise"] = noise.figure(run.requests, before, after)
    if per_position:
        metrics["per_position_ms"] = run.per_position_ms()
    weight_bytes = (models.model_bytes(prepared.model) if prepared.model is not None else 0) \
        + prepared.extra_model_bytes
    mean_context = (sum(o.prompt_tokens for o in run.outputs) / max(len(run.outputs), 1)
                    + workload.max_new_tokens / 2)
    kv_read = kv_bytes_read(prepared, mean_context, run.batch_size)
    metrics.update(roofline.roofline(env["mem_bandwidth_gb_s"], weight_bytes, kv_read, max(run.batch_size, 1),
                                     metrics["tpot_ms"]["p50"]))
    metrics.update({
        "peak_rss_bytes": run.peak_rss_bytes,
        "rss_before_bytes": run.rss_before_bytes,
        "peak_rss_delta_bytes": run.peak_rss_bytes - run.rss_before_bytes,
        "cuda_peak_bytes": run.cuda_peak_bytes,
        "model_bytes": weight_bytes,
        "first_call_ms": run.first_call_ms,
        "warmup_s": run.warmup_s,
        "iterations": run.iterations,
        "generated_tokens": run.generated_tokens,
    })
    if prepared.extra_model_bytes:
        metrics["extra_model_bytes"] = prepared.extra_model_bytes
    texts = [o.text for o in run.outputs]
    references = [inputs.prompts[o.prompt_index].reference for o in run.outputs]
    metrics.update(quality.reference_scores(texts, references))
    metrics["ppl"] = (reference_perplexity(prepared.model, prepared.tokenizer, inputs.rendered,
                                           [p.reference for p in inputs.prompts], device=prepared.device)
                      if measure_ppl and prepared.model is not None else None)
    if execute:
        from infer_tune.metrics.passk import pass_at_1

        isolation = "unsafe" if execute == "unsafe" else "sandbox"
        metrics["pass_at_1"] = pass_at_1([inputs.prompts[o.prompt_index] for o in run.outputs], texts,
                                         isolation=isolation)
        metrics["pass_at_1_isolation"] = isolation
    metrics.update(prepared.metrics)
    metrics.update(run.counters)
    if run.ranks:
        metrics["ranks"] = run.ranks
    outputs = [{"prompt_id": inputs.prompts[o.prompt_index].id, "prompt": inputs.prompts[o.prompt_index].text,
                "output": o.text, "token_ids": o.token_ids, "prompt_tokens": o.prompt_tokens,
                "hit_eos": o.hit_eos, "reference": inputs.prompts[o.prompt_index].reference}
               for o in run.outputs]
    if baseline is not None and baseline_outputs is not None:
        metrics.update(deltas.versus_baseline(metrics, outputs, baseline, baseline_outputs))
    result = {
        "schema_version": results.SCHEMA_VERSION,
        "run_id": results.new_run_id(technique, prepared.label),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tool": envinfo.tool_info(),
        "env": env,
        # params: the logical parameter count of the source model (a quantized copy stores fewer
        # nn.Parameters); model_bytes: what the prepared model really stores (+ a draft's weights)
        "model": {"ref": loaded.ref, "path": loaded.path,
                  "params": models.count_params(loaded.model) if loaded.model is not None else None,
                  "model_bytes": weight_bytes, "dtype": loaded.dtype,
                  "content_id": models.content_id(loaded) if loaded.model is not None else None},
        "technique": technique,
        "label": prepared.label,
        "config": config,
        "runner": runner,
        "workload": {**workload_block(workload, inputs), "suite_id": suites.content_id(workload.suite)},
        "protocol": asdict(protocol),
        "metrics": metrics,
        "samples": samples,
        "baseline_run_id": baseline["run_id"] if baseline else None,
        "fingerprint": run_fingerprint(loaded, technique, config, workload, env, execute, protocol=protocol,
                                       measure_ppl=measure_ppl),
    }
    return result, outputs


def find_result(out_dir: Path, fingerprint: str, technique: str | None = None) -> dict | None:
    """The newest finished result with this fingerprint in `out_dir` (baseline reuse and --resume)."""
    if not Path(out_dir).exists():
        return None
    for doc in reversed(results.find_results(out_dir)):
        if doc.get("fingerprint") == fingerprint and (technique is None or doc.get("technique") == technique):
            return doc
    return None


def ensure_baseline(
    loaded: models.LoadedModel,
    inputs: Inputs,
    workload: Workload,
    protocol: Protocol,
    ctx: RunContext,
    *,
    reuse: bool = True,
    measure_ppl: bool = True,
    execute: bool = False,
) -> tuple[dict, list[dict], bool]:
    """Reuse a baseline of the same fingerprint from `ctx.out_dir`, or measure and save one.

    Returns (doc, outputs, reused).
    """
    fp = run_fingerprint(loaded, "baseline", {}, workload, ctx.env, execute, protocol=protocol,
                         measure_ppl=measure_ppl)
    if reuse and (found := find_result(ctx.out_dir, fp, "baseline")) is not None:
        return found, results.load_outputs(found["_path"]), True
    prepared = PreparedModel(model=loaded.model, tokenizer=loaded.tokenizer, label="baseline", device=ctx.device)
    doc, outputs = measure_prepared(loaded, prepared, inputs, workload, protocol, technique="baseline", config={},
                                    env=ctx.env, measure_ppl=measure_ppl, execute=execute, progress=ctx.progress)
    saved = results.save_run(ctx.out_dir, doc, outputs)
    doc["_path"] = str(saved.run_dir)
    return doc, outputs, False


def resolve_configs(configs: list[TechniqueConfig], ctx: RunContext) -> list[TechniqueConfig]:
    """Each config with its host-dependent choices settled (what the result will record)."""
    out = []
    for config in configs:
        entry = technique_for(config)
        out.append(entry.resolve(config, ctx) if entry.resolve else config)
    return out


def preflight(loaded: models.LoadedModel, workload: Workload, configs: list[TechniqueConfig], ctx: RunContext) -> None:
    """Every check that can fail before a measurement: constraints, then each technique's own checks."""
    for config in configs:
        entry = technique_for(config)
        entry.check_workload(workload, config)
        if entry.preflight:
            entry.preflight(loaded, config, ctx)


def run_configs(
    loaded: models.LoadedModel,
    inputs: Inputs,
    workload: Workload,
    protocol: Protocol,
    configs: list[TechniqueConfig],
    ctx: RunContext,
    *,
    resume: bool = False,
    reuse_baseline: bool = True,
    measure_ppl: bool = True,
    execute: bool = False,
) -> tuple[dict, list[dict]]:
    """Baseline (measured or reused), then every config prepared, measured by its runner and saved.

    Each finished config is saved at once (atomically), so an interrupted sweep keeps its rows and
    `resume=True` skips them. A technique's `annotate` hook sees the results measured before it.
    Returns (baseline document, candidate documents in config order).
    """
    configs = resolve_configs(configs, ctx)
    preflight(loaded, workload, configs, ctx)
    waiting = (lambda: ctx.progress(f"waiting for another infer-tune run in {ctx.out_dir}", 0, None)) \
        if ctx.progress else None
    with results.runs_lock(ctx.out_dir, on_wait=waiting):  # concurrent sweeps queue; none measures twice
        return _sweep(loaded, inputs, workload, protocol, configs, ctx, resume=resume,
                      reuse_baseline=reuse_baseline, measure_ppl=measure_ppl, execute=execute)


def _sweep(loaded: models.LoadedModel, inputs: Inputs, workload: Workload, protocol: Protocol,
           configs: list[TechniqueConfig], ctx: RunContext, *, resume: bool, reuse_baseline: bool,
           measure_ppl: bool, execute: bool | str) -> tuple[dict, list[dict]]:
    baseline, baseline_outputs, _ = ensure_baseline(loaded, inputs, workload, protocol, ctx, reuse=reuse_baseline,
                                                    measure_ppl=measure_ppl, execute=execute)
    docs: list[dict] = []
    if ctx.progress:
        ctx.progress("configs", 1, len(configs) + 1)  # the baseline is done
    for config in configs:
        entry = technique_for(config)
        config_dict = config.to_dict()
        ppl = measure_ppl and entry.measure_ppl
        fp = run_fingerprint(loaded, entry.name, config_dict, workload, ctx.env, execute, protocol=protocol,
                             measure_ppl=ppl)
        if resume and (done := find_result(ctx.out_dir, fp)) is not None:
            docs.append(done)
            if ctx.progress:
                ctx.progress("configs", len(docs) + 1, len(configs) + 1)
            continue
        prepared = entry.prepare(loaded, config, ctx)
        prepared.device = ctx.device
        try:
            doc, outputs = measure_prepared(loaded, prepared, inputs, workload, protocol, technique=entry.name,
                                            config=config_dict, env=ctx.env, runner=prepared.runner or entry.runner,
                                            baseline=baseline,
                                            baseline_outputs=baseline_outputs, measure_ppl=ppl, execute=execute,
                                            progress=ctx.progress)
        finally:
            if prepared.cleanup:
                prepared.cleanup()
            del prepared
            gc.collect()
        if entry.annotate:
            entry.annotate(doc, docs)
        saved = results.save_run(ctx.out_dir, doc, outputs)
        doc["_path"] = str(saved.run_dir)
        docs.append(doc)
        if ctx.progress:
            ctx.progress("configs", len(docs) + 1, len(configs) + 1)
    summarize_sweep(docs)
    return baseline, docs


def summarize_sweep(docs: list[dict]) -> None:
    """Each technique's sweep-level claim (`summarize`) and figures (`plots`), stored in its results."""
    load_techniques()
    by_technique: dict[str, list[dict]] = {}
    for doc in docs:
        by_technique.setdefault(doc["technique"], []).append(doc)
    for entry in TECHNIQUES.values():
        group = by_technique.get(entry.name)
        if not group:
            continue
        if entry.summarize:
            store_claim(group, entry.summarize(group))
        files = entry.plots(group) if entry.plots else {}
        for doc in group:
            if files and doc.get("_path"):
                results.add_files(doc, files)


def store_claim(docs: list[dict], claim: dict | None) -> None:
    """`claim` as `metrics.claim_check` of every doc in `docs`, rewritten where it changed."""
    if claim is None:
        return
    for doc in docs:
        if doc["metrics"].get("claim_check") != claim:
            doc["metrics"]["claim_check"] = claim
            if doc.get("_path"):
                results.update_result(doc)
