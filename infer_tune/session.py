"""The sweep engine: the one code path that measures configs and writes their results.

`run_configs` resolves and preflights every config, takes the runs directory's lock, skips what
`resume` finds done, prepares the candidates, and measures them together with the baseline in
interleaved rounds (infer_tune.rounds) when their runner times closed-loop passes: a group of
candidates as large as memory allows, each round one pass of each in shuffled order, until every
ratio's 95% interval is within the protocol's target. Candidates whose runner does not run in passes
(an arrival trace, a server, several processes) are measured alone against the group's baseline.
A config that runs its own workload (the registry's `workload` hook) is measured alone too. Each
result then gets the technique's `finalize` facts and files, `annotate`, an atomic save, and the
sweep's `complete` keys, `summarize` claim and `plots`, then the command's `SweepPlan.conclude`.
`save_rows` is the one writer for rows run_configs cannot measure (a live endpoint's, expert-placement
predictions). `build_document` turns a runner's raw timings into a result document. See
docs/architecture.md, "The sweep engine".
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infer_tune import env as envinfo
from infer_tune import models, results, rounds, suites
from infer_tune.document import ResultDocument, merge_facts
from infer_tune.errors import ConfigError
from infer_tune.metrics import deltas, kv, noise, quality, roofline
from infer_tune.metrics.memory import is_out_of_memory, long_lived_heap
from infer_tune.metrics.perplexity import reference_perplexity
from infer_tune.metrics.stats import summarize
from infer_tune.runners import GenerationRun, PreparedModel, get_runner
from infer_tune.runners.base import PASS_RUNNERS, WHOLE_RUNNERS, Progress
from infer_tune.tuners.base import TECHNIQUES, RunContext, TechniqueConfig, load_techniques, technique_for
from infer_tune.workload import Inputs, Protocol, Workload, prepare_inputs, rebatched, workload_block

__all__ = ["Admission", "Inputs", "Row", "Skipped", "SweepPlan", "build_document", "ensure_baseline",
           "measure_prepared", "prepare_inputs", "run_configs", "run_fingerprint", "save_rows"]


@dataclass
class Admission:
    """What a sweep's `admit` callback says of a config before it is prepared: facts for its row, or why it
    is not measured (docs/architecture.md, "The sweep engine")."""

    metrics: dict = field(default_factory=dict)  # added to the row's `metrics` once measured
    facts: dict = field(default_factory=dict)  # what names the row when it is skipped (batch sweep: its size)
    skip: str | None = None  # a status (e.g. `over_memory_limit`): the config is not measured
    reason: str = ""


@dataclass
class Skipped:
    """A config the sweep did not measure, and why."""

    config: TechniqueConfig
    status: str
    reason: str
    facts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**self.facts, "status": self.status, "reason": self.reason}


@dataclass
class SweepPlan:
    """What a command asks of the engine beyond measuring its configs against the plain baseline.

    - `reference`: `baseline` (the plain model, measured or reused) or `first`: every config measured
      alone, one after another, against the first one measured (a batch-size sweep: the smallest size);
      no plain baseline is measured.
    - `admit(config, workload, inputs, earlier_docs) -> Admission`: called before each config is
      prepared (a memory prediction that skips a config, facts for its row).
    - `skip_out_of_memory`: a config whose measurement runs out of memory becomes a `Skipped` row
      (`out_of_memory`) and the sweep goes on.
    - `conclude(docs, skipped) -> {file name: bytes} | None`: after the techniques' sweep hooks, adds
      to the results what the command's own options define (goodput under its SLOs, a plot over one
      context length); the engine rewrites the results it changed and writes the files into each.
    - `stop_rounds(intervals) -> reason | None`: may end a group's interleaved rounds early
      (rounds.run_rounds' `stop`; tune: a candidate whose interval settles its place, `scenarios/tune.decided`).
    - `skipped`: filled by the engine, in config order.
    - `baseline`: filled by the engine before `conclude` runs: the baseline the rows were measured against
      last (its rounds are those of the last group measured; `metrics.rounds.group` says which rows shared
      them), so a command's own keys can be taken against it (tune's goodput).
    - `written`: filled by the engine: the run ids of the candidate rows this sweep saved (not those
      `resume` read back), in config order: the only rows a later step of the command may rewrite
      (`store_claim`).
    """

    reference: str = "baseline"
    admit: Callable[[TechniqueConfig, Workload, Inputs, list[ResultDocument]], Admission] | None = None
    skip_out_of_memory: bool = False
    conclude: Callable[[list[ResultDocument], list[Skipped]], dict[str, bytes] | None] | None = None
    stop_rounds: Callable[[dict[str, dict]], str | None] | None = None
    skipped: list[Skipped] = field(default_factory=list)
    baseline: ResultDocument | None = None
    written: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.reference not in ("baseline", "first"):
            raise ConfigError(f"reference must be 'baseline' or 'first', got '{self.reference}'")


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
) -> tuple[ResultDocument, list[dict]]:
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
) -> tuple[ResultDocument, list[dict]]:
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
        "peak_rss_delta_bytes": run.peak_rss_bytes - run.rss_before_bytes
        if run.peak_rss_bytes is not None and run.rss_before_bytes is not None else None,
        "cuda_peak_bytes": run.cuda_peak_bytes,
        # no weights in this process and none declared (an endpoint whose served bytes are unknown): unknown
        "model_bytes": weight_bytes if prepared.model is not None or prepared.extra_model_bytes else None,
        "first_call_ms": run.first_call_ms,
        "warmup_s": run.warmup_s,
        "iterations": run.iterations,
        "generated_tokens": run.generated_tokens,
    })
    if prepared.extra_model_bytes:
        metrics["extra_model_bytes"] = prepared.extra_model_bytes
    texts = [o.text for o in run.outputs]
    references = [inputs.prompts[o.prompt_index].reference for o in run.outputs]
    random_weights = loaded.weights is not None  # no quality to measure: outputs of random weights mean nothing
    metrics.update(quality.reference_scores(texts, references))
    metrics["ppl"] = (reference_perplexity(prepared.model, prepared.tokenizer, inputs.rendered,
                                           [p.reference for p in inputs.prompts], device=prepared.device)
                      if measure_ppl and prepared.model is not None and not random_weights else None)
    if execute and not random_weights:
        from infer_tune.metrics import passk
        from infer_tune.metrics.passk import pass_at_1

        isolation = "unsafe" if execute == "unsafe" else "sandbox"
        metrics["pass_at_1"] = pass_at_1([inputs.prompts[o.prompt_index] for o in run.outputs], texts,
                                         isolation=isolation)
        metrics["pass_at_1_isolation"] = isolation
        metrics["pass_at_1_memory_limit"] = passk.memory_limit(isolation)
    # the technique's facts and counters beside the measured figures, never over them (OverwriteError)
    merge_facts(metrics, prepared.metrics, f"{technique}'s prepared facts")
    merge_facts(metrics, run.counters, f"{technique}'s counters")
    if run.ranks:
        metrics["ranks"] = run.ranks
    outputs = [{"prompt_id": inputs.prompts[o.prompt_index].id, "prompt": inputs.prompts[o.prompt_index].text,
                "output": o.text, "token_ids": o.token_ids, "prompt_tokens": o.prompt_tokens,
                "hit_eos": o.hit_eos, "reference": inputs.prompts[o.prompt_index].reference}
               for o in run.outputs]
    if baseline is not None and baseline_outputs is not None:
        # a runner's own `output_mismatches` (a batch scheduler's count against single-request greedy on its
        # own weights, docs/batch.md) is what the row claims; the count against the baseline's outputs (another
        # model when the row quantizes) is kept beside it as `output_mismatches_vs_baseline`
        own = run.counters.get("output_mismatches")
        metrics.update(deltas.versus_baseline(metrics, outputs, baseline, baseline_outputs))
        if own is not None and "output_mismatches" in metrics:
            metrics["output_mismatches_vs_baseline"] = metrics["output_mismatches"]
            metrics["output_mismatches"] = own
        for name, interval in (ratios or {}).items():
            if interval is not None:  # the rounds' geometric mean: the figure its interval is about
                metrics[name] = interval["point"]
                metrics[f"{name}_ci95"] = interval["ci95"]
    if random_weights:
        quality_not_applicable(metrics)
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
               "content_id": models.content_id(loaded) if loaded.model is not None else None,
               **({"weights": "pretrained"} if loaded.weights is None else loaded.weights.describe())},
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
    return result, outputs


# quality figures that mean nothing on random weights (docs/metrics.md, "Random weights")
QUALITY_KEYS = ("bleu", "chrf", "ppl", "pass_at_1", "pass_at_1_isolation", "bleu_drift", "bleu_drift_ci95",
                "ppl_delta_pct", "pass_at_1_delta", "bleu_vs_baseline", "exact_match_vs_baseline")


def quality_not_applicable(metrics: dict) -> None:
    """A random-weight row: every quality figure null, `quality` says why, and no broken verdict (it rests on
    quality alone). Token-level agreement with the baseline (`output_mismatches`) stays: it is not quality."""
    from infer_tune.weights import QUALITY_NA

    for key in QUALITY_KEYS:
        if key in metrics:
            metrics[key] = None
    metrics["quality"] = QUALITY_NA
    if "broken" in metrics:
        metrics.update(broken=False, broken_why=None, verdict_evidence=QUALITY_NA)


def find_result(out_dir: Path, fingerprint: str, technique: str | None = None) -> ResultDocument | None:
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
) -> tuple[ResultDocument, list[dict], bool]:
    """Reuse a baseline of the same fingerprint from `ctx.out_dir`, or measure and save one.

    Returns (doc, outputs, reused).
    """
    fp = run_fingerprint(loaded, "baseline", {}, workload, ctx.env, execute, protocol=protocol,
                         measure_ppl=measure_ppl)
    with results.runs_lock(ctx.out_dir):  # re-entrant: a sweep holds it already; `tune` calls this alone
        if reuse and (found := find_result(ctx.out_dir, fp, "baseline")) is not None:
            return found, results.load_outputs(found), True
        prepared = PreparedModel(model=loaded.model, tokenizer=loaded.tokenizer, label="baseline", device=ctx.device)
        doc, outputs = measure_prepared(loaded, prepared, inputs, workload, protocol, technique="baseline", config={},
                                        env=ctx.env, measure_ppl=measure_ppl, execute=execute, progress=ctx.progress)
        results.save_run(ctx.out_dir, doc, outputs)
        return doc, outputs, False


def resolve_configs(configs: list[TechniqueConfig], ctx: RunContext) -> list[TechniqueConfig]:
    """Each config with its host-dependent choices settled (what the result will record)."""
    out = []
    for config in configs:
        entry = technique_for(config)
        out.append(entry.resolve(config, ctx) if entry.resolve else config)
    return out


def config_workload(config: TechniqueConfig, workload: Workload) -> Workload:
    """The workload `config` runs: the sweep's, unless a part's registry entry overrides it per config
    (`workload` hook: a batch-size sweep row runs at its own batch size)."""
    for part in config.parts():
        entry = technique_for(part)
        if entry.workload is not None:
            workload = entry.workload(part, workload)
    return workload


def preflight(loaded: models.LoadedModel, workload: Workload, configs: list[TechniqueConfig], ctx: RunContext) -> None:
    """Every check that can fail before a measurement: constraints, then each technique's own checks."""
    for config in configs:
        entry = technique_for(config)
        entry.check_workload(config_workload(config, workload), config)
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
    plan: SweepPlan | None = None,
) -> tuple[ResultDocument | None, list[ResultDocument]]:
    """Every config prepared, measured beside the baseline (interleaved rounds where its runner runs in
    passes and its workload is the sweep's, else alone against the baseline) and saved (module
    docstring; docs/architecture.md, "The sweep engine").

    Results are saved atomically as each group finishes, so an interrupted sweep keeps its rows and
    `resume=True` skips them. A technique's `annotate` hook sees the results finished before it. `plan`
    says what a command asks beyond that (`SweepPlan`: the reference, admission, out-of-memory skips,
    its own sweep-level keys); the configs it skipped are in `plan.skipped`.
    Returns (baseline document, candidate documents in config order); with `plan.reference == "first"`
    the baseline is the first measured candidate (None when every config was skipped).
    """
    plan = plan or SweepPlan()
    configs = resolve_configs(configs, ctx)
    preflight(loaded, workload, configs, ctx)
    waiting = (lambda: ctx.progress(f"waiting for another infer-tune run in {ctx.out_dir}", 0, None)) \
        if ctx.progress else None
    # concurrent sweeps queue (none measures twice); the collection before each pass skips what lives on
    with results.runs_lock(ctx.out_dir, on_wait=waiting), long_lived_heap():
        return _sweep(loaded, inputs, workload, protocol, configs, ctx, resume=resume,
                      reuse_baseline=reuse_baseline, measure_ppl=measure_ppl, execute=execute, plan=plan)


