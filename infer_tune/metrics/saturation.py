"""Serving under load: latency SLOs, goodput, and the saturation knee of a request-rate sweep.

- A request is *good* when it completed and meets every SLO given: TTFT <= `ttft_ms`, TPOT <=
  `tpot_ms` (a request's TPOT is (e2e - TTFT) / (tokens - 1); a one-token request has no inter-token
  time and passes it, as vLLM counts it 0), e2e <= `e2e_ms`.
- Goodput is the DistServe definition vLLM's and AIPerf's benchmarks use: `goodput_req_s` = good
  requests / duration of the run; `slo_attainment` = good / all requests submitted (failed or
  unfinished ones count against it). Without any SLO both are None: goodput needs objectives.
  Batch traces (`batch serve-sim`), live endpoints (`bench --endpoint --slo`) and `tune --objective
  goodput` use these.
- One request at a time (`one_at_a_time`): a server without batching, first come first served, on an
  arrival trace: each request starts when it has arrived and the one before it has finished, and then
  takes its own service time; its TTFT and e2e count the wait from its arrival.
- Knee: along the rates in ascending order, a rate is *saturated* when its TTFT p50 exceeds
  `factor` x the TTFT p50 at the lowest rate (requests queue faster than they are served); the knee
  is the highest rate before the first saturated one. The lowest rate is the reference only if the
  server kept up with it (achieved request rate >= rate / `factor`); otherwise every rate is
  saturated and the knee lies below the sweep. No saturated rate: the knee lies beyond the sweep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from infer_tune.errors import ConfigError
from infer_tune.runners.base import RequestTiming

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; None: not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and (not value > 0 or math.isinf(value)):
                raise ConfigError(f"SLO {name} must be a finite number of milliseconds > 0, got {value}")

    @classmethod
    def from_dict(cls, slo: dict[str, float] | None) -> SLO:
        unknown = set(slo or {}) - set(SLO_KEYS)
        if unknown:
            raise ConfigError(f"unknown SLO keys {sorted(unknown)}; known: {', '.join(SLO_KEYS)}")
        return cls(**(slo or {}))

    @property
    def given(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    def to_dict(self) -> dict:
        """The objectives given (unconstrained ones left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def request_tpot_ms(timing: RequestTiming) -> float:
    """Per-request TPOT; 0 for a one-token request (it has no inter-token time)."""
    tpot = timing.tpot_ms
    return 0.0 if tpot is None else tpot


def meets(timing: RequestTiming, slo: SLO) -> bool:
    """Whether one completed request meets every objective of `slo`."""
    if not timing.token_ns:
        return False
    return ((slo.ttft_ms is None or timing.ttft_ms <= slo.ttft_ms)
            and (slo.tpot_ms is None or request_tpot_ms(timing) <= slo.tpot_ms)
            and (slo.e2e_ms is None or timing.e2e_ms <= slo.e2e_ms))


def goodput(timings: Sequence[RequestTiming], slo: SLO, duration_s: float, *, submitted: int | None = None) -> dict:
    """`goodput_req_s`, `slo_attainment`, `good_requests`, the SLO and per-objective attainment.

    `submitted` counts requests that never completed too (default: one per timing); a request without
    tokens is not completed and meets nothing. Without any SLO the goodput figures are None.
    """
    total = len(timings) if submitted is None else submitted
    if not slo.given:
        return {"goodput_req_s": None, "slo_attainment": None, "good_requests": None, "slo": slo.to_dict(),
                "slo_attainment_by_objective": {}}
    good = sum(1 for t in timings if meets(t, slo))
    by_objective = {}
    for name in SLO_KEYS:
        limit = getattr(slo, name)
        if limit is not None:
            one = SLO(**{name: limit})
            by_objective[name] = sum(1 for t in timings if meets(t, one)) / total if total else None
    return {
        "goodput_req_s": good / duration_s if duration_s > 0 else None,
        "slo_attainment": good / total if total else None,
        "good_requests": good,
        "slo": slo.to_dict(),
        "slo_attainment_by_objective": by_objective,
    }


def request_timing(ttft_ms: float, e2e_ms: float, tokens: int, prompt_index: int = 0) -> RequestTiming:
    """A request known by its TTFT, e2e and token count from its arrival (what the SLO checks read: TPOT
    is (e2e - TTFT) / (tokens - 1))."""
    first, last = int(round(ttft_ms * 1e6)), int(round(e2e_ms * 1e6))
    return RequestTiming(prompt_index, 0, 0, 0, [first] + [last] * (max(int(tokens), 1) - 1))


def one_at_a_time(arrivals_s: Sequence[float], ttft_ms: Sequence[float], tpot_ms: Sequence[float],
                  tokens: Sequence[int]) -> tuple[list[RequestTiming], float]:
    """(each request's timing from its arrival, duration in s from time 0 to the last token) of a server
    that serves requests one at a time, first come first served (module docstring): request i, once
    started, takes `ttft_ms[i]` to its first token and `tpot_ms[i]` per further token of `tokens[i]`.
    Timings are returned in the order given."""
    order = sorted(range(len(arrivals_s)), key=lambda i: arrivals_s[i])
    timings: list[RequestTiming | None] = [None] * len(order)
    free_s = 0.0
    for i in order:
        start_s = max(float(arrivals_s[i]), free_s)
        wait_ms = 1000.0 * (start_s - arrivals_s[i])
        first = wait_ms + ttft_ms[i]
        last = first + max(int(tokens[i]) - 1, 0) * tpot_ms[i]
        timings[i] = request_timing(first, last, tokens[i], i)
        free_s = arrivals_s[i] + last / 1000.0
    return [t for t in timings if t is not None], free_s


def knee(rates: Sequence[float], ttft_p50: Sequence[float | None], achieved: Sequence[float | None] | None = None,
         factor: float = 2.0) -> tuple[float | None, list[bool], str]:
    """(knee rate, saturated flag per rate, status) for rates given in ascending order (module docstring).

    status: `within` (the knee is one of the rates), `beyond` (no swept rate is saturated) or `below`
    (the lowest rate already is: nothing succeeded there, or its achieved request rate fell below
    rate / factor, so its TTFT is no reference). A rate without a TTFT (nothing succeeded) is saturated.
    """
    if not rates:
        return None, [], "beyond"
    reference = ttft_p50[0]
    lowest_keeps_up = reference is not None and (
        achieved is None or math.isinf(rates[0]) or (achieved[0] or 0.0) >= rates[0] / factor)
    if not lowest_keeps_up:
        return None, [True] * len(rates), "below"
    saturated = [False] + [v is None or v > factor * reference for v in ttft_p50[1:]]
    first = next((i for i, s in enumerate(saturated) if s), None)
    if first is None:
        return None, saturated, "beyond"
    return rates[first - 1], saturated, "within"
