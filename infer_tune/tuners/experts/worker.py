"""The validation worker: real expert parallelism over torch.distributed under a placement plan.

Each rank (one process per device of the plan, started by the `multiprocess` runner):
- `setup` (untimed): loads the checkpoint, takes its share of the workload (whole batches, balanced by
  token count: data-parallel attention, as DeepSeek-style serving runs it), computes the unsharded
  single-process reference for those batches (final hidden states, greedy tokens), then keeps only
  the plan's experts and installs the plan's expert parallelism (`dispatch.install`);
- `worker` (timed): a teacher-forced pass over its batches (the bytes and loads of this pass are
  the headline measurement: the same tokens a profile of the workload routes), checked against the
  reference, then greedy generation of the workload under expert parallelism (per-token timings,
  tokens checked against the reference generation).
A rank with fewer batches runs one-token dummy passes so it joins every collective (as data-parallel
serving engines do for idle ranks); those add nothing to its counts.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}  # max |diff| / max |reference|


def assign_batches(token_counts: list[int], world: int) -> list[list[int]]:
    """Batches per rank: largest first onto the rank with the fewest tokens (ranks hold equal token shares
    as far as whole batches allow, as a data-parallel scheduler would keep them)."""
    tokens = [0] * world
    ranks: list[list[int]] = [[] for _ in range(world)]
    for b in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        r = min(range(world), key=lambda i: (tokens[i], i))
        ranks[r].append(b)
        tokens[r] += token_counts[b]
    return [sorted(r) for r in ranks]


def _batches(payload: dict, rank: int, world: int) -> tuple[list[int], int]:
    counts = [sum(map(sum, batch["attention_mask"])) for batch in payload["inputs"]["batches"]]
    ranks = assign_batches(counts, world)
    return ranks[rank], max(len(r) for r in ranks)


def _tensors(batch: dict, device: str) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in batch.items()}


def _forward(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                    output_hidden_states=True)
    return out.hidden_states[-1].float(), out.logits.argmax(-1)


def setup(rank: int, world: int, payload: dict) -> dict:
    """Load, compute the unsharded reference of this rank's batches, then shard the experts."""
    import transformers

    from infer_tune import models
    from infer_tune.errors import ConfigError
    from infer_tune.runners.generation import generate_once
    from infer_tune.runners.prepared import PreparedModel
    from infer_tune.tuners.experts import dispatch, routing
    from infer_tune.tuners.experts.planners import Plan

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun across hosts: this host's GPU index
    device = f"cuda:{local}" if payload.get("backend") == "nccl" else "cpu"
    loaded = models.load(payload["model_path"], dtype=payload["dtype"], device=device)
    model = loaded.model
    layers = routing.require_moe(model, payload["model_ref"])
    plan = Plan.from_dict(payload["plan"])
    if plan.topology.devices != world:
        raise ConfigError(f"the plan places experts on {plan.topology.devices} devices; this run has {world} ranks")
    mine, rounds = _batches(payload, rank, world)
    batches = {b: _tensors(payload["inputs"]["batches"][b], device) for b in mine}
    prepared = PreparedModel(model=model, tokenizer=loaded.tokenizer, device=device)
    n = payload["inputs"]["max_new_tokens"]
    pin = payload["inputs"].get("pin_length", True)
    reference = {}
    for b, batch in batches.items():
        hidden, top1 = _forward(model, batch)
        _, _, generated, _ = generate_once(prepared, batch, n, pin_length=pin)
        reference[b] = (hidden, top1, generated)
    stats, kept = dispatch.install(layers, plan, rank, world)
    first = payload["inputs"]["batches"][0]["input_ids"][0][-1]
    spare = {"input_ids": torch.tensor([[first]], device=device), "attention_mask": torch.ones(1, 1, dtype=torch.long,
                                                                                            device=device)}
    return {"model": model, "prepared": prepared, "batches": batches, "mine": mine, "rounds": rounds, "spare": spare,
            "reference": reference, "stats": stats, "expert_bytes": kept, "max_new_tokens": n, "pin": pin,
            "dtype": loaded.dtype, "batch_size": len(payload["inputs"]["batches"][0]["input_ids"])}


