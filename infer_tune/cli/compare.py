"""`infer-tune compare`: deltas with confidence against a base result, and the CI regression gate."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.errors import InferTuneError

FORMATS = ("table", "md", "json", "junit")
STYLED = {"pass": "[green]pass[/]", "regression": "[bold red]REGRESSED[/]", "inconclusive": "[bold yellow]INCONCLUSIVE[/]"}
INCONCLUSIVE_EXIT = 4


def render(comparison) -> None:
    """Per candidate: the gate checks (when any) and the deltas of the main metrics, as rich tables."""
    from infer_tune.report import formats as f

    for cand in comparison.candidates:
        title = f"candidate {cand.run_id} ({cand.technique}) vs base {comparison.base_run_id}"
        if cand.checks:
            checks = Table(title=f"gate: {title}")
            for name in f.CHECK_HEADER:
                checks.add_column(name, justify="left" if name == "--fail-if" else "right")
            for check in cand.checks:
                row = [escape(cell) for cell in f.check_row(check)]
                checks.add_row(*row[:-1], Text.from_markup(STYLED[check.outcome]))  # stdout prints no markup
            output.out.print(checks)
            for check in cand.checks:
                for note in f.check_notes(check):
                    output.out.print(f"  {check.expr}: {note}", soft_wrap=True, markup=False, highlight=False)
        deltas = Table(title=f"deltas: {title}")
        for name in f.DELTA_HEADER:
            deltas.add_column(name, justify="left" if name == "metric" else "right")
        for d in cand.deltas:
            deltas.add_row(*f.delta_row(d))
        output.out.print(deltas)
        output.out.print(f"  timing medians: {cand.pairing}", soft_wrap=True)
        output.out.print(f"  run-to-run: {f.run_to_run_text(comparison, cand)}", soft_wrap=True, markup=False)


def print_plain(text: str) -> None:
    output.out.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True, end="")


def compare(
    base: Annotated[Path, typer.Argument(help="Base run folder or its result.json (e.g. the stored baseline).")],
    candidates: Annotated[list[Path], typer.Argument(help="Candidate run folders or result.json files.")],
    fail_if: Annotated[list[str] | None, typer.Option("--fail-if", help="Gate EXPR 'METRIC OP VALUE[%]', repeatable: "
                                                      "'tpot_ms.p50 > +10%', 'bleu_drift < -1.0'.")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="table, md, json or junit.")] = "table",
    allow_mismatch: Annotated[bool, typer.Option("--allow-mismatch", help="Compare results measured differently (suite, model, "
                                                 "max new tokens, batch size, limit, dtype, threads, machine): a loud warning instead of exit 2.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Treat an inconclusive check (its interval straddles the "
                                         "threshold) as a failure: exit 1 instead of 4.")] = False,
    max_failed_requests: Annotated[int, typer.Option("--max-failed-requests", min=0, help="Failed requests a candidate "
                                                     "may record (endpoint runs) before the gate refuses it.")] = 0,
    run_to_run: Annotated[float | None, typer.Option("--run-to-run", min=0.0, max=50.0, help="One run's level spread "
                          "(%) added to timing intervals between separate runs; default: this machine's calibration "
                          "(--calibrate), else 2%. 0 turns it off.")] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Instead of comparing: measure this machine's "
                         "run-to-run spread from 3+ results of ONE measurement from separate runs (all paths "
                         "given), store it in $INFER_TUNE_HOME/run_to_run.json and print it.")] = False,
    seed: opt.Seed = 0,
    json_out: opt.Json = False,
    debug: opt.Debug = False,
) -> None:
    """Deltas of CAND vs BASE with bootstrap 95% intervals; with --fail-if, a CI gate.

    A % threshold is the relative change cand vs base; a plain number is compared with the candidate's
    value (for bleu_drift, ppl_delta_pct, speedup_vs_baseline). A timing check with raw samples is a
    regression when the WHOLE bootstrap 95% interval is past the threshold, a pass when it is wholly on
    the passing side, inconclusive when it straddles the threshold; each check prints the smallest change
    this sample can detect and what would shrink it. A noisy input can only make a pass inconclusive; a
    candidate with failed requests (above --max-failed-requests) is a regression; negative
    timings or a zero TTFT / e2e are bad input. Results measured differently (suite, model, max new tokens, batch size, limit,
    dtype, threads, machine) are refused unless --allow-mismatch.
    Exit 0 pass, 1 regression (or inconclusive with --strict), 2 bad input, 3 internal error, 4 inconclusive.
    When GITHUB_STEP_SUMMARY is set, the markdown report is appended to that file.

    Example: infer-tune compare baseline/result.json runs/pr/*/ --fail-if "tpot_ms.p50 > +10%" --format md
    """
    from infer_tune import results
    from infer_tune.report import compare as cmp
    from infer_tune.report import formats as f
    from infer_tune.report import run_to_run as rtr

    fmt = "json" if json_out else fmt
    if fmt not in FORMATS:
        raise InferTuneError(f"unknown --format {fmt!r}; use {', '.join(FORMATS)}")
    if calibrate:
        if fail_if:
            raise InferTuneError("--calibrate measures the run-to-run spread; it takes no --fail-if")
        calibrate_host([base, *candidates], fmt)
        return
    exprs = [cmp.parse_expr(text) for text in fail_if or []]
    base_doc = results.load_result(base)
    cand_docs = [results.load_result(c) for c in candidates]
    spread = rtr.for_host(base_doc, run_to_run)
    comparison = cmp.compare(base_doc, cand_docs, exprs, allow_mismatch=allow_mismatch, seed=seed,
                             max_failed_requests=max_failed_requests, spread=spread)
    for warning in comparison.warnings:
        output.warn(warning)
    markdown = f.to_markdown(comparison)
    if summary := os.environ.get("GITHUB_STEP_SUMMARY"):
        try:
            with open(summary, "a", encoding="utf-8") as handle:
                handle.write(markdown + "\n")
        except OSError as exc:
            output.note(f"could not append to GITHUB_STEP_SUMMARY ({summary}): {exc}")
    if fmt == "json":
        output.print_json(comparison.to_dict())
    elif fmt == "md":
        print_plain(markdown)
    elif fmt == "junit":
        print_plain(f.to_junit(comparison, strict=strict))
    else:
        render(comparison)
    exit_gate(comparison, strict)


def calibrate_host(paths: list[Path], fmt: str) -> None:
    """`compare --calibrate`: the run-to-run spread of one measurement repeated in separate runs, stored."""
    from infer_tune import results
    from infer_tune.report import run_to_run as rtr

    cal = rtr.save(rtr.calibrate([results.load_result(p) for p in paths]))
    if fmt == "json":
        output.print_json(cal.to_dict())
        return
    table = Table(title=f"run-to-run spread of {cal.runs} runs (this machine, {escape(cal.host)})")
    for name in ("metric", "between runs", "adjacent runs", "drift", "within a run", "run-to-run (per run)",
                 "smallest gate (separate runs)"):
        table.add_column(name, justify="left" if name == "metric" else "right")
    for m in cal.metrics:
        table.add_row(m.metric, *(f"{v:.2f}%" for v in (m.between_pct, m.adjacent_pct, m.drift_pct, m.within_pct,
                                                        m.sigma_pct)), f"+{m.gate_pct:.1f}%")
    output.out.print(table)
    output.out.print(f"  stored in {cal.path}; `compare` adds it to intervals between separate runs on this machine",
                     soft_wrap=True, markup=False)
    output.out.print("  smallest gate: the smallest --fail-if threshold two separate runs of one config pass 19 times "
                     "in 20 here; below it, measure base and candidate in one run (`bench --recipe`), where the "
                     "run-to-run spread cancels", soft_wrap=True, markup=False)


def exit_gate(comparison, strict: bool) -> None:
    """Exit 1 on a regression (or, with --strict, an inconclusive check), 4 on an inconclusive one, else return."""
    def named(outcome: str) -> str:
        return "; ".join(sorted({c.expr for cand in comparison.candidates for c in cand.checks if c.outcome == outcome}))

    if comparison.outcome == "regression":
        output.error(f"regression: {named('regression')}")
        raise typer.Exit(1)
    if comparison.outcome == "inconclusive":
        undecided = named("inconclusive")
        if strict:
            output.error(f"inconclusive (failed under --strict): {undecided}")
            raise typer.Exit(1)
        output.warn(f"inconclusive: {undecided}: the interval straddles the threshold; more prompts (--limit) "
                    "or rounds (--min-iterations) narrow it (exit 4; --strict makes it a failure)")
        raise typer.Exit(INCONCLUSIVE_EXIT)
