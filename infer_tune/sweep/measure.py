"""Measuring: one prepared model alone through its runner (`measure_prepared`), and a sweep's candidates
measured in groups of interleaved rounds with the baseline or alone against it (`Measuring`), each result
built, finished by its technique and saved; docs/architecture.md, "The sweep engine"."""

from __future__ import annotations

import gc

from infer_tune import models, results, rounds
from infer_tune.document import ResultDocument
from infer_tune.engines.base import engine_of
from infer_tune.metrics import noise
from infer_tune.metrics.memory import is_out_of_memory
from infer_tune.runners import GenerationRun, PreparedModel, get_runner
from infer_tune.runners.base import WHOLE_RUNNERS, Progress
from infer_tune.sweep.document import Measured, RowSpec, build_document, run_fingerprint
from infer_tune.sweep.plan import Admission, Skipped, SweepPlan
from infer_tune.sweep.writing import save_result
from infer_tune.tuners.base import MeasuredRow, RunContext, TechniqueConfig, technique_for
from infer_tune.workload import Inputs, Protocol, Workload, rebatched


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
    progress: Progress | None = None,
    engine: str | None = None,
    engine_argv: list[str] | None = None,
) -> tuple[ResultDocument, list[dict]]:
    """Run the workload on `prepared` through `runner` (alone, per the protocol) and build its result
    document and outputs rows (`build_document`)."""
    before = noise.HostSnapshot.take()
    run = get_runner(runner)(prepared, inputs, workload, protocol, progress)
    after = noise.HostSnapshot.take()
    return build_document(Measured(loaded, prepared, run, inputs, workload, protocol, (before, after)),
                          RowSpec(technique, config, runner, env, measure_ppl=measure_ppl, execute=execute,
                                  baseline=baseline, baseline_outputs=baseline_outputs, engine=engine,
                                  engine_argv=engine_argv))


def fits_another(loaded: models.LoadedModel, group: list) -> bool:
    """Whether one more prepared variant fits beside those held (estimated as the largest held one, or
    the source model's bytes, with 1 GiB to spare)."""
    import psutil

    held = [models.model_bytes(p.model) + p.extra_model_bytes for _, p in group if p.model is not None]
    need = max(held + [models.model_bytes(loaded.model) if loaded.model is not None else 0]) + (1 << 30)
    return psutil.virtual_memory().available > need


def config_workload(config: TechniqueConfig, workload: Workload) -> Workload:
    """The workload `config` runs: the sweep's, unless a part runs its own (`TechniqueConfig.workload_for`:
    a batch-size sweep row runs at its own batch size)."""
    for part in config.parts():
        workload = part.workload_for(workload)
    return workload


def ranked_on(config: TechniqueConfig) -> str:
    """What a row is ranked on: the first objective of its parts other than decode, else decode."""
    objectives = [technique_for(p).objective for p in config.parts()]
    return next((o for o in objectives if o != "decode"), "decode")


