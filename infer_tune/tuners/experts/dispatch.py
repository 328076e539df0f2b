"""Expert parallelism under a placement plan: each rank keeps only its experts and exchanges tokens.

Installed the way transformers installs its own EP (`EpDispatchExpertsParallel`): the experts
module's `forward(hidden_states, top_k_index, top_k_weights)` is replaced on the instance, and the
experts' math stays transformers' own (the module's `forward`, on a copy that holds this rank's
expert slots, called top-1 with unit weights as transformers' `AllToAllEP` does). What transformers'
EP cannot express and a plan needs is added here: any expert -> device map, replicas of hot experts
(round-robin over an expert's replicas, or with `local` replica routing the one on the token's own
device first),
and one copy of a token per destination device (its experts there are summed before it goes back).

Per layer call: an all_to_all of the row counts, of the hidden states, of the (slot, weight) lists,
and one back with the partial sums. The bytes are counted for the rank whose tokens they carry (its
copies out, their partial sums back), so passes a rank runs only to join the collectives add nothing.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from infer_tune.tuners.experts.planners import Plan
from infer_tune.tuners.experts.routing import MoELayer


@dataclass
class ExchangeStats:
    """What one rank sent and computed (counted only while `enabled`)."""

    layers: int
    world: int
    enabled: bool = True
    tokens: int = 0  # token-layer visits homed on this rank
    remote_rows: int = 0  # token copies sent to other ranks (dispatch)
    payload_bytes: int = 0  # hidden states of this rank's tokens on the wire: copies out + partial sums back
    meta_bytes: int = 0  # row counts, expert slots and routing weights sent
    local_pairs: int = 0
    remote_pairs: int = 0
    comm_s: float = 0.0
    expert_s: float = 0.0
    pairs_to_rank: list[list[int]] = field(default_factory=list)  # [layer][rank] (token, expert) pairs sent
    payload_bytes_to_rank: list[int] = field(default_factory=list)  # [rank] payload bytes on the link to it

    def __post_init__(self) -> None:
        self.pairs_to_rank = [[0] * self.world for _ in range(self.layers)]
        self.payload_bytes_to_rank = [0] * self.world

    def reset(self) -> None:
        fresh = ExchangeStats(self.layers, self.world, self.enabled)
        self.__dict__.update(fresh.__dict__)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("enabled", "layers", "world")}


class RouteTable:
    """For one layer on one rank: the rank and slot that computes each expert's tokens."""

    def __init__(self, devices: list[list[int]], rank: int, plan: Plan) -> None:
        topo = plan.topology
        num_experts = plan.num_experts
        self.local_slot = torch.full((num_experts,), -1, dtype=torch.long)
        for slot, expert in enumerate(devices[rank]):
            if plan.replica_routing == "local" or sum(expert in dev for dev in devices) == 1:
                self.local_slot[expert] = slot  # else `even`: every replica, this one too, in turn
        choices: list[list[tuple[int, int]]] = []
        for expert in range(num_experts):
            hosts = [(d, dev.index(expert)) for d, dev in enumerate(devices) if expert in dev]
            near = [h for h in hosts if topo.node_of(h[0]) == topo.node_of(rank)]
            choices.append(near or hosts)
        width = max(len(c) for c in choices)
        self.rank_of = torch.zeros((num_experts, width), dtype=torch.long)
        self.slot_of = torch.zeros((num_experts, width), dtype=torch.long)
        self.count = torch.tensor([len(c) for c in choices], dtype=torch.long)
        for e, options in enumerate(choices):
            for j, (d, s) in enumerate(options):
                self.rank_of[e, j], self.slot_of[e, j] = d, s
        self.next = torch.zeros(num_experts, dtype=torch.long)  # round-robin position per expert
        self.rank = rank
        self.device = torch.device("cpu")

    def to(self, device: torch.device) -> RouteTable:
        if device != self.device:
            for name in ("local_slot", "rank_of", "slot_of", "count", "next"):
                setattr(self, name, getattr(self, name).to(device))
            self.device = device
        return self

    def route(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank, slot) for each routed pair (expert ids [M])."""
        slot = self.local_slot[experts]
        rank = torch.full_like(experts, self.rank)
        remote = slot < 0
        if remote.any():
            e = experts[remote]
            order = torch.argsort(e, stable=True)
            sorted_e = e[order]
            per_expert = torch.bincount(sorted_e, minlength=len(self.count))
            start = torch.cumsum(per_expert, 0) - per_expert
            occurrence = torch.empty_like(e)
            occurrence[order] = torch.arange(len(e), device=e.device) - start[sorted_e]
            pick = (self.next[e] + occurrence) % self.count[e]
            self.next += per_expert
            rank[remote] = self.rank_of[e, pick]
            slot[remote] = self.slot_of[e, pick]
        return rank, slot


def local_experts(module: torch.nn.Module, slots: list[int], num_experts: int) -> torch.nn.Module:
    """A copy of an experts module holding only `slots` (its forward is transformers' own)."""
    local = copy.copy(module)
    local._parameters = dict(module._parameters)
    local._buffers = dict(module._buffers)
    local._modules = dict(module._modules)
    index = torch.tensor(slots, dtype=torch.long)
    for name, param in module._parameters.items():
        if param is not None and param.dim() >= 1 and param.shape[0] == num_experts:
            local._parameters[name] = torch.nn.Parameter(param.data[index].clone(), requires_grad=False)
    local.num_experts = len(slots)
    local._is_expert_parallel = False
    return local


class PlacedExperts:
    """The replacement forward of one experts module on one rank."""

    def __init__(self, layer: MoELayer, devices: list[list[int]], rank: int, world: int, plan: Plan,
                 stats: ExchangeStats) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.index, self.rank, self.world = layer.index, rank, world
        self.table = RouteTable(devices, rank, plan)
        self.experts = local_experts(layer.module, devices[rank], layer.num_experts)
        self.forward_local = type(layer.module).forward
        self.stats = stats
        self.expert_bytes = sum(p.numel() * p.element_size() for p in self.experts._parameters.values()
                                if p is not None and p.dim() >= 1 and p.shape[0] == len(devices[rank]))

    def _exchange(self, tensor: torch.Tensor, recv_sizes: list[int], send_sizes: list[int]) -> torch.Tensor:
        out = tensor.new_empty((sum(recv_sizes), *tensor.shape[1:]))
        start = time.perf_counter()
        self.dist.all_to_all_single(out, tensor.contiguous(), recv_sizes, send_sizes)
        self.stats.comm_s += time.perf_counter() - start
        return out

    def _run_experts(self, inputs: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if inputs.shape[0] == 0:
            return inputs.new_zeros(inputs.shape)
        start = time.perf_counter()
        ones = torch.ones((inputs.shape[0], 1), dtype=inputs.dtype, device=inputs.device)
        out = self.forward_local(self.experts, inputs, slots.unsqueeze(-1), ones)
        self.stats.expert_s += time.perf_counter() - start
        return out

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 *args, **kwargs) -> torch.Tensor:
        x = hidden_states
        tokens, k = top_k_index.shape[0], top_k_index.shape[-1]
        hidden = x.shape[-1]
        experts = top_k_index.reshape(-1).long()
        weights = top_k_weights.reshape(-1)
        device = x.device
        token = torch.arange(tokens, device=device).repeat_interleave(k)
        rank, slot = self.table.to(device).route(experts)
        local = rank == self.rank
        remote = ~local
        # one copy per (token, destination rank); rows sorted by rank, then token
        key = rank[remote] * tokens + token[remote]
        rows, row_of = torch.unique(key, sorted=True, return_inverse=True)
        send_rank, send_token = rows // max(tokens, 1), rows % max(tokens, 1)
        send_counts = torch.bincount(send_rank, minlength=self.world)
        order = torch.argsort(row_of, stable=True)
        per_row = torch.bincount(row_of, minlength=len(rows))
        start = torch.cumsum(per_row, 0) - per_row
        position = torch.empty_like(row_of)
        position[order] = torch.arange(len(row_of), device=device) - start[row_of[order]]
        send_slots = torch.full((len(rows), k), -1, dtype=torch.int32, device=device)
        send_weights = torch.zeros((len(rows), k), dtype=weights.dtype, device=device)
        send_slots[row_of, position] = slot[remote].to(torch.int32)
        send_weights[row_of, position] = weights[remote]

        recv_counts = torch.empty_like(send_counts)
        begin = time.perf_counter()
        self.dist.all_to_all_single(recv_counts, send_counts)
        self.stats.comm_s += time.perf_counter() - begin
        send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()
        recv_x = self._exchange(x[send_token], recv_sizes, send_sizes)
        recv_slots = self._exchange(send_slots, recv_sizes, send_sizes)
        recv_weights = self._exchange(send_weights, recv_sizes, send_sizes)

        # this rank's experts: its own tokens' local pairs and the received rows, in one call
        recv_row, recv_pos = torch.nonzero(recv_slots >= 0, as_tuple=True)
        inputs = torch.cat([x[token[local]], recv_x[recv_row]])
        slots = torch.cat([slot[local], recv_slots[recv_row, recv_pos].long()])
        scale = torch.cat([weights[local], recv_weights[recv_row, recv_pos]])
        y = self._run_experts(inputs, slots) * scale.unsqueeze(-1)
        n_local = int(local.sum())
        out = torch.zeros((tokens, hidden), dtype=y.dtype, device=device)
        out.index_add_(0, token[local], y[:n_local])
        partial = torch.zeros((recv_x.shape[0], hidden), dtype=y.dtype, device=device)
        partial.index_add_(0, recv_row, y[n_local:])
        back = self._exchange(partial, send_sizes, recv_sizes)
        out.index_add_(0, send_token, back)

        if self.stats.enabled:
            s = self.stats
            element = x.element_size()
            s.tokens += tokens
            s.remote_rows += len(rows)
            s.payload_bytes += 2 * len(rows) * hidden * element  # its copies out, their partial sums back
            for dest, n in enumerate(send_counts.tolist()):
                s.payload_bytes_to_rank[dest] += 2 * n * hidden * element
            s.meta_bytes += (self.world - 1) * send_counts.element_size() + len(rows) * k * (
                send_slots.element_size() + send_weights.element_size())
            s.local_pairs += n_local
            s.remote_pairs += int(remote.sum())
            counts = torch.bincount(rank, minlength=self.world).tolist()
            s.pairs_to_rank[self.index] = [a + b for a, b in zip(s.pairs_to_rank[self.index], counts)]
        return out.to(x.dtype)


def install(layers: list[MoELayer], plan: Plan, rank: int, world: int) -> tuple[ExchangeStats, int]:
    """Replace every experts module's forward with the plan's expert parallelism on this rank.

    Returns the rank's exchange counters and the bytes of the expert slots it keeps; the full expert
    tensors are released.
    """
    stats = ExchangeStats(layers=len(layers), world=world)
    kept = 0
    for layer in layers:
        placed = PlacedExperts(layer, plan.placement[layer.index], rank, world, plan, stats)
        kept += placed.expert_bytes
        for name in list(layer.expert_params()):
            layer.module._parameters[name] = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        layer.module.forward = placed
    return stats, kept
