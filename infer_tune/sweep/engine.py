"""The sweep engine's entry, `run_configs`: resolve and preflight every config, take the runs directory's
lock, skip what `resume` finds done, prepare the candidates and measure them (sweep.measure), then the
sweep-level hooks (sweep.writing); docs/architecture.md, "The sweep engine"."""

from __future__ import annotations

from infer_tune import models, results
from infer_tune.document import ResultDocument
from infer_tune.metrics.memory import long_lived_heap
from infer_tune.runners import PreparedModel
from infer_tune.runners.base import PASS_RUNNERS
from infer_tune.sweep.baseline import ensure_baseline
from infer_tune.sweep.measure import Measuring, config_workload, fits_another
from infer_tune.sweep.plan import Admission, Skipped, SweepPlan
from infer_tune.sweep.writing import conclude_sweep, find_result
from infer_tune.tuners.base import RunContext, TechniqueConfig, technique_for
from infer_tune.workload import Inputs, Protocol, Workload


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
        config.check_workload(config_workload(config, workload))
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
    `resume=True` skips them. A technique's `finish` hook sees the results finished before it. `plan`
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
    sweep = Measuring(loaded, inputs, workload, protocol, ctx, measure_ppl=measure_ppl, execute=execute, plan=plan)
    docs: list[ResultDocument | None] = [None] * len(configs)
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
            # with `reference: first`, the rows that join the first one's group are measured in rounds beside it
            # (it is the rounds' variant 0); the rows after that group are measured alone against its result
            if ((prepared.runner or entry.runner) in PASS_RUNNERS and not sweep.own_workload(config)
                    and not (first and sweep.baseline is not None)):
                group.append((i, prepared))
                if not fits_another(loaded, group):  # hold no more variants than memory allows
                    sweep.measure_group(group, configs, docs)
                    group = []
            else:
                sweep.measure_group(group, configs, docs)
                group = []
                if sweep.baseline is None and not first:  # measured alone: against a baseline reused or measured now
                    try:
                        sweep.use_baseline(*ensure_baseline(loaded, inputs, workload, protocol, ctx, reuse=reuse_baseline,
                                                            measure_ppl=measure_ppl, execute=execute))
                    except BaseException:
                        if prepared.cleanup:
                            prepared.cleanup()
                        raise
                sweep.measure_alone(i, config, prepared, docs, admission=admission)
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
    measured = conclude_sweep(measured, plan, own=sweep.written)  # concluded rows are new documents
    baseline = next((d for d in measured if sweep.baseline is not None and d.run_id == sweep.baseline.run_id),
                    sweep.baseline)
    return baseline, measured
