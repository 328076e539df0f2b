"""Multi-turn endpoint results in the report: TTFT p50 / p90 by turn and by history length, per result
that has them (`metrics.turns`, `endpoint sim --workload multi-turn`, docs/endpoint.md)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from infer_tune.document import ResultDocument
from infer_tune.report import display

HEADER = ["turn / history tokens", "requests", "history tokens p50", "TTFT p50 ms", "TTFT p90 ms"]


def _num(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table_rows(turns: dict) -> list[list[str]]:
    """One row per turn, then one per history-length bucket."""
    rows = [[f"turn {r['turn']}", str(r["requests"]), _num(r.get("history_tokens_p50"), ".0f"),
             _num(r["ttft_ms"]["p50"]), _num(r["ttft_ms"]["p90"])] for r in turns.get("by_turn") or []]
    rows += [[f"history {r['history_tokens'][0]}-{r['history_tokens'][1]}", str(r["requests"]), "",
              _num(r["ttft_ms"]["p50"]), _num(r["ttft_ms"]["p90"])] for r in turns.get("by_history") or []]
    return rows


def with_turns(docs: Sequence[ResultDocument]) -> list[tuple[str, list[list[str]]]]:
    """(title, rows) of every result with per-turn metrics."""
    found = []
    for doc in docs:
        turns = (doc.metrics or {}).get("turns")
        if isinstance(turns, dict) and turns.get("by_turn"):
            found.append((f"{doc.label or doc.run_id} ({doc.run_id})", table_rows(turns)))
    return found


def markdown(docs: Sequence[ResultDocument]) -> str:
    """A '## TTFT by turn' section (empty when no result has turns)."""
    found = with_turns(docs)
    if not found:
        return ""
    parts = ["\n## TTFT by turn (multi-turn sessions)\n"]
    for title, rows in found:
        parts += [f"**{display.md_cell(title)}**\n", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        parts += ["| " + " | ".join(display.md_cell(c) for c in row) + " |" for row in rows]
        parts.append("")
    return "\n".join(parts)


def html(docs: Sequence[ResultDocument]) -> str:
    """The same section as HTML tables (empty when no result has turns)."""
    found = with_turns(docs)
    if not found:
        return ""
    out = ["<h2>TTFT by turn (multi-turn sessions)</h2>"]
    for title, rows in found:
        out.append(f"<h3>{escape(title)}</h3><table class=\"turns\"><thead><tr>"
                   + "".join(f"<th>{escape(h)}</th>" for h in HEADER) + "</tr></thead><tbody>")
        out += ["<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows]
        out.append("</tbody></table>")
    return "".join(out)
