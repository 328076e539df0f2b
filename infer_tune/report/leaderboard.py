"""The combined leaderboard: one row per result across techniques, written as md / csv / html.

Speed and quality drift of the same run sit in one row. The csv holds every column as raw numbers;
the markdown and the self-contained HTML report (report/html.py) show human units, the claims table
and the recommended configuration; the HTML embeds its plots (speedup vs perplexity change with the
Pareto front, TTFT/TPOT p50/p99 bars, per-position decode latency, and each technique's own PNGs).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from infer_tune import atomic
from infer_tune.errors import InferTuneError
from infer_tune.report import claims, display
from infer_tune.report import html as html_report
from infer_tune.report.plots import per_position_png, png_bytes, pyplot
from infer_tune.report.recommend import Budget, recommend

COLUMNS = ("run_id", "technique", "config", "model", "suite", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
           "tpot_p99_ms", "output_throughput_tok_s", "speedup_vs_baseline", "peak_rss_bytes", "model_bytes", "bleu",
           "bleu_drift", "bleu_vs_baseline", "exact_match_vs_baseline", "ppl_delta_pct", "pass_at_1",
           "roofline_fraction", "output_mismatches", "ttft_speedup_vs_baseline", "bleu_drift_ci95", "broken", "broken_why",
           "verdict_evidence")
OBJECT_COLUMNS = {"run_id", "technique", "config", "model", "suite", "bleu_drift_ci95", "broken", "broken_why",
                  "verdict_evidence"}
FORMATS = ("md", "csv", "html")


def config_summary(doc: dict) -> str:
    """The technique's own short label (e.g. `int8-static-torch-a0.5`), else `k=v` pairs of its config."""
    if doc.get("technique") == "baseline":
        return "-"
    if doc.get("label"):
        return str(doc["label"])
    parts = [f"{k}={v}" for k, v in (doc.get("config") or {}).items() if k != "kind" and v is not None]
    return " ".join(parts) or "-"


def flatten(doc: dict) -> dict:
    """One leaderboard row of a result document."""
    m = doc.get("metrics", {})

    def dist(key: str, stat: str) -> float | None:
        return (m.get(key) or {}).get(stat)

    row = {
        "run_id": doc["run_id"],
        "technique": doc.get("technique"),
        "config": config_summary(doc),
        "model": doc.get("model", {}).get("ref"),
        "suite": doc.get("workload", {}).get("suite"),
        "ttft_p50_ms": dist("ttft_ms", "p50"),
        "ttft_p99_ms": dist("ttft_ms", "p99"),
        "tpot_p50_ms": dist("tpot_ms", "p50"),
        "tpot_p99_ms": dist("tpot_ms", "p99"),
    }
    for key in COLUMNS:
        row.setdefault(key, m.get(key))
    if display.is_broken(row):  # a broken model is never shown as a speedup (metrics.deltas.verdict; the verdict column says why)
        row["speedup_vs_baseline"] = None
    elif (m.get("noise") or {}).get("noisy"):
        row["config"] = f"{row['config']} [noisy]"
    if row["technique"] == "baseline":  # the baseline is its own reference point
        row["speedup_vs_baseline"] = 1.0 if row["speedup_vs_baseline"] is None else row["speedup_vs_baseline"]
        row["bleu_drift"] = 0.0 if row["bleu_drift"] is None else row["bleu_drift"]
    return row


def build(docs: Sequence[dict], *, technique: Sequence[str] = (), model: Sequence[str] = (),
          suite: Sequence[str] = (), sort: str | None = None, descending: bool = False) -> pd.DataFrame:
    """A DataFrame of flattened results, filtered (any of the given values) and sorted."""
    frame = pd.DataFrame([flatten(d) for d in docs], columns=list(COLUMNS))
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
    return frame.reset_index(drop=True)


def per_position(docs: Sequence[dict], run_ids: Sequence[str]) -> dict[str, list[float]]:
    """`per_position_ms` of the shown rows that have one (kv-cache runs)."""
    wanted = set(run_ids)
    found = {}
    for doc in docs:
        values = doc.get("metrics", {}).get("per_position_ms")
        if doc["run_id"] in wanted and isinstance(values, list) and values \
                and all(isinstance(v, (int, float)) for v in values):
            found[doc["run_id"]] = [float(v) for v in values]
    return found


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (both maximised)."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(ox >= x and oy >= y and (ox > x or oy > y) for j, (ox, oy) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return front


def _png(fig) -> str:
    return base64.b64encode(png_bytes(fig)).decode("ascii")


