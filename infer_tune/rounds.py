"""Interleaved rounds: the baseline and its candidates measured in alternating one-pass rounds.

Each variant is warmed once (none with warmup 0; `warm`): its warmup calls on the first request batch,
then every other request batch once with a few new tokens, so every prompt's prefill shape has run
before the first round (a variant that compiles per cache length, or replays a trace, runs its warmup
calls and one whole discarded pass instead). Then every round is one timed pass over the workload of
each variant, interleaved request by request: for each request batch of the workload, every variant
runs it back to back in a freshly shuffled order, so drift of the host (a neighbour starting,
frequency changes) hits every variant alike and the pairs being compared are seconds apart, not a
whole pass. A request batch during which other processes used more than `noise.OTHER_CPU_LIMIT` of
the host (the host's counters say so, not the timings) is run again once by every variant and the
first try dropped (`reruns_by_round`). A ratio is taken per round — for TTFT and TPOT the geometric
mean over prompts of each prompt's paired ratio, for throughput the pass totals — and the rounds are
its samples, or for TTFT and TPOT the (round, prompt) pairs when the rounds do not differ beyond the
pairs' own spread (`interval`; metrics.stats.paired_rounds_interval): rounds continue until every candidate's intervals of the ratios the target is on are
within the protocol's target half-width (all three, or with `target_on: objective` the one the row is
ranked on: `judged`), or the round or time budget ends. A variant whose runner replays an arrival
trace (`register_runner(..., passes="whole")`) runs its whole trace once per round, at a shuffled
point among the request batches, and is judged on throughput alone (its TTFT and TPOT include
queueing by design). Every variant's per-round pass figures are kept (`per_round`), so any two
variants of the same rounds can be compared with an interval later (continuous vs static batching).
See docs/architecture.md, "The sweep engine".
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import resource
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from infer_tune import env, models
from infer_tune.document import RoundsBlock
from infer_tune.metrics import noise
from infer_tune.metrics.stats import log_ratio_interval, paired_rounds_interval
from infer_tune.runners import GenerationRun, PreparedModel, get_runner
from infer_tune.runners.base import Progress
from infer_tune.workload import Inputs, Protocol, Workload

MIN_ROUNDS = 3  # an interval from two rounds has one degree of freedom: t = 12.7
# the ratios every candidate reports with an interval: name -> the per-pass figure it is taken from (round_ratio)
RATIOS = {"speedup_vs_baseline": "tpot_ms", "ttft_speedup_vs_baseline": "ttft_ms",
          "throughput_ratio_vs_baseline": "output_throughput_tok_s"}
WHOLE_RATIOS = ("throughput_ratio_vs_baseline",)  # what a whole-trace variant is judged on
# a row's objective (ResultDocument.objective: what it is ranked on) -> its ratio
OBJECTIVE_RATIO = {"decode": "speedup_vs_baseline", "ttft": "ttft_speedup_vs_baseline",
                   "throughput": "throughput_ratio_vs_baseline"}
RERUNS = 1  # times a request batch is run again when other processes used the host meanwhile (`run_rounds`)
WARM_TOKENS = 4  # new tokens per request of the warm pass over the request batches after the first
SHORT_WARM = ("generation", "speculative")  # runners whose warm pass may be short (`warm`)
# the per-pass figures kept per round for every variant (RoundsBlock.per_round)
PER_ROUND = ("output_throughput_tok_s", "tpot_ms", "ttft_ms", "e2e_ms_mean")


VARIANT_ATTR = "infer_tune_variant"  # an exception raised while a variant ran carries its name here


@contextlib.contextmanager
def naming(v: Variant):
    """An exception raised inside names the variant that was running (`VARIANT_ATTR`, first one wins); it is
    re-raised unchanged otherwise, so a caller that can drop a variant whose engine failed (scenarios/engine_tune.py
    `rounds_without_crashes`) knows which, and every other caller sees what it always saw."""
    try:
        yield
    except Exception as exc:
        if not hasattr(exc, VARIANT_ATTR):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(exc, VARIANT_ATTR, v.name)
        raise


@dataclass
class Variant:
    """One prepared model taking part in the rounds (the baseline is variant 0)."""

    name: str
    prepared: PreparedModel
    runner: str
    whole: bool = False  # the runner replays the whole workload per call (an arrival trace)
    objective: str = "decode"  # what its row is ranked on (OBJECTIVE_RATIO; the target's ratio under "objective")
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
    stopped_by: str  # "target", "max_rounds", "max_duration_s" or "early: <why>" (run_rounds' `stop`)
    order: list[list[str]]
    intervals: dict[str, dict[str, dict]]  # candidate name -> ratio name -> log_ratio_interval(...)
    baseline_drift_pct: float | None  # the baseline's last round against its first (TPOT median)
    variants: int = 1
    per_round: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)  # name -> figure -> rounds
    other_cpu_by_round: list[float] = field(default_factory=list)  # share of the host other processes used
    reruns_by_round: list[int] = field(default_factory=list)  # contended request batches run again, per round
    major_faults_by_round: list[int] = field(default_factory=list)  # pages this process read back from disk
    # per variant and round, the mean of the plain reads of its weights right after each of its runs (env.read_gb_s)
    read_gb_s_by_round: dict[str, list[float | None]] = field(default_factory=dict)
    tpot_ms_by_prompt: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # name -> per round
    group: str = field(default_factory=lambda: uuid.uuid4().hex[:16])  # the id its rows share (RoundsBlock.group)
    judged: dict[str, tuple[str, ...]] = field(default_factory=dict)  # candidate name -> the target's ratios

    def block(self, name: str) -> dict:
        """The `metrics.rounds` block of one candidate (or of the baseline)."""
        mine = self.intervals.get(name, {})
        on = self.judged.get(name, tuple(mine))
        widths = [iv["half_width_pct"] if iv else float("inf") for key, iv in mine.items() if key in on]
        worst = max(widths, default=float("inf"))
        # met for this row when its own intervals reached the target (the group's rounds may have gone on
        # for another row's sake); None for the baseline, which has no ratio of its own
        met = (worst <= self.target_half_width_pct) if name in self.intervals else None
        return asdict(RoundsBlock(
            rounds=self.rounds, elapsed_s=self.elapsed_s, variants=self.variants,
            target_half_width_pct=self.target_half_width_pct,
            achieved_half_width_pct=worst if worst != float("inf") else None,
            target_met=met, stopped_by=self.stopped_by,
            baseline_drift_pct=self.baseline_drift_pct, per_round=self.per_round.get(name),
            other_cpu_by_round=self.other_cpu_by_round or None,
            major_faults_by_round=self.major_faults_by_round or None, group=self.group,
            read_gb_s_by_round=self.read_gb_s_by_round.get(name) or None,
            tpot_ms_by_prompt_by_round=self.tpot_ms_by_prompt.get(name) or None,
            reruns_by_round=self.reruns_by_round or None,
            judged_on=list(on) if name in self.intervals else None,
            interval_method={key: {k: iv[k] for k in ("pooled", "df", "rounds_f_p") if k in iv}
                             for key, iv in mine.items() if iv and "pooled" in iv} or None))


def one_pass(protocol: Protocol) -> Protocol:
    return dataclasses.replace(protocol, warmup=0, min_iterations=1, min_duration_s=0.0)


def warm_pass(protocol: Protocol) -> Protocol:
    return dataclasses.replace(protocol, min_iterations=1, min_duration_s=0.0)


def warm(v: Variant, inputs: Inputs, workload: Workload, protocol: Protocol) -> GenerationRun:
    """Warm one variant before the rounds: `protocol.warmup` calls of the first request batch at the
    workload's length (the last one is the pass returned; its first call is `first_call_ms`, their time
    `warmup_s`), then one pass over the other request batches at WARM_TOKENS new tokens: every prompt's
    prefill shape runs before the first round at a fraction of a pass's time (decode is most of a pass).
    A variant that compiles per cache length (`compile_config`: every shape must run at full length),
    replays a whole trace, or whose runner is not in SHORT_WARM runs its warmup calls and one whole
    discarded pass (`warm_pass`)."""
    runner = get_runner(v.runner)
    batches = request_batches(inputs)
    short = (not v.whole and v.runner in SHORT_WARM and "compile_config" not in v.prepared.generate_kwargs
             and len(batches) > 1 and workload.max_new_tokens > WARM_TOKENS)
    if not short:
        return runner(v.prepared, inputs, workload, warm_pass(protocol), None)
    start = time.perf_counter()
    first = runner(v.prepared, batches[0][0], workload,
                   dataclasses.replace(warm_pass(protocol), warmup=protocol.warmup - 1), None)
    timed = [r for r in first.requests if r.token_ns]
    first_call_ms = first.first_call_ms if first.first_call_ms is not None else (
        timed[0].e2e_ms if timed else None)
    warmup_s = time.perf_counter() - start
    offset = batches[1][1]
    rest = dataclasses.replace(inputs, prompts=inputs.prompts[offset:], rendered=inputs.rendered[offset:],
                               batches=inputs.batches[1:])
    short_workload = dataclasses.replace(workload, max_new_tokens=WARM_TOKENS)
    runner(v.prepared, rest, short_workload, one_pass(protocol), None)
    return dataclasses.replace(first, first_call_ms=first_call_ms, warmup_s=warmup_s)


def pass_value(run: GenerationRun, metric: str) -> float | None:
    """One pass's figure: the median TPOT / TTFT of its requests, their mean e2e, or its output throughput."""
    if metric == "output_throughput_tok_s":
        return run.generated_tokens / run.measured_wall_s if run.measured_wall_s > 0 else None
    if metric == "e2e_ms_mean":
        e2e = [r.e2e_ms for r in run.requests if r.token_ns]
        return statistics.fmean(e2e) if e2e else None
    values = [getattr(r, metric) for r in run.requests if r.token_ns]
    values = [v for v in values if v is not None and v > 0]
    return statistics.median(values) if values else None


