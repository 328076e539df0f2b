"""Interleaved timing of candidate kernels against fp32, and the choice taken from its intervals.

How a regime's kernel is screened (docs/architecture.md, "Kernel screen"):

- Every candidate, fp32 included, is timed once per round; the order is shuffled every round, so a
  burst of work from another process lands on whichever candidate ran then, not on one of them for
  the whole screen.
- A round's time of a kernel divided by the same round's fp32 time is one paired ratio; its median
  over rounds, with a 95% bootstrap interval, says how the kernel compares with fp32.
- Rounds go on (at least `min_rounds`) until the fastest kernel is separated from every other one
  (the 95% interval of their per-round ratio lies wholly below 1), or `max_rounds` / `budget_s` ends.
- The choice: the fastest kernel by median, except that a kernel whose interval says slower than
  fp32 is never chosen while a candidate whose interval does not say so exists; when every kernel is
  slower than fp32 the fastest is kept and the regime is flagged `slower_than_fp32` (tune then never
  picks that method for the regime).

Everything here takes its timings from a `measure(name) -> ms` callable and a clock, so the
decision logic is tested with scripted timings (no timing assertions).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from infer_tune.metrics.stats import bootstrap_interval

FP32 = "fp32"
MIN_ROUNDS = 5
MAX_ROUNDS = 40
BUDGET_S = 5.0


@dataclass
class Screen:
    """Per-round times (ms) of each candidate; `failed` names candidates this host cannot run."""

    samples: dict[str, list[float]]
    failed: list[str] = field(default_factory=list)
    rounds: int = 0
    separated: bool = False
    stopped: str = ""  # "separated", "max rounds" or "time budget"

    def kernels(self) -> list[str]:
        return [k for k in self.samples if k != FP32]

    def median_ms(self, name: str) -> float:
        return float(np.median(self.samples[name]))

    def ratio(self, a: str, b: str, *, seed: int = 0) -> tuple[float, float, float]:
        """Median over rounds of time(a) / time(b), with its 95% bootstrap interval."""
        values = np.asarray(self.samples[a]) / np.asarray(self.samples[b])
        if len(values) < 2:
            point = float(values[0])
            return point, point, point
        low, high = bootstrap_interval(values, "p50", seed=seed, resamples=1000)
        return float(np.median(values)), low, high

    def vs_fp32(self) -> dict[str, list[float]]:
        """kernel -> [median, low, high] of its time over fp32's, per round (above 1: slower)."""
        return {k: [round(v, 4) for v in self.ratio(k, FP32)] for k in self.kernels()}

    def fastest(self) -> str | None:
        kernels = self.kernels()
        return min(kernels, key=self.median_ms) if kernels else None

    def is_separated(self) -> bool:
        """The fastest kernel beats every other kernel with a per-round ratio interval wholly below 1."""
        best = self.fastest()
        if best is None:
            return False
        return all(self.ratio(best, other)[2] < 1.0 for other in self.kernels() if other != best)

    def timings(self) -> tuple[dict[str, float | None], float]:
        """(kernel -> median ms, None for a failed kernel; fp32 median ms): what `kernels.choose` reads."""
        out: dict[str, float | None] = {k: self.median_ms(k) for k in self.kernels()}
        out.update(dict.fromkeys(self.failed))
        return out, self.median_ms(FP32)

    def record(self) -> dict:
        """The facts kept in `metrics.kernels` for one regime."""
        return {"rounds": self.rounds, "separated": self.separated, "stopped": self.stopped,
                "vs_fp32_ci95": self.vs_fp32()}


def run(measure: Callable[[str], float], names: list[str], *, min_rounds: int = MIN_ROUNDS,
        max_rounds: int = MAX_ROUNDS, budget_s: float = BUDGET_S, seed: int = 0,
        clock: Callable[[], float] = time.perf_counter) -> Screen:
    """Time `names` (FP32 among them) in shuffled rounds until separated or out of rounds / time.

    A candidate whose `measure` raises RuntimeError (a kernel this build or CPU lacks) is dropped and
    listed in `failed`; fp32 failing is an error of the caller.
    """
    if FP32 not in names:
        raise ValueError("the screen needs the fp32 reference among its candidates")
    screen = Screen(samples={n: [] for n in names})
    order = list(names)
    rng = random.Random(seed)
    start = clock()
    while True:
        rng.shuffle(order)
        for name in order:
            if name in screen.failed:
                continue
            try:
                screen.samples[name].append(float(measure(name)))
            except RuntimeError:
                if name == FP32:
                    raise
                screen.failed.append(name)
                del screen.samples[name]
        order = [n for n in order if n not in screen.failed]
        screen.rounds += 1
        if not screen.kernels():
            screen.stopped = "no kernel runs"
        elif screen.rounds >= min_rounds and screen.is_separated():
            screen.separated, screen.stopped = True, "separated"
        elif screen.rounds >= max_rounds:
            screen.stopped = "max rounds"
        elif screen.rounds >= min_rounds and clock() - start >= budget_s:
            screen.stopped = "time budget"
        if screen.stopped:
            return screen


def pick(medians: dict[str, float], vs_fp32: dict[str, list[float]] | None) -> tuple[str, str]:
    """(kernel, why): the fastest by median, unless its interval says slower than fp32 while another
    candidate's does not (then the fastest of those). `vs_fp32` as `Screen.vs_fp32` (None: point timings)."""
    fastest = min(medians, key=medians.get)
    if not vs_fp32:
        return fastest, "fastest measured on this host"
    slower = {k for k in medians if k in vs_fp32 and vs_fp32[k][1] > 1.0}
    if fastest not in slower:
        return fastest, "fastest by median over interleaved rounds"
    safe = {k: v for k, v in medians.items() if k not in slower}
    if safe:
        chosen = min(safe, key=safe.get)
        return chosen, (f"{fastest} had the lowest median but its interval says slower than fp32; "
                        f"{chosen} is the fastest whose interval does not")
    return fastest, "fastest by median over interleaved rounds (every candidate's interval says slower than fp32)"