def _sweep(loaded: models.LoadedModel, inputs: Inputs, workload: Workload, protocol: Protocol,
           configs: list[TechniqueConfig], ctx: RunContext, *, resume: bool, reuse_baseline: bool,
           measure_ppl: bool, execute: bool | str, plan: SweepPlan) -> tuple[ResultDocument | None, list[ResultDocument]]:
    sweep = _Sweep(loaded, inputs, workload, protocol, ctx, measure_ppl=measure_ppl, execute=execute, plan=plan)
    docs: list[dict | None] = [None] * len(configs)
    done = [find_result(ctx.out_dir, sweep.fingerprint(config)) if resume else None for config in configs]
    sweep.progress_configs(sum(d is not None for d in done), len(configs))
    first = plan.reference == "first"
    group: list[tuple[int, PreparedModel]] = []
    try:
        for i, config in enumerate(configs):
            if done[i] is not None:
                docs[i] = done[i]
                if first and sweep.baseline is None:  # a resumed reference: the later rows compare with it
                    sweep.baseline, sweep.baseline_outputs = done[i], results.load_outputs(done[i])
                continue
            entry = technique_for(config)
            admission = plan.admit(config, *sweep.point(config), [d for d in docs if d is not None]) \
                if plan.admit else Admission()
            if admission.skip is not None:
                plan.skipped.append(Skipped(config, admission.skip, admission.reason, admission.facts))
                continue
            sweep.admitted[i] = admission.metrics
            prepared = entry.prepare(loaded, config, ctx)
            prepared.device = ctx.device
            if (prepared.runner or entry.runner) in PASS_RUNNERS and not first and not sweep.own_workload(config):
                group.append((i, prepared))
                if not fits_another(loaded, group):  # hold no more variants than memory allows
                    sweep.measure_group(group, configs, docs)
                    group = []
            else:
                sweep.measure_group(group, configs, docs)
                group = []
                sweep.measure_alone(i, config, prepared, docs, reuse_baseline=reuse_baseline, admission=admission)
        sweep.measure_group(group, configs, docs)
        group = []
    finally:
        for _, prepared in group:
            if prepared.cleanup:
                prepared.cleanup()
    measured = [d for d in docs if d is not None]
    if sweep.baseline is None and not first:  # every config was found done (resume), or none: reuse or measure one
        sweep.baseline, _, _ = ensure_baseline(loaded, inputs, workload, protocol, ctx, reuse=reuse_baseline,
                                               measure_ppl=measure_ppl, execute=execute)
    plan.baseline = sweep.baseline
    plan.written = [d["run_id"] for d in measured if d["run_id"] in sweep.written]
    summarize_sweep(measured, plan, own=sweep.written)
    return sweep.baseline, measured