def plots(frame: pd.DataFrame, positions: dict[str, list[float]]) -> dict[str, str]:
    """Title -> base64 PNG of each plot that has data."""
    plt = pyplot()
    images = {}
    # technique, config and the run id's random suffix (tells repeated runs of one config apart)
    labels = [f"{t} {'' if c == '-' else c} #{r[-4:]}".replace("  ", " ")[:44]
              for t, c, r in zip(frame["technique"], frame["config"], frame["run_id"], strict=True)]
    # quality axis: perplexity change (a stronger signal than BLEU on a few outputs); a run without
    # perplexity whose outputs equal the baseline's (a lossless technique) sits at 0
    quality = frame["ppl_delta_pct"].astype(float).copy()
    quality[((frame["output_mismatches"] == 0) | (frame["technique"] == "baseline")) & quality.isna()] = 0.0
    points = pd.DataFrame({"x": frame["speedup_vs_baseline"].astype(float), "y": -quality})
    broken = [display.is_broken(row) for row in frame.to_dict(orient="records")]
    has = points.notna().all(axis=1).to_numpy() & ~np.array(broken, dtype=bool)
    if has.any():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xy = [(float(x), float(y)) for x, y in points[has].itertuples(index=False)]
        names = [n for n, h in zip(labels, has, strict=True) if h]
        ax.scatter([p[0] for p in xy], [p[1] for p in xy], color="tab:blue")
        for (x, y), name in zip(xy, names, strict=True):
            ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = sorted((xy[i] for i in pareto_front(xy)), key=lambda p: p[0])
        ax.plot([p[0] for p in front], [p[1] for p in front], "o--", color="tab:red", label="Pareto front")
        ax.set_xlabel("decode speedup vs baseline (x, TPOT p50)")
        ax.set_ylabel("perplexity change (%, negated: higher is better)")
        ax.legend()
        images["Speedup vs quality drift (Pareto front)"] = _png(fig)
    if len(frame):
        fig, axes = plt.subplots(1, 2, figsize=(max(7, 1.2 * len(frame) + 4), 4))
        index = range(len(frame))
        for ax, key in zip(axes, ("ttft", "tpot"), strict=True):
            ax.bar([i - 0.2 for i in index], frame[f"{key}_p50_ms"].astype(float), width=0.4, label="p50")
            ax.bar([i + 0.2 for i in index], frame[f"{key}_p99_ms"].astype(float), width=0.4, label="p99")
            ax.set_xticks(list(index), labels, rotation=30, ha="right", fontsize=7)
            ax.set_ylabel(f"{key.upper()} (ms)")
            ax.legend()
        images["TTFT and TPOT p50 / p99"] = _png(fig)
    if positions:
        names = dict(zip(frame["run_id"], labels, strict=True))
        curves = {names.get(run_id, run_id[-40:]): values for run_id, values in positions.items()}
        images["Per-position decode latency"] = base64.b64encode(per_position_png(curves)).decode("ascii")
    return images


def write(frame: pd.DataFrame, docs: Sequence[dict], out_dir: Path, formats: Sequence[str] = FORMATS,
          budget: Budget | None = None) -> dict[str, Path]:
    """Write leaderboard.{md,csv,html} atomically into `out_dir`; returns format -> path."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise InferTuneError(f"unknown leaderboard format {', '.join(unknown)}; use {', '.join(FORMATS)}")
    budget = budget or Budget()
    shown = [d for d in docs if d["run_id"] in set(frame["run_id"])]
    rows = frame.astype(object).where(frame.notna(), None).to_dict(orient="records")
    found_claims = claims.collect(shown)
    rec = recommend(shown, budget)
    budget_text = budget_summary(budget)
    out_dir = Path(out_dir)
    written = {}
    for fmt in formats:
        path = out_dir / f"leaderboard.{fmt}"
        if fmt == "md":
            text = to_markdown(rows, found_claims, rec, budget_text)
        elif fmt == "csv":
            text = frame.to_csv(index=False)
        else:
            images = {t: base64.b64decode(d) for t, d in plots(frame, per_position(docs, list(frame["run_id"]))).items()}
            env = next((d.get("env") for d in shown if d.get("env")), {}) or {}
            text = html_report.page(rows, env, found_claims, rec, budget_text, images, html_report.technique_images(shown))
        atomic.write_text(path, text)
        written[fmt] = path
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
        parts.extend(f"| {c.claim} | {c.measured} | {c.verdict}{' (' + c.why + ')' if c.why and c.verdict != 'held' else ''} |"
                     for c in found_claims)
    parts.append("\n## Recommended configuration\n")
    if rec.doc is None:
        parts.append(f"None within {budget_text}: {'; '.join(rec.reasons[-3:]) or 'no candidate results'}.")
    else:
        m = rec.doc["metrics"]
        parts.append(f"**{rec.doc['technique']} {rec.doc.get('label', '')}**: {display.times(m.get('speedup_vs_baseline'))} "
                     f"decode, perplexity {display.signed_pct(m.get('ppl_delta_pct'))} (within {budget_text}); "
                     f"{rec.decision()}.\n\n"
                     f"Reproduce: `{rec.command}`" + (f"\n\nSaved model: `{rec.saved_model}`" if rec.saved_model else ""))
    return "\n".join(parts) + "\n"
