"""Seeded arrival traces for `endpoint sim`: Poisson (burstiness 1) or gamma inter-arrival times.

Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean `1 / rate` (the form
vLLM's serving benchmark uses): burstiness 1 is a Poisson process, below 1 burstier, above 1 more
regular. The first request arrives at 0; prompts are taken in turn. (`batch serve-sim` builds the
same traces; either kind of list feeds `replay_trace`.)
"""

from __future__ import annotations

import math

from infer_tune.errors import ConfigError
from infer_tune.runners.trace import TraceRequest
from infer_tune.tuners.batch.arrivals import arrival_times


def poisson_trace(requests: int, rate: float, n_prompts: int, *, seed: int = 0, burstiness: float = 1.0,
                  max_new_tokens: int | None = None) -> list[TraceRequest]:
    """`requests` arrivals at `rate` requests/s (math.inf: all at once), cycling over `n_prompts` prompts."""
    if n_prompts < 1:
        raise ConfigError("a trace needs at least one prompt")
    if math.isinf(rate):  # everything at once (a closed burst)
        if requests < 1:
            raise ConfigError(f"requests must be >= 1, got {requests}")
        arrivals = [0.0] * requests
    else:  # the same generator as `batch serve-sim` (one home for the arrival process)
        arrivals = arrival_times(requests, rate, burstiness, seed)
    return [TraceRequest(prompt_index=i % n_prompts, arrival_s=float(t), max_new_tokens=max_new_tokens)
            for i, t in enumerate(arrivals)]


def parse_rates(text: str) -> list[float]:
    """`0.5,1,2,inf` -> [0.5, 1.0, 2.0, inf], ascending, each > 0."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"rates must be comma-separated numbers of requests/s (e.g. 0.5,1,2), got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ConfigError(f"rates must be numbers > 0 (requests/s), got {text!r}")
    return sorted(set(rates))
