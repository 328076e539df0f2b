"""What a placement plan predicts on a load file: balance, dispatch traffic and memory per device.

Definitions (docs/experts.md):
- device load: the tokens its expert replicas compute; an expert's tokens split evenly over its
  replicas (`even` replica routing spreads them round-robin; `local` routing sends a token to a
  replica on its own device when there is one, which is an even split when tokens' homes are).
- `balancedness`: mean device load / max device load, per layer; overall sum of the per-layer means
  over sum of the per-layer maxima (the figure DeepSeek's EPLB and vLLM's EPLB report). 1.0 = even.
- `time_balancedness`: the same on load / speed (what a heterogeneous machine waits for).
- `cross_device_tokens_per_token`: expected copies of one token's hidden state sent to other
  devices in one MoE layer (one copy per destination device, however many of its experts live
  there), with the token's home device uniform over the devices; mean over layers. Exact over the
  load file's recorded expert sets.
- `alltoall_bytes_per_token`: bytes one token puts on the wire through all MoE layers of one
  forward pass: dispatch + combine (2 x copies x hidden size x activation bytes), summed over layers;
  with nodes > 1 split by link kind into `intra_node_bytes_per_token` and `inter_node_bytes_per_token`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from infer_tune.tuners.experts.loadfile import LoadFile
from infer_tune.tuners.experts.planners import Plan, Topology


def replica_choice(hosts: np.ndarray, topo: Topology, routing: str = "even") -> np.ndarray:
    """[E, D_home, D_dest]: probability a token homed on h sends its expert e to device d.

    The replicas on the token's node (else all), evenly; with `local` routing a replica on the
    token's own device first.
    """
    num_experts, devices = hosts.shape
    node = np.array([topo.node_of(d) for d in range(devices)])
    same_node = (node[:, None] == node[None, :]).astype(np.float64)  # [h, d]
    out = np.zeros((num_experts, devices, devices))
    for h in range(devices):
        local = (hosts[:, h] > 0) & (routing == "local")
        near = hosts * same_node[h][None, :]
        tier = np.where(local[:, None], np.eye(devices)[h][None, :] * hosts,
                        np.where(near.sum(1, keepdims=True) > 0, near, hosts)).astype(np.float64)
        out[:, h, :] = tier / np.maximum(tier.sum(1, keepdims=True), 1)
    return out


def expected_copies(routes: list[tuple[tuple[int, ...], int]], hosts: np.ndarray, topo: Topology,
                    top_k: int, routing: str = "even") -> tuple[float, float, float]:
    """(remote device copies, remote node copies, remote device copies on other nodes) per token, averaged
    over homes and the route sets. The third is what the dispatch (one copy per destination device)
    sends between nodes; the second what a per-node deduplicating dispatch would."""
    if not routes:
        return 0.0, 0.0, 0.0
    num_experts, devices = hosts.shape
    choice = replica_choice(hosts, topo, routing)  # [E, h, d]
    pad = np.zeros((1, devices, devices))
    choice = np.concatenate([choice, pad])  # index E: no expert
    index = np.full((len(routes), top_k), num_experts, dtype=np.int64)
    for r, (experts, _) in enumerate(routes):
        index[r, :len(experts)] = experts
    weight = np.array([c for _, c in routes], dtype=np.float64)
    node = np.array([topo.node_of(d) for d in range(devices)])
    device_total, node_total, other_node_total = 0.0, 0.0, 0.0
    for h in range(devices):
        miss = np.prod(1.0 - choice[index, h, :], axis=1)  # [R, D]: no expert of the set goes to d
        hit = 1.0 - miss
        hit[:, h] = 0.0
        device_total += float(weight @ hit.sum(1))
        other_node_total += float(weight @ hit[:, node != node[h]].sum(1))
        if topo.nodes > 1:
            node_miss = np.stack([np.prod(miss[:, node == n], axis=1) for n in range(topo.nodes)], 1)
            node_hit = 1.0 - node_miss
            node_hit[:, node[h]] = 0.0
            node_total += float(weight @ node_hit.sum(1))
    norm = weight.sum() * devices
    return device_total / norm, node_total / norm, other_node_total / norm


def evaluate(plan: Plan, load: LoadFile) -> dict[str, Any]:
    """Every predicted metric of `plan` on `load` (see the module docstring)."""
    topo = plan.topology
    hosts = plan.hosts()  # [L, E, D]
    loads = load.loads()  # [L, E]
    copies = hosts.sum(2)  # [L, E]
    device_load = np.einsum("le,led->ld", loads / np.maximum(copies, 1), hosts)  # [L, D]
    speeds = np.asarray(topo.speeds, dtype=np.float64)
    means, maxes = device_load.mean(1), device_load.max(1)
    per_layer = np.where(maxes > 0, means / np.maximum(maxes, 1e-300), 1.0)
    times = device_load / speeds[None, :]
    ideal = device_load.sum(1) / speeds.sum()
    device_copies, node_copies, inter_copies = [], [], []
    for layer, hosts_l in zip(load.layers, hosts):
        d, n, x = expected_copies(layer.routes, hosts_l, topo, load.model.top_k, plan.replica_routing)
        device_copies.append(d)
        node_copies.append(n)
        inter_copies.append(x)
    wire = 2 * load.model.hidden_size * load.model.dtype_bytes
    slots_used = hosts.sum(1)  # [L, D]
    memory = slots_used.sum(0) * load.model.expert_bytes + load.model.dense_bytes
    metrics: dict[str, Any] = {
        "balancedness": float(means.sum() / maxes.sum()) if maxes.sum() > 0 else 1.0,
        "balancedness_per_layer": [float(v) for v in per_layer],
        "time_balancedness": float(ideal.sum() / times.max(1).sum()) if times.max(1).sum() > 0 else 1.0,
        "cross_device_tokens_per_token": float(np.mean(device_copies)),
        "cross_device_tokens_per_token_per_layer": [float(v) for v in device_copies],
        "alltoall_bytes_per_token": float(np.sum(device_copies) * wire),
        "device_load_share": [float(v) for v in device_load.sum(0) / max(device_load.sum(), 1e-300)],
        "device_memory_bytes": [int(v) for v in memory],
        "max_device_memory_bytes": int(memory.max()),
        "expert_slots_per_device": [int(v) for v in slots_used.max(0)],
        "physical_experts_per_layer": int(hosts.sum() // max(len(hosts), 1)),
        "replicas": plan.replicas,
    }
    if topo.nodes > 1:
        metrics["cross_node_tokens_per_token"] = float(np.mean(node_copies))
        # the dispatch's bytes per link kind: to devices of the token's own node, to other nodes
        metrics["inter_node_bytes_per_token"] = float(np.sum(inter_copies) * wire)
        metrics["intra_node_bytes_per_token"] = metrics["alltoall_bytes_per_token"] - metrics["inter_node_bytes_per_token"]
    return metrics
