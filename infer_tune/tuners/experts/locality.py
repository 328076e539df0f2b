"""The locality-aware planner: keep experts that one token chooses together on one device.

Starts from the balanced packing (no replicas) and allows the heaviest device to grow by at most
`LOCALITY_SLACK` over it. Two hill climbs, best improvement first:
1. on the co-activated pair weight kept on a device (matrix algebra over all swaps and moves at once;
   exact for top-2 routing, a proxy above);
2. on the exact objective, the number of distinct devices each recorded expert set touches (the
   dispatch sends one copy per device), when the recorded sets are few enough (`EXACT_BUDGET`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from infer_tune.tuners.experts.planners import _EPS, PLANNERS, Topology, _slots, check_fits, load_balanced

LOCALITY_SLACK = 0.10  # the heaviest device may be this much heavier than in the balanced packing
EXACT_BUDGET = 3e8  # swaps x route entries per sweep above which only the pair proxy is used


def _where(placement: list[list[int]], num_experts: int) -> np.ndarray:
    where = np.zeros(num_experts, dtype=np.int64)
    for d, experts in enumerate(placement):
        where[experts] = d
    return where


def _limit(weights: np.ndarray, placement: list[list[int]], devices: int) -> float:
    load = np.bincount(_where(placement, len(weights)), weights=weights, minlength=devices)
    return max(float(load.max()) * (1 + LOCALITY_SLACK), _EPS)


def exact_refine(where: np.ndarray, weights: np.ndarray, routes: list[tuple[tuple[int, ...], int]], devices: int,
                 slots: int, limit: float, max_sweeps: int = 200) -> np.ndarray:
    """First-improvement swaps / moves on sum over sets of count x distinct devices touched."""
    num_experts = len(weights)
    top_k = max(len(r) for r, _ in routes)
    index = np.full((len(routes), top_k), num_experts, dtype=np.int64)
    for r, (experts, _) in enumerate(routes):
        index[r, :len(experts)] = experts
    count = np.array([c for _, c in routes], dtype=np.float64)
    if num_experts * num_experts * index.size > EXACT_BUDGET:
        return where
    rows_of = [np.nonzero((index == e).any(1))[0] for e in range(num_experts)]

    def cost(rows: np.ndarray, assign: np.ndarray) -> float:
        dev = np.append(assign, devices)[index[rows]]  # [R, k], padding -> a dummy device
        touched = np.zeros((len(rows), devices + 1), dtype=bool)
        np.put_along_axis(touched, dev, True, axis=1)
        return float(count[rows] @ touched[:, :devices].sum(1))

    where = where.copy()
    for _ in range(max_sweeps):
        improved = False
        load = np.bincount(where, weights=weights, minlength=devices)
        size = np.bincount(where, minlength=devices)
        for a in range(num_experts):
            for b in list(range(a + 1, num_experts)) + [-d - 1 for d in range(devices)]:
                if b >= 0:  # swap a and b
                    if where[a] == where[b]:
                        continue
                    delta = weights[a] - weights[b]
                    if load[where[a]] - delta > limit or load[where[b]] + delta > limit:
                        continue
                    rows = np.union1d(rows_of[a], rows_of[b])
                    trial = where.copy()
                    trial[a], trial[b] = where[b], where[a]
                else:  # move a to device -b-1 with a free slot
                    d = -b - 1
                    if d == where[a] or size[d] >= slots or load[d] + weights[a] > limit:
                        continue
                    rows = rows_of[a]
                    trial = where.copy()
                    trial[a] = d
                if cost(rows, trial) < cost(rows, where) - _EPS:
                    where = trial
                    load = np.bincount(where, weights=weights, minlength=devices)
                    size = np.bincount(where, minlength=devices)
                    improved = True
        if not improved:
            break
    return where


def locality(loads: np.ndarray, topo: Topology, coactivation: np.ndarray | None = None, replicas: int = 0,
             groups: int = 1, routes: list | None = None, **_: Any) -> list[list[list[int]]]:
    """Balanced packing without replicas, then swaps / moves that keep co-activated experts together:
    first on the pair weight, then (when the recorded expert sets are given and small enough) on the
    exact number of devices each recorded set touches."""
    num_experts = loads.shape[1]
    check_fits(num_experts, topo, 0)
    slots = _slots(topo, num_experts)
    start = load_balanced(loads, topo, 0, groups)
    if coactivation is None:
        return start
    out = []
    for i, (w, layer) in enumerate(zip(loads, start)):
        where = _cluster_layer(w, coactivation[i].astype(np.float64), layer, topo.devices, slots)
        limit = _limit(w, layer, topo.devices)
        if routes is not None and routes[i]:
            where = exact_refine(where, w, routes[i], topo.devices, slots, limit)
        out.append([sorted(int(e) for e in np.nonzero(where == d)[0]) for d in range(topo.devices)])
    return out


def _cluster_layer(weights: np.ndarray, pair: np.ndarray, start: list[list[int]], devices: int,
                   slots: int) -> np.ndarray:
    """Greedy best-gain swaps / moves that raise the co-activation kept on one device."""
    num_experts = len(weights)
    where = _where(start, num_experts)
    limit = _limit(weights, start, devices)
    for _ in range(num_experts * num_experts):
        member = np.eye(devices)[where]  # [E, D]
        with_dev = pair @ member  # co-activation of expert e with the members of device d
        load = np.bincount(where, weights=weights, minlength=devices)
        size = np.bincount(where, minlength=devices)
        own = with_dev[np.arange(num_experts), where]
        # moves: e to device d with a free slot
        move_gain = with_dev - own[:, None]
        move_ok = (size[None, :] < slots) & (np.arange(devices)[None, :] != where[:, None]) \
            & (load[None, :] + weights[:, None] <= limit)
        move_gain = np.where(move_ok, move_gain, -np.inf)
        # swaps: a (on i) with b (on j)
        cross = with_dev[:, where]  # [a, b] = co-activation of a with b's device
        swap_gain = cross - own[:, None] + cross.T - own[None, :] - 2 * pair
        delta = weights[:, None] - weights[None, :]
        swap_ok = (where[:, None] != where[None, :]) \
            & (load[where][:, None] - delta <= limit) & (load[where][None, :] + delta <= limit)
        swap_gain = np.where(swap_ok, swap_gain, -np.inf)
        best_move, best_swap = move_gain.max(), swap_gain.max()
        if max(best_move, best_swap) <= _EPS:
            break
        if best_move >= best_swap:
            e, d = np.unravel_index(int(np.argmax(move_gain)), move_gain.shape)
            where[e] = d
        else:
            a, b = np.unravel_index(int(np.argmax(swap_gain)), swap_gain.shape)
            where[a], where[b] = where[b], where[a]
    return where


PLANNERS["locality"] = locality
