"""Expert -> device placement per MoE layer: four strategies over one load file.

- `round-robin` (the baseline): expert e on device e mod D, no replicas.
- `load-balanced` (the EPLB idea): replicate the hottest experts (each new replica goes to the expert
  whose per-replica load is highest), pack the replicas onto devices heaviest first onto the lightest
  device with a free slot (never two replicas of one expert on one device), then improve by local
  search: moves and swaps that lighten the heaviest device until none does. With `nodes > 1` it is
  hierarchical: experts (or the model's expert groups) are packed onto nodes first, replicas are
  made within each node and packed onto that node's devices, so replicas never cross a node.
- `locality` (locality.py): no replicas; starts from the balanced packing and swaps / moves experts to keep
  co-activated experts (pairs chosen by the same token) on one device, as long as the heaviest device
  stays within `LOCALITY_SLACK` of the balanced packing's.
- `speed-aware`: `load-balanced` for heterogeneous devices: the objective is time, load / speed, so
  hot experts land on fast devices and cold ones share the slow ones.

A device has `slots` expert slots per layer (the same in every layer: memory is per device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infer_tune.errors import ConfigError

STRATEGIES = ("round-robin", "load-balanced", "locality", "speed-aware")
# how a token picks among an expert's replicas: `even` spreads each expert's tokens evenly over its
# replicas (round-robin; the planned loads hold whatever the tokens' homes); `local` uses a replica on
# the token's own device when there is one (less traffic; loads then follow where the tokens live)
REPLICA_ROUTINGS = ("even", "local")
_EPS = 1e-12


@dataclass
class Topology:
    """The devices a plan places experts on."""

    devices: int
    speeds: list[float] = field(default_factory=list)  # relative speed per device (default: all 1)
    nodes: int = 1
    slots: int | None = None  # expert slots per device per layer (None: as many as the plan needs)

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"devices must be >= 1, got {self.devices}")
        if not self.speeds:
            self.speeds = [1.0] * self.devices
        if len(self.speeds) != self.devices:
            raise ConfigError(f"device_speeds has {len(self.speeds)} values but devices is {self.devices}; "
                              "give one speed per device")
        if any(not (s > 0 and math.isfinite(s)) for s in self.speeds):
            raise ConfigError(f"device_speeds must be positive numbers, got {self.speeds}")
        if self.nodes < 1 or self.devices % self.nodes:
            raise ConfigError(f"nodes must be >= 1 and divide devices ({self.devices}), got {self.nodes}")
        if self.slots is not None and self.slots < 1:
            raise ConfigError(f"slots per device must be >= 1, got {self.slots}")

    @property
    def per_node(self) -> int:
        return self.devices // self.nodes

    def node_of(self, device: int) -> int:
        return device // self.per_node


@dataclass
class Plan:
    """Which experts each device holds in each MoE layer (replicas appear on several devices)."""

    strategy: str
    topology: Topology
    placement: list[list[list[int]]]  # [layer][device] -> logical expert ids
    num_experts: int
    replicas: int = 0
    replica_routing: str = "even"

    def hosts(self) -> np.ndarray:
        """[L, E, D] 1 where device d holds expert e in layer l."""
        out = np.zeros((len(self.placement), self.num_experts, self.topology.devices), dtype=np.int64)
        for layer, devices in enumerate(self.placement):
            for d, experts in enumerate(devices):
                out[layer, experts, d] = 1
        return out

    def to_dict(self) -> dict[str, Any]:
        t = self.topology
        return {"strategy": self.strategy, "devices": t.devices, "device_speeds": t.speeds, "nodes": t.nodes,
                "slots": t.slots, "num_experts": self.num_experts, "replicas": self.replicas,
                "replica_routing": self.replica_routing, "placement": self.placement}

    @classmethod
    def from_dict(cls, doc: Any, source: str = "plan") -> Plan:
        try:
            topo = Topology(devices=int(doc["devices"]), speeds=[float(s) for s in doc["device_speeds"]],
                            nodes=int(doc.get("nodes", 1)), slots=doc.get("slots"))
            placement = [[[int(e) for e in dev] for dev in layer] for layer in doc["placement"]]
            plan = cls(strategy=str(doc["strategy"]), topology=topo, placement=placement,
                       num_experts=int(doc["num_experts"]), replicas=int(doc.get("replicas", 0)),
                       replica_routing=str(doc.get("replica_routing", "even")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source} is not a placement plan ({type(exc).__name__}: {exc})") from None
        check_plan(plan, source)
        return plan


def check_plan(plan: Plan, source: str = "plan") -> None:
    """Every expert placed in every layer, every device used, slot capacity respected."""
    if plan.replica_routing not in REPLICA_ROUTINGS:
        raise ConfigError(f"{source}: replica_routing must be one of {', '.join(REPLICA_ROUTINGS)}, "
                          f"got '{plan.replica_routing}'")
    for layer, devices in enumerate(plan.placement):
        if len(devices) != plan.topology.devices:
            raise ConfigError(f"{source}: layer {layer} places experts on {len(devices)} devices, "
                              f"the plan has {plan.topology.devices}")
        seen = {e for dev in devices for e in dev}
        missing = set(range(plan.num_experts)) - seen
        if missing or any(not 0 <= e < plan.num_experts for e in seen):
            raise ConfigError(f"{source}: layer {layer} leaves experts {sorted(missing)} unplaced or names "
                              f"experts outside 0..{plan.num_experts - 1}")
        if any(len(set(dev)) != len(dev) for dev in devices):
            raise ConfigError(f"{source}: layer {layer} puts two replicas of one expert on one device")
        slots = plan.topology.slots
        if slots is not None and any(len(dev) > slots for dev in devices):
            raise ConfigError(f"{source}: layer {layer} exceeds {slots} expert slots on a device")


# --------------------------------------------------------------------------- shared steps
def replicate(weights: np.ndarray, extra: int, max_copies: int) -> np.ndarray:
    """Replica count per expert: each extra replica goes to the expert with the highest load per replica."""
    counts = np.ones(len(weights), dtype=np.int64)
    for _ in range(extra):
        per = np.where(counts < max_copies, weights / counts, -np.inf)
        counts[int(np.argmax(per))] += 1
    return counts


def pack(items: list[tuple[int, float]], devices: list[int], slots: int, speeds: np.ndarray) -> dict[int, list[int]]:
    """Heaviest item first onto the device whose time (load / speed) stays lowest, one replica of an
    expert per device, at most `slots` items per device. When only devices that already hold the expert
    have room, a device without it hands one of its items to a device with room first."""
    load = {d: 0.0 for d in devices}
    held: dict[int, dict[int, float]] = {d: {} for d in devices}
    for expert, weight in sorted(items, key=lambda it: (-it[1], it[0])):
        free = [d for d in devices if len(held[d]) < slots]
        if not free:
            raise ConfigError(f"{len(items)} expert replicas do not fit in {len(devices)} devices x {slots} slots")
        fresh = [d for d in free if expert not in held[d]]
        if not fresh:
            fresh = _make_room(held, load, expert, free)
        best = min(fresh, key=lambda d: ((load[d] + weight) / speeds[d], load[d], d))
        held[best][expert] = weight
        load[best] += weight
    return {d: list(v) for d, v in held.items()}


def _make_room(held: dict[int, dict[int, float]], load: dict[int, float], expert: int, free: list[int]) -> list[int]:
    """Move one item from a full device that lacks `expert` to a device with room; that device is then fresh."""
    for donor in sorted(held, key=lambda d: -load[d]):
        if expert in held[donor] or donor in free:
            continue
        for item, weight in sorted(held[donor].items(), key=lambda kv: kv[1]):
            target = next((f for f in free if item not in held[f]), None)
            if target is not None:
                held[target][item] = held[donor].pop(item)
                load[target] += weight
                load[donor] -= weight
                return [donor]
    raise ConfigError(f"cannot place the replicas of expert {expert} on distinct devices; use fewer replicas")


def refine(held: dict[int, list[int]], share: dict[int, float], slots: int, speeds: np.ndarray,
           max_rounds: int = 10_000) -> dict[int, list[int]]:
    """Local search on the heaviest device (by time): the best move or swap that lowers the larger of the
    two devices' times, until none does. `share[e]` is the load of one replica of expert e."""
    devices = list(held)

    def time_of(d: int, experts: list[int]) -> float:
        return sum(share[e] for e in experts) / speeds[d]

    for _ in range(max_rounds):
        times = {d: time_of(d, held[d]) for d in devices}
        top = max(devices, key=lambda d: (times[d], -d))
        best: tuple[float, Any] | None = None
        for other in devices:
            if other == top:
                continue
            for i, a in enumerate(held[top]):
                if len(held[other]) < slots and a not in held[other]:  # move a
                    worst = max((times[top] * speeds[top] - share[a]) / speeds[top],
                                (times[other] * speeds[other] + share[a]) / speeds[other])
                    if worst < times[top] - _EPS and (best is None or worst < best[0]):
                        best = (worst, ("move", i, other, None))
                for j, b in enumerate(held[other]):
                    if a == b or b in held[top] or a in held[other] or share[a] <= share[b]:
                        continue
                    delta = share[a] - share[b]
                    worst = max((times[top] * speeds[top] - delta) / speeds[top],
                                (times[other] * speeds[other] + delta) / speeds[other])
                    if worst < times[top] - _EPS and (best is None or worst < best[0]):
                        best = (worst, ("swap", i, other, j))
        if best is None:
            break
        kind, i, other, j = best[1]
        a = held[top].pop(i)
        if kind == "swap":
            b = held[other].pop(j)
            held[top].append(b)
        held[other].append(a)
    return {d: sorted(v) for d, v in held.items()}


