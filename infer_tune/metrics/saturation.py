"""Serving under load: goodput against latency SLOs, and the saturation knee of a request-rate sweep.

- A request is *good* when it succeeded and meets every SLO given: TTFT <= `ttft_ms`, TPOT <=
  `tpot_ms` (requests of one token have no TPOT and pass it), e2e <= `e2e_ms`.
  `goodput_req_s` = good requests / wall time of the replay; `slo_attainment` = good / all requests
  sent (failed requests count against it).
- Knee: along the rates in ascending order, a rate is *saturated* when its TTFT p50 exceeds
  `factor` x the TTFT p50 at the lowest rate (requests queue faster than they are served); the knee
  is the highest rate before the first saturated one. The lowest rate is the reference only if the
  server kept up with it (achieved request rate >= rate / `factor`); otherwise every rate is
  saturated and the knee lies below the sweep. No saturated rate: the knee lies beyond the sweep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from infer_tune.runners.base import RequestTiming

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


def meets(timing: RequestTiming, slo: dict[str, float]) -> bool:
    """Whether one successful request meets every SLO in `slo` (keys from SLO_KEYS)."""
    if not timing.token_ns:
        return False
    values = {"ttft_ms": timing.ttft_ms, "tpot_ms": timing.tpot_ms, "e2e_ms": timing.e2e_ms}
    return all(values[k] is None or values[k] <= limit for k, limit in slo.items())


def goodput(timings: Sequence[RequestTiming], failed: int, wall_s: float, slo: dict[str, float]) -> dict:
    """`goodput_req_s`, `slo_attainment`, `good_requests` and the SLO itself (empty SLO: every success is good)."""
    unknown = set(slo) - set(SLO_KEYS)
    if unknown:
        raise ValueError(f"unknown SLO keys {sorted(unknown)}; known: {', '.join(SLO_KEYS)}")
    good = sum(1 for t in timings if meets(t, slo))
    total = len(timings) + failed
    return {"goodput_req_s": good / wall_s if wall_s > 0 else None,
            "slo_attainment": good / total if total else None, "good_requests": good, "slo": dict(slo)}


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
