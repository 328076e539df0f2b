"""`infer-tune leaderboard`: every result under a runs directory in one table (md / csv / html + terminal)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from infer_tune.cli import options as opt
from infer_tune.cli import output


def render(rows: list[dict]) -> None:
    """The leaderboard on stdout: a rich table on a wide terminal; markdown of the narrow column set when
    the output is not a terminal or narrower than the table (a CI log), so nothing is truncated."""
    from infer_tune.report import display

    if not (output.out.is_terminal and output.out.width >= 160):
        output.out.print(display.markdown(rows, narrow=True), markup=False, highlight=False, soft_wrap=True)
        return
    table = Table(title=f"infer-tune leaderboard ({len(rows)} results)")
    cols = display.columns()
    for c in cols:
        table.add_column(c.header, justify="right" if c.numeric else "left")
    for row in rows:
        table.add_row(*(c.render(row) for c in cols))
    output.out.print(table)


def print_recommendation(rec, budget, rows: list[dict] | None = None) -> None:
    """The recommended configuration and its reproduce command, or why there is none."""
    from infer_tune.report import display
    from infer_tune.report import leaderboard as lb

    if rec.doc is not None:
        # the label and the reproduce path come from result files: no control character reaches the terminal
        line = f"{display.recommendation_line(rec, rows or [])} -- {rec.decision()}"
        output.out.print(f"recommended ({lb.budget_summary(budget)}): {output.clean(line)}", markup=False,
                         soft_wrap=True)
        output.out.print(f"reproduce: {output.clean(rec.command)}", markup=False, soft_wrap=True)
    else:
        output.out.print(f"no configuration to recommend within {lb.budget_summary(budget)}", markup=False,
                         soft_wrap=True)


def leaderboard(
    runs_dir: Annotated[Path, typer.Argument(help="Runs directory holding <run-id>/result.json folders.")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Where to write the files (default: RUNS_DIR).")] = None,
    formats: Annotated[list[str] | None, typer.Option("--format", "-f", help="md, csv, html (repeat or comma-separate; default all).")] = None,
    sort: Annotated[str | None, typer.Option("--sort", help="Column to sort by, e.g. speedup_vs_baseline.")] = None,
    desc: Annotated[bool, typer.Option("--desc", help="Sort descending.")] = False,
    technique: Annotated[list[str] | None, typer.Option("--technique", help="Keep only this technique (repeatable).")] = None,
    model: Annotated[list[str] | None, typer.Option("--model", help="Keep only this model ref (repeatable).")] = None,
    suite: Annotated[list[str] | None, typer.Option("--suite", help="Keep only this suite (repeatable).")] = None,
    max_bleu_drift: Annotated[float, typer.Option("--max-bleu-drift", help="Recommendation budget: BLEU points lost at most.")] = 1.0,
    max_ppl_delta: Annotated[float, typer.Option("--max-ppl-delta", help="Recommendation budget: perplexity change in % at most.")] = 5.0,
    require_lossless: Annotated[bool, typer.Option("--require-lossless", help="Recommend only configs whose outputs equal the baseline's.")] = False,
    json_out: opt.Json = False,
    debug: opt.Debug = False,
) -> None:
    """Combine every result under RUNS_DIR into leaderboard.md, leaderboard.csv and a self-contained
    leaderboard.html report: the table (sortable, filterable), the claims table, the recommended
    configuration within a drift budget, and plots (speedup vs perplexity change with the Pareto
    front, TTFT/TPOT p50/p99, per-position latency, each technique's own plots).

    Example: infer-tune leaderboard runs/ --sort speedup_vs_baseline --desc
    """
    from infer_tune import paths, results
    from infer_tune.errors import ResultError
    from infer_tune.report import leaderboard as lb

    skipped: list[tuple[str, str]] = []
    docs = results.find_results(runs_dir, skipped=skipped, drop=("samples",))  # the report reads no samples
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
    from infer_tune.report.claims import collect
    from infer_tune.report.recommend import Budget, recommend, reproduce_command

    budget = Budget(max_bleu_drift=max_bleu_drift, max_ppl_delta=max_ppl_delta, require_lossless=require_lossless)
    written = lb.write(frame, docs, out or runs_dir, wanted, budget)
    shown = [d for d in docs if d["run_id"] in set(frame["run_id"])]
    rec = recommend(shown, budget)
    if rec.doc is not None and "recommended" in written:
        rec.command = reproduce_command(rec.doc, written["recommended"])
    rows = lb.rows_of(frame, rec.doc["run_id"] if rec.doc else None)
    if json_out:
        output.print_json({"rows": rows, "claims": [c.to_dict() for c in collect(shown)],
                           "recommendation": rec.to_dict(), "files": {k: str(v) for k, v in written.items()}})
        return
    render(rows)
    print_recommendation(rec, budget, rows)
    for path in written.values():
        output.note(f"wrote {path}")
