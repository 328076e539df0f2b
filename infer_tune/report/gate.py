"""The decisions `compare` takes from an interval (docs/compare.md, "Outcomes"), apart from how the
interval is computed (report/compare.py):

- `outcome`: pass (the whole interval on the passing side of the threshold), regression (the whole
  interval past it) or inconclusive (it straddles the threshold). A point value is pass or regression.
- `noise_caution`: a noisy input (metrics.noise) can only withhold a pass (pass -> inconclusive when
  the interval, widened by the noise, reaches the threshold); it never turns a regression into a pass.
- `detectable`: the smallest change this sample could tell apart (the interval's half-width) and what
  would shrink it (more prompts, more timed rounds).
- `failed_requests`: how many requests a result records as failed (endpoint runs).
- `timing_problem`: impossible timings (negative durations, a zero TTFT or e2e), refused as bad input.
"""

from __future__ import annotations

import math
import operator

from infer_tune.document import ResultDocument
from infer_tune.metrics import noise

PASS, REGRESSION, INCONCLUSIVE = "pass", "regression", "inconclusive"
OUTCOMES = (PASS, INCONCLUSIVE, REGRESSION)  # in order of severity
OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
NOISE_WIDENING = 2.0  # a noisy input: the interval is widened by this many times its measured CV, each side
TIMING_DERIVED = ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms", "output_throughput_tok_s", "request_throughput_req_s",
                  "speedup_vs_baseline", "ttft_speedup_vs_baseline", "throughput_ratio_vs_baseline")
FAILURE_KEYS = ("requests_failed", "warmup_failures", "failed_requests")  # metrics counters of failed requests
TIMING_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms")
POSITIVE_STATS = ("p50", "p90", "p99", "mean")
MAX_FACTOR = 100  # beyond this many times the samples, the hint says the change is too close to call


def outcome(op: str, threshold: float, observed: float, interval: list[float] | None) -> str:
    """Pass, regression or inconclusive for `METRIC OP threshold` (the expression describes a regression)."""
    holds = OPS[op]
    low, high = interval if interval is not None else (observed, observed)
    near, far = (low, high) if op in (">", ">=") else (high, low)  # near: the end closest to passing
    if holds(near, threshold):
        return REGRESSION
    if not holds(far, threshold):
        return PASS
    return INCONCLUSIVE


def worst(outcomes) -> str:
    """The overall outcome of several: any regression, else any inconclusive, else pass."""
    return max(outcomes, key=OUTCOMES.index, default=PASS)


def noise_caution(metric: str, op: str, threshold: float, relative: bool, observed: float,
                  interval: list[float] | None, base: ResultDocument, cand: ResultDocument) -> tuple[str | None, str | None]:
    """(outcome override, note) when a noisy input withholds a pass of a timing-derived metric.

    The widening is NOISE_WIDENING x the largest per-iteration CV of the two inputs (at least the noise
    limit, 5%) on each side. Only a pass is re-judged, and only towards inconclusive: whichever side
    says it is noisy, noise is never a reason for a change to pass.
    """
    if metric.partition(".")[0] not in TIMING_DERIVED or not (base.noisy or cand.noisy):
        return None, None
    noisy = ", ".join(d.run_id or "?" for d in (base, cand) if d.noisy)
    if outcome(op, threshold, observed, interval) != PASS:
        return None, f"noisy input ({noisy}): not used to relax the verdict"
    width = NOISE_WIDENING * max(noise.widest_cv(base, cand), noise.NOISE_CV_LIMIT)
    low, high = interval if interval is not None else (observed, observed)
    widened = [low - 100.0 * width, high + 100.0 * width] if relative \
        else [low - abs(low) * width, high + abs(high) * width]
    if outcome(op, threshold, observed, widened) == PASS:
        return None, f"noisy input ({noisy}): passes even widened by {width:.0%} each side"
    unit = "%" if relative else ""
    return INCONCLUSIVE, (f"noisy input ({noisy}): widened by {width:.0%} each side the interval reaches the "
                          f"threshold ([{widened[0]:+.4g}{unit}, {widened[1]:+.4g}{unit}]); rerun on a quiet host")


