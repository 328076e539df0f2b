"""Service-level objectives and goodput, computed on plain `RequestTiming` lists (any runner, or a
replay against an HTTP server that fills the same timings).

Goodput is the DistServe definition vLLM's and AIPerf's benchmarks use: completed requests per second
of benchmark time that meet every SLO given. A request's TPOT is (e2e - TTFT) / (tokens - 1); a
one-token request has no inter-token time and meets any TPOT objective (vLLM counts its TPOT as 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from infer_tune.errors import ConfigError
from infer_tune.runners.base import RequestTiming


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

    @property
    def given(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    def to_dict(self) -> dict:
        return asdict(self)


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
    """`goodput_req_s` (requests meeting every SLO / duration), `slo_attainment` (their share of the
    submitted requests), `slo_met` and per-objective attainment. Without any SLO both are None.

    `submitted` counts requests that never completed too (default: one per timing); a request without
    tokens is not completed and meets nothing.
    """
    total = len(timings) if submitted is None else submitted
    if not slo.given:
        return {"goodput_req_s": None, "slo_attainment": None, "slo_met": None, "slo": slo.to_dict(),
                "slo_attainment_by_objective": {}}
    good = sum(1 for t in timings if meets(t, slo))
    by_objective = {}
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        limit = getattr(slo, name)
        if limit is not None:
            one = SLO(**{name: limit})
            by_objective[name] = sum(1 for t in timings if meets(t, one)) / total if total else None
    return {
        "goodput_req_s": good / duration_s if duration_s > 0 else None,
        "slo_attainment": good / total if total else None,
        "slo_met": good,
        "slo": slo.to_dict(),
        "slo_attainment_by_objective": by_objective,
    }
