"""The claims table: every claim check found in a set of results, in one shape.

A claim row: the claim as usually stated, what was measured (a human sentence with the numbers), the
number and its interval when there is one, and the verdict: `held`, `did not hold here`, `inconclusive`
(a claim judged from intervals, one of which straddles its threshold: docs/architecture.md, "Decisions
taken from intervals") or `not applicable`, with the reason. Techniques keep their claim checks in their
results (`metrics.claim_check`, `metrics.claims` or the document's `claims`), each in one shape —
`statement` (or `claim`), `finding` (the technique's own line of what was measured), `held`, `verdict`
(when a bool cannot say it: inconclusive), `value`, `interval`, `why` — so this module knows no technique:
it only reads and normalises them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from infer_tune.document import ResultDocument, as_document

HELD, NOT_HELD, INCONCLUSIVE, NOT_APPLICABLE = "held", "did not hold here", "inconclusive", "not applicable"


@dataclass
class ClaimRow:
    claim: str
    measured: str
    verdict: str
    value: float | None = None
    interval: list[float] | None = None
    why: str = ""
    technique: str = ""
    run_id: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _verdict(held) -> str:
    return NOT_APPLICABLE if held is None else HELD if held else NOT_HELD


def _generic(c: dict, doc: ResultDocument) -> ClaimRow | None:
    """A claim check in the common shape: claim/statement, measured, verdict or held (True/False/None), why..."""
    statement = c.get("statement") or c.get("claim")
    if not statement:
        return None
    measured = c.get("finding") or c.get("measured")  # `finding`: the technique's own human line
    return ClaimRow(claim=str(statement), measured=measured if isinstance(measured, str) else "",
                    verdict=c.get("verdict") or _verdict(c.get("held")), value=c.get("value"),
                    interval=c.get("interval"), why=str(c.get("why", "")))


def _candidates(doc: ResultDocument) -> list[dict]:
    found = []
    for source in (doc.metrics.get("claim_check"), doc.metrics.get("claims"), doc.claims):
        if isinstance(source, dict):
            found.append(source)
        elif isinstance(source, list):
            found.extend(c for c in source if isinstance(c, dict))
    return found


def collect(docs: list[ResultDocument]) -> list[ClaimRow]:
    """Every claim check of `docs`, deduplicated (a sweep repeats its claims on each of its rows)."""
    rows: list[ClaimRow] = []
    seen: set[tuple[str, str]] = set()
    for doc in map(as_document, docs):
        for c in _candidates(doc):
            row = _generic(c, doc)
            if row is None or (row.claim, row.measured) in seen:
                continue
            seen.add((row.claim, row.measured))
            row.technique, row.run_id = str(doc.technique or ""), str(doc.run_id)
            rows.append(row)
    return rows
