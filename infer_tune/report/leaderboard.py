"""The combined leaderboard: one row per result across techniques, written as md / csv / html.

Speed and quality drift of the same run sit in one row. The csv holds every column as raw numbers;
the markdown and the self-contained HTML report (report/html.py) show human units, the claims table
and the recommended configuration; the HTML embeds its plots (speedup vs perplexity change with the
Pareto front, TTFT/TPOT p50/p99 bars, per-position decode latency, and each technique's own PNGs).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from infer_tune import atomic
from infer_tune.document import ResultDocument, as_document
from infer_tune.errors import InferTuneError
from infer_tune.report import claims, display, leads, turns
from infer_tune.report import html as html_report
from infer_tune.report import plots as shared_plots
from infer_tune.report.plots import pareto_front  # noqa: F401 - part of this module's API (tests, tune)
from infer_tune.report.recommend import Budget, recommend, write_recommended

COLUMNS = ("run_id", "technique", "config", "model", "suite", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
           "tpot_p99_ms", "output_throughput_tok_s", "speedup_vs_baseline", "peak_rss_bytes", "model_bytes", "bleu",
           "bleu_drift", "bleu_vs_baseline", "exact_match_vs_baseline", "ppl_delta_pct", "pass_at_1",
           "roofline_fraction", "output_mismatches", "output_mismatches_vs_baseline", "ttft_speedup_vs_baseline", "bleu_drift_ci95", "broken", "broken_why",
           "verdict_evidence", "speedup_vs_baseline_ci95", "ttft_speedup_vs_baseline_ci95", "lead", "lead_value",
           "lead_vs", "lead_decode", "host", "quality", "crashed")
OBJECT_COLUMNS = {"crashed", "quality", "run_id", "technique", "config", "model", "suite", "bleu_drift_ci95", "broken", "broken_why",
                  "verdict_evidence", "speedup_vs_baseline_ci95", "ttft_speedup_vs_baseline_ci95", "lead", "lead_vs",
                  "lead_decode", "host"}


def host_of(doc: ResultDocument) -> str | None:
    """The host a row was measured on: a short hash of the machine key (each ratio is against that host's
    own baseline; `--executor ray` results come from several, docs/scale.md)."""
    import hashlib

    key = (doc.get("env") or {}).get("machine")
    return f"host-{hashlib.sha256(str(key).encode()).hexdigest()[:6]}" if key else None


FORMATS = ("md", "csv", "html")
CSV_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def flatten(doc: ResultDocument) -> dict:
    """One leaderboard row of a result document (its text without control characters: display.plain)."""
    doc = as_document(doc)
    m = doc.metrics
    row = {
        "run_id": doc.run_id,
        "technique": doc.technique,
        "config": display.config_summary(doc),
        "model": doc.model.get("ref"),
        "suite": doc.workload.get("suite"),
        "ttft_p50_ms": doc.ttft_p50_ms,
        "ttft_p99_ms": doc.stat("ttft_ms", "p99"),
        "tpot_p50_ms": doc.tpot_p50_ms,
        "tpot_p99_ms": doc.stat("tpot_ms", "p99"),
        "host": host_of(doc),
    }
    for key in ("speedup_vs_baseline", "ttft_speedup_vs_baseline"):
        ci = doc.interval(key)
        row[f"{key}_ci95"] = list(ci) if ci else None
    for key in COLUMNS:
        if not key.startswith("lead"):
            row.setdefault(key, m.get(key))
    crash = doc.get("crash") if doc.get("engine_status") == "crashed" else None
    if isinstance(crash, dict):  # a launch that crashed (engines/crash.py): the verdict, and how to run it again
        row["crashed"] = str(crash.get("summary") or "crashed")
        row["verdict_evidence"] = (f"{row['crashed']}; reproduce: "
                                   f"{(crash.get('reproducer') or {}).get('line') or '-'}")
    if display.is_broken(row):  # a broken model is never shown as a speedup (metrics.deltas.verdict; the verdict column says why)
        row["speedup_vs_baseline"] = None
    elif doc.noisy:
        row["config"] = f"{row['config']} [noisy]"
    row = {k: display.plain(v) if isinstance(v, str) else v for k, v in row.items()}
    if row["technique"] == "baseline":  # the baseline is its own reference point
        row["speedup_vs_baseline"] = 1.0 if row["speedup_vs_baseline"] is None else row["speedup_vs_baseline"]
        row["bleu_drift"] = 0.0 if row["bleu_drift"] is None else row["bleu_drift"]
    return row


def build(docs: Sequence[ResultDocument], *, technique: Sequence[str] = (), model: Sequence[str] = (),
          suite: Sequence[str] = (), sort: str | None = None, descending: bool = False) -> pd.DataFrame:
    """A DataFrame of flattened results (with each technique's lead figures), filtered and sorted."""
    docs = [as_document(d) for d in docs]
    found = leads.leads(docs)
    rows = []
    for doc in docs:
        row, lead = flatten(doc), found[str(doc.run_id)]
        row.update(lead=display.plain(lead.text()) if lead.figures else "baseline", lead_value=lead.value,
                   lead_vs=display.plain(lead.vs) if isinstance(lead.vs, str) else lead.vs,
                   lead_decode=display.plain(lead.decode) if isinstance(lead.decode, str) else lead.decode)
        rows.append(row)
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    for column in COLUMNS:  # numeric columns: a missing value is NaN (rendered "-"), never "None"
        if column not in OBJECT_COLUMNS:
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
    for column, wanted in (("technique", technique), ("model", model), ("suite", suite)):
        if wanted:
            frame = frame[frame[column].isin(list(wanted))]
    if sort:
        if sort not in frame.columns:
            raise InferTuneError(f"unknown --sort column {sort!r}; columns: {', '.join(frame.columns)}")
        frame = frame.sort_values(sort, ascending=not descending, na_position="last", kind="stable")
    if frame["host"].nunique() > 1:  # rows of one host together, in their order
        frame = frame.sort_values("host", kind="stable", na_position="last")
    return frame.reset_index(drop=True)


def per_position(docs: Sequence[ResultDocument], run_ids: Sequence[str]) -> dict[str, list[float]]:
    """`per_position_ms` of the shown rows that have one (kv-cache runs)."""
    wanted = set(run_ids)
    found = {}
    for doc in map(as_document, docs):
        values = doc.metrics.get("per_position_ms")
        if doc.run_id in wanted and isinstance(values, list) and values \
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            found[doc["run_id"]] = [float(v) for v in values]
    return found


def csv_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """Text cells that a spreadsheet would run as a formula (= + - @ tab CR first) get a leading `'`;
    numbers and the lone `-` stay as they are."""
    def cell(value):
        if isinstance(value, str):
            value = display.plain(value)
        if not isinstance(value, str) or not value.startswith(CSV_FORMULA_START) or value == "-":
            return value
        try:
            float(value)
            return value
        except ValueError:
            return "'" + value

    safe = frame.copy()
    for column in OBJECT_COLUMNS & set(safe.columns):
        safe[column] = safe[column].map(cell)
    return safe


def rows_of(frame: pd.DataFrame, recommended: str | None = None) -> list[dict]:
    """The frame as row dicts (NaN -> None), the recommended row flagged."""
    rows = frame.astype(object).where(frame.notna(), None).to_dict(orient="records")
    for row in rows:
        row["recommended"] = recommended is not None and row["run_id"] == recommended
    return rows


def write(frame: pd.DataFrame, docs: Sequence[ResultDocument], out_dir: Path, formats: Sequence[str] = FORMATS,
          budget: Budget | None = None) -> dict[str, Path]:
    """Write leaderboard.{md,csv,html} atomically into `out_dir`, and `recommended.yaml` beside them when
    there is a recommendation; returns format (or "recommended") -> path."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise InferTuneError(f"unknown leaderboard format {', '.join(unknown)}; use {', '.join(FORMATS)}")
    budget = budget or Budget()
    docs = [as_document(d) for d in docs]
    shown = [d for d in docs if d.run_id in set(frame["run_id"])]
    found_claims = claims.collect(shown)
    rec = recommend(shown, budget)
    out_dir = Path(out_dir)
    written = {}
    recipe = write_recommended(rec, out_dir)
    rows = rows_of(frame, rec.doc.run_id if rec.doc else None)
    budget_text = budget_summary(budget)
    for fmt in formats:
        path = out_dir / f"leaderboard.{fmt}"
        if fmt == "md":
            text = to_markdown(rows, found_claims, rec, budget_text) + turns.markdown(shown)
        elif fmt == "csv":
            text = csv_safe(frame).to_csv(index=False)
        else:
            figures = shared_plots.report_plots(rows, per_position(docs, list(frame["run_id"])))
            env = next((d.env for d in shown if isinstance(d.env, dict)), {})
            text = html_report.page(rows, env, found_claims, rec, budget_text, figures, html_report.technique_images(shown),
                                    sections=turns.html(shown))
        atomic.write_text(path, text)
        written[fmt] = path
    if recipe is not None:
        written["recommended"] = recipe
    return written


def budget_summary(budget: Budget) -> str:
    parts = []
    if budget.max_ppl_delta is not None:
        parts.append(f"perplexity change <= {budget.max_ppl_delta:g}%")
    if budget.max_bleu_drift is not None:
        parts.append(f"BLEU drift >= -{budget.max_bleu_drift:g}")
    if budget.require_lossless:
        parts.append("outputs identical to the baseline's")
    return ", ".join(parts) or "no drift budget"


def to_markdown(rows: list[dict], found_claims: list, rec, budget_text: str) -> str:
    """The leaderboard, the claims table and the recommendation as GitHub-flavoured markdown."""
    parts = [f"# infer-tune leaderboard ({len(rows)} results)\n", display.markdown(rows)]
    if found_claims:
        parts.append("\n## Claims\n\n| claim | measured here | verdict |\n|---|---|---|")
        parts.extend("| " + " | ".join(display.md_cell(v) for v in (c.claim, c.measured, claim_verdict(c))) + " |"
                     for c in found_claims)
    parts.append("\n## Recommended configuration\n")
    if rec.doc is None:
        why = display.md_cell("; ".join(rec.reasons[-3:]) or "no candidate results")
        parts.append(f"None within {budget_text}: {why}.")
    else:
        parts.append(f"{display.md_cell(display.recommendation_line(rec, rows))} (within {budget_text}); "
                     f"{display.md_cell(rec.decision())}.\n\n"
                     f"Reproduce: `{display.plain(rec.command)}`"
                     + (f"\n\nSaved model: `{display.plain(rec.saved_model)}`" if rec.saved_model else ""))
    return "\n".join(parts) + "\n"


def claim_verdict(c) -> str:
    """The verdict, with why it did not hold."""
    return f"{c.verdict}{' (' + str(c.why) + ')' if c.why and c.verdict != 'held' else ''}"


