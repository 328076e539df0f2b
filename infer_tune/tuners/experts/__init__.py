"""MoE expert placement: profile routing, plan expert -> device placement, validate it with real expert
parallelism (`technique: experts`, the `multiprocess` runner: one rank per device of the plan).

The registry entry turns a plan (or a load file plus a strategy) into a multi-process run of the
workload under that plan; `finish_validation` turns the ranks' readings into the measured keys
(`balancedness`, `cross_device_tokens_per_token`, `alltoall_bytes_per_token`) beside the plan's
predictions. The commands are in infer_tune.scenarios.experts; definitions in docs/experts.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from infer_tune import jsonsafe, models
from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError
from infer_tune.runners.prepared import PreparedModel
from infer_tune.tuners.base import Conclusion, MeasuredRow, RunContext, TechniqueConfig, register_technique
from infer_tune.tuners.experts import (
    claim,
    loadfile,
    locality,  # noqa: F401  (registers the locality planner)
    plan_metrics,
    plots,
    routing,
)
from infer_tune.tuners.experts.planners import REPLICA_ROUTINGS, STRATEGIES, Plan, Topology, make_plan
from infer_tune.tuners.experts.report import report_columns

PREDICTED_KEYS = ("balancedness", "cross_device_tokens_per_token", "alltoall_bytes_per_token")
LINK_KEYS = ("intra_node_bytes_per_token", "inter_node_bytes_per_token")  # plans with nodes > 1


@dataclass
class ExpertsConfig(TechniqueConfig):
    """One placement strategy on `devices` devices (validation runs one process per device)."""

    technique: ClassVar[str] = "experts"

    strategy: str = "load-balanced"
    devices: int = 2
    replicas: int = 0
    device_speeds: list[float] | None = None
    nodes: int = 1
    memory_per_device: int | None = None  # bytes
    load_file: str | None = None  # from `experts profile`
    plan_file: str | None = None  # from `experts plan --save` (holds every strategy)
    replica_routing: str = "even"  # even | local (see planners.REPLICA_ROUTINGS)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"experts strategy must be one of {', '.join(STRATEGIES)}, got '{self.strategy}'")
        if self.devices < 1:
            raise ConfigError(f"experts devices must be >= 1, got {self.devices}")
        if self.replicas < 0:
            raise ConfigError(f"experts replicas must be >= 0, got {self.replicas}")
        if self.memory_per_device is not None and self.memory_per_device < 1:
            raise ConfigError(f"experts memory_per_device must be a positive byte count, got {self.memory_per_device}")
        if self.replica_routing not in REPLICA_ROUTINGS:
            raise ConfigError(f"experts replica_routing must be one of {', '.join(REPLICA_ROUTINGS)}, "
                              f"got '{self.replica_routing}'")
        self.topology()  # checks speeds and nodes

    def topology(self, slots: int | None = None) -> Topology:
        return Topology(devices=self.devices, speeds=list(self.device_speeds or []), nodes=self.nodes, slots=slots)

    def label(self) -> str:
        extra = f"-r{self.replicas}" if self.replicas and self.strategy in ("load-balanced", "speed-aware") else ""
        return f"{self.strategy}-{self.devices}dev{extra}"


def slots_for_memory(config: ExpertsConfig, info: loadfile.ModelInfo, layers: int) -> int | None:
    """Expert slots per device per layer that `memory_per_device` holds after the dense weights."""
    if config.memory_per_device is None:
        return None
    free = config.memory_per_device - info.dense_bytes
    per_slot = info.expert_bytes * layers
    slots = free // per_slot if free > 0 else 0
    if slots < 1:
        raise ConfigError(f"memory_per_device {config.memory_per_device} bytes does not hold the dense weights "
                          f"({info.dense_bytes} bytes) plus one expert per layer ({per_slot} bytes)")
    return int(slots)


def plan_from_load(config: ExpertsConfig, load: loadfile.LoadFile) -> Plan:
    """The config's strategy on a load file."""
    slots = slots_for_memory(config, load.model, load.num_layers)
    coactivation = np.stack([layer.coactivation for layer in load.layers])
    return make_plan(config.strategy, load.loads(), config.topology(slots), replicas=config.replicas,
                     coactivation=coactivation, groups=load.model.num_groups, replica_routing=config.replica_routing,
                     routes=[layer.routes for layer in load.layers])


def read_plan_file(path: str, strategy: str) -> tuple[Plan, dict]:
    """One strategy's plan (and its predicted metrics) from a file written by `experts plan --save`."""
    file = Path(path)
    try:
        doc = jsonsafe.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"plan file {path} cannot be read: {exc}") from None
    plans = doc.get("plans") if isinstance(doc, dict) else None
    if not isinstance(plans, dict) or not plans:
        raise ConfigError(f"plan file {path} holds no plans (write one with `infer-tune experts plan --save`)")
    if strategy not in plans:
        raise ConfigError(f"plan file {path} has no '{strategy}' plan; it has {', '.join(plans)}")
    entry = plans[strategy]
    return Plan.from_dict(entry.get("plan"), f"plan file {path}"), dict(entry.get("metrics") or {})