def _slots(topo: Topology, physical: int) -> int:
    """Slots per device: the topology's capacity, else the fewest that fit `physical` replicas."""
    need = math.ceil(physical / topo.devices)
    if topo.slots is None:
        return need
    if topo.slots < need:
        raise ConfigError(f"{physical} expert replicas per layer need {need} slots per device on {topo.devices} "
                          f"devices; memory_per_device allows {topo.slots}")
    return topo.slots


def check_fits(num_experts: int, topo: Topology, replicas: int) -> None:
    """Refuse topologies a layer cannot fill: every device needs at least one expert replica."""
    physical = num_experts + replicas
    if topo.devices > physical:
        raise ConfigError(f"{topo.devices} devices but only {num_experts} experts + {replicas} replicas = "
                          f"{physical} expert slots per layer: every device needs at least one; use at most "
                          f"{physical} devices or at least {topo.devices - num_experts} replicas")
    if replicas < 0:
        raise ConfigError(f"replicas must be >= 0, got {replicas}")
    if replicas > num_experts * (topo.devices - 1):
        raise ConfigError(f"{replicas} replicas exceed one replica of each of {num_experts} experts per device")


# --------------------------------------------------------------------------- strategies
def round_robin(loads: np.ndarray, topo: Topology, replicas: int = 0, **_: Any) -> list[list[list[int]]]:
    """Expert e on device e mod D in every layer (replicas are not used)."""
    num_experts = loads.shape[1]
    check_fits(num_experts, topo, 0)
    _slots(topo, num_experts)
    layer = [[e for e in range(num_experts) if e % topo.devices == d] for d in range(topo.devices)]
    return [[list(dev) for dev in layer] for _ in range(loads.shape[0])]