class Measuring:
    """The state one sweep shares between its groups: the workload, the baseline measured last, the run
    ids it saved."""

    def __init__(self, loaded: models.LoadedModel, inputs: Inputs, workload: Workload, protocol: Protocol,
                 ctx: RunContext, *, measure_ppl: bool, execute: bool | str, plan: SweepPlan) -> None:
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

    def use_baseline(self, doc: ResultDocument, outputs: list[dict], reused: bool) -> None:
        """The baseline the next rows are measured against (reused from an earlier run, or saved now)."""
        self.baseline, self.baseline_outputs = doc, outputs
        if not reused:
            self.written.add(doc.run_id)

    def baseline_prepared(self) -> PreparedModel:
        return PreparedModel(model=self.loaded.model, tokenizer=self.loaded.tokenizer, label="baseline",
                             device=self.ctx.device)

    def measure_group(self, group: list[tuple[int, PreparedModel]], configs: list[TechniqueConfig],
                      docs: list[ResultDocument | None]) -> None:
        """The baseline and `group` in interleaved rounds; then every result built, finished and saved.

        With `reference: first` and no reference measured yet, the group's first row is the reference: it is
        the rounds' variant 0 (the others' ratios and intervals are against it) and its own row, not a
        baseline, is what the later rows compare with; alone in its group, it is measured alone."""
        if not group:
            return
        reference = self.plan.reference == "first" and self.baseline is None
        if reference and len(group) == 1:
            (i, prepared), = group
            group.clear()
            self.measure_alone(i, configs[i], prepared, docs, admission=Admission(metrics=self.admitted.get(i) or {}))
            return
        runners = [p.runner or technique_for(configs[i]).runner for i, p in group]
        variants = [rounds.Variant(f"{i}:{p.label}", p, runner, whole=runner in WHOLE_RUNNERS,
                                   objective=ranked_on(configs[i]))
                    for (i, p), runner in zip(group, runners)]
        base = variants[0] if reference else rounds.Variant("baseline", self.baseline_prepared(), "generation")
        if not reference:
            variants.insert(0, base)
        before = noise.HostSnapshot.take()
        try:
            outcome = rounds.run_rounds(variants, self.inputs, self.workload, self.protocol, seed=self.workload.seed,
                                        progress=self.ctx.progress, stop=self.plan.stop_rounds)
            host = (before, noise.HostSnapshot.take())
            if reference:
                i0, prepared0 = group[0]
                docs[i0] = self._finish(configs[i0], prepared0, rounds.merged_run(base), host,
                                        rounds_block=outcome.block(base.name), earlier=docs,
                                        metrics=self.admitted.get(i0))
                self.baseline, self.baseline_outputs = docs[i0], results.load_outputs(docs[i0])
            else:
                self.baseline, self.baseline_outputs = self._save_baseline(base, outcome, host)
            for (i, prepared), variant in zip(group[1:] if reference else group, variants[1:]):
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
        doc, outputs = build_document(
            Measured(self.loaded, base.prepared, rounds.merged_run(base), self.inputs, self.workload, self.protocol,
                     host, rounds_block=outcome.block("baseline")),
            RowSpec("baseline", {}, "generation", self.ctx.env, measure_ppl=self.measure_ppl, execute=self.execute))
        # a new result with its own run id, never a rewrite of an earlier baseline of the same fingerprint:
        # the rows saved against that one keep the numbers they were compared with (`baseline_run_id`)
        save_result(self.ctx.out_dir, doc, outputs)
        self.written.add(doc.run_id)
        return doc, outputs

    def measure_alone(self, i: int, config: TechniqueConfig, prepared: PreparedModel, docs: list[ResultDocument | None], *,
                      admission: Admission) -> None:
        """A candidate measured once per the protocol (its runner does not run in passes, it runs its own
        workload, or the plan compares every row with the first and the row is not in the first one's group),
        against the baseline measured last (or one the engine reused / measured for it; with `reference:
        first`, the first row measured, or none for that row)."""
        try:
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
                earlier: list[ResultDocument | None], rounds_block: dict | None = None,
                ratios: dict | None = None, metrics: dict | None = None) -> ResultDocument:
        """Build one candidate's result, let its technique finish it (facts and files), and save it."""
        entry = technique_for(config)
        workload, inputs = self.point(config)
        doc, outputs = build_document(
            Measured(self.loaded, prepared, run, inputs, workload, self.protocol, host, rounds_block, ratios),
            RowSpec(entry.name, config.to_dict(), prepared.runner or entry.runner, self.ctx.env,
                    measure_ppl=self.measure_ppl and entry.measure_ppl, execute=self.execute,
                    baseline=self.baseline, baseline_outputs=self.baseline_outputs, engine=engine_of(config)))
        doc.objective = ranked_on(config)
        doc.add_metrics(metrics, source="the sweep's admission", namespace="sweep")
        files = entry.finish(MeasuredRow(config, doc, outputs, prepared, run, inputs, self.ctx,
                                         [d for d in earlier if d is not None], baseline=self.baseline)) \
            if entry.finish else None
        save_result(self.ctx.out_dir, doc, outputs, files)
        self.written.add(doc.run_id)
        self.finished += 1
        if self.ctx.progress:
            self.ctx.progress("configs", self.finished, self.total)
        return doc
