"""What every runner returns, the timing clock they share, and the runner registry.

A runner executes a workload against a `PreparedModel` and returns raw measurements (a
`GenerationRun`): the host timestamp of every generated token of every request, the outputs, memory
readings and the technique's run-time counters. Statistics are computed later, in `sweep.document`.
The runner kinds and how a technique picks one: docs/architecture.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.streamers import BaseStreamer

from infer_tune.workload import Protocol

if TYPE_CHECKING:
    from infer_tune.runners.prepared import PreparedModel
    from infer_tune.workload import Inputs, Workload


Progress = Callable[[str, int, int | None], None]


@dataclass
class RequestTiming:
    """One request of one iteration, in host nanoseconds.

    `submit_ns`: when the request was submitted (its arrival, under an arrival trace);
    `start_ns`: when a scheduler started serving it (None: at once, no queue);
    `token_ns`: the time each generated token became available; tokens delivered by one step share
    that step's time, and `step_tokens` says how many each step delivered (None: one per step).
    """

    prompt_index: int
    iteration: int
    prompt_tokens: int
    submit_ns: int
    token_ns: list[int]
    step_tokens: list[int] | None = None
    start_ns: int | None = None

    @property
    def ttft_ms(self) -> float:
        return (self.token_ns[0] - self.submit_ns) / 1e6

    @property
    def e2e_ms(self) -> float:
        return (self.token_ns[-1] - self.submit_ns) / 1e6

    @property
    def queue_ms(self) -> float:
        return 0.0 if self.start_ns is None else (self.start_ns - self.submit_ns) / 1e6

    def step_ns(self) -> list[int]:
        """The time of each step (one entry per streamer delivery)."""
        if self.step_tokens is None:
            return list(self.token_ns)
        times, k = [], 0
        for n in self.step_tokens:
            if k >= len(self.token_ns):
                break
            times.append(self.token_ns[k])
            k += n
        return times

    @property
    def itl_ms(self) -> list[float]:
        """Gaps between consecutive steps (per token when every step delivers one token)."""
        steps = self.step_ns()
        return [(b - a) / 1e6 for a, b in zip(steps, steps[1:])]

    @property
    def tpot_ms(self) -> float | None:
        n = len(self.token_ns)
        return (self.e2e_ms - self.ttft_ms) / (n - 1) if n > 1 else None

    def truncated(self, n_tokens: int) -> RequestTiming:
        """The same request cut to its first `n_tokens` tokens (steps cut to match)."""
        steps = None
        if self.step_tokens is not None:
            steps, left = [], n_tokens
            for n in self.step_tokens:
                if left <= 0:
                    break
                steps.append(min(n, left))
                left -= n
        return RequestTiming(self.prompt_index, self.iteration, self.prompt_tokens, self.submit_ns,
                             self.token_ns[:n_tokens], steps, self.start_ns)


@dataclass
class Output:
    """The natural (unpinned-equivalent) greedy output of one prompt."""

    prompt_index: int
    text: str
    token_ids: list[int]
    prompt_tokens: int
    hit_eos: bool


@dataclass
class GenerationRun:
    """Raw measurements of a workload run; statistics are computed by `sweep.document` and `metrics`.

    `counters`: the technique's run-time counters (timed passes only) plus what the runner itself
    counts; `ranks`: per-process readings of a multi-process run; `cuda_peak_bytes`: max allocated on
    the GPU (None on CPU).
    """

    requests: list[RequestTiming]
    outputs: list[Output]
    measured_wall_s: float
    iterations: int
    first_call_ms: float | None
    warmup_s: float
    peak_rss_bytes: int | None  # None where this process cannot see the memory used (a live endpoint)
    rss_before_bytes: int | None
    generated_tokens: int
    batch_size: int
    counters: dict[str, Any] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    cuda_peak_bytes: int | None = None

    def per_position_ms(self) -> list[float]:
        """Mean latency of each decode step, in order (element k: the gap before step k+1), averaged
        over the requests that reached that step."""
        sums: list[float] = []
        counts: list[int] = []
        for request in self.requests:
            for k, gap in enumerate(request.itl_ms):
                if k == len(sums):
                    sums.append(0.0)
                    counts.append(0)
                sums[k] += gap
                counts[k] += 1
        return [total / n for total, n in zip(sums, counts)]


class TokenClock(BaseStreamer):
    """Streamer that records `perf_counter_ns` and the number of tokens of each `put` after the prompt.

    `generate` puts the prompt first, then one tensor per step: shape [B] for one token per row, or
    [1, n] when a step delivers n tokens at once (assisted / speculative generation).
    """

    def __init__(self) -> None:
        self.step_ns: list[int] = []
        self.step_tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter_ns()
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.step_ns.append(now)
        self.step_tokens.append(int(value.shape[-1]) if value.dim() > 1 else 1)

    def end(self) -> None:
        pass

    @property
    def token_ns(self) -> list[int]:
        """One timestamp per generated token (tokens of one step share it)."""
        return [t for t, n in zip(self.step_ns, self.step_tokens) for _ in range(n)]

    @property
    def multi_token(self) -> bool:
        return any(n != 1 for n in self.step_tokens)


RunnerFn = Callable[["PreparedModel", "Inputs", "Workload", Protocol, "Progress | None"], GenerationRun]
RUNNERS: dict[str, RunnerFn] = {}


PASS_RUNNERS: set[str] = set()  # runners the sweep engine can run once per round beside the baseline
WHOLE_RUNNERS: set[str] = set()  # of those, runners that replay their whole workload per call (an arrival trace)


def register_runner(name: str, *, passes: bool | str = False) -> Callable[[RunnerFn], RunnerFn]:
    """Register a runner under `name` (the value a technique's `runner=` names). `passes=True`: it times
    closed-loop passes over the workload (warmup, then `min_iterations` passes), so the sweep engine runs
    it one pass per round beside the baseline, request batch by request batch. `passes="whole"`: one
    call replays the whole workload once (an arrival trace, which cannot be cut into request batches),
    so each round runs it once, at a shuffled point among the baseline's batches (docs/architecture.md,
    "The sweep engine")."""
    if passes not in (False, True, "whole"):
        raise ValueError(f"passes must be False, True or 'whole', got {passes!r}")

    def decorator(fn: RunnerFn) -> RunnerFn:
        RUNNERS[name] = fn
        if passes:
            PASS_RUNNERS.add(name)
        if passes == "whole":
            WHOLE_RUNNERS.add(name)
        return fn

    return decorator


def sync(device: str) -> None:
    """Wait for the device before reading the clock (a no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