def fits_another(loaded: models.LoadedModel, group: list) -> bool:
    """Whether one more prepared variant fits beside those held (estimated as the largest held one, or
    the source model's bytes, with 1 GiB to spare)."""
    import psutil

    held = [models.model_bytes(p.model) + p.extra_model_bytes for _, p in group if p.model is not None]
    need = max(held + [models.model_bytes(loaded.model) if loaded.model is not None else 0]) + (1 << 30)
    return psutil.virtual_memory().available > need


def ranked_on(config: TechniqueConfig) -> str:
    """What a row is ranked on: the first objective of its parts other than decode, else decode."""
    objectives = [technique_for(p).objective for p in config.parts()]
    return next((o for o in objectives if o != "decode"), "decode")


class _Sweep:
    """The state one sweep shares between its groups: the workload, the baseline measured last."""

    def __init__(self, loaded, inputs, workload, protocol, ctx, *, measure_ppl, execute, plan: SweepPlan) -> None:
        self.loaded, self.inputs, self.workload, self.protocol, self.ctx = loaded, inputs, workload, protocol, ctx
        self.measure_ppl, self.execute, self.plan = measure_ppl, execute, plan
        self.batched: dict[int, Inputs] = {workload.batch_size: inputs}
        self.admitted: dict[int, dict] = {}  # config index -> the metrics its admission adds to its row
        self.baseline: ResultDocument | None = None
        self.baseline_outputs: list[dict] | None = None
        self.finished = 0
        self.total = 0
        self.written: set[str] = set()  # run ids this sweep saved: the only results its hooks may rewrite

    def fingerprint(self, config: TechniqueConfig) -> str:
        entry = technique_for(config)
        return run_fingerprint(self.loaded, entry.name, config.to_dict(), config_workload(config, self.workload),
                               self.ctx.env, self.execute, protocol=self.protocol,
                               measure_ppl=self.measure_ppl and entry.measure_ppl)

    def own_workload(self, config: TechniqueConfig) -> bool:
        return config_workload(config, self.workload) != self.workload

    def point(self, config: TechniqueConfig) -> tuple[Workload, Inputs]:
        """The workload `config` runs and its inputs (encoded again at its own batch size when it has one)."""
        workload = config_workload(config, self.workload)
        if workload.batch_size not in self.batched:
            self.batched[workload.batch_size] = rebatched(self.inputs, self.loaded.tokenizer, workload.batch_size)
        return workload, self.batched[workload.batch_size]

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
        variants = [base] + [rounds.Variant(f"{i}:{p.label}", p, runner, whole=runner in WHOLE_RUNNERS,
                                            objective=ranked_on(configs[i]))
                             for (i, p), runner in zip(group, runners)]
        before = noise.HostSnapshot.take()
        try:
            outcome = rounds.run_rounds(variants, self.inputs, self.workload, self.protocol, seed=self.workload.seed,
                                        progress=self.ctx.progress, stop=self.plan.stop_rounds)
            host = (before, noise.HostSnapshot.take())
            self.baseline, self.baseline_outputs = self._save_baseline(base, outcome, host)
            for (i, prepared), variant in zip(group, variants[1:]):
                docs[i] = self._finish(configs[i], prepared, rounds.merged_run(variant), host,
                                       rounds_block=outcome.block(variant.name),
                                       ratios=outcome.intervals.get(variant.name), earlier=docs,
                                       metrics=self.admitted.get(i))
        finally:
            for _, prepared in group:
                if prepared.cleanup:
                    prepared.cleanup()
            group.clear()
            gc.collect()

    def _save_baseline(self, base: rounds.Variant, outcome: rounds.RoundsOutcome, host) -> tuple[ResultDocument, list[dict]]:
        doc, outputs = build_document(self.loaded, base.prepared, rounds.merged_run(base), self.inputs, self.workload,
                                      self.protocol, technique="baseline", config={}, env=self.ctx.env,
                                      runner="generation", host=host, measure_ppl=self.measure_ppl,
                                      execute=self.execute, rounds_block=outcome.block("baseline"))
        # a new result with its own run id, never a rewrite of an earlier baseline of the same fingerprint:
        # the rows saved against that one keep the numbers they were compared with (`baseline_run_id`)
        results.save_run(self.ctx.out_dir, doc, outputs)
        self.written.add(doc.run_id)
        return doc, outputs

    def measure_alone(self, i: int, config: TechniqueConfig, prepared: PreparedModel, docs: list[dict | None], *,
                      reuse_baseline: bool, admission: Admission) -> None:
        """A candidate measured once per the protocol (its runner does not run in passes, it runs its own
        workload, or the plan compares every row with the first), against the baseline measured last (or
        one reused / measured now; with `reference: first`, the first row measured, or none for that row)."""
        try:
            if self.baseline is None and self.plan.reference == "baseline":
                self.baseline, self.baseline_outputs, reused = ensure_baseline(
                    self.loaded, self.inputs, self.workload, self.protocol, self.ctx, reuse=reuse_baseline,
                    measure_ppl=self.measure_ppl, execute=self.execute)
                if not reused:
                    self.written.add(self.baseline["run_id"])
            entry = technique_for(config)
            workload, inputs = self.point(config)
            before = noise.HostSnapshot.take()
            try:
                run = get_runner(prepared.runner or entry.runner)(prepared, inputs, workload, self.protocol,
                                                                 self.ctx.progress)
            except Exception as exc:  # noqa: BLE001 (only allocation failures are skipped; the rest re-raise)
                if not (self.plan.skip_out_of_memory and is_out_of_memory(exc)):
                    raise
                self.plan.skipped.append(Skipped(config, "out_of_memory", str(exc).splitlines()[0][:200],
                                                 admission.facts))
                return
            docs[i] = self._finish(config, prepared, run, (before, noise.HostSnapshot.take()), earlier=docs,
                                   metrics=admission.metrics)
            if self.baseline is None:  # reference `first`: this row is what the later rows compare with
                self.baseline, self.baseline_outputs = docs[i], results.load_outputs(docs[i])
        finally:
            if prepared.cleanup:
                prepared.cleanup()
            gc.collect()

    def _finish(self, config: TechniqueConfig, prepared: PreparedModel, run: GenerationRun, host, *,
                earlier: list[dict | None], rounds_block: dict | None = None,
                ratios: dict | None = None, metrics: dict | None = None) -> ResultDocument:
        """Build, finalize (technique facts and files), annotate and save one candidate's result."""
        entry = technique_for(config)
        workload, inputs = self.point(config)
        doc, outputs = build_document(
            self.loaded, prepared, run, inputs, workload, self.protocol, technique=entry.name,
            config=config.to_dict(), env=self.ctx.env, runner=prepared.runner or entry.runner, host=host,
            baseline=self.baseline, baseline_outputs=self.baseline_outputs,
            measure_ppl=self.measure_ppl and entry.measure_ppl, execute=self.execute,
            per_position=any(technique_for(p).per_position for p in config.parts()), rounds_block=rounds_block,
            ratios=ratios)
        doc.objective = ranked_on(config)
        doc.add_metrics(metrics, source="the sweep's admission")
        files = entry.finalize(config, doc, outputs, prepared, inputs, self.ctx) if entry.finalize else None
        if entry.annotate:
            entry.annotate(doc, [d for d in earlier if d is not None])
        results.save_run(self.ctx.out_dir, doc, outputs, extra_files=files or None)
        self.written.add(doc.run_id)
        self.finished += 1
        if self.ctx.progress:
            self.ctx.progress("configs", self.finished, self.total)
        return doc


