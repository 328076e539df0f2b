"""The sweep engine: the one code path that measures configs and writes their results.

`run_configs` resolves and preflights every config, takes the runs directory's lock, skips what
`resume` finds done, prepares the candidates, and measures them together with the baseline in
interleaved rounds (infer_tune.rounds) when their runner times closed-loop passes: a group of
candidates as large as memory allows, each round one pass of each in shuffled order, until every
ratio's 95% interval is within the protocol's target. Candidates whose runner does not run in passes
(an arrival trace, a server, several processes) are measured alone against the group's baseline.
Each result then gets the technique's `finalize` facts and files, `annotate`, an atomic save, and
the sweep's `summarize` claim and `plots`. `build_document` turns a runner's raw timings into a
result document. See docs/architecture.md, "The sweep engine".
"""

from __future__ import annotations

import gc
from dataclasses import asdict
from pathlib import Path

from infer_tune import env as envinfo
from infer_tune import models, results, rounds, suites
from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError
from infer_tune.metrics import deltas, kv, noise, quality, roofline
from infer_tune.metrics.perplexity import reference_perplexity
from infer_tune.metrics.stats import summarize
from infer_tune.runners import GenerationRun, PreparedModel, get_runner
from infer_tune.runners.base import PASS_RUNNERS, WHOLE_RUNNERS, Progress
from infer_tune.tuners.base import TECHNIQUES, RunContext, TechniqueConfig, load_techniques, technique_for
from infer_tune.workload import Inputs, Protocol, Workload, prepare_inputs, workload_block

__all__ = ["Inputs", "build_document", "ensure_baseline", "measure_prepared", "prepare_inputs", "run_configs",
           "run_fingerprint"]


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
               "prompt_index": [r.prompt_index for r in timed], "output_tokens": [len(r.token_ns) for r in timed]}
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
    """Run the workload on `prepared` through `runner` (alone, per the protocol) and build its result
    document and outputs rows (`build_document`)."""
    before = noise.HostSnapshot.take()
    run = get_runner(runner)(prepared, inputs, workload, protocol, progress)
    after = noise.HostSnapshot.take()
    return build_document(loaded, prepared, run, inputs, workload, protocol, technique=technique, config=config,
                          env=env, runner=runner, baseline=baseline, baseline_outputs=baseline_outputs,
                          measure_ppl=measure_ppl, execute=execute, per_position=per_position,
                          host=(before, after))


