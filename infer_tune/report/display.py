"""Human rendering of leaderboard rows: units (ms, tok/s, MiB, x, %), the technique and its config
first, drift judged on perplexity and faithfulness with BLEU's interval beside it, and a verdict
column (`crashed`, `broken`, `lossless`, `lossy`). Shared by the markdown, HTML and terminal renderings."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from infer_tune.document import ResultDocument
from infer_tune.metrics import deltas as drift_verdict


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def ms(v) -> str:
    if _missing(v):
        return "-"
    return f"{v / 1000:.2f} s" if v >= 10_000 else f"{v:.1f} ms" if v >= 10 else f"{v:.2f} ms"


def tok_s(v) -> str:
    return "-" if _missing(v) else f"{v:.1f}"


def times(v) -> str:
    return "-" if _missing(v) else f"{v:.2f}x"


def pct(v) -> str:
    return "-" if _missing(v) else f"{v:.0%}"


def of_ceiling(v) -> str:
    """A fraction of a physical ceiling: one above 100% is a measurement error (metrics/roofline.py), never
    printed as a figure (results saved before the check could hold one)."""
    return "-" if _missing(v) else "refused (>100%)" if v > 1.0 else f"{v:.0%}"


def signed_pct(v) -> str:
    return "-" if _missing(v) else f"{v:+.2f}%"


def mib(v) -> str:
    if _missing(v):
        return "-"
    return f"{v / 2**30:.2f} GiB" if v >= 2**30 else f"{v / 2**20:.1f} MiB"


# control characters (C0 but tab/newline/CR, DEL, C1), bidi marks and overrides: a result's text never carries them out
_CONTROL = {c: None for c in [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), *range(0x7F, 0xA0), 0x200E, 0x200F,
                              *range(0x202A, 0x202F), *range(0x2066, 0x206A)]}
_SPACES = {0x09: " ", 0x0A: " ", 0x0D: " "}


def plain(value, *, lines: bool = False) -> str:
    """`value` as text without control characters (ESC sequences, BEL, backspace, bidi overrides): a
    label or any other string of a result file reaches the terminal, md, csv and html inert. Tabs and
    line ends become spaces unless `lines`."""
    out = str(value).translate(_CONTROL)
    return out if lines else out.translate(_SPACES)


def text(v) -> str:
    return "-" if _missing(v) or v == "" else plain(v)


def bleu_drift(row: dict) -> str:
    v = row.get("bleu_drift")
    if _missing(v):
        return "-"
    ci = row.get("bleu_drift_ci95")
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(isinstance(x, (int, float)) and not _missing(x) for x in ci):
        return f"{v:+.2f} [{ci[0]:+.1f}, {ci[1]:+.1f}]"
    return f"{v:+.2f}"


def crashed(row: dict) -> bool:
    """A launch that crashed (engines/crash.py): nothing measured, its reproducer in `verdict_evidence`."""
    return isinstance(row.get("crashed"), str) and bool(row["crashed"])


def verdict(row: dict) -> str:
    """`baseline`, `crashed` (the engine died or hung), `broken` (drift says the model no longer works),
    `lossless` (token-identical to the baseline) or `lossy`; empty when nothing was compared."""
    if row.get("technique") == "baseline":
        return "baseline"
    if crashed(row):
        return "crashed"
    if is_broken(row):
        return "broken"
    # against the baseline's outputs: a row whose own `output_mismatches` counts against another reference
    # (a batch scheduler's, against single-request greedy on its own weights) keeps that count apart
    mismatches = row.get("output_mismatches_vs_baseline")
    if _missing(mismatches):
        mismatches = row.get("output_mismatches")
    if not _missing(mismatches):
        return "lossless" if mismatches == 0 else "lossy"
    return ""


def is_broken(row: dict) -> bool:
    """Broken as measured (metrics.deltas.verdict) when the row carries the verdict's evidence; a row
    that predates it is judged again by today's rules (overlap with the baseline alone no longer counts),
    trusting its stored mark only for what the row cannot show (its outputs were long enough)."""
    if not _missing(row.get("verdict_evidence")):
        return row.get("broken") is True
    if row.get("broken") is True and "perplexity" in str(row.get("broken_why") or ""):
        return True  # the perplexity rule has not changed
    clean = {k: (None if _missing(v) else v) for k, v in row.items()}
    return bool(drift_verdict.broken_reasons(clean, outputs_long_enough=row.get("broken") is True))


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    render: Callable[[dict], str]
    numeric: bool = True
    narrow: bool = False  # kept in the narrow (CI log) rendering


def _get(key: str, fn: Callable) -> Callable[[dict], str]:
    return lambda row: fn(row.get(key))


RECOMMENDED_MARK = "★"


def config_cell(row: dict) -> str:
    """The config, with a star on the recommended row."""
    shown = text(row.get("config"))
    return f"{shown} {RECOMMENDED_MARK}" if row.get("recommended") else shown


def lead_cell(row: dict) -> str:
    """What the row's technique is judged on (report/leads.py); a broken row is never a speedup."""
    if crashed(row):
        return "crashed"
    if is_broken(row) and row.get("technique") != "baseline":
        return "broken"
    return text(row.get("lead"))


