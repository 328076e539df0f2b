"""`experts`: profile MoE routing, plan expert placement, validate a plan with real expert parallelism.

- `run_profile`: teacher-forced passes over the workload's prompts with every router hooked; writes
  the load file (JSON) and its heatmap (PNG beside it).
- `run_plan`: every strategy on a load file; one result document each (`technique: experts`,
  predicted metrics, `measured: false`) with the heatmap, the device-load plot and the plan as
  extra files; optionally every plan in one file for `validate`; the communication claim check.
- `run_validate`: each strategy of a plan file measured with one process per device through the
  sweep engine's loop (a single-process baseline of the same workload first, so output drift and
  speed are deltas against single-process execution); measured beside predicted keys.
- `run_build_demo`: builds and registers `moe-demo`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from infer_tune import atomic, jsonsafe, results
from infer_tune import env as envinfo
from infer_tune.document import ResultDocument
from infer_tune.engines.base import ENGINES, engine_of
from infer_tune.errors import ConfigError
from infer_tune.runners.base import Progress
from infer_tune.scenarios.common import RunSpec, open_run
from infer_tune.sweep import Row, run_configs, save_rows
from infer_tune.tuners.experts import ExpertsConfig, loadfile, plan_from_load, plan_metrics, plots, routing
from infer_tune.tuners.experts.claim import communication_claim
from infer_tune.tuners.experts.planners import STRATEGIES, Plan
from infer_tune.workload import workload_block

PLAN_FILE_KIND = "infer-tune-expert-plans"


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "-" for c in text.lower()).strip("-")[:40] or "model"


def write_bytes(path: Path, data: bytes) -> None:
    """Write `data` through a temp file and an atomic rename."""
    import os
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- profile
@dataclass
class ProfileOutcome:
    load: loadfile.LoadFile
    path: Path
    heatmap: Path


def default_load_path(out_dir: Path, model: str, suite: str) -> Path:
    return Path(out_dir) / f"expert-load-{slug(Path(model).name or model)}-{slug(Path(suite).name or suite)}.json"


def run_profile(spec: RunSpec, *, save: Path | None = None, route_tokens: int = routing.DEFAULT_ROUTE_TOKENS,
                progress: Progress | None = None) -> ProfileOutcome:
    """Route the workload's prompts through every MoE layer; write the load file and the heatmap."""
    if route_tokens < 1:
        raise ConfigError(f"route_tokens must be >= 1, got {route_tokens}")
    run = open_run(spec, progress)
    layers = routing.require_moe(run.loaded.model, spec.model)
    recorder = routing.profile_batches(run.loaded.model, run.inputs.batches, layers, route_tokens=route_tokens,
                                       device=run.ctx.device, progress=progress)
    block = workload_block(spec.workload, run.inputs)
    block["tokens"] = int(max(recorder.tokens))
    load = routing.load_file(run.loaded.model, spec.model, run.loaded.path, layers, recorder, block)
    path = Path(save) if save else default_load_path(spec.out_dir, spec.model, spec.workload.suite)
    load.save(path)
    heatmap = path.with_suffix(".png")
    write_bytes(heatmap, plots.load_heatmap_png(load))
    return ProfileOutcome(load=load, path=path, heatmap=heatmap)


# --------------------------------------------------------------------------- plan
@dataclass
class PlanOutcome:
    load: loadfile.LoadFile
    rows: list[tuple[Plan, dict]]
    docs: list[ResultDocument]
    claim: dict | None
    saved: Path | None
    images: dict[str, bytes] = field(default_factory=dict)


def plan_doc(load: loadfile.LoadFile, config: ExpertsConfig, metrics: dict, env: dict, load_path: str,
             claim: dict | None = None) -> ResultDocument:
    """A result document for one predicted plan (same schema as measured results); `claim`: the plans'
    communication claim, the same on every plan's row."""
    m = load.model
    model_bytes = m.dense_bytes + m.expert_bytes * m.num_experts * load.num_layers
    doc = ResultDocument(
        run_id=results.new_run_id(ExpertsConfig.technique, "plan-" + config.label()),
        created_at=results.created_stamp(),
        tool=envinfo.tool_info(),
        env=env,
        model={"ref": m.ref, "path": m.path, "params": None, "model_bytes": model_bytes, "dtype": m.dtype},
        technique=ExpertsConfig.technique,
        label="plan " + config.label(),
        config=config.to_dict(),
        runner=None,
        workload=dict(load.workload),
        protocol=None,
        metrics={**metrics, "strategy": config.strategy, "devices": config.devices, "measured": False,
                 "load_file": load_path, "model_bytes": model_bytes,
                 **({"claim_check": claim} if claim is not None else {})},
        samples={},
        baseline_run_id=None,
        fingerprint=results.fingerprint("experts-plan", load_path, config.to_dict(), load.tokens),
    )
    engine = ENGINES[engine_of(config)]  # the engine the plan is for (predicted: nothing ran)
    doc.set_engine(engine.name, engine.identity())
    return doc


