"""What each row of the combined report leads with: the figures its technique is judged on, and what
they are compared with ("vs static batching at the same rate", "vs round-robin placement").

A technique declares them itself: `report_columns(doc, docs) -> Lead` in its registry entry
(tuners/base.py; docs/architecture.md, "The technique contract"). A technique without one leads with
its decode speedup against the baseline of the same session. Speedups carry their 95% interval when
the result has one (`metrics.<key>_ci95` = [low, high]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from infer_tune.document import ResultDocument, as_document, finite

BASELINE_VS = "baseline (same session)"


number = finite  # a finite float, else None (a result document is untrusted input)


def interval(metrics: Mapping, key: str) -> tuple[float, float] | None:
    """`metrics[key + "_ci95"]` as (low, high) when it is two finite numbers in order, else None (a
    technique's sub-block; a document's own: `ResultDocument.interval`)."""
    raw = (metrics or {}).get(f"{key}_ci95")
    if not isinstance(raw, (list, tuple)) or len(raw) != 2:
        return None
    low, high = number(raw[0]), number(raw[1])
    return (low, high) if low is not None and high is not None and low <= high else None


@dataclass(frozen=True)
class Figure:
    """One number a row is judged on. unit: `x` (ratio), `%` (change), `B/token`, `tok/s`, `req/s`, `ms`,
    `tokens`, or "" (a plain fraction such as balancedness); `reference`: the compared value, shown beside."""

    name: str
    value: float | None
    unit: str = "x"
    ci95: tuple[float, float] | None = None
    reference: float | None = None

    def text(self) -> str:
        shown = _fmt(self.value, self.unit)
        if self.ci95 is not None and self.value is not None:
            shown += f" [{_fmt(self.ci95[0], self.unit, bare=True)}–{_fmt(self.ci95[1], self.unit, bare=True)}]"
        if self.reference is not None and self.value is not None:
            shown += f" vs {_fmt(self.reference, self.unit)}"
        return shown


def _fmt(v: float | None, unit: str, bare: bool = False) -> str:
    if v is None:
        return "-"
    if unit == "x":
        return f"{v:.2f}" if bare else f"{v:.2f}x"
    if unit == "%":
        return f"{v:+.1f}%"
    if unit == "ms":
        return f"{v / 1000:.2f} s" if v >= 10_000 else f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms"
    if unit == "B/token":
        return f"{v:,.0f} B/token"
    if unit in ("tok/s", "req/s"):
        return f"{v:.1f} {unit}" if unit == "tok/s" else f"{v:.2f} {unit}"
    if unit == "tokens":
        return f"{v:.2f} tokens"
    return f"{v:.2f}"


@dataclass(frozen=True)
class Lead:
    """The figures a row leads with (the first one sorts the column) and what they are compared with.
    `decode`: the first figure is the decode speedup vs the baseline (the Pareto plot's axis)."""

    figures: tuple[Figure, ...]
    vs: str
    decode: bool = False

    @property
    def value(self) -> float | None:
        return self.figures[0].value if self.figures else None

    def text(self) -> str:
        return " · ".join(f"{f.name} {f.text()}" for f in self.figures) or "-"


def decode_speedup(doc: ResultDocument, docs: Sequence[ResultDocument] = (), vs: str = BASELINE_VS) -> Lead:
    """The default lead: decode (and TTFT) speedup vs the baseline, with their intervals; vs the reference the
    row names instead when the baseline was skipped (`metrics.compared_with`: scenarios/common.reference_that_fits)."""
    doc = as_document(doc)
    compared = (doc.get("metrics") or {}).get("compared_with")
    if isinstance(compared, str) and compared:
        vs = compared
    elif not doc.get("baseline_run_id") and doc.speedup is None:
        return Lead((), "- (no baseline of its own)")  # e.g. bench --endpoint of a server without --baseline
    figures = [Figure("decode", doc.speedup, "x", doc.speedup_ci95)]
    if doc.ttft_speedup is not None:
        figures.append(Figure("TTFT", doc.ttft_speedup, "x", doc.interval("ttft_speedup_vs_baseline")))
    return Lead(tuple(figures), vs, decode=True)


BASELINE = Lead((), "-")


def lead_for(doc: ResultDocument, docs: Sequence[ResultDocument], declared: dict) -> Lead:
    """The row's lead: the technique's own `report_columns`, else the decode speedup; a technique's
    function that cannot read a malformed result falls back to the decode speedup."""
    technique = doc.get("technique")
    if technique == "baseline":
        return BASELINE
    fn = declared.get(technique)
    if fn is not None:
        try:
            lead = fn(doc, list(docs))
            if isinstance(lead, Lead):
                return lead
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
            pass
    return decode_speedup(doc, docs)


def declared_columns() -> dict:
    """Technique name -> its registered `report_columns` (the registry is read, never listed here)."""
    from infer_tune.tuners.base import TECHNIQUES, load_techniques

    load_techniques()
    found = {entry.name: entry.report_columns for entry in TECHNIQUES.values() if entry.report_columns}
    # launches of a serving engine (tune --engine) are no technique of the registry: their ratios are against
    # the engine's default launch, and their rows say so
    from infer_tune.report.recommend import ENGINE

    found.setdefault(ENGINE, engine_columns)
    return found


def engine_columns(doc: ResultDocument, docs: Sequence[ResultDocument]) -> Lead:
    """What the combined report leads an engine launch row with (`tune --engine`): its objective's ratio and
    interval against the engine's default launch of the same run; the default launch itself is the reference
    of those rows. In-process rows beside it are against their own baseline."""
    from infer_tune.report.recommend import ENGINE_OBJECTIVES, OBJECTIVES

    doc = as_document(doc)
    engine = (doc.config or {}).get("engine") or "the engine"
    if doc.extra.get("engine_status") == "default" or not doc.baseline_run_id:
        return Lead((), f"reference of the {engine} rows" if doc.extra.get("engine_status") == "default" else "-")
    vs = default_vs(engine, doc, docs)
    objective = doc.objective if doc.objective in ENGINE_OBJECTIVES else "decode"
    if objective == "decode":
        return decode_speedup(doc, docs, vs)
    key = OBJECTIVES[objective]
    name = {"ttft": "TTFT", "throughput": "throughput"}[objective]
    return Lead((Figure(name, finite(doc.metrics.get(key)), "x", interval(doc.metrics, key)),), vs)


def default_vs(engine: str, doc: ResultDocument, docs: Sequence[ResultDocument]) -> str:
    """What an engine row is compared with: its engine's default (a launch for a server) of the same run, with
    the default row's settings (its label after the engine's name; "default flags" when it has none)."""
    from infer_tune.engines.base import ENGINES

    base = next((d for d in docs if d.get("run_id") == doc.baseline_run_id), None)
    settings = str(base.get("label") or "").removeprefix(engine).strip() if base is not None else ""
    entry = ENGINES.get(engine)
    kind = " launch" if entry is None or entry.starts == "server" else ""
    return f"{engine} default{kind} ({settings if settings and settings != 'default' else 'default flags'}; same run)"


def leads(docs: Sequence[ResultDocument]) -> dict[str, Lead]:
    """run_id -> Lead for every document."""
    docs = [as_document(d) for d in docs]
    declared = declared_columns()
    return {str(d.get("run_id")): lead_for(d, docs, declared) for d in docs}


def same_stage(a: ResultDocument, b: ResultDocument) -> bool:
    """Two results of one sweep stage: same baseline (else same model and suite)."""
    if a.get("baseline_run_id") and b.get("baseline_run_id"):
        return a["baseline_run_id"] == b["baseline_run_id"]
    return ((a.get("model") or {}).get("ref") == (b.get("model") or {}).get("ref")
            and (a.get("workload") or {}).get("suite") == (b.get("workload") or {}).get("suite"))


def ratio(value, reference) -> float | None:
    value, reference = number(value), number(reference)
    return value / reference if value is not None and reference else None


def change_pct(value, reference) -> float | None:
    r = ratio(value, reference)
    return None if r is None else 100.0 * (r - 1.0)