def _balance_layer(weights: np.ndarray, topo: Topology, replicas: int, speeds: np.ndarray,
                   groups: int) -> list[list[int]]:
    num_experts = len(weights)
    slots = _slots(topo, num_experts + replicas)
    if topo.nodes == 1:
        counts = replicate(weights, replicas, topo.devices)
        share = {e: float(weights[e] / counts[e]) for e in range(num_experts)}
        items = [(e, share[e]) for e in range(num_experts) for _ in range(counts[e])]
        held = refine(pack(items, list(range(topo.devices)), slots, speeds), share, slots, speeds)
        return [held[d] for d in range(topo.devices)]
    # hierarchical: units (expert groups when the model routes by group, else experts) -> nodes
    if num_experts % topo.nodes or replicas % topo.nodes:
        raise ConfigError(f"hierarchical placement over {topo.nodes} nodes needs experts ({num_experts}) and "
                          f"replicas ({replicas}) divisible by the node count")
    unit = num_experts // groups if groups > 1 and groups % topo.nodes == 0 else 1
    units = num_experts // unit
    unit_load = weights.reshape(units, unit).sum(1)
    node_speed = np.array([speeds[n * topo.per_node:(n + 1) * topo.per_node].sum() for n in range(topo.nodes)])
    unit_share = {u: float(unit_load[u]) for u in range(units)}
    per_node_units = units // topo.nodes
    packed = pack([(u, unit_share[u]) for u in range(units)], list(range(topo.nodes)), per_node_units, node_speed)
    candidates = [packed, refine({n: list(v) for n, v in packed.items()}, unit_share, per_node_units, node_speed)]
    # a better-balanced node split can pack worse onto devices: keep whichever ends lighter
    placements = [_fill_nodes(nodes, weights, topo, replicas, speeds, unit, slots) for nodes in candidates]
    return min(placements, key=lambda p: max(_time(p, weights, speeds)))