@dataclass
class Row:
    """A result document built outside `run_configs`, its outputs rows and the files saved beside it."""

    doc: ResultDocument | dict  # a dict is typed (ResultDocument.from_dict) when it is saved
    outputs: list[dict] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)


def save_rows(out_dir: Path, rows: list[Row], *, resume: bool = False) -> list[ResultDocument]:
    """The engine's writer for rows that `run_configs` cannot measure: a live endpoint's (no weights here, no
    plain baseline: docs/endpoint.md) and expert-placement plans (predictions, nothing measured). Under the
    runs directory's lock, each row is saved atomically; with `resume`, a row whose fingerprint is already
    saved is read back instead. Returns the saved documents (typed, with their `location`), in order
    (docs/architecture.md, "The sweep engine")."""
    out = []
    with results.runs_lock(out_dir):
        for row in rows:
            done = find_result(out_dir, row.doc["fingerprint"], row.doc.get("technique")) if resume else None
            if done is None:
                done = results.save_run(out_dir, row.doc, row.outputs, extra_files=row.files or None).result
            out.append(done)
    return out


def summarize_sweep(docs: list[ResultDocument], plan: SweepPlan | None = None, *, own: set[str] | frozenset[str]) -> None:
    """Each technique's sweep-level claim (`summarize`), keys (`complete`) and figures (`plots`), then the
    plan's own (`conclude`), over every result of the sweep; stored only in the results this sweep saved
    (`own`: their run ids), whose changed `result.json` is rewritten atomically. A result read back from
    an earlier run (`resume`, a reused baseline, a landed folder that was there) is never rewritten: its
    `result.json` stays byte for byte what that run wrote."""
    load_techniques()
    plan = plan or SweepPlan()
    before = {id(doc): _snapshot(doc) for doc in docs}
    by_technique: dict[str, list[dict]] = {}
    for doc in docs:
        by_technique.setdefault(doc["technique"], []).append(doc)
    files_of: dict[int, dict[str, bytes]] = {}
    for entry in TECHNIQUES.values():
        group = by_technique.get(entry.name)
        skipped = [s for s in plan.skipped if technique_for(s.config).name == entry.name]
        if not group and not skipped:
            continue
        if entry.complete:
            entry.complete(group or [], skipped)
        if not group:
            continue
        claim = entry.summarize(group) if entry.summarize else None
        for doc in group if claim is not None else ():
            doc["metrics"]["claim_check"] = claim
        files = entry.plots(group) if entry.plots else {}
        for doc in group:
            files_of.setdefault(id(doc), {}).update(files)
    extra = (plan.conclude(docs, plan.skipped) if plan.conclude else None) or {}
    for doc in docs:
        if not isinstance(doc, ResultDocument) or doc.location is None or doc.run_id not in own:
            continue
        if _snapshot(doc) != before[id(doc)]:
            results.update_result(doc)
        files = {**files_of.get(id(doc), {}), **extra}
        if files:
            results.add_files(doc, files)


def _snapshot(doc: dict) -> str:
    return json.dumps(doc.to_dict() if isinstance(doc, ResultDocument) else doc, sort_keys=True, default=str)


def store_claim(docs: list[ResultDocument], claim: dict | None, *, own: set[str] | frozenset[str]) -> None:
    """`claim` as `metrics.claim_check` of every doc in `docs`, rewritten where it changed (a claim over
    several sweeps of one command: speculate's suites); only the results of `own` (run ids the command's
    sweeps saved, `SweepPlan.written`) are rewritten, never one an earlier run wrote."""
    if claim is None:
        return
    changed = [d for d in docs if d["metrics"].get("claim_check") != claim]
    for doc in changed:
        doc["metrics"]["claim_check"] = claim
    by_dir: dict[Path, list[dict]] = {}
    for doc in changed:
        if isinstance(doc, ResultDocument) and doc.location is not None and doc.run_id in own:
            by_dir.setdefault(Path(doc.location).parent, []).append(doc)
    for out_dir, mine in by_dir.items():
        with results.runs_lock(out_dir):  # the same lock a sweep holds: no rewrite while another run saves
            for doc in mine:
                results.update_result(doc)
