"""Interleaved rounds: the baseline and its candidates measured in alternating one-pass rounds.

Each variant is warmed once (its warmup calls plus one discarded pass), then every round runs one
timed pass over the workload of each variant in a freshly shuffled order, so drift of the host (a
neighbour starting, thermal or frequency changes) hits every variant alike. A ratio (decode speedup,
TTFT ratio, throughput ratio) is taken per round and the rounds are its samples: rounds continue
until every candidate's ratio intervals are within the protocol's target half-width, or the round or
time budget ends. See docs/architecture.md, "Measurement protocol".
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from infer_tune.document import RoundsBlock
from infer_tune.metrics.stats import log_ratio_interval
from infer_tune.runners import GenerationRun, PreparedModel, get_runner
from infer_tune.runners.base import Progress
from infer_tune.workload import Inputs, Protocol, Workload

MIN_ROUNDS = 3  # an interval from two rounds has one degree of freedom: t = 12.7
# the ratios every candidate reports with an interval: name -> (metric, higher is better for the candidate?)
RATIOS = {"speedup_vs_baseline": "tpot_ms", "ttft_speedup_vs_baseline": "ttft_ms",
          "throughput_ratio_vs_baseline": "output_throughput_tok_s"}


@dataclass
class Variant:
    """One prepared model taking part in the rounds (the baseline is variant 0)."""

    name: str
    prepared: PreparedModel
    runner: str
    warm: GenerationRun | None = None
    passes: list[GenerationRun] = field(default_factory=list)

    @property
    def timed_s(self) -> float:
        return sum(p.measured_wall_s for p in self.passes)


@dataclass
class RoundsOutcome:
    """What the rounds measured: per candidate, its ratio intervals; for the group, how it stopped."""

    rounds: int
    elapsed_s: float
    target_half_width_pct: float
    target_met: bool
    stopped_by: str  # "target", "max_rounds" or "max_duration_s"
    order: list[list[str]]
    intervals: dict[str, dict[str, dict]]  # candidate name -> ratio name -> log_ratio_interval(...)
    baseline_drift_pct: float | None  # the baseline's last round against its first (TPOT median)

    def block(self, name: str) -> dict:
        """The `metrics.rounds` block of one candidate (or of the baseline)."""
        mine = self.intervals.get(name, {})
        widths = [iv["half_width_pct"] if iv else float("inf") for iv in mine.values()]
        return asdict(RoundsBlock(
            rounds=self.rounds, elapsed_s=self.elapsed_s, variants=len(self.order[0]) if self.order else 1,
            target_half_width_pct=self.target_half_width_pct,
            achieved_half_width_pct=max(widths) if widths and max(widths) != float("inf") else None,
            target_met=self.target_met if name in self.intervals else None, stopped_by=self.stopped_by,
            baseline_drift_pct=self.baseline_drift_pct))


def one_pass(protocol: Protocol) -> Protocol:
    return dataclasses.replace(protocol, warmup=0, min_iterations=1, min_duration_s=0.0)


def warm_pass(protocol: Protocol) -> Protocol:
    return dataclasses.replace(protocol, min_iterations=1, min_duration_s=0.0)


def pass_value(run: GenerationRun, metric: str) -> float | None:
    """One pass's figure: the median TPOT / TTFT of its requests, or its output throughput."""
    if metric == "output_throughput_tok_s":
        return run.generated_tokens / run.measured_wall_s if run.measured_wall_s > 0 else None
    values = [getattr(r, metric) for r in run.requests if r.token_ns]
    values = [v for v in values if v is not None and v > 0]
    return statistics.median(values) if values else None


def round_ratios(base: Variant, cand: Variant, metric: str) -> list[float]:
    """Per round, the candidate's advantage: base / cand for latencies, cand / base for throughput."""
    out = []
    for b_run, c_run in zip(base.passes, cand.passes):
        b, c = pass_value(b_run, metric), pass_value(c_run, metric)
        if b and c:
            out.append(c / b if metric == "output_throughput_tok_s" else b / c)
    return out


def intervals(base: Variant, cand: Variant) -> dict[str, dict | None]:
    return {name: log_ratio_interval(round_ratios(base, cand, metric)) for name, metric in RATIOS.items()}