def _count(doc: ResultDocument, block: str, key: str) -> int | None:
    value = (doc.get(block) or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def detectable(interval: list[float] | None, relative: bool, observed: float, threshold: float, cand: ResultDocument,
               decided: bool) -> tuple[float | None, str | None]:
    """(half-width of the interval, a hint naming what would shrink it); (None, None) for a point value.

    The half-width falls about as 1 / sqrt(samples): more prompts (`--limit`) or more timed rounds
    (`--min-iterations`). When the check is undecided, the hint says about how many more samples would
    bring the half-width under the distance between the estimate and the threshold.
    """
    if interval is None:
        return None, None
    half = (interval[1] - interval[0]) / 2.0
    limit = _count(cand, "workload", "limit") or _count(cand, "workload", "prompts")
    rounds = _count(cand, "metrics", "iterations") or _count(cand, "protocol", "min_iterations")
    unit = "%" if relative else ""
    now_limit = f", now {limit}" if limit else ""
    now_rounds = f", now {rounds}" if rounds else ""
    hint = (f"more prompts (--limit{now_limit}) or more timed rounds (--min-iterations{now_rounds}; beside a "
            "baseline, --max-rounds / --target-ci) shrink it")
    gap = abs(observed - threshold)
    if not decided and half > 0 and gap > 0 and (half / gap) ** 2 > MAX_FACTOR:
        hint += (f"; the estimate is {gap:.3g}{unit} from the threshold: more than {MAX_FACTOR}x the samples "
                 "would be needed to decide it")
    elif not decided and half > 0 and gap > 0:
        factor = (half / gap) ** 2
        more = []
        if limit:
            more.append(f"--limit {math.ceil(limit * factor)}")
        if rounds:
            more.append(f"--min-iterations {math.ceil(rounds * factor)}")
        hint += (f"; to decide an effect of {gap:.3g}{unit} from the threshold: about {factor:.1f}x the samples"
                 + (f" ({' or '.join(more)})" if more else ""))
    elif not decided:
        hint += "; the estimate sits on the threshold: no sample size decides it"
    return half, hint


def failed_requests(doc: ResultDocument) -> int | None:
    """Failed requests a result records (timed and warmup), None when it records no such counter."""
    metrics = doc.metrics
    values = [metrics.get(k) for k in FAILURE_KEYS if k in metrics]
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not values:
        return None
    if len(numbers) != len(values) or any(not math.isfinite(v) or v < 0 for v in numbers):
        return -1  # a counter that is not a count: the caller refuses the document
    return int(sum(numbers))


# a gap between tokens can be 0 (a server that sends several tokens in one network read; tokens of one
# speculative step share a timestamp); a request's first token and its end cannot come at submission
MAY_BE_ZERO = ("tpot_ms", "itl_ms")


def timing_problem(doc: ResultDocument) -> str | None:
    """What makes a result's timings impossible (a negative duration, or a zero TTFT / e2e), None when they
    are not."""
    samples, metrics = doc.samples, doc.metrics
    for key in TIMING_KEYS:
        values = samples.get(key) or []
        floor_ok = (lambda v: v >= 0) if key in MAY_BE_ZERO else (lambda v: v > 0)
        bad = [v for v in values if isinstance(v, (int, float)) and not floor_ok(v)]
        if bad:
            return (f"samples.{key} holds {len(bad)} of {len(values)} values <= 0 (e.g. {bad[0]!r}); "
                    "a duration is positive")
        block = metrics.get(key)
        if isinstance(block, dict):
            for stat in POSITIVE_STATS:
                value = block.get(stat)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and not floor_ok(value):
                    return f"metrics.{key}.{stat} is {value!r}; a duration is positive"
    return None