def per_prompt(run: GenerationRun, metric: str) -> dict[int, float]:
    """TTFT / TPOT of each prompt of one pass (its median when a prompt ran more than once)."""
    values: dict[int, list[float]] = {}
    for r in run.requests:
        value = getattr(r, metric) if r.token_ns else None
        if value is not None and value > 0:
            values.setdefault(r.prompt_index, []).append(value)
    return {k: statistics.median(v) for k, v in values.items()}


def round_ratio(b_run: GenerationRun, c_run: GenerationRun, metric: str) -> float | None:
    """One round's advantage of the candidate: cand / base throughput, or for a latency the geometric mean
    over the prompts both ran of base / cand (each prompt's pair ran back to back)."""
    if metric == "output_throughput_tok_s":
        b, c = pass_value(b_run, metric), pass_value(c_run, metric)
        return c / b if b and c else None
    b, c = per_prompt(b_run, metric), per_prompt(c_run, metric)
    shared = sorted(set(b) & set(c))
    if not shared:
        return None
    return math.exp(statistics.fmean(math.log(b[k] / c[k]) for k in shared))


def round_ratios(base: Variant, cand: Variant, metric: str) -> list[float]:
    """Per round, the candidate's advantage (`round_ratio`)."""
    ratios = (round_ratio(b, c, metric) for b, c in zip(base.passes, cand.passes))
    return [r for r in ratios if r is not None]


