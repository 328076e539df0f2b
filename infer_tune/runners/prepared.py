"""What a technique hands to a runner: the model to run, how to call it, and what to count.

See docs/architecture.md ("Techniques and runners") for the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class RunCounters:
    """Counters a technique's instrumentation increments while a runner measures (the run-time channel).

    The runner calls `reset()` after warmup, so only timed work is counted, and `snapshot()` after the
    timed passes; the snapshot goes into the result's `metrics`. A technique that derives rates from
    its counts (acceptance = accepted / proposed, say) overrides `snapshot`.
    """

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.held = False  # while True, reset() keeps the counts (rounds of one-pass runs accumulate)

    def add(self, name: str, amount: float = 1) -> None:
        self.values[name] = self.values.get(name, 0) + amount

    def add_at(self, name: str, index: int, amount: float = 1) -> None:
        """Add to element `index` of the list counter `name` (per-position counts), growing it as needed."""
        values = self.values.setdefault(name, [])
        values.extend([0] * (index + 1 - len(values)))
        values[index] += amount

    def reset(self) -> None:
        if not self.held:
            self.values = {}

    def snapshot(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.values.items()}


@dataclass
class PreparedModel:
    """A model after a technique was applied, and everything its runner needs.

    - `generate_kwargs` carry the technique into `generate` (cache implementation, assistant model,
      prompt lookup...); settings that are GenerationConfig fields go into the config.
    - `metrics` are technique facts known before measuring (bytes saved, backend chosen).
    - `counters` (optional) are incremented while the runner runs; reset after warmup.
    - `extra_model_bytes` are weights read per step besides `model` (a draft model's): they count in
      `model_bytes` and in the roofline.
    - `runner_options` are read by the runner the technique names (an arrival trace and a scheduler,
      a worker function and a process count, ...); the generation runner ignores them.
    - `device` is where inputs go.
    - `runner` (optional) names the runner when it depends on the config (a stack's parts decide).
    - `scorer` (optional): `scorer(scored) -> (summed NLL, targets)` where the eager forward does not compute
      what the row decodes with (the native step's int8 KV cache): the row's `ppl` is scored by it instead.
    """

    model: torch.nn.Module | None
    tokenizer: Any
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    label: str = "baseline"
    device: str = "cpu"
    counters: RunCounters | None = None
    extra_model_bytes: int = 0
    runner_options: dict[str, Any] = field(default_factory=dict)
    cleanup: Callable[[], None] | None = None
    runner: str | None = None  # overrides the registry entry's runner (a stack picks its parts' runner)
    scorer: Callable | None = None  # the row's teacher-forced NLL where the eager forward is not what decodes
