"""`bench`: the baseline of a workload, or every config of a recipe measured against it."""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer_tune.runners.base import Progress
from infer_tune.scenarios.common import RunSpec, open_run
from infer_tune.session import run_configs


@dataclass
class BenchOutcome:
    baseline: dict
    docs: list[dict]


def spec_from_recipe(name_or_path: str, spec: RunSpec, *, workload_given: dict[str, Any],
                     protocol_given: dict[str, Any], model_given: bool) -> tuple[RunSpec, list]:
    """The recipe's workload, protocol, model and configs; values the user gave explicitly win."""
    from infer_tune import recipe as recipes

    loaded_recipe = recipes.load_recipe(name_or_path)
    workload = recipes.build_workload(loaded_recipe, workload_given)
    protocol = recipes.build_protocol(loaded_recipe, protocol_given)
    model = loaded_recipe.model if loaded_recipe.model and not model_given else spec.model
    configs = recipes.build_configs(loaded_recipe)
    return dataclasses.replace(spec, workload=workload, protocol=protocol, model=model), configs


def run_bench(spec: RunSpec, configs: list | None = None, *, progress: Progress | None = None) -> BenchOutcome:
    """Measure the baseline (reused from `spec.out_dir` only with `spec.resume`) and each config against it."""
    run = open_run(spec, progress)
    with tempfile.TemporaryDirectory(prefix="infer-tune-artifacts-") as scratch:  # e.g. quantized checkpoints
        run.ctx.scratch_dir = Path(scratch)
        baseline, docs = run_configs(run.loaded, run.inputs, spec.workload, spec.protocol, list(configs or []),
                                     run.ctx, resume=spec.resume, reuse_baseline=spec.resume or bool(configs),
                                     measure_ppl=spec.measure_ppl, execute=spec.execute)
    return BenchOutcome(baseline=baseline, docs=docs)