def judged(v: Variant, protocol: Protocol) -> tuple[str, ...]:
    """The ratios whose intervals the target is on for candidate `v`: a whole-trace variant's throughput;
    else every ratio, or with `protocol.target_on == "objective"` the ratio of its row's objective."""
    if v.whole:
        return WHOLE_RATIOS
    if protocol.target_on == "objective":
        return (OBJECTIVE_RATIO.get(v.objective, "speedup_vs_baseline"),)
    return tuple(RATIOS)


def pair_table(base: Variant, cand: Variant, metric: str) -> list[list[float]] | None:
    """The log paired ratio base / cand of every (round, prompt) for a latency, or None unless every round
    paired the same prompts (then the rounds alone are the samples)."""
    if metric == "output_throughput_tok_s":
        return None
    rows: list[dict[int, float]] = []
    for b_run, c_run in zip(base.passes, cand.passes):
        b, c = per_prompt(b_run, metric), per_prompt(c_run, metric)
        rows.append({k: math.log(b[k] / c[k]) for k in set(b) & set(c)})
    keys = sorted(rows[0]) if rows else []
    if not keys or any(sorted(row) != keys for row in rows):
        return None
    return [[row[k] for k in keys] for row in rows]


def interval(base: Variant, cand: Variant, metric: str) -> dict | None:
    """A ratio's 95% interval over the rounds: from the table of paired ratios per (round, prompt) where
    there is one (`paired_rounds_interval`: the rounds pooled with the pairs when they do not differ beyond
    them), else from the per-round ratios."""
    table = pair_table(base, cand, metric)
    if table is not None and len(table) >= 2:
        return paired_rounds_interval(table)
    return log_ratio_interval(round_ratios(base, cand, metric))


