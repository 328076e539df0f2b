"""`bench`: the baseline of a workload, or every config of a recipe measured against it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infer_tune import atomic
from infer_tune.document import ResultDocument
from infer_tune.runners.base import Progress
from infer_tune.scenarios.common import RunSpec, open_run, reference_that_fits
from infer_tune.sweep import run_configs


@dataclass
class BenchOutcome:
    baseline: ResultDocument
    docs: list[ResultDocument]


@dataclass
class Stage:
    name: str
    spec: RunSpec
    configs: list


def stages_from_recipe(name_or_path: str, spec: RunSpec, *, workload_given: dict[str, Any],
                       protocol_given: dict[str, Any], model_given: bool) -> list[Stage]:
    """Each stage's workload, protocol, model and configs; values the user gave explicitly win. Every
    stage is built (and so validated) before anything is measured."""
    from infer_tune import recipe as recipes

    stages = []
    for part in recipes.expand_stages(recipes.load_recipe(name_or_path)):
        workload = recipes.build_workload(part, workload_given)
        protocol = recipes.build_protocol(part, protocol_given)
        model = part.model if part.model and not model_given else spec.model
        stage_spec = dataclasses.replace(spec, workload=workload, protocol=protocol, model=model)
        stages.append(Stage(name=part.name, spec=stage_spec, configs=recipes.build_configs(part)))
    return stages


def run_recipe(stages: list[Stage], *, progress: Progress | None = None) -> list[BenchOutcome]:
    """Every stage in order, each against its own baseline; overall progress as `configs done / total`.
    Finished results are saved as they come, so an interrupted recipe resumes with `resume`."""
    total = sum(len(s.configs) for s in stages)  # the engine reports configs; each stage's baseline rides along
    done = 0
    outcomes = []

    def overall(stage: str, step: int, count: int | None) -> None:
        if progress:
            progress(stage, step, count)
            if stage == "configs":
                progress("recipe", done + step, total)

    for stage in stages:
        outcomes.append(run_bench(stage.spec, stage.configs, progress=overall))
        done += len(stage.configs)
    return outcomes


def run_bench(spec: RunSpec, configs: list | None = None, *, progress: Progress | None = None) -> BenchOutcome:
    """Measure the baseline (reused from `spec.out_dir` only with `spec.resume`) and each config against it."""
    from infer_tune import executors

    if configs and (executor := executors.current()) is not None:  # e.g. Ray: each config on a node
        baseline, docs = executor.run_configs(spec, list(configs), progress)
        return BenchOutcome(baseline=baseline, docs=docs)
    run = open_run(spec, progress, lazy_weights=bool(configs))
    # random weights too large to build whole: no baseline, every row against a reference that fits
    configs, plan = reference_that_fits(run.loaded, list(configs or []), run.ctx.device)
    with atomic.scratch() as scratch:  # e.g. quantized checkpoints; a killed run's is removed by the next
        run.ctx.scratch_dir = scratch
        baseline, docs = run_configs(run.loaded, run.inputs, spec.workload, spec.protocol, configs,
                                     run.ctx, resume=spec.resume, reuse_baseline=spec.resume,
                                     measure_ppl=spec.measure_ppl, execute=spec.execute, plan=plan)
    return BenchOutcome(baseline=baseline, docs=docs)
