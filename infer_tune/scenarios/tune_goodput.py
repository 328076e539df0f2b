"""`tune --objective goodput`: the batched stacks' goodput on one seeded arrival trace against the
baseline's on the same trace, with the 95% interval of their ratio.

- Goodput is the DistServe definition (metrics/saturation.py): requests per second that meet every
  SLO, here TTFT <= `slo_ttft_ms` (from the request's arrival, queueing included) and TPOT <=
  `slo_tpot_ms`, over the replay's duration (the trace's start to its last token).
- A candidate replays the trace (`trace.jsonl` beside its result) once per interleaved round, beside
  the baseline's closed-loop passes (docs/architecture.md, "The sweep engine"); its requests of each
  round give that round's goodput.
- The baseline serves the same trace one request at a time, first come first served
  (`saturation.one_at_a_time`): each request starts once it has arrived and the one before it has
  finished, and takes what the baseline took for its prompt in the same round: its TTFT, then its
  TPOT for each further token of the trace's output length for that prompt.
- Each round gives one ratio ((good_c + 1/2) / D_c) / ((good_b + 1/2) / D_b), good the requests
  meeting the SLOs and D the duration: half a request on each side keeps a round where one side met
  none finite and pulls the count part toward 1, never away. `goodput_ratio_vs_baseline` and its
  `_ci95` are the rounds' geometric mean and 95% t-interval (metrics.stats.log_ratio_interval), as
  the throughput ratio's are; `tune` decides from its lower bound.
- A row whose rounds are not the baseline's (a resumed row: `metrics.rounds.group` differs) is
  compared with the baseline's own rounds unpaired: a point ratio of the pooled figures, no interval.

The keys are added by the sweep engine's `SweepPlan.conclude`, which rewrites the results.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from infer_tune.document import ResultDocument, as_document
from infer_tune.metrics.saturation import SLO, goodput, one_at_a_time, request_timing
from infer_tune.metrics.stats import log_ratio_interval
from infer_tune.report.run_to_run import same_rounds
from infer_tune.tuners.base import Conclusion

HALF = 0.5  # requests added to each side's good count per round (see the module docstring)
SERVED = ("one request at a time, first come first served, on the same trace: each request starts once it has "
          "arrived and the one before it has finished, and takes the baseline's TTFT and TPOT for its prompt "
          "measured in the same round")


def trace_rows(doc: ResultDocument) -> list[dict] | None:
    """The trace a row replayed (prompt_index, arrival_s, output_tokens per request), from the
    `trace.jsonl` saved beside it (its `location`); None when it replayed none."""
    file = Path(doc.location) / "trace.jsonl" if doc.location else None
    if file is None or not file.is_file():
        return None
    rows = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows or None


def by_round(samples: dict, rounds: int) -> list[dict[int, tuple[float, float, int]]] | None:
    """Each round's requests of a row, prompt index -> (TTFT ms, e2e ms, tokens), from its samples (the
    requests of every round, round after round, each prompt at most once per round); None when they do
    not split into `rounds` so."""
    out: list[dict[int, tuple[float, float, int]]] = [{} for _ in range(max(rounds, 1))]
    seen: Counter = Counter()
    for p, ttft, e2e, n in zip(samples.get("prompt_index") or [], samples.get("ttft_ms") or [],
                               samples.get("e2e_ms") or [], samples.get("output_tokens") or []):
        k = seen[p]
        if k >= len(out):
            return None
        seen[p] += 1
        out[k][p] = (float(ttft), float(e2e), int(n))
    return out


def replayed(rows: list[dict], served: dict[int, tuple[float, float, int]], slo: SLO) -> tuple[dict, float]:
    """(goodput figures, duration in s) of one replay of the trace by a candidate: its requests as they
    were timed (a request it did not complete counts against it)."""
    timings, end = [], 0.0
    for row in rows:
        got = served.get(row["prompt_index"])
        if got is None:
            continue
        ttft, e2e, n = got
        timings.append(request_timing(ttft, e2e, n, row["prompt_index"]))
        end = max(end, row["arrival_s"] + e2e / 1000.0)
    return goodput(timings, slo, end, submitted=len(rows)), end


def one_at_a_time_replay(rows: list[dict], alone: dict[int, tuple[float, float, int]],
                         slo: SLO) -> tuple[dict, float] | None:
    """(goodput figures, duration in s) of the baseline serving the trace one request at a time, from its
    closed-loop timing of each prompt (`alone`); None when a prompt of the trace is missing there."""
    if any(row["prompt_index"] not in alone for row in rows):
        return None
    ttft, tpot = [], []
    for row in rows:
        first, last, n = alone[row["prompt_index"]]
        ttft.append(first)
        tpot.append((last - first) / (n - 1) if n > 1 else 0.0)
    timings, duration = one_at_a_time([row["arrival_s"] for row in rows], ttft, tpot,
                                      [max(int(row["output_tokens"]), 1) for row in rows])
    return goodput(timings, slo, duration), duration


def corrected(figures: dict, duration: float) -> float | None:
    return (figures["good_requests"] + HALF) / duration if duration > 0 and figures["good_requests"] is not None \
        else None


def goodput_keys(docs: list[ResultDocument], baseline: ResultDocument | None, slo: SLO, rate: float) -> Conclusion:
    """Every trace-replaying row's goodput under `slo`, its baseline's on the same trace and their ratio
    with its 95% interval: keys of the sweep's namespace, a `Conclusion` the engine saves beside each row
    (module docstring)."""
    out = Conclusion()
    if baseline is None:
        return out
    baseline = as_document(baseline)
    base_split = by_round(baseline.samples, baseline.rounds.get("rounds") or 1)
    for doc in docs:
        rows = trace_rows(doc)
        if not rows or base_split is None:
            continue
        split = by_round(doc.samples, doc.rounds.get("rounds") or 1)
        if split is None:
            continue
        paired = same_rounds(baseline, doc) and len(split) == len(base_split)
        ours = [replayed(rows, served, slo) for served in split]
        theirs = [one_at_a_time_replay(rows, alone, slo) for alone in base_split]
        if any(t is None for t in theirs):
            continue
        ratios = [(corrected(*c) or 0.0) / b for c, t in zip(ours, theirs) if (b := corrected(*t))] if paired else []
        interval = log_ratio_interval(ratios) if paired else None
        pooled = _pooled(ours, len(rows), slo)
        base_pooled = _pooled(theirs, len(rows), slo)
        c_rate, b_rate = corrected(pooled, sum(d for _, d in ours)), corrected(base_pooled, sum(d for _, d in theirs))
        point = interval["point"] if interval else (c_rate / b_rate if c_rate and b_rate else None)
        out.metrics[doc.run_id] = {
            **pooled,
            "goodput_ratio_vs_baseline": point,
            "goodput_ratio_vs_baseline_ci95": interval["ci95"] if interval else None,
            "goodput_vs_baseline": {
                "rate_req_s": rate, "slo": slo.to_dict(), "requests_per_round": len(rows),
                "rounds": len(ours), "paired": paired, "correction_requests": HALF,
                "by_round": [g["goodput_req_s"] for g, _ in ours],
                "baseline_by_round": [g["goodput_req_s"] for g, _ in theirs],
                "baseline_goodput_req_s": base_pooled["goodput_req_s"],
                "baseline_slo_attainment": base_pooled["slo_attainment"],
                "baseline_good_requests": base_pooled["good_requests"],
                "baseline_served": SERVED},
        }
    return out


def _pooled(replays: list[tuple[dict, float]], requests: int, slo: SLO) -> dict:
    """The goodput figures of every round together: good requests over the rounds' summed durations."""
    good = sum(g["good_requests"] or 0 for g, _ in replays)
    duration = sum(d for _, d in replays)
    submitted = requests * len(replays)
    by_objective: dict = {}
    for name in next((g["slo_attainment_by_objective"] for g, _ in replays), {}):
        shares = [g["slo_attainment_by_objective"][name] for g, _ in replays]
        by_objective[name] = math.fsum(s * requests for s in shares if s is not None) / submitted if submitted \
            else None
    return {"goodput_req_s": good / duration if duration > 0 else None,
            "slo_attainment": good / submitted if submitted else None, "good_requests": good,
            "slo": slo.to_dict(), "slo_attainment_by_objective": by_objective}