def _time(placement: list[list[int]], weights: np.ndarray, speeds: np.ndarray) -> list[float]:
    copies = np.zeros(len(weights))
    for experts in placement:
        copies[experts] += 1
    return [sum(weights[e] / copies[e] for e in experts) / speeds[d] for d, experts in enumerate(placement)]


def _fill_nodes(nodes: dict[int, list[int]], weights: np.ndarray, topo: Topology, replicas: int, speeds: np.ndarray,
                unit: int, slots: int) -> list[list[int]]:
    """Replicate and pack each node's experts onto that node's devices."""
    placement: list[list[int]] = [[] for _ in range(topo.devices)]
    for node, node_units in nodes.items():
        experts = [u * unit + i for u in node_units for i in range(unit)]
        devices = list(range(node * topo.per_node, (node + 1) * topo.per_node))
        counts = replicate(weights[experts], replicas // topo.nodes, topo.per_node)
        share = {e: float(weights[e] / c) for e, c in zip(experts, counts)}
        items = [(e, share[e]) for e, c in zip(experts, counts) for _ in range(c)]
        node_slots = max(slots, math.ceil(len(items) / topo.per_node))
        if topo.slots is not None and node_slots > topo.slots:
            raise ConfigError(f"node {node} needs {node_slots} slots per device; memory_per_device allows {topo.slots}")
        held = refine(pack(items, devices, node_slots, speeds), share, node_slots, speeds)
        for d in devices:
            placement[d] = held[d]
    return placement


def load_balanced(loads: np.ndarray, topo: Topology, replicas: int = 0, groups: int = 1,
                  **_: Any) -> list[list[list[int]]]:
    """Replicate hot experts and pack replicas so the heaviest device is as light as possible (equal speeds)."""
    check_fits(loads.shape[1], topo, replicas)
    speeds = np.ones(topo.devices)
    return [_balance_layer(w, topo, replicas, speeds, groups) for w in loads]


def speed_aware(loads: np.ndarray, topo: Topology, replicas: int = 0, groups: int = 1,
                **_: Any) -> list[list[list[int]]]:
    """Like load-balanced, minimizing the slowest device's time (load / speed)."""
    check_fits(loads.shape[1], topo, replicas)
    speeds = np.asarray(topo.speeds, dtype=np.float64)
    return [_balance_layer(w, topo, replicas, speeds, groups) for w in loads]


# strategy -> planner; `locality` (tuners/experts/locality.py, built on these helpers) adds itself
PLANNERS = {"round-robin": round_robin, "load-balanced": load_balanced, "speed-aware": speed_aware}


def make_plan(strategy: str, loads: np.ndarray, topo: Topology, *, replicas: int = 0,
              coactivation: np.ndarray | None = None, groups: int = 1, replica_routing: str = "even",
              routes: list | None = None) -> Plan:
    """One strategy's placement over [L, E] loads (replicas apply to load-balanced and speed-aware)."""
    if strategy not in PLANNERS:
        raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got '{strategy}'")
    used = replicas if strategy in ("load-balanced", "speed-aware") else 0
    placement = PLANNERS[strategy](loads, topo, replicas=used, coactivation=coactivation, groups=groups,
                                   routes=routes)
    plan = Plan(strategy=strategy, topology=topo, placement=placement, num_experts=loads.shape[1], replicas=used,
                replica_routing=replica_routing)
    check_plan(plan, f"the {strategy} plan")
    return plan