def resolve_plan(config: ExpertsConfig) -> tuple[Plan, dict]:
    """The plan a config names (plan file, else load file + strategy) and its predicted metrics."""
    if config.plan_file:
        plan, predicted = read_plan_file(config.plan_file, config.strategy)
        if plan.topology.devices != config.devices:
            raise ConfigError(f"the '{config.strategy}' plan in {config.plan_file} places experts on "
                              f"{plan.topology.devices} devices, not {config.devices}")
        return plan, predicted
    if config.load_file:
        load = loadfile.load(config.load_file)
        plan = plan_from_load(config, load)
        return plan, plan_metrics.evaluate(plan, load)
    raise ConfigError("experts needs load_file (from `infer-tune experts profile`) or plan_file "
                      "(from `infer-tune experts plan --save`)")


def check_model(layers: list[routing.MoELayer], plan: Plan, ref: str) -> None:
    if len(layers) != len(plan.placement) or layers[0].num_experts != plan.num_experts:
        raise ConfigError(f"the plan is for {len(plan.placement)} MoE layers of {plan.num_experts} experts; model "
                          f"'{ref}' has {len(layers)} of {layers[0].num_experts}")


def _preflight(loaded: models.LoadedModel, config: ExpertsConfig, ctx: RunContext) -> None:
    plan, _ = resolve_plan(config)
    check_model(routing.require_moe(loaded.model, loaded.ref), plan, loaded.ref)


def finish_validation(doc: ResultDocument, earlier: list[dict] | None = None) -> None:
    """Measured keys from the ranks' readings (prefill pass), beside the predictions, taken on a copy of the
    row's metrics and added to it (`add_metrics`)."""
    m = dict(doc.metrics)
    ranks = m.get("ranks") or []
    if not ranks or "pairs_to_rank" not in ranks[0]:
        return
    loads = np.sum([r["pairs_to_rank"] for r in ranks], axis=0).astype(np.float64)  # [L, world]
    layers = loads.shape[0]
    tokens = m["prefill_tokens"] / max(layers, 1)
    m["measured_device_load_share"] = [float(v) for v in loads.sum(0) / max(loads.sum(), 1)]
    m["balancedness"] = float(loads.mean(1).sum() / loads.max(1).sum()) if loads.max(1).sum() else 1.0
    m["cross_device_tokens_per_token"] = m["prefill_remote_rows"] / max(m["prefill_tokens"], 1)
    m["alltoall_bytes_per_token"] = m["prefill_payload_bytes"] / max(tokens, 1)
    m["meta_bytes_per_token"] = m["prefill_meta_bytes"] / max(tokens, 1)
    decode_tokens = m.get("generate_tokens", 0) / max(layers, 1)
    m["generate_alltoall_bytes_per_token"] = m.get("generate_payload_bytes", 0) / decode_tokens if decode_tokens else None
    m["tokens_measured"] = int(tokens)
    for key in PREDICTED_KEYS:
        predicted = m.get(f"predicted_{key}")
        if predicted:
            m[f"{key}_vs_predicted_pct"] = 100.0 * (m[key] / predicted - 1.0)
    m["top1_agreement"] = m["top1_equal"] / max(m["top1_total"], 1)
    m["max_abs_diff"] = max(r["max_abs_diff"] for r in ranks)
    m["relative_diff"] = max(r["relative_diff"] for r in ranks)
    m["within_tolerance"] = all(r["within_tolerance"] for r in ranks)
    m["tolerance"] = ranks[0]["tolerance"]
    m["outputs_match_single_process"] = m["generation_mismatches"] == 0 and m["within_tolerance"]
    m["expert_bytes_per_rank"] = [r["expert_bytes"] for r in ranks]
    link_bytes(m, ranks, tokens)
    doc.add_metrics({k: v for k, v in m.items() if k not in doc.metrics}, source="experts' finish")