def build_document(
    loaded: models.LoadedModel,
    prepared: PreparedModel,
    run: GenerationRun,
    inputs: Inputs,
    workload: Workload,
    protocol: Protocol,
    *,
    technique: str,
    config: dict,
    env: dict,
    runner: str,
    host: tuple[noise.HostSnapshot, noise.HostSnapshot],
    baseline: dict | None = None,
    baseline_outputs: list[dict] | None = None,
    measure_ppl: bool = True,
    execute: bool | str = False,
    per_position: bool = False,
    rounds_block: dict | None = None,
    ratios: dict[str, dict | None] | None = None,
) -> tuple[dict, list[dict]]:
    """The result document and outputs rows of one measured run.

    `per_position=True` adds `per_position_ms` (mean latency of each decode step, in order);
    `execute=True` also runs the code suite's tests on the outputs (pass@1) in the OS sandbox
    (metrics/sandbox.py); `execute="unsafe"` runs them without it (only where the user allowed that).
    A run measured in rounds passes its `metrics.rounds` block and its per-round ratio intervals
    (`ratios`: name -> log_ratio_interval), which replace the pooled point ratios.
    """
    metrics, samples = timing_metrics(run)
    if rounds_block is not None:
        metrics["rounds"] = rounds_block
    metrics["noise"] = noise.figure(run.requests, *host, rounds=rounds_block)
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
        for name, interval in (ratios or {}).items():
            if interval is not None:  # the rounds' geometric mean: the figure its interval is about
                metrics[name] = interval["point"]
                metrics[f"{name}_ci95"] = interval["ci95"]
    result = ResultDocument(
        run_id=results.new_run_id(technique, prepared.label),
        created_at=results.created_stamp(),
        tool=envinfo.tool_info(),
        env=env,
        # params: the logical parameter count of the source model (a quantized copy stores fewer
        # nn.Parameters); model_bytes: what the prepared model really stores (+ a draft's weights)
        model={"ref": loaded.ref, "path": loaded.path,
               "params": models.count_params(loaded.model) if loaded.model is not None else None,
               "model_bytes": weight_bytes, "dtype": loaded.dtype,
               "content_id": models.content_id(loaded) if loaded.model is not None else None},
        technique=technique,
        label=prepared.label,
        config=config,
        runner=runner,
        workload={**workload_block(workload, inputs), "suite_id": suites.content_id(workload.suite)},
        protocol=asdict(protocol),
        metrics=metrics,
        samples=samples,
        baseline_run_id=baseline["run_id"] if baseline else None,
        fingerprint=run_fingerprint(loaded, technique, config, workload, env, execute, protocol=protocol,
                                    measure_ppl=measure_ppl),
    )
    return result.to_dict(), outputs


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
    """Every config prepared, measured beside the baseline (interleaved rounds where its runner runs in
    passes, else alone against the baseline) and saved (module docstring; docs/architecture.md).

    Results are saved atomically as each group finishes, so an interrupted sweep keeps its rows and
    `resume=True` skips them. A technique's `annotate` hook sees the results finished before it.
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
    sweep = _Sweep(loaded, inputs, workload, protocol, ctx, measure_ppl=measure_ppl, execute=execute)
    docs: list[dict | None] = [None] * len(configs)
    pending = []
    for i, config in enumerate(configs):
        done = find_result(ctx.out_dir, sweep.fingerprint(config)) if resume else None
        if done is not None:
            docs[i] = done
        else:
            pending.append(i)
    sweep.progress_configs(len(configs) - len(pending), len(configs))
    group: list[tuple[int, PreparedModel]] = []
    try:
        for i in pending:
            config = configs[i]
            entry = technique_for(config)
            prepared = entry.prepare(loaded, config, ctx)
            prepared.device = ctx.device
            if (prepared.runner or entry.runner) in PASS_RUNNERS:
                group.append((i, prepared))
                if not fits_another(loaded, group):  # hold no more variants than memory allows
                    sweep.measure_group(group, configs, docs)
                    group = []
            else:
                sweep.measure_group(group, configs, docs)
                group = []
                sweep.measure_alone(i, config, prepared, docs, reuse_baseline=reuse_baseline)
        sweep.measure_group(group, configs, docs)
        group = []
    finally:
        for _, prepared in group:
            if prepared.cleanup:
                prepared.cleanup()
    measured = [d for d in docs if d is not None]
    if sweep.baseline is None:  # every config was found done (resume), or there were none: reuse or measure one
        sweep.baseline, _, _ = ensure_baseline(loaded, inputs, workload, protocol, ctx, reuse=True,
                                               measure_ppl=measure_ppl, execute=execute)
    summarize_sweep(measured)
    return sweep.baseline, measured


def fits_another(loaded: models.LoadedModel, group: list) -> bool:
    """Whether one more prepared variant fits beside those held (estimated as the largest held one, or
    the source model's bytes, with 1 GiB to spare)."""
    import psutil

    held = [models.model_bytes(p.model) + p.extra_model_bytes for _, p in group if p.model is not None]
    need = max(held + [models.model_bytes(loaded.model) if loaded.model is not None else 0]) + (1 << 30)
    return psutil.virtual_memory().available > need


class _Sweep:
    """The state one sweep shares between its groups: the workload, the baseline measured last."""

    def __init__(self, loaded, inputs, workload, protocol, ctx, *, measure_ppl, execute) -> None:
        self.loaded, self.inputs, self.workload, self.protocol, self.ctx = loaded, inputs, workload, protocol, ctx
        self.measure_ppl, self.execute = measure_ppl, execute
        self.baseline: dict | None = None
        self.baseline_outputs: list[dict] | None = None
        self.finished = 0
        self.total = 0

    def fingerprint(self, config: TechniqueConfig) -> str:
        entry = technique_for(config)
        return run_fingerprint(self.loaded, entry.name, config.to_dict(), self.workload, self.ctx.env, self.execute,
                               protocol=self.protocol, measure_ppl=self.measure_ppl and entry.measure_ppl)

    def progress_configs(self, done: int, total: int) -> None:
        self.total = total
        self.finished = done
        if self.ctx.progress:
            self.ctx.progress("configs", done, total)

    def baseline_prepared(self) -> PreparedModel:
        return PreparedModel(model=self.loaded.model, tokenizer=self.loaded.tokenizer, label="baseline",
                             device=self.ctx.device)

    def measure_group(self, group: list[tuple[int, PreparedModel]], configs: list[TechniqueConfig],
                      docs: list[dict | None]) -> None:
        """The baseline and `group` in interleaved rounds; then every result built, finalized and saved."""
        if not group:
            return
        base = rounds.Variant("baseline", self.baseline_prepared(), "generation")
        runners = [p.runner or technique_for(configs[i]).runner for i, p in group]
        variants = [base] + [rounds.Variant(f"{i}:{p.label}", p, runner, whole=runner in WHOLE_RUNNERS)
                             for (i, p), runner in zip(group, runners)]
        before = noise.HostSnapshot.take()
        try:
            outcome = rounds.run_rounds(variants, self.inputs, self.workload, self.protocol, seed=self.workload.seed,
                                        progress=self.ctx.progress)
            host = (before, noise.HostSnapshot.take())
            self.baseline, self.baseline_outputs = self._save_baseline(base, outcome, host)
            for (i, prepared), variant in zip(group, variants[1:]):
                docs[i] = self._finish(configs[i], prepared, rounds.merged_run(variant), host,
                                       rounds_block=outcome.block(variant.name),
                                       ratios=outcome.intervals.get(variant.name), earlier=docs)
        finally:
            for _, prepared in group:
                if prepared.cleanup:
                    prepared.cleanup()
            group.clear()
            gc.collect()

    def _save_baseline(self, base: rounds.Variant, outcome: rounds.RoundsOutcome, host) -> tuple[dict, list[dict]]:
        doc, outputs = build_document(self.loaded, base.prepared, rounds.merged_run(base), self.inputs, self.workload,
                                      self.protocol, technique="baseline", config={}, env=self.ctx.env,
                                      runner="generation", host=host, measure_ppl=self.measure_ppl,
                                      execute=self.execute, rounds_block=outcome.block("baseline"))
        # one baseline row per measurement (fingerprint) in a runs directory: a later sweep's rounds refresh it
        existing = find_result(self.ctx.out_dir, doc["fingerprint"], "baseline")
        if existing is not None:
            doc["run_id"], doc["_path"] = existing["run_id"], existing["_path"]
            results.update_result(doc)
        else:
            doc["_path"] = str(results.save_run(self.ctx.out_dir, doc, outputs).run_dir)
        return doc, outputs

    def measure_alone(self, i: int, config: TechniqueConfig, prepared: PreparedModel, docs: list[dict | None], *,
                      reuse_baseline: bool) -> None:
        """A candidate whose runner does not run in passes: measured once per the protocol, against the
        baseline measured last (or one reused / measured now)."""
        try:
            if self.baseline is None:
                self.baseline, self.baseline_outputs, _ = ensure_baseline(
                    self.loaded, self.inputs, self.workload, self.protocol, self.ctx, reuse=reuse_baseline,
                    measure_ppl=self.measure_ppl, execute=self.execute)
            entry = technique_for(config)
            before = noise.HostSnapshot.take()
            run = get_runner(prepared.runner or entry.runner)(prepared, self.inputs, self.workload, self.protocol,
                                                             self.ctx.progress)
            docs[i] = self._finish(config, prepared, run, (before, noise.HostSnapshot.take()), earlier=docs)
        finally:
            if prepared.cleanup:
                prepared.cleanup()
            gc.collect()

    def _finish(self, config: TechniqueConfig, prepared: PreparedModel, run: GenerationRun, host, *,
                earlier: list[dict | None], rounds_block: dict | None = None,
                ratios: dict | None = None) -> dict:
        """Build, finalize (technique facts and files), annotate and save one candidate's result."""
        entry = technique_for(config)
        doc, outputs = build_document(
            self.loaded, prepared, run, self.inputs, self.workload, self.protocol, technique=entry.name,
            config=config.to_dict(), env=self.ctx.env, runner=prepared.runner or entry.runner, host=host,
            baseline=self.baseline, baseline_outputs=self.baseline_outputs,
            measure_ppl=self.measure_ppl and entry.measure_ppl, execute=self.execute,
            per_position=any(technique_for(p).per_position for p in config.parts()), rounds_block=rounds_block,
            ratios=ratios)
        objectives = [technique_for(p).objective for p in config.parts()]
        doc["objective"] = next((o for o in objectives if o != "decode"), "decode")  # what it is ranked on
        files = entry.finalize(config, doc, outputs, prepared, self.inputs, self.ctx) if entry.finalize else None
        if entry.annotate:
            entry.annotate(doc, [d for d in earlier if d is not None])
        saved = results.save_run(self.ctx.out_dir, doc, outputs, extra_files=files or None)
        doc["_path"] = str(saved.run_dir)
        self.finished += 1
        if self.ctx.progress:
            self.ctx.progress("configs", self.finished, self.total)
        return doc


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
