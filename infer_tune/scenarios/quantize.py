"""`quantize`: calibrate, quantize, save, reload and measure each method against the baseline.

The same registry entry runs whether a method comes from here or from a recipe; this scenario adds
where checkpoints are kept (`save`, else a temporary folder) and the sweep order: bf16 first when it
is swept, so the INT8 claim is judged against 16-bit weights measured in the same run.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError
from infer_tune.runners.base import Progress
from infer_tune.scenarios.common import RunSpec, open_run, reference_that_fits
from infer_tune.sweep import resolve_configs, run_configs
from infer_tune.tuners.quantize import QuantizeConfig


@dataclass
class QuantizeOutcome:
    baseline: ResultDocument
    docs: list[ResultDocument]
    claim: dict | None
    saved: bool


def save_targets(save: Path | None, configs: list[QuantizeConfig], overwrite: bool) -> dict[str, Path]:
    """Method -> where its checkpoint goes (a sweep writes save/<method>); refuses existing folders
    unless `overwrite`, and never replaces a folder that is not a quantized model (checked up front)."""
    if save is None:
        return {}
    targets = {c.method: (save / c.method if len(configs) > 1 else save) for c in configs}
    for target in targets.values():
        if target.exists() and not overwrite:
            raise ConfigError(f"save folder {target} already exists; allow overwriting to replace it")
        if target.exists() and not (target / "quantization.json").is_file() and any(target.iterdir()):
            raise ConfigError(f"save folder {target} holds something that is not a quantized model; "
                              "refusing to overwrite it")
    return targets


def sweep_order(configs: list[QuantizeConfig]) -> list[QuantizeConfig]:
    """bf16 first (the 16-bit reference of the INT8 claim), then the given order."""
    return sorted(configs, key=lambda c: c.method != "bf16")


def run_quantize(spec: RunSpec, configs: list[QuantizeConfig], *, save: Path | None = None, overwrite: bool = False,
                 progress: Progress | None = None) -> QuantizeOutcome:
    """Every config through quantize -> save -> reload -> measure; one result each, plus the claim check."""
    targets = save_targets(save, configs, overwrite)  # before the model loads: a refusal costs nothing
    run = open_run(spec, progress, lazy_weights=True)
    configs = sweep_order(resolve_configs(configs, run.ctx))
    # random weights too large to build whole: no baseline, every method against a reference that fits
    configs, plan = reference_that_fits(run.loaded, configs, run.ctx.device)
    run.ctx.save_dirs = {c.label(): targets[c.method] for c in configs if c.method in targets}
    scratch = Path(tempfile.mkdtemp(prefix="infer-tune-quantized-"))
    run.ctx.scratch_dir = scratch
    try:
        baseline, docs = run_configs(run.loaded, run.inputs, spec.workload, spec.protocol, configs, run.ctx,
                                     resume=spec.resume, measure_ppl=spec.measure_ppl, plan=plan)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    claim = next((d.metrics.claim_check for d in docs if d.metrics.claim_check), None)
    return QuantizeOutcome(baseline=baseline, docs=docs, claim=claim, saved=save is not None)