def run_rounds(variants: list[Variant], inputs: Inputs, workload: Workload, protocol: Protocol, *, seed: int = 0,
               progress: Progress | None = None) -> RoundsOutcome:
    """Warm every variant, then rounds of one pass each in shuffled order until the intervals are
    within `protocol.target_half_width_pct` (every candidate, every ratio), or a budget ends.

    `protocol.min_iterations` (at least MIN_ROUNDS) and `min_duration_s` (timed seconds per variant)
    are floors; `max_rounds` and `max_duration_s` (from the first round) are the budget.
    """
    for i, v in enumerate(variants):
        if progress:
            progress(f"warming {v.name}", i, len(variants))
        v.warm = get_runner(v.runner)(v.prepared, inputs, workload, warm_pass(protocol), None)
        if v.prepared.counters is not None:
            v.prepared.counters.reset()
            v.prepared.counters.held = True  # counts accumulate over the rounds
    base, candidates = variants[0], variants[1:]
    rng = random.Random(seed)
    floor = max(protocol.min_iterations, MIN_ROUNDS)
    start = time.perf_counter()
    order: list[list[str]] = []
    found: dict[str, dict[str, dict]] = {}
    met, stopped_by = False, "max_rounds"
    try:
        while True:
            sequence = list(variants)
            rng.shuffle(sequence)
            order.append([v.name for v in sequence])
            for v in sequence:
                run = get_runner(v.runner)(v.prepared, inputs, workload, one_pass(protocol), None)
                for request in run.requests:
                    request.iteration = len(order) - 1
                v.passes.append(run)
            found = {c.name: intervals(base, c) for c in candidates}
            widths = [iv["half_width_pct"] if iv else float("inf") for ivs in found.values() for iv in ivs.values()]
            worst = max(widths, default=0.0)
            if progress:
                shown = f"±{worst:.1f}%" if worst != float("inf") else "interval pending"
                progress(f"round {len(order)} ({shown}, target ±{protocol.target_half_width_pct:g}%)",
                         len(order), protocol.max_rounds)
            floors_met = len(order) >= floor and all(v.timed_s >= protocol.min_duration_s for v in variants)
            if floors_met and worst <= protocol.target_half_width_pct:
                met, stopped_by = True, "target"
                break
            if len(order) >= max(protocol.max_rounds, floor) and floors_met:
                stopped_by = "max_rounds"
                break
            if time.perf_counter() - start >= protocol.max_duration_s and floors_met:
                stopped_by = "max_duration_s"
                break
    finally:
        for v in variants:
            if v.prepared.counters is not None:
                v.prepared.counters.held = False
    first, last = pass_value(base.passes[0], "tpot_ms"), pass_value(base.passes[-1], "tpot_ms")
    drift = 100.0 * (last / first - 1.0) if first and last and len(base.passes) > 1 else None
    return RoundsOutcome(rounds=len(order), elapsed_s=time.perf_counter() - start,
                         target_half_width_pct=protocol.target_half_width_pct, target_met=met or not candidates,
                         stopped_by=stopped_by, order=order, intervals=found, baseline_drift_pct=drift)


def merged_run(v: Variant) -> GenerationRun:
    """The variant's passes as one run: requests of every round (iteration = round), outputs of the
    first round, timed wall summed, warmup from the warm call, technique counters accumulated over the
    rounds (the runner's own per-pass counts summed)."""
    passes = v.passes
    technique_keys = set(v.prepared.counters.snapshot()) if v.prepared.counters is not None else set()
    counters = dict(passes[-1].counters)
    for key in counters:
        if key not in technique_keys and all(isinstance(p.counters.get(key), (int, float)) for p in passes):
            counters[key] = sum(p.counters[key] for p in passes)
    cuda = [p.cuda_peak_bytes for p in passes if p.cuda_peak_bytes is not None]
    warm = v.warm
    peak = max(p.peak_rss_bytes for p in passes)
    own_delta = max(p.peak_rss_bytes - p.rss_before_bytes for p in passes)  # the largest any one pass added
    return GenerationRun(
        requests=[r for p in passes for r in p.requests], outputs=passes[0].outputs,
        measured_wall_s=sum(p.measured_wall_s for p in passes), iterations=len(passes),
        first_call_ms=warm.first_call_ms if warm else None, warmup_s=warm.warmup_s if warm else 0.0,
        peak_rss_bytes=peak, rss_before_bytes=peak - own_delta,
        generated_tokens=sum(p.generated_tokens for p in passes), batch_size=passes[0].batch_size,
        counters=counters, cuda_peak_bytes=max(cuda) if cuda else None)
