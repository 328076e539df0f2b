"""Seeded arrival traces for open-loop serving benchmarks (no model, no torch: reusable by any replayer).

Arrivals follow vLLM's / AIPerf's convention: inter-arrival gaps are gamma distributed with shape K
(the burstiness) and mean 1/rate, so K = 1 is a Poisson process and the gaps' coefficient of
variation is 1/sqrt(K) (K < 1 burstier, K > 1 more regular). The first request arrives at time 0.
Which prompt each request carries is a seeded draw
from the available prompts (without replacement unless repeats are allowed); its output length is
the length given for that prompt (the prompt's natural greedy length, capped, in infer-tune).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from infer_tune.errors import ConfigError


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: which prompt, when it arrives (s from the trace start), its lengths."""

    prompt_index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def check_rate(rate: float) -> None:
    """A request rate must be a finite number > 0 (requests per second)."""
    if not rate > 0 or math.isinf(rate) or math.isnan(rate):
        raise ConfigError(f"rate must be a finite number > 0 requests/s, got {rate}")


def check_burstiness(burstiness: float) -> None:
    if not burstiness > 0 or math.isinf(burstiness) or math.isnan(burstiness):
        raise ConfigError(f"burstiness must be a finite number > 0 (1 = Poisson), got {burstiness}")


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """`n` arrival offsets in seconds: 0, then cumulative gamma(K, 1/(rate*K)) gaps (Poisson at K = 1)."""
    if n < 1:
        raise ConfigError(f"requests must be >= 1, got {n}")
    check_rate(rate)
    check_burstiness(burstiness)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def pick_prompts(n: int, available: int, *, seed: int = 0, allow_repeat: bool = False) -> list[int]:
    """Which prompt each of `n` requests carries: a seeded permutation of the `available` prompts, or
    (with `allow_repeat`, when there are fewer prompts than requests) a seeded draw with replacement."""
    if available < 1:
        raise ConfigError("no prompts to build a trace from")
    rng = np.random.default_rng(seed + 1)  # not the arrival stream: rates change gaps, never prompts
    if n <= available:
        return rng.permutation(available)[:n].tolist()
    if not allow_repeat:
        raise ConfigError(f"{n} requests but only {available} prompts fit; ask for at most {available} requests "
                          f"or allow repeats (requests then sample prompts with replacement)")
    return rng.integers(0, available, size=n).tolist()


def trace_plan(n: int, available: int, rate: float, *, burstiness: float = 1.0, seed: int = 0,
               allow_repeat: bool = False) -> list[tuple[int, float]]:
    """(prompt index, arrival s) of `n` requests over `available` prompts, in arrival order.

    The prompt order depends on the seed only (the same at every rate); the arrival gaps on seed,
    rate and burstiness.
    """
    picks = pick_prompts(n, available, seed=seed, allow_repeat=allow_repeat)
    return list(zip(picks, arrival_times(n, rate, burstiness, seed)))


def build_trace(prompt_tokens: Sequence[int], output_tokens: Sequence[int], n: int, rate: float, *,
                burstiness: float = 1.0, seed: int = 0, allow_repeat: bool = False) -> list[TraceRow]:
    """A trace of `n` requests over prompts with these prompt / output lengths (one entry per prompt)."""
    if len(prompt_tokens) != len(output_tokens):
        raise ConfigError("build_trace needs one prompt length and one output length per prompt")
    plan = trace_plan(n, len(prompt_tokens), rate, burstiness=burstiness, seed=seed, allow_repeat=allow_repeat)
    return [TraceRow(p, t, prompt_tokens[p], output_tokens[p]) for p, t in plan]


def interarrival_cv(arrivals: list[float]) -> float | None:
    """Coefficient of variation (stdev / mean) of the gaps between consecutive arrivals."""
    gaps = np.diff(np.asarray(arrivals, dtype=np.float64))
    if gaps.size < 2 or gaps.mean() == 0:
        return None
    return float(gaps.std(ddof=1) / gaps.mean())


def offered_rate(arrivals: list[float]) -> float | None:
    """Requests per second the trace really offers: (n - 1) / span."""
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    return (len(arrivals) - 1) / span if span > 0 else None
