"""`infer-tune experts`: profile MoE routing, plan expert placement, validate it with real expert parallelism."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError

app = typer.Typer(help="MoE expert placement: profile routing, plan experts -> devices, validate with real "
                       "expert parallelism (torch.distributed).", no_args_is_help=True)

Save = Annotated[Path | None, typer.Option("--save", help="Load file to write (default: OUT/expert-load-<model>-"
                                                         "<suite>.json); the heatmap goes beside it (.png).")]
RouteTokens = Annotated[int, typer.Option("--route-tokens", help="Tokens per layer whose expert sets are kept "
                                                                 "(exact communication metrics).")]
Load = Annotated[Path, typer.Option("--load", help="Load file from `experts profile`.")]
Devices = Annotated[int, typer.Option("--devices", "-d", help="Devices to place experts on.")]
Speeds = Annotated[str | None, typer.Option("--device-speeds", help="Relative speed per device, comma-separated "
                                                                    "(e.g. 1,1,0.5,0.5).")]
Replicas = Annotated[int, typer.Option("--replicas", help="Redundant expert replicas per layer (load-balanced and "
                                                          "speed-aware).")]
Nodes = Annotated[int, typer.Option("--nodes", help="Nodes the devices are spread over (hierarchical packing).")]
Memory = Annotated[str | None, typer.Option("--memory-per-device", help="Memory per device (e.g. 24GiB, 512MB): "
                                                                       "caps expert slots after the dense weights.")]
Strategies = Annotated[str | None, typer.Option("--strategy", help="Comma-separated strategies (default: all): "
                                                                   "round-robin, load-balanced, locality, speed-aware.")]
ReplicaRouting = Annotated[str, typer.Option("--replica-routing", help="How tokens pick among an expert's replicas: "
                                                                     "even (round-robin: planned balance holds) or "
                                                                     "local (own device first: less traffic).")]
ReplicaRouting = Annotated[str, typer.Option("--replica-routing", help="How tokens pick among an expert's replicas: "
                                                                     "even (round-robin: planned balance holds) or "
                                                                     "local (own device first: less traffic).")]
PlanSave = Annotated[Path | None, typer.Option("--save", help="Write every plan to this file (input of validate).")]
PlanFile = Annotated[Path, typer.Option("--plan", help="Plan file from `experts plan --save`.")]
Procs = Annotated[int | None, typer.Option("--procs", help="Processes (one per device of the plan; default 2, or "
                                                            "torchrun's world size when started by torchrun).")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Runs directory for the result documents.")]

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
         "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | None) -> int | None:
    """`24GiB`, `512MB`, `1e9` -> bytes."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].lower() not in UNITS:
        raise ConfigError(f"--memory-per-device must be a size like 24GiB or 512MB, got '{text}'")
    return int(float(match[1]) * UNITS[match[2].lower()])


def parse_speeds(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--device-speeds must be comma-separated numbers, got '{text}'") from None
    return values


def parse_strategies(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))


@app.command("profile")
def profile(
    model: opt.Model = "moe-demo",
    suite: opt.Suite = "chat",
    limit: opt.Limit = 8,
    seed: opt.Seed = 0,
    batch_size: opt.BatchSize = 1,
    max_prompt_tokens: opt.MaxPromptTokens = 512,
    chat_template: opt.ChatTemplate = True,
    lang: opt.Lang = "en",
    dtype: opt.Dtype = "auto",
    device: opt.Device = "cpu",
    threads: opt.Threads = None,
    out: Out = Path("runs"),
    save: Save = None,
    route_tokens: RouteTokens = 50_000,
    json_out: opt.Json = False,
    debug: opt.Debug = False,
) -> None:
    """Hook every router of a MoE model and count tokens per expert per layer and co-activated pairs.

    Example: infer-tune experts profile --model moe-demo --suite chat --limit 8 --save load.json
    """
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.scenarios.experts import run_profile
    from infer_tune.workload import Workload

    spec = RunSpec(model=model, workload=Workload(suite=suite, limit=limit, seed=seed, max_new_tokens=1,
                                                  batch_size=batch_size, chat_template=chat_template,
                                                  max_prompt_tokens=max_prompt_tokens, lang=lang),
                   threads=threads, device=device, dtype=dtype, out_dir=out)
    with output.progress_bar(not json_out) as progress:
        outcome = run_profile(spec, save=save, route_tokens=route_tokens, progress=progress)
    load = outcome.load
    if json_out:
        output.print_json({"load_file": str(outcome.path), "heatmap": str(outcome.heatmap), **load.to_dict()})
        return
    loads = load.loads()
    share = loads.max(1) / loads.sum(1) * load.model.num_experts
    output.out.print(f"{load.model.ref}: {load.num_layers} MoE layers x {load.model.num_experts} experts, top-"
                     f"{load.model.top_k}; {load.tokens} tokens routed per layer")
    output.out.print(f"  hottest expert carries {share.mean():.2f}x its even share on average (max {share.max():.2f}x, "
                     f"layer {int(share.argmax())})")
    output.out.print(f"  load file {outcome.path}")
    output.out.print(f"  heatmap   {outcome.heatmap}")


