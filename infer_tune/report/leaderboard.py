"""The combined leaderboard: one row per result across techniques, written as md / csv / html.

Speed and quality drift of the same run sit in one row. The html file is self-contained: its
plots (speedup vs BLEU drift with the Pareto front, TTFT/TPOT p50/p99 bars, per-position decode
latency of kv-cache runs) are embedded as base64 PNG.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from infer_tune import atomic
from infer_tune.errors import InferTuneError
from infer_tune.report.plots import per_position_png, png_bytes, pyplot

COLUMNS = ("run_id", "technique", "config", "model", "suite", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
           "tpot_p99_ms", "output_throughput_tok_s", "speedup_vs_baseline", "peak_rss_bytes", "model_bytes", "bleu",
           "bleu_drift", "bleu_vs_baseline", "exact_match_vs_baseline", "ppl_delta_pct", "pass_at_1",
           "roofline_fraction")
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
    if m.get("broken"):  # a broken model is never shown as a speedup (metrics.deltas.verdict)
        row["config"] = f"{row['config']} [BROKEN: {m.get('broken_why')}]"
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
    for column in COLUMNS[5:]:  # numeric columns: a missing value is NaN (rendered "-"), never "None"
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


def to_markdown(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured markdown table (no extra dependency)."""
    def cell(v: object) -> str:
        if v is None or (isinstance(v, float) and pd.isna(v)):
            return "-"
        return f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def _png(fig) -> str:
    return base64.b64encode(png_bytes(fig)).decode("ascii")


def plots(frame: pd.DataFrame, positions: dict[str, list[float]]) -> dict[str, str]:
    """Title -> base64 PNG of each plot that has data."""
    plt = pyplot()
    images = {}
    # technique, config and the run id's random suffix (tells repeated runs of one config apart)
    labels = [f"{t} {'' if c == '-' else c} #{r[-4:]}".replace("  ", " ")[:44]
              for t, c, r in zip(frame["technique"], frame["config"], frame["run_id"], strict=True)]
    points = frame[["speedup_vs_baseline", "bleu_drift"]].astype(float)
    has = points.notna().all(axis=1).to_numpy()
    if has.any():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xy = [(float(x), float(y)) for x, y in points[has].itertuples(index=False)]
        names = [n for n, h in zip(labels, has, strict=True) if h]
        ax.scatter([p[0] for p in xy], [p[1] for p in xy], color="tab:blue")
        for (x, y), name in zip(xy, names, strict=True):
            ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = sorted((xy[i] for i in pareto_front(xy)), key=lambda p: p[0])
        ax.plot([p[0] for p in front], [p[1] for p in front], "o--", color="tab:red", label="Pareto front")
        ax.set_xlabel("speedup vs baseline (x, TPOT p50)")
        ax.set_ylabel("BLEU drift (points)")
        ax.legend()
        images["Speedup vs BLEU drift"] = _png(fig)
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


def to_html(frame: pd.DataFrame, images: dict[str, str]) -> str:
    """A self-contained page: the table and the embedded plots."""
    table = frame.to_html(index=False, na_rep="-", float_format=lambda v: f"{v:.4g}", border=0, classes="lb")
    figures = "".join(f"<h2>{html.escape(title)}</h2><img alt=\"{html.escape(title)}\" "
                      f"src=\"data:image/png;base64,{data}\">" for title, data in images.items())
    style = ("body{font-family:sans-serif;margin:2em}table.lb{border-collapse:collapse;font-size:12px}"
             "table.lb td,table.lb th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
             "img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>infer-tune leaderboard</title>"
            f"<style>{style}</style></head><body><h1>infer-tune leaderboard</h1>{table}{figures}</body></html>\n")


def write(frame: pd.DataFrame, docs: Sequence[dict], out_dir: Path, formats: Sequence[str] = FORMATS) -> dict[str, Path]:
    """Write leaderboard.{md,csv,html} atomically into `out_dir`; returns format -> path."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise InferTuneError(f"unknown leaderboard format {', '.join(unknown)}; use {', '.join(FORMATS)}")
    out_dir = Path(out_dir)
    written = {}
    for fmt in formats:
        path = out_dir / f"leaderboard.{fmt}"
        if fmt == "md":
            text = to_markdown(frame)
        elif fmt == "csv":
            text = frame.to_csv(index=False)
        else:
            text = to_html(frame, plots(frame, per_position(docs, list(frame["run_id"]))))
        atomic.write_text(path, text)
        written[fmt] = path
    return written