def run_plan(load_path: Path, *, devices: int, strategies: list[str] | None = None,
             device_speeds: list[float] | None = None, replicas: int = 0, nodes: int = 1,
             memory_per_device: int | None = None, replica_routing: str = "even", out_dir: Path | None = Path("runs"),
             save: Path | None = None) -> PlanOutcome:
    """Every strategy on the load file, side by side; a result document each (unless `out_dir` is None)."""
    strategies = strategies or list(STRATEGIES)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ConfigError(f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    load = loadfile.load(load_path)
    configs = [ExpertsConfig(strategy=s, devices=devices, replicas=replicas, device_speeds=device_speeds, nodes=nodes,
                             memory_per_device=memory_per_device, load_file=str(load_path),
                             replica_routing=replica_routing) for s in strategies]
    rows = []
    for config in configs:  # every plan is made (and can fail) before anything is written
        plan = plan_from_load(config, load)
        rows.append((plan, plan_metrics.evaluate(plan, load)))
    named = [(plan.strategy, m) for plan, m in rows]
    claim = communication_claim(named, measured=False)
    speeds = configs[0].topology().speeds
    images = {"heatmap.png": plots.load_heatmap_png(load), "plan_loads.png": plots.plan_loads_png(named, speeds)}
    document = {"kind": PLAN_FILE_KIND, "load_file": str(load_path), "model": load.model.to_dict(),
                "plans": {plan.strategy: {"plan": plan.to_dict(), "metrics": m} for plan, m in rows},
                "claim_check": claim}
    if save is not None:
        atomic.write_json(Path(save), document)
    docs = []
    if out_dir is not None:  # predictions, nothing measured: the engine's writer saves them (not run_configs)
        env = envinfo.collect_env()
        planned = []
        for config, (plan, metrics) in zip(configs, rows):
            doc = plan_doc(load, config, metrics, env, str(load_path), claim)
            planned.append(Row(doc, [], dict(images, **{"plan.json": json.dumps(plan.to_dict(), indent=1).encode()})))
        docs = save_rows(out_dir, planned)
    return PlanOutcome(load=load, rows=rows, docs=docs, claim=claim, saved=save, images=images)


# --------------------------------------------------------------------------- validate
@dataclass
class ValidateOutcome:
    baseline: ResultDocument
    docs: list[ResultDocument]
    claim: dict | None


def plan_file_strategies(plan_file: Path) -> list[str]:
    try:
        doc = jsonsafe.loads(Path(plan_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"plan file {plan_file} cannot be read: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kind") != PLAN_FILE_KIND or not isinstance(doc.get("plans"), dict):
        raise ConfigError(f"{plan_file} is not a plan file (write one with `infer-tune experts plan --save FILE`)")
    return list(doc["plans"])


def run_validate(spec: RunSpec, plan_file: Path, *, procs: int, strategies: list[str] | None = None,
                 progress: Progress | None = None) -> ValidateOutcome:
    """Each strategy's plan run with `procs` processes (one per device), against single-process execution."""
    if procs < 2:
        raise ConfigError(f"expert-parallel validation needs at least 2 processes, got {procs}")
    available = plan_file_strategies(plan_file)
    strategies = strategies or available
    missing = [s for s in strategies if s not in available]
    if missing:
        raise ConfigError(f"plan file {plan_file} has no {', '.join(missing)} plan; it has {', '.join(available)}")
    configs = [ExpertsConfig(strategy=s, devices=procs, plan_file=str(plan_file)) for s in strategies]
    run = open_run(spec, progress)
    baseline, docs = run_configs(run.loaded, run.inputs, spec.workload, spec.protocol, configs, run.ctx,
                                 resume=spec.resume, measure_ppl=False)
    claim = communication_claim([(d.config["strategy"], d.metrics) for d in docs], measured=True)
    return ValidateOutcome(baseline=baseline, docs=docs, claim=claim)


# --------------------------------------------------------------------------- demo model
def run_build_demo(experts: int = 16, top_k: int = 4, shared: int = 512, calib_texts: int = 40,
                   progress: Progress | None = None, rebuild: bool = False) -> dict:
    """Build `moe-demo` (MoEfied SmolLM2) into the model cache, or keep the cached one built from the same
    spec and source; returns its build facts."""
    from infer_tune.scenarios.common import setup_threads
    from infer_tune.tuners.experts import demo

    spec = demo.DemoSpec(experts=experts, top_k=top_k, shared=shared, calib_texts=calib_texts)
    setup_threads(None)
    return demo.build(spec, progress=progress, rebuild=rebuild)