def render_plans(outcome) -> None:
    """The plans side by side."""
    load = outcome.load
    rows = outcome.rows
    base = next((m for p, m in rows if p.strategy == "round-robin"), None)
    table = Table(title=f"expert placement · {load.model.ref} · {load.num_layers} layers x {load.model.num_experts} "
                        f"experts (top-{load.model.top_k}) on {rows[0][0].topology.devices} devices")
    for col in ("strategy", "balancedness", "time bal.", "cross-device tok/tok", "all-to-all B/tok", "vs round-robin",
                "replicas", "max memory/device"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for plan, m in rows:
        change = (f"{100 * (m['alltoall_bytes_per_token'] / base['alltoall_bytes_per_token'] - 1):+.1f}%"
                  if base and base["alltoall_bytes_per_token"] else "-")
        table.add_row(plan.strategy, f"{m['balancedness']:.3f}", f"{m['time_balancedness']:.3f}",
                      f"{m['cross_device_tokens_per_token']:.3f}", f"{m['alltoall_bytes_per_token']:,.0f}", change,
                      str(m["replicas"]), output.fmt_bytes(m["max_device_memory_bytes"]))
    output.out.print(table)


def claim_line(claim: dict | None) -> str | None:
    from infer_tune.tuners.experts.claim import claim_line as line

    return None if claim is None else f"claim check: {line(claim)}"


@app.command("plan")
def plan(
    load: Load,
    devices: Devices = 4,
    device_speeds: Speeds = None,
    replicas: Replicas = 0,
    nodes: Nodes = 1,
    memory_per_device: Memory = None,
    strategy: Strategies = None,
    replica_routing: ReplicaRouting = "even",
    save: PlanSave = None,
    out: Out = Path("runs"),
    json_out: opt.Json = False,
    debug: opt.Debug = False,
) -> None:
    """Place experts on devices per layer by round-robin, load-balanced packing with replicas of hot experts,
    locality-aware packing and speed-aware placement; predicted balancedness, dispatch traffic and memory.

    Example: infer-tune experts plan --load load.json --devices 4 --device-speeds 1,1,0.5,0.5 --replicas 4 --save plans.json

    One result document per strategy goes into --out (with heatmap.png, plan_loads.png and plan.json).
    """
    from infer_tune.scenarios.experts import run_plan

    if devices < 1:
        raise ConfigError(f"--devices must be >= 1, got {devices}")
    if replicas < 0:
        raise ConfigError(f"--replicas must be >= 0, got {replicas}")
    speeds = parse_speeds(device_speeds)
    if speeds is not None and len(speeds) != devices:
        raise ConfigError(f"--device-speeds has {len(speeds)} values but --devices is {devices}; give one per device")
    outcome = run_plan(load, devices=devices, strategies=parse_strategies(strategy), device_speeds=speeds,
                       replicas=replicas, nodes=nodes, memory_per_device=parse_bytes(memory_per_device),
                       replica_routing=replica_routing, out_dir=out, save=save)
    if json_out:
        output.print_json({"plans": [{"strategy": p.strategy, "metrics": m, "placement": p.placement,
                                      "run_dir": str(d.location) if d.location else None} for (p, m), d in zip(outcome.rows, outcome.docs)],
                           "claim_check": outcome.claim, "plan_file": str(save) if save else None})
        return
    render_plans(outcome)
    line = claim_line(outcome.claim)
    if line:
        output.out.print(line)
    if save:
        output.out.print(f"  plans saved to {save}")
    for doc in outcome.docs:
        output.out.print(f"  result {doc.location}/result.json")


@opt.measuring_command(model="moe-demo", max_new_tokens=16, warmup=0, min_iterations=1, min_duration=0.0,
                       ppl=False)
def validate(
    opts: opt.MeasureOptions,
    plan_file: PlanFile,
    procs: Procs = None,
    strategy: Strategies = None,
) -> None:
    """Run the model with real expert parallelism under each plan (one process per device, gloo on CPU,
    nccl on GPUs): bytes exchanged and time, outputs checked against single-process execution.

    Example: infer-tune experts validate --model moe-demo --plan plans.json --procs 2 --limit 8

    Across hosts: torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29400
    -m infer_tune experts validate --plan plans.json --limit 8 (on each host; rank 0 writes the results).

    The plans must be made for --procs devices. A single-process baseline of the same workload is
    measured first (or reused), so output drift and speed are deltas against it.
    """
    from infer_tune.cli.measure import run_spec
    from infer_tune.runners import launcher
    from infer_tune.scenarios.experts import run_validate

    started = launcher.detect()
    if started is not None:
        if procs is not None and procs != started["world_size"]:
            raise ConfigError(f"--procs {procs} but torchrun started {started['world_size']} processes; leave "
                              f"--procs out under torchrun")
        procs = started["world_size"]
        if started["rank"] != 0:
            from infer_tune.runners.multiprocess import run_rank

            launcher.follow(run_rank, opts.device)
            return
        launcher.join(opts.device)
    procs = 2 if procs is None else procs
    if procs < 2:
        raise ConfigError(f"--procs must be >= 2, got {procs}")
    try:
        with output.progress_bar(not opts.json_out, out_dir=opts.out) as progress:
            outcome = run_validate(run_spec(opts, measure_ppl=False), plan_file, procs=procs,
                                   strategies=parse_strategies(strategy), progress=progress)
    finally:
        launcher.release()
    if opts.json_out:
        output.print_json({"baseline": outcome.baseline, "results": outcome.docs, "claim_check": outcome.claim})
        return
    render_validation(outcome.docs, procs)
    line = claim_line(outcome.claim)
    if line:
        output.out.print(line)
    for doc in outcome.docs:
        output.out.print(f"  result {doc.location}/result.json")


def render_validation(docs: list[ResultDocument], procs: int) -> None:
    table = Table(title=f"expert-parallel validation · {docs[0]['model']['ref']} · {procs} processes · "
                        f"{docs[0].metrics.get('tokens_measured')} tokens")
    for col in ("strategy", "balancedness pred / meas", "cross-device tok/tok pred / meas",
                "all-to-all B/tok pred / meas", "meta B/tok", "hidden |Δ| rel (tol)", "outputs", "TPOT p50 ms"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    def pair(m: dict, key: str, spec: str) -> str:
        return f"{output.fmt(m.get('predicted_' + key), spec)} / {output.fmt(m.get(key), spec)}"

    for doc in docs:
        m = doc.metrics
        bytes_cell = pair(m, "alltoall_bytes_per_token", ",.0f")
        if m.get("alltoall_bytes_per_token_vs_predicted_pct") is not None:
            bytes_cell += f" ({m['alltoall_bytes_per_token_vs_predicted_pct']:+.1f}%)"
        match = "identical" if m.get("outputs_match_single_process") else \
            f"{m.get('generation_mismatches')} differ"
        table.add_row(doc["config"]["strategy"], pair(m, "balancedness", ".3f"),
                      pair(m, "cross_device_tokens_per_token", ".3f"), bytes_cell,
                      output.fmt(m.get("meta_bytes_per_token"), ",.0f"),
                      f"{output.fmt(m.get('relative_diff'), '.1e')} ({output.fmt(m.get('tolerance'), '.0e')})",
                      match, output.fmt((m.get("tpot_ms") or {}).get("p50"), ".1f"))
    output.out.print(table)
    for doc in docs:
        m = doc.metrics
        if m.get("inter_node_bytes_per_token") is None:
            continue
        cells = []
        for kind, key in (("inside a node", "intra_node_bytes_per_token"), ("between nodes", "inter_node_bytes_per_token")):
            pct = m.get(f"{key}_vs_predicted_pct")
            cells.append(f"{kind} {output.fmt(m.get('predicted_' + key), ',.0f')} / {output.fmt(m.get(key), ',.0f')}"
                         + (f" ({pct:+.1f}%)" if pct is not None else ""))
        output.out.print(f"  {doc['config']['strategy']}: B/tok predicted / measured by link: {'; '.join(cells)} "
                         f"(nodes from the {m.get('link_nodes_from')})")


@app.command("build-demo")
def build_demo(
    experts: Annotated[int, typer.Option("--experts", help="Routed experts per layer.")] = 16,
    top_k: Annotated[int, typer.Option("--top-k", help="Experts per token.")] = 4,
    shared: Annotated[int, typer.Option("--shared", help="MLP neurons kept in the always-on shared expert.")] = 512,
    calib_texts: Annotated[int, typer.Option("--calib-texts", help="Suite texts to calibrate on.")] = 40,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Build again even when the cached moe-demo was "
                                          "built from the same options, source weights and builder.")] = False,
    json_out: opt.Json = False,
    debug: opt.Debug = False,
) -> None:
    """Build `moe-demo`: SmolLM2-135M MoEfied into a Qwen2-MoE checkpoint (experts = neurons that fire together,
    routers fitted on calibration activations), cached and usable as --model moe-demo. A cached build from
    the same options, the same SmolLM2 bytes and the same builder is kept (--rebuild builds anyway).

    Example: infer-tune experts build-demo
    """
    from infer_tune.scenarios.experts import run_build_demo

    with output.progress_bar(not json_out) as progress:
        facts = run_build_demo(experts=experts, top_k=top_k, shared=shared, calib_texts=calib_texts,
                               progress=progress, rebuild=rebuild)
    if json_out:
        output.print_json(facts)
        return
    if facts.get("cached"):
        output.out.print(f"moe-demo is built (same options, source weights and builder): {facts['path']} "
                         f"(--rebuild to build again)")
        return
    output.out.print(f"built moe-demo: {facts['layers']} layers x {facts['experts']} experts (top-{facts['top_k']}) + "
                     f"{facts['shared_neurons']}-neuron shared expert, from {facts['source']} in {facts['build_s']:.0f} s")
    output.out.print(f"  router top-{facts['top_k']} recall {facts['router_topk_recall_mean']:.2f}; held-out perplexity "
                     f"{facts['held_out_ppl_moe']:.1f} (dense {facts['held_out_ppl_dense']:.1f})")
    output.out.print(f"  saved to {facts['path']}")


app.command("validate")(validate)