def intervals(base: Variant, cand: Variant) -> dict[str, dict | None]:
    names = WHOLE_RATIOS if cand.whole else tuple(RATIOS)
    return {name: interval(base, cand, RATIOS[name]) for name in names}


def run_rounds(variants: list[Variant], inputs: Inputs, workload: Workload, protocol: Protocol, *, seed: int = 0,
               progress: Progress | None = None,
               stop: Callable[[dict[str, dict]], str | None] | None = None) -> RoundsOutcome:
    """Warm every variant, then rounds of one pass each in shuffled order until the intervals are
    within `protocol.target_half_width_pct` (every candidate, every ratio it is `judged` on), or a budget
    ends.

    `protocol.min_iterations` (at least MIN_ROUNDS) and `min_duration_s` (timed seconds per variant)
    are floors; `max_rounds` and `max_duration_s` (from the first round) are the budget. `stop(intervals)`
    (candidate name -> ratio name -> interval, after each round once the floors are met) may end the rounds
    early with a reason (`stopped_by` "early: <reason>"): tune's rule that a candidate whose interval already
    settles its place (below the baseline, behind the leader, or ahead of both) needs no more rounds.
    """
    for i, v in enumerate(variants):
        if protocol.warmup > 0:  # warmup 0 asks for none: the first round is timed as it comes
            if progress:
                progress(f"warming {v.name}", i, len(variants))
            with naming(v):
                v.warm = warm(v, inputs, workload, protocol)
        if v.prepared.counters is not None:
            v.prepared.counters.reset()
            v.prepared.counters.held = True  # counts accumulate over the rounds
    base, candidates = variants[0], variants[1:]
    split, whole = [v for v in variants if not v.whole], [v for v in variants if v.whole]
    batches = request_batches(inputs)
    rng = random.Random(seed)
    floor = max(protocol.min_iterations, MIN_ROUNDS)
    start = time.perf_counter()
    order: list[list[str]] = []
    found: dict[str, dict[str, dict]] = {}
    on = {c.name: judged(c, protocol) for c in candidates}
    met, stopped_by = False, "max_rounds"

    def timed(v: Variant, v_inputs: Inputs, offset: int) -> GenerationRun:
        with naming(v):
            run = get_runner(v.runner)(v.prepared, v_inputs, workload, one_pass(protocol), None)
        shift_prompts(run, offset, len(order))
        return run

    other_cpu: list[float] = []
    faults: list[int] = []
    # the bytes each variant's decode reads, read plainly right after each of its runs: its roofline ceiling, taken
    # in the same seconds as its decode (the host's memory moves between two speeds within a round; a read at the
    # round's end paired a decode in one with a read in the other, fractions 0.63-1.33 in one 1B run), the round's
    # read the mean of its runs' reads
    weights = {v.name: models.readable_tensors(v.prepared.model) if v.prepared.model is not None else [] for v in variants}
    reads: dict[str, list[float | None]] = {v.name: [] for v in variants}

    def read_of(v: Variant) -> float | None:
        return env.read_gb_s(weights[v.name]) if weights[v.name] else None
    reruns: list[int] = []
    try:
        while True:
            snapshot, faulted = noise.HostSnapshot.take(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            parts: dict[str, list[GenerationRun]] = {v.name: [] for v in variants}
            round_reads: dict[str, list[float | None]] = {v.name: [] for v in variants}
            sequences = []
            reruns.append(0)
            # a whole-trace variant runs once, before request batch `at` (len(batches): after the last)
            at = {v.name: rng.randrange(len(batches) + 1) for v in whole}
            for k in range(len(batches) + 1):
                due = [v for v in whole if at[v.name] == k]
                rng.shuffle(due)
                for v in due:
                    parts[v.name].append(timed(v, inputs, 0))
                    round_reads[v.name].append(read_of(v))
                if k == len(batches):
                    break
                batch_inputs, offset = batches[k]
                sequence = list(split)
                rng.shuffle(sequence)
                sequences.append([v.name for v in sequence])
                for attempt in range(RERUNS + 1):
                    # contended (another process used over OTHER_CPU_LIMIT of the host while the batch ran,
                    # steal included): every variant's run of it is dropped and the batch run again, once;
                    # decided by the host's counters, never by the timings
                    counts = {v.name: copy.deepcopy(v.prepared.counters.values) for v in sequence
                              if v.prepared.counters is not None}
                    host = noise.HostSnapshot.take()
                    runs = []
                    for v in sequence:  # each run's read right after it: (variant, run, GB/s)
                        run = timed(v, batch_inputs, offset)
                        runs.append((v, run, read_of(v)))
                    calm = noise.other_share(host, noise.HostSnapshot.take()) <= noise.OTHER_CPU_LIMIT
                    if calm or attempt == RERUNS:
                        break
                    reruns[-1] += 1
                    for v in sequence:
                        if v.name in counts:  # a dropped run's technique counts are dropped with it
                            v.prepared.counters.values = counts[v.name]
                for v, run, read in runs:
                    parts[v.name].append(run)
                    round_reads[v.name].append(read)
                if progress:  # the line moves within a round too (a round of a slow variant takes a while)
                    progress(f"round {len(order) + 1}: request batches", k + 1, len(batches))
            order.append(sequences[0])
            other_cpu.append(noise.other_share(snapshot, noise.HostSnapshot.take()))
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faulted)
            for v in variants:
                v.passes.append(concat(parts[v.name], v.prepared))
                got = [r for r in round_reads[v.name] if r]
                reads[v.name].append(statistics.fmean(got) if got else None)
            found = {c.name: intervals(base, c) for c in candidates}
            widths = [iv["half_width_pct"] if iv else float("inf")
                      for name, ivs in found.items() for key, iv in ivs.items() if key in on[name]]
            worst = max(widths, default=0.0)
            if progress:
                shown = f"±{worst:.1f}%" if worst != float("inf") else "interval pending"
                progress(f"round {len(order)} ({shown}, target ±{protocol.target_half_width_pct:g}%)",
                         len(order), protocol.max_rounds)
            floors_met = len(order) >= floor and all(v.timed_s >= protocol.min_duration_s for v in variants)
            if floors_met and worst <= protocol.target_half_width_pct:
                met, stopped_by = True, "target"
                break
            why = stop(found) if stop is not None and floors_met else None
            if why:
                stopped_by = f"early: {why}"
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
    per_round = {v.name: {m: [pass_value(p, m) for p in v.passes] for m in PER_ROUND} for v in variants}
    by_prompt = {v.name: [{str(k): t for k, t in per_prompt(p, "tpot_ms").items()} for p in v.passes]
                 for v in variants if not v.whole}
    return RoundsOutcome(rounds=len(order), elapsed_s=time.perf_counter() - start,
                         target_half_width_pct=protocol.target_half_width_pct, target_met=met or not candidates,
                         stopped_by=stopped_by, order=order, intervals=found, baseline_drift_pct=drift,
                         variants=len(variants), per_round=per_round, other_cpu_by_round=other_cpu,
                         major_faults_by_round=faults, judged=on, reruns_by_round=reruns,
                         read_gb_s_by_round=reads, tpot_ms_by_prompt=by_prompt)


