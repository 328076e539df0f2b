"""The result document's typed home: what every `result.json` holds, built in one place (the sweep
engine's `session.build_document`) and written as JSON. Readers get it back as a plain dict from
`results.load_result`, which validates it. The keys and their meaning: docs/architecture.md,
"Result documents".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SCHEMA_VERSION = 1


@dataclass
class RoundsBlock:
    """`metrics.rounds` of a row measured in interleaved rounds (docs/architecture.md, "The sweep engine")."""

    rounds: int
    elapsed_s: float
    variants: int
    target_half_width_pct: float
    achieved_half_width_pct: float | None
    target_met: bool | None  # None for the baseline (it has no ratio of its own)
    stopped_by: str  # "target", "max_rounds", "max_duration_s" or "early: <why>" (rounds.run_rounds' `stop`)
    baseline_drift_pct: float | None
    design: str = "interleaved"
    # this variant's pass figures, one per round (rounds.PER_ROUND): two rows of the same rounds pair up
    per_round: dict[str, list[float | None]] | None = None
    other_cpu_by_round: list[float] | None = None  # share of the host's CPU other processes used, per round
    major_faults_by_round: list[int] | None = None  # pages the process had to read back (paged out), per round
    # one id per rounds run: rows with the same group were measured in the same process, interleaved, so
    # `compare` adds no run-to-run spread between them (docs/compare.md, "Run-to-run spread")
    group: str | None = None


@dataclass
class ResultDocument:
    """One measured run: where and what was measured, its metrics and raw samples.

    `metrics` holds the shared timing / quality / memory figures (session.build_document), the deltas
    against the baseline (metrics/deltas.py), the technique's own keys (its `prepare` facts, run-time
    counters and `finalize`), and `rounds` / `noise`. `objective` is what a candidate row is ranked on.
    """

    run_id: str
    created_at: str
    tool: dict[str, Any]
    env: dict[str, Any]
    model: dict[str, Any]
    technique: str
    label: str
    config: dict[str, Any]
    runner: str
    workload: dict[str, Any]
    protocol: dict[str, Any]
    metrics: dict[str, Any]
    samples: dict[str, list]
    fingerprint: str
    baseline_run_id: str | None = None
    objective: str | None = None
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        if doc["objective"] is None:
            doc.pop("objective")
        return doc
