"""`infer-tune leaderboard`: every result under a runs directory in one table (md / csv / html + terminal)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from infer_tune.cli import options as opt
from infer_tune.cli import output

# (column, header, format): a compact subset; the files hold every column.
TERMINAL_COLUMNS = (("technique", "technique", "s"), ("config", "config", "s"), ("ttft_p50_ms", "TTFT p50 ms", ".0f"),
                    ("ttft_p99_ms", "p99", ".0f"), ("tpot_p50_ms", "TPOT p50 ms", ".1f"),
                    ("output_throughput_tok_s", "tok/s", ".1f"), ("speedup_vs_baseline", "speedup", ".2f"),
                    ("peak_rss_bytes", "peak RSS", "bytes"), ("model_bytes", "model", "bytes"), ("bleu", "BLEU", ".2f"),
                    ("bleu_drift", "drift", "+.2f"), ("exact_match_vs_baseline", "exact", ".0%"),
                    ("ppl_delta_pct", "ppl Δ%", "+.1f"), ("roofline_fraction", "roofline", ".0%"))


def render(frame) -> None:
    """The leaderboard as a rich table on stdout."""
    table = Table(title=f"infer-tune leaderboard ({len(frame)} results)")
    for name, header, _ in TERMINAL_COLUMNS:
        table.add_column(header, justify="left" if name in ("technique", "config") else "right")
    for row in frame.to_dict(orient="records"):
        cells = []
        for name, _, spec in TERMINAL_COLUMNS:
            value = row.get(name)
            value = None if value != value else value  # NaN -> missing
            cells.append(output.fmt_bytes(value) if spec == "bytes" else output.fmt(value, spec))
        table.add_row(*cells)
    output.out.print(table)


def leaderboard(
    runs_dir: Annotated[Path, typer.Argument(help="Runs directory holding <run-id>/result.json folders.")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Where to write the files (default: RUNS_DIR).")] = None,
    formats: Annotated[list[str] | None, typer.Option("--format", "-f", help="md, csv, html (repeat or comma-separate; default all).")] = None,
    sort: Annotated[str | None, typer.Option("--sort", help="Column to sort by, e.g. speedup_vs_baseline.")] = None,
    desc: Annotated[bool, typer.Option("--desc", help="Sort descending.")] = False,
    technique: Annotated[list[str] | None, typer.Option("--technique", help="Keep only this technique (repeatable).")] = None,
    model: Annotated[list[str] | None, typer.Option("--model", help="Keep only this model ref (repeatable).")] = None,
    suite: Annotated[list[str] | None, typer.Option("--suite", help="Keep only this suite (repeatable).")] = None,
    json_out: opt.Json = False,
    debug: opt.Debug = False,
) -> None:
    """Combine every result under RUNS_DIR into leaderboard.md, leaderboard.csv and a self-contained
    leaderboard.html with plots (speedup vs BLEU drift with the Pareto front, TTFT/TPOT p50/p99).

    Example: infer-tune leaderboard runs/ --sort speedup_vs_baseline --desc
    """
    from infer_tune import paths, results
    from infer_tune.errors import ResultError
    from infer_tune.report import leaderboard as lb

    skipped: list[tuple[str, str]] = []
    docs = results.find_results(runs_dir, skipped=skipped)
    if not docs:
        why = f" ({len(skipped)} unreadable, e.g. {skipped[0][1]})" if skipped else ""
        raise ResultError(f"no readable result.json under {runs_dir}{why}; run `infer-tune bench --out {runs_dir}` first")
    wanted = [f.strip() for item in (formats or list(lb.FORMATS)) for f in item.split(",") if f.strip()]
    unknown = [f for f in wanted if f not in lb.FORMATS]
    if unknown:
        raise ResultError(f"unknown --format {', '.join(unknown)}; use {', '.join(lb.FORMATS)}")
    paths.ensure_writable(out or runs_dir, "--out")
    frame = lb.build(docs, technique=technique or (), model=model or (), suite=suite or (), sort=sort,
                     descending=desc)
    if skipped:
        output.warn(f"skipped {len(skipped)} unreadable result file(s): "
                    + "; ".join(f"{path} ({reason.rsplit(': ', 1)[-1]})" for path, reason in skipped))
    written = lb.write(frame, docs, out or runs_dir, wanted)
    if json_out:
        output.print_json({"rows": frame.astype(object).where(frame.notna(), None).to_dict(orient="records"),
                           "files": {k: str(v) for k, v in written.items()}})
        return
    render(frame)
    for path in written.values():
        output.note(f"wrote {path}")