def request_batches(inputs: Inputs) -> list[tuple[Inputs, int]]:
    """The workload one request batch at a time, each with the index of its first prompt."""
    out, offset = [], 0
    for batch in inputs.batches:
        rows = int(batch["input_ids"].shape[0])
        out.append((dataclasses.replace(inputs, prompts=inputs.prompts[offset:offset + rows],
                                        rendered=inputs.rendered[offset:offset + rows], batches=[batch]), offset))
        offset += rows
    return out


def shift_prompts(run: GenerationRun, offset: int, round_index: int) -> None:
    """A run over one request batch: its prompt indices made the workload's, its iteration the round."""
    for request in run.requests:
        request.prompt_index += offset
        request.iteration = round_index
    for output in run.outputs:
        output.prompt_index += offset


def merged_counters(runs: list[GenerationRun], prepared: PreparedModel, *, whole: bool = False) -> dict:
    """The technique's counters as the last run saw them (they accumulate while held), the runner's own
    per-call counts (steps) summed. `whole`: each run replayed the whole trace, so its figures describe
    one trace: integers (requests, steps, mismatches) and `max_*` figures are the largest any round saw,
    other floats (a busy share, a mean batch size, a duration) the mean over the rounds."""
    technique_keys = set(prepared.counters.snapshot()) if prepared.counters is not None else set()
    counters = dict(runs[-1].counters)
    for key in counters:
        values = [r.counters.get(key) for r in runs]
        if key in technique_keys or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue
        if not whole:
            counters[key] = sum(values)
        elif key.startswith("max_") or not any(isinstance(v, float) for v in values):
            counters[key] = max(values)
        else:
            counters[key] = statistics.fmean(values)
    return counters


