"""The one-screen summary a recipe (`make demo`) ends with, written as plain lines: the rows with each
technique's key figures and what they are compared with, the claims, the recommendation with the
command that reproduces it, and the report's files. The README shows it (scripts/update-readme-results.py)."""

from __future__ import annotations

from pathlib import Path

from infer_tune.document import ResultDocument, as_document
from infer_tune.report import claims, display
from infer_tune.report import leaderboard as lb
from infer_tune.report.recommend import Budget, recommend, reproduce_command


def lines(docs: list[ResultDocument], out_dir: Path | str, budget: Budget | None = None, *, write: bool = True) -> list[str]:
    """Write the report into `out_dir` (unless `write` is False) and return the summary's lines."""
    budget = budget or Budget()
    docs = [as_document(d) for d in docs]
    frame = lb.build(docs)
    written = lb.write(frame, docs, Path(out_dir), budget=budget) if write else {}
    rec = recommend(docs, budget)
    recipe = written.get("recommended") or Path(out_dir) / "recommended.yaml"
    if rec.doc is not None:
        rec.command = reproduce_command(rec.doc, recipe)
    rows = lb.rows_of(frame, rec.doc.run_id if rec.doc else None)
    out = display.markdown(rows, narrow=True).rstrip("\n").splitlines()
    for claim in claims.collect(docs):
        out.append(f"claim: {claim.claim} -> {lb.claim_verdict(claim)}")
    if rec.doc is not None:
        out.append(f"recommended ({lb.budget_summary(budget)}): {display.recommendation_line(rec, rows)}")
        out.append(f"  {rec.decision()}")
        out.append(f"reproduce: {rec.command}")
    else:
        out.append(f"no configuration to recommend within {lb.budget_summary(budget)}: "
                   f"{'; '.join(rec.reasons[-2:]) or 'no candidate results'}")
        if rec.speed_only and rec.SPEED_ONLY not in rec.reasons[-2:]:
            out.append(f"  {rec.SPEED_ONLY}")
    if not write:
        written = {fmt: Path(out_dir) / f"leaderboard.{fmt}" for fmt in lb.FORMATS
                   if (Path(out_dir) / f"leaderboard.{fmt}").is_file()}
    out.extend(f"report: {path}" for key, path in written.items() if key != "recommended")
    return [_printable(line) for line in out]


def _printable(line: str) -> str:
    """No escape sequence from a result's text reaches the terminal."""
    return "".join(ch if ch.isprintable() else " " for ch in line)
