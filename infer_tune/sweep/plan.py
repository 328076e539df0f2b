"""What a command asks of the sweep engine beyond measuring its configs (`SweepPlan`), what it says of one
config before it is prepared (`Admission`), and a config the sweep did not measure (`Skipped`);
docs/architecture.md, "The sweep engine"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError
from infer_tune.tuners.base import Conclusion, TechniqueConfig
from infer_tune.workload import Inputs, Workload


@dataclass
class Admission:
    """What a sweep's `admit` callback says of a config before it is prepared: facts for its row, or why it
    is not measured (docs/architecture.md, "The sweep engine")."""

    metrics: dict = field(default_factory=dict)  # added to the row's `metrics` once measured
    facts: dict = field(default_factory=dict)  # what names the row when it is skipped (batch sweep: its size)
    skip: str | None = None  # a status (e.g. `over_memory_limit`): the config is not measured
    reason: str = ""


@dataclass
class Skipped:
    """A config the sweep did not measure, and why."""

    config: TechniqueConfig
    status: str
    reason: str
    facts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**self.facts, "status": self.status, "reason": self.reason}


@dataclass
class SweepPlan:
    """What a command asks of the engine beyond measuring its configs against the plain baseline.

    - `reference`: `baseline` (the plain model, measured or reused) or `first`: every config measured
      alone, one after another, against the first one measured (a batch-size sweep: the smallest size);
      no plain baseline is measured.
    - `admit(config, workload, inputs, earlier_docs) -> Admission`: called before each config is
      prepared (a memory prediction that skips a config, facts for its row).
    - `skip_out_of_memory`: a config whose measurement runs out of memory becomes a `Skipped` row
      (`out_of_memory`) and the sweep goes on.
    - `conclude(docs, skipped) -> Conclusion | None`: after the techniques' own `conclude`, what the command's
      options define over every row of the sweep (goodput under its SLOs, a plot over one context length):
      a `Conclusion` (tuners/base.py) the engine stores like a technique's (the rows are saved and frozen: a
      hook returns what it concludes, it sets nothing on them). The engine saves the conclusion beside the
      results this sweep saved (never in their result.json) and writes the files into each.
    - `stop_rounds(intervals) -> reason | None`: may end a group's interleaved rounds early
      (rounds.run_rounds' `stop`; tune: a candidate whose interval settles its place, `scenarios/tune.decided`).
    - `skipped`: filled by the engine, in config order.
    - `baseline`: filled by the engine before `conclude` runs: the baseline the rows were measured against
      last (its rounds are those of the last group measured; `metrics.rounds.group` says which rows shared
      them), so a command's own keys can be taken against it (tune's goodput).
    - `written`: filled by the engine: the run ids of the candidate rows this sweep saved (not those
      `resume` read back), in config order: the only rows a later step of the command may conclude on disk
      (`store_claim`).
    """

    reference: str = "baseline"
    admit: Callable[[TechniqueConfig, Workload, Inputs, list[ResultDocument]], Admission] | None = None
    skip_out_of_memory: bool = False
    conclude: Callable[[list[ResultDocument], list[Skipped]], Conclusion | None] | None = None
    stop_rounds: Callable[[dict[str, dict]], str | None] | None = None
    skipped: list[Skipped] = field(default_factory=list)
    baseline: ResultDocument | None = None
    written: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.reference not in ("baseline", "first"):
            raise ConfigError(f"reference must be 'baseline' or 'first', got '{self.reference}'")