def concat(runs: list[GenerationRun], prepared: PreparedModel) -> GenerationRun:
    """Runs over consecutive request batches as one pass over the workload."""
    first = runs[0]
    counters = merged_counters(runs, prepared)
    cuda = [r.cuda_peak_bytes for r in runs if r.cuda_peak_bytes is not None]
    sized = [r for r in runs if r.peak_rss_bytes is not None and r.rss_before_bytes is not None]
    peak = max(r.peak_rss_bytes for r in sized) if sized else None  # None: a server's memory, not measured here
    worst = max(sized, key=lambda r: r.peak_rss_bytes - r.rss_before_bytes) if sized else None
    return GenerationRun(
        requests=[q for r in runs for q in r.requests], outputs=[o for r in runs for o in r.outputs],
        measured_wall_s=sum(r.measured_wall_s for r in runs), iterations=1, first_call_ms=first.first_call_ms,
        warmup_s=0.0, peak_rss_bytes=peak,
        rss_before_bytes=peak - (worst.peak_rss_bytes - worst.rss_before_bytes) if sized else None,
        generated_tokens=sum(r.generated_tokens for r in runs), batch_size=first.batch_size, counters=counters,
        cuda_peak_bytes=max(cuda) if cuda else None)


def merged_run(v: Variant) -> GenerationRun:
    """The variant's passes as one run: requests of every round (iteration = round), outputs of the
    first round, timed wall summed, warmup from the warm call, technique counters accumulated over the
    rounds (the runner's own per-pass counts summed)."""
    passes = v.passes
    counters = merged_counters(passes, v.prepared, whole=v.whole)
    cuda = [p.cuda_peak_bytes for p in passes if p.cuda_peak_bytes is not None]
    warm = v.warm
    sized = [p for p in passes if p.peak_rss_bytes is not None and p.rss_before_bytes is not None]
    peak = max(p.peak_rss_bytes for p in sized) if sized else None  # None: a server's memory, not measured here
    own_delta = max(p.peak_rss_bytes - p.rss_before_bytes for p in sized) if sized else 0  # the most one pass added
    return GenerationRun(
        requests=[r for p in passes for r in p.requests], outputs=passes[0].outputs,
        measured_wall_s=sum(p.measured_wall_s for p in passes), iterations=len(passes),
        first_call_ms=warm.first_call_ms if warm else None, warmup_s=warm.warmup_s if warm else 0.0,
        peak_rss_bytes=peak, rss_before_bytes=peak - own_delta if peak is not None else None,
        generated_tokens=sum(p.generated_tokens for p in passes), batch_size=passes[0].batch_size,
        counters=counters, cuda_peak_bytes=max(cuda) if cuda else None)
