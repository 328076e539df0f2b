"""Serving under load: goodput against latency SLOs, and the saturation knee of a request-rate sweep.

- A request is *good* when it succeeded and meets every SLO given: TTFT <= `ttft_ms`, TPOT <=
  `tpot_ms` (requests of one token have no TPOT and pass it), e2e <= `e2e_ms`.
  `goodput_req_s` = good requests / wall time of the replay; `slo_attainment` = good / all requests
  sent (failed requests count against it).
- Knee: along the rates in ascending order, a rate is *saturated* when its TTFT p50 exceeds
  `factor` x the TTFT p50 at the lowest rate (requests queue faster than they are served); the knee
  is the highest rate before the first saturated one (None when no swept rate is saturated: the knee
  lies beyond the sweep).
"""

from __future__ import annotations

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


def knee(rates: Sequence[float], ttft_p50: Sequence[float | None], factor: float = 2.0) -> tuple[float | None, list[bool]]:
    """(knee rate, saturated flag per rate) for rates given in ascending order (see module docstring).

    A rate without a TTFT (nothing succeeded) counts as saturated.
    """
    if not rates:
        return None, []
    reference = ttft_p50[0]
    saturated = [v is None or reference is None or v > factor * reference for v in ttft_p50]
    saturated[0] = reference is None
    first = next((i for i, s in enumerate(saturated) if s), None)
    if first is None:
        return None, saturated
    return (rates[first - 1] if first > 0 else None), saturated
