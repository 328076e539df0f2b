"""How far a result's timings can be trusted: whether its intervals reached their target, and how busy
the host was while it ran.

- `noisy`: for a run measured in interleaved rounds, the intervals of the ratios the target was on
  (`metrics.rounds.judged_on`: all three, or the one the row is ranked on) did not reach the target
  half-width within the round budget (`why` says by how much, and names contention when another
  process used more than OTHER_CPU_LIMIT of the host); for a run measured alone (a trace, a server,
  several processes), another process used more than OTHER_CPU_LIMIT of the host. A two-sample CV
  decides nothing: a noise flag never removes a candidate and never loosens a gate.
- `tpot_p50_cv` / `ttft_p50_cv`: coefficient of variation (stdev / mean) of the per-iteration (per
  round) medians, for reading; None with a single iteration.
- `loadavg_before` / `loadavg_after`: the 1-minute load average when the runner started and ended.
- `other_cpu_share`: CPU time used by every other process during the run, as a share of the host's
  capacity (wall time x logical CPUs): the direct measure of contention that load averages blur.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from infer_tune.document import ResultDocument

NOISE_CV_LIMIT = 0.05  # the CV `compare` assumes for a noisy input that recorded none
OTHER_CPU_LIMIT = 0.10


@dataclass
class HostSnapshot:
    """CPU counters at one instant: host busy seconds, the CPU seconds of this process and its children (the
    running ones too: a launched server's work is this measurement's, not contention)."""

    wall_s: float
    host_busy_s: float
    own_cpu_s: float
    loadavg_1m: float | None

    @classmethod
    def take(cls) -> HostSnapshot:
        times = psutil.cpu_times()
        busy = times.user + times.system + getattr(times, "nice", 0.0) + getattr(times, "irq", 0.0) \
            + getattr(times, "softirq", 0.0) + getattr(times, "steal", 0.0)
        me = psutil.Process()
        own_s = _cpu_s(me.cpu_times()) + sum(_cpu_s(t) for t in _descendant_times(me))
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = None
        return cls(time.perf_counter(), busy, own_s, load)


def _cpu_s(times) -> float:
    """User + system seconds of a process and of its children it has waited for."""
    return times.user + times.system + getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0)


def _descendant_times(process: psutil.Process) -> list:
    """cpu_times of the process's live descendants: a server it started (a launched engine, a worker) works
    for it, and the kernel counts a child's time in `children_*` only once it has exited and been waited for,
    so without these a running child's work would count as another process's."""
    out = []
    try:
        children = process.children(recursive=True)
    except (psutil.Error, OSError):
        return out
    for child in children:
        try:
            out.append(child.cpu_times())
        except (psutil.Error, OSError):
            continue  # exited meanwhile: its time moves to its parent's children_* once it is waited for
    return out


def other_share(before: HostSnapshot, after: HostSnapshot) -> float:
    """Share of the host's CPU capacity that other processes used between two snapshots (steal included)."""
    wall = max(after.wall_s - before.wall_s, 1e-9)
    other = max((after.host_busy_s - before.host_busy_s) - (after.own_cpu_s - before.own_cpu_s), 0.0)
    return other / (wall * (psutil.cpu_count() or 1))


def cv(values: list[float]) -> float | None:
    """stdev / mean of `values` (None for fewer than two values or a zero mean)."""
    values = [v for v in values if v is not None]
    if len(values) < 2 or statistics.fmean(values) == 0:
        return None
    return statistics.stdev(values) / statistics.fmean(values)


def per_iteration_medians(requests, attr: str) -> list[float]:
    """Median of `attr` (ttft_ms / tpot_ms) over the requests of each iteration, in iteration order."""
    by_iteration: dict[int, list[float]] = {}
    for request in requests:
        if not request.token_ns:
            continue
        value = getattr(request, attr)
        if value is not None:
            by_iteration.setdefault(request.iteration, []).append(value)
    return [statistics.median(v) for _, v in sorted(by_iteration.items()) if v]


def figure(requests, before: HostSnapshot, after: HostSnapshot, *, rounds: dict | None = None,
           other_limit: float = OTHER_CPU_LIMIT) -> dict:
    """The noise figure of one run (module docstring) from its request timings, two host snapshots and,
    for a run measured in rounds, its `metrics.rounds` block."""
    share = other_share(before, after)
    out = {
        "tpot_p50_cv": cv(per_iteration_medians(requests, "tpot_ms")),
        "ttft_p50_cv": cv(per_iteration_medians(requests, "ttft_ms")),
        "loadavg_before": before.loadavg_1m,
        "loadavg_after": after.loadavg_1m,
        "other_cpu_share": share,
        "other_cpu_limit": other_limit,
    }
    contended = share > other_limit
    why = []
    if rounds is not None and rounds.get("target_met") is False:
        achieved = rounds.get("achieved_half_width_pct")
        shown = f"±{achieved:.1f}%" if isinstance(achieved, (int, float)) and achieved != float("inf") else "none"
        on = rounds.get("judged_on")
        shown += f" ({', '.join(on)})" if on else ""
        why.append(f"95% interval {shown} did not reach ±{rounds['target_half_width_pct']:g}% in "
                   f"{rounds['rounds']} rounds ({rounds['stopped_by']})")
        if contended:
            why.append(f"other processes used {share:.0%} of the host's CPU during the rounds")
        else:
            by_round = rounds.get("other_cpu_by_round") or []
            busiest = max(range(len(by_round)), key=by_round.__getitem__, default=None)
            if busiest is not None and by_round[busiest] > other_limit:
                why.append(f"other processes used {by_round[busiest]:.0%} of the host's CPU in round {busiest + 1}")
    elif rounds is None and contended:
        why.append(f"other processes used {share:.0%} of the host's CPU during the run")
    out["noisy"] = bool(why)
    out["why"] = why
    return out


def widest_cv(*docs: ResultDocument) -> float:
    """The largest timing CV among the documents' noise figures (0 when none recorded); whether a document
    is flagged noisy: `ResultDocument.noisy`."""
    values = []
    for doc in docs:
        values += [doc.noise.get(k) for k in ("tpot_p50_cv", "ttft_p50_cv") if isinstance(doc.noise.get(k), (int, float))]
    return max(values, default=0.0)