def worker(rank: int, world: int, state: dict) -> dict:
    """Teacher-forced pass (measured exchange, checked), then greedy generation under the plan."""
    from infer_tune.runners.base import TokenClock
    from infer_tune.runners.generation import collect_rows, eos_ids, generate_once

    model, stats, mine = state["model"], state["stats"], state["mine"]
    spare = state["spare"]
    diff, scale, top1_equal, top1_total = 0.0, 0.0, 0, 0
    stats.reset()
    start = time.perf_counter()
    for step in range(state["rounds"]):
        b = mine[step] if step < len(mine) else None
        stats.enabled = b is not None
        batch = state["batches"][b] if b is not None else spare
        hidden, top1 = _forward(model, batch)
        if b is not None:
            ref_hidden, ref_top1, _ = state["reference"][b]
            mask = batch["attention_mask"].bool()
            diff = max(diff, float((hidden - ref_hidden)[mask].abs().max()))
            scale = max(scale, float(ref_hidden[mask].abs().max()))
            top1_equal += int((top1 == ref_top1)[mask].sum())
            top1_total += int(mask.sum())
    prefill_s = time.perf_counter() - start
    prefill = stats.to_dict()

    stats.reset()
    eos = set(eos_ids(model, state["prepared"].tokenizer))
    requests, outputs, mismatches = [], [], 0
    start = time.perf_counter()
    for step in range(state["rounds"]):
        b = mine[step] if step < len(mine) else None
        stats.enabled = b is not None
        batch = state["batches"][b] if b is not None else spare
        clock = TokenClock()
        submit_ns, _, generated, natural = generate_once(state["prepared"], batch, state["max_new_tokens"],
                                                         pin_length=state["pin"], clock=clock)
        if b is None:
            continue
        mismatches += int((generated != state["reference"][b][2]).any(dim=1).sum())
        timings, outs = collect_rows(state["prepared"].tokenizer, eos, {k: v.cpu() for k, v in batch.items()},
                                     submit_ns, clock, generated.cpu(), natural,
                                     iteration=0, base_index=b * state["batch_size"], pin_length=state["pin"])
        requests += [dataclasses.asdict(t) for t in timings]
        outputs += [dataclasses.asdict(o) for o in outs]
    generate_s = time.perf_counter() - start
    decode = stats.to_dict()
    tolerance = TOLERANCE.get(state["dtype"], 2e-2)
    return {
        "counters": {"prefill_tokens": prefill["tokens"], "prefill_remote_rows": prefill["remote_rows"],
                     "prefill_payload_bytes": prefill["payload_bytes"], "prefill_meta_bytes": prefill["meta_bytes"],
                     "generate_tokens": decode["tokens"], "generate_remote_rows": decode["remote_rows"],
                     "generate_payload_bytes": decode["payload_bytes"], "generate_meta_bytes": decode["meta_bytes"],
                     "top1_equal": top1_equal, "top1_total": top1_total, "generation_mismatches": mismatches},
        "outputs": outputs,
        "requests": requests,
        "batches": mine,
        "prefill_s": prefill_s,
        "generate_s": generate_s,
        "prefill_comm_s": prefill["comm_s"],
        "prefill_expert_s": prefill["expert_s"],
        "pairs_to_rank": prefill["pairs_to_rank"],
        "payload_bytes_to_rank": prefill["payload_bytes_to_rank"],
        "expert_bytes": state["expert_bytes"],
        "max_abs_diff": diff,
        "relative_diff": diff / scale if scale else 0.0,
        "within_tolerance": bool(diff <= tolerance * max(scale, 1e-30)),
        "tolerance": tolerance,
    }