def link_bytes(m: dict, ranks: list[dict], tokens: float) -> None:
    """Measured payload bytes per token by link kind (inside a node, between nodes), beside the plan's.

    A rank's node is the launcher's (torchrun's GROUP_RANK) when the ranks came from torchrun, else the
    plan's (device // devices per node: nodes simulated on one host)."""
    plan_nodes = m.get("plan_node_of_rank")
    if not plan_nodes or "payload_bytes_to_rank" not in ranks[0]:
        return
    launched = all(r.get("group_rank") is not None for r in ranks)
    node = [r["group_rank"] for r in ranks] if launched else list(plan_nodes)
    m["link_nodes_from"] = "launcher" if launched else "plan"
    m["node_of_rank"] = node
    m["node_map_matches_plan"] = node == list(plan_nodes)
    if max(node) == 0 and max(plan_nodes) == 0:
        return
    inter = sum(b for r in ranks for d, b in enumerate(r["payload_bytes_to_rank"]) if node[d] != node[r["rank"]])
    total = sum(sum(r["payload_bytes_to_rank"]) for r in ranks)
    m["inter_node_bytes_per_token"] = inter / max(tokens, 1)
    m["intra_node_bytes_per_token"] = (total - inter) / max(tokens, 1)
    for key in LINK_KEYS:
        predicted = m.get(f"predicted_{key}")
        if predicted:
            m[f"{key}_vs_predicted_pct"] = 100.0 * (m[key] / predicted - 1.0)


def _finish(row: MeasuredRow) -> None:
    finish_validation(row.doc)


def _conclude(docs: list, skipped: list) -> Conclusion:
    """The measured claim over the sweep's plans (locality vs round-robin bytes) and the device-load figures."""
    return Conclusion(claim=claim.summarize(docs), files=plots.validation_plots(docs))


# the metrics an experts row carries beyond the core (its namespace: metrics/schema.py)
METRIC_KEYS = {
    **dict.fromkeys(("strategy", "devices", "replicas", "measured", "nodes", "procs", "nnodes", "launch_elapsed_s",
                     "plan_node_of_rank", "node_of_rank", "link_nodes_from", "node_map_matches_plan"),
                    "the plan and how its ranks ran"),
    **{f"predicted_{k}": "the plan's prediction" for k in (*PREDICTED_KEYS, *LINK_KEYS)},
    **{f"{k}_vs_predicted_pct": "measured against predicted, %" for k in (*PREDICTED_KEYS, *LINK_KEYS)},
    **dict.fromkeys(("prefill_tokens", "prefill_remote_rows", "prefill_payload_bytes", "prefill_meta_bytes",
                     "generate_tokens", "generate_remote_rows", "generate_payload_bytes", "generate_meta_bytes",
                     "top1_equal", "top1_total", "generation_mismatches"), "the ranks' readings"),
    **dict.fromkeys(("measured_device_load_share", "balancedness", "cross_device_tokens_per_token",
                     "alltoall_bytes_per_token", "meta_bytes_per_token", "generate_alltoall_bytes_per_token",
                     "tokens_measured", "top1_agreement", "max_abs_diff", "relative_diff", "within_tolerance",
                     "tolerance", "outputs_match_single_process", "expert_bytes_per_rank", "inter_node_bytes_per_token",
                     "intra_node_bytes_per_token", "cross_node_tokens_per_token"), "measured from the readings"),
}


@register_technique(ExpertsConfig, runner="multiprocess", preflight=_preflight, finish=_finish, conclude=_conclude,
                    measure_ppl=False, report_columns=report_columns, metric_keys=METRIC_KEYS)
def prepare_experts(loaded: models.LoadedModel, config: ExpertsConfig, ctx: RunContext) -> PreparedModel:
    """A multi-process run of the workload under the plan: one rank per device."""
    from infer_tune.tuners.experts import worker

    plan, predicted = resolve_plan(config)
    layers = routing.require_moe(loaded.model, loaded.ref)
    check_model(layers, plan, loaded.ref)
    metrics: dict[str, Any] = {f"predicted_{k}": predicted.get(k) for k in PREDICTED_KEYS}
    metrics.update(strategy=config.strategy, devices=config.devices, replicas=plan.replicas, measured=True)
    topo = plan.topology
    if topo.nodes > 1:
        metrics.update({f"predicted_{k}": predicted.get(k) for k in LINK_KEYS}, nodes=topo.nodes)
    metrics["plan_node_of_rank"] = [topo.node_of(d) for d in range(topo.devices)]
    backend = "nccl" if ctx.device.startswith("cuda") else "gloo"
    payload = {"model_path": loaded.path, "model_ref": loaded.ref, "dtype": loaded.dtype, "plan": plan.to_dict(),
               "backend": backend}
    return PreparedModel(model=loaded.model, tokenizer=loaded.tokenizer, metrics=metrics, label=config.label(),
                         runner_options={"worker": worker.worker, "setup": worker.setup, "procs": config.devices,
                                         "payload": payload, "with_inputs": True, "backend": backend})


__all__ = ["ExpertsConfig", "Plan", "STRATEGIES", "Topology", "finish_validation", "plan_from_load",
           "resolve_plan"]


from infer_tune.tuners.experts import demo as _demo  # noqa: E402

_demo.register()