def quality_or(render: Callable[[dict], str]) -> Callable[[dict], str]:
    """A quality cell: "n/a (random weights)" on a row that has no quality (its `quality` says why)."""
    return lambda row: text(row.get("quality")) if not _missing(row.get("quality")) else render(row)


COLUMNS: tuple[Column, ...] = (
    Column("technique", "technique", _get("technique", text), numeric=False, narrow=True),
    Column("config", "config", config_cell, numeric=False, narrow=True),
    Column("suite", "suite", _get("suite", text), numeric=False),
    Column("lead_value", "key figures", lead_cell, narrow=True),
    Column("lead_vs", "compared with", _get("lead_vs", text), numeric=False, narrow=True),
    Column("ttft_p50_ms", "TTFT p50", _get("ttft_p50_ms", ms)),
    Column("ttft_p99_ms", "TTFT p99", _get("ttft_p99_ms", ms)),
    Column("tpot_p50_ms", "TPOT p50", _get("tpot_p50_ms", ms), narrow=True),
    Column("output_throughput_tok_s", "tok/s", _get("output_throughput_tok_s", tok_s)),
    Column("ppl_delta_pct", "ppl change", quality_or(_get("ppl_delta_pct", signed_pct)), narrow=True),
    Column("exact_match_vs_baseline", "same output as baseline", quality_or(_get("exact_match_vs_baseline", pct))),
    Column("bleu_drift", "BLEU drift [95% CI]", quality_or(bleu_drift)),
    Column("model_bytes", "model", _get("model_bytes", mib)),
    Column("peak_rss_bytes", "peak RSS", _get("peak_rss_bytes", mib)),
    Column("roofline_fraction", "of roofline", _get("roofline_fraction", of_ceiling)),
    Column("verdict", "verdict", verdict, numeric=False, narrow=True),
    Column("verdict_evidence", "verdict evidence", _get("verdict_evidence", text), numeric=False),
    Column("run_id", "run", _get("run_id", text), numeric=False),
)


def columns(narrow: bool = False) -> tuple[Column, ...]:
    return tuple(c for c in COLUMNS if c.narrow) if narrow else COLUMNS


def sort_value(row: dict, column: Column):
    """What the HTML page sorts a cell by (the raw number, or the text)."""
    if column.key == "verdict":
        return verdict(row)
    if column.key == "lead_value" and is_broken(row) and row.get("technique") != "baseline":
        return ""
    value = row.get(column.key)
    if column.numeric:
        return "" if _missing(value) else float(value)
    return text(value)


def md_cell(value) -> str:
    """Text safe in one markdown table cell: one line, no cell break, no HTML (results are untrusted)."""
    return " ".join(plain(value).split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def markdown(rows: list[dict], narrow: bool = False) -> str:
    """A GitHub-flavoured markdown table of the rows (the human columns)."""
    cols = columns(narrow)
    lines = ["| " + " | ".join(c.header for c in cols) + " |",
             "|" + "|".join("---" if not c.numeric else "---:" for c in cols) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(md_cell(c.render(row)) for c in cols) + " |")
    if any(row.get("recommended") for row in rows):
        lines.append(f"\n{RECOMMENDED_MARK} recommended configuration")
    return "\n".join(lines) + "\n"


def config_summary(doc: ResultDocument) -> str:
    """The technique's own short label (e.g. `int8-static-torch-a0.5`), else `k=v` pairs of its config."""
    if doc.get("technique") == "baseline":
        return "-"
    if doc.get("label"):
        return plain(doc["label"])
    parts = [f"{k}={v}" for k, v in (doc.get("config") or {}).items() if k != "kind" and v is not None]
    return plain(" ".join(parts)) or "-"


def recommendation_line(rec, rows: list[dict]) -> str:
    """`technique label: key figures vs what, perplexity change`, for the recommended row."""
    row = next((r for r in rows if r.get("run_id") == rec.doc.run_id), None) or {}
    lead = f"{row.get('lead') or '-'} vs {row.get('lead_vs') or 'the baseline'}"
    quality = (f"quality {rec.doc.metrics['quality']}" if rec.doc.metrics.get("quality") else
               f"perplexity {signed_pct(rec.doc.ppl_delta_pct)}")
    return plain(f"{RECOMMENDED_MARK} {rec.doc.technique} {row.get('config') or config_summary(rec.doc)}: "
                 f"{lead}, {quality}")
