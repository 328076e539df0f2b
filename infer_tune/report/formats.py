"""Text renderings of a `Comparison`: markdown (CI job summaries) and JUnit XML (CI test reports)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from infer_tune.report.compare import Check, Comparison, Delta


def fmt_num(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def fmt_interval(interval: list[float] | None, relative: bool = True) -> str:
    if interval is None:
        return "-"
    return f"[{fmt_pct(interval[0])}, {fmt_pct(interval[1])}]" if relative else \
        f"[{fmt_num(interval[0])}, {fmt_num(interval[1])}]"


def fmt_observed(check: Check) -> str:
    return fmt_pct(check.observed) if check.relative else fmt_num(check.observed)


def delta_row(d: Delta) -> list[str]:
    return [d.metric, fmt_num(d.base), fmt_num(d.cand), fmt_pct(d.change_pct), fmt_interval(d.ci95_pct)]


def fmt_mde(c: Check) -> str:
    """The smallest change this sample could detect: the interval's half-width (± in the check's unit)."""
    if c.mde is None:
        return "-"
    return f"±{c.mde:.1f}%" if c.relative else f"±{c.mde:.4g}"


OUTCOME_TEXT = {"pass": "pass", "regression": "REGRESSED", "inconclusive": "INCONCLUSIVE"}


def check_row(c: Check) -> list[str]:
    return [c.expr, fmt_observed(c), fmt_interval(c.interval, c.relative), fmt_mde(c), c.method,
            OUTCOME_TEXT[c.outcome]]


def check_notes(c: Check) -> list[str]:
    """What a reader needs besides the row: why a gate's own check failed, noise, what shrinks the interval."""
    notes = [text for text in (c.reason, c.noise) if text]
    if c.mde_hint:
        notes.append(f"detectable change at this sample {fmt_mde(c)}: {c.mde_hint}")
    return notes


DELTA_HEADER = ["metric", "base", "candidate", "change", "95% CI of change"]
CHECK_HEADER = ["--fail-if", "observed", "95% CI", "detectable", "method", "outcome"]
VERDICT_TEXT = {"pass": "✅ pass", "regression": "❌ regression", "inconclusive": "⚠️ inconclusive"}


def md_table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])


def run_to_run_text(comparison: Comparison, cand) -> str:
    """Whether the spread between separate runs was added to this candidate's timing intervals, and from where."""
    if cand.same_rounds:
        return "none added (measured beside the base in one run's interleaved rounds)"
    spread = comparison.run_to_run or {}
    return f"added between separate runs: {spread.get('detail', 'none')}"


def to_markdown(comparison: Comparison) -> str:
    """A job-summary section: verdict, then per candidate the gate checks and the deltas."""
    verdict = VERDICT_TEXT[comparison.outcome]
    parts = [f"## infer-tune compare: {verdict}", "", f"Base: `{comparison.base_run_id}`", ""]
    parts += [f"> ⚠️ warning: {w}" for w in comparison.warnings] + ([""] if comparison.warnings else [])
    for cand in comparison.candidates:
        parts += [f"### `{cand.run_id}` ({cand.technique})", "", f"Timing medians: {cand.pairing}.",
                  f"Run-to-run: {run_to_run_text(comparison, cand)}.", ""]
        if cand.checks:
            parts += [md_table(CHECK_HEADER, [check_row(c) for c in cand.checks]), ""]
            notes = [f"- `{c.expr}`: {note}" for c in cand.checks for note in check_notes(c)]
            parts += notes + ([""] if notes else [])
        parts += [md_table(DELTA_HEADER, [delta_row(d) for d in cand.deltas]), ""]
    parts.append("A timing check is a regression when its whole bootstrap 95% interval is past the threshold, "
                 "a pass when the whole interval is on the passing side, and inconclusive when it straddles "
                 "the threshold; 'detectable' is the interval's half-width.")
    return "\n".join(parts) + "\n"


def to_junit(comparison: Comparison, *, strict: bool = False) -> str:
    """JUnit XML: one testsuite per candidate, one testcase per expression: a failure when it regressed,
    skipped (with the reason) when it was inconclusive, or a failure too under `strict`."""
    root = ET.Element("testsuites", name="infer-tune compare")
    total = failures = skipped = 0
    for cand in comparison.candidates:
        suite = ET.SubElement(root, "testsuite", name=cand.run_id, tests=str(len(cand.checks)))
        bad = undecided = 0
        for check in cand.checks:
            case = ET.SubElement(suite, "testcase", classname=f"infer-tune.{cand.run_id}", name=check.expr)
            message = "; ".join([f"{check.outcome}: {check.metric} observed {fmt_observed(check)}, 95% CI "
                                 f"{fmt_interval(check.interval, check.relative)}, detectable {fmt_mde(check)} "
                                 f"({check.method}) vs base {comparison.base_run_id}", *check_notes(check)])
            if check.outcome == "regression" or (check.outcome == "inconclusive" and strict):
                ET.SubElement(case, "failure", message=message, type=check.outcome).text = message
                bad += 1
            elif check.outcome == "inconclusive":
                ET.SubElement(case, "skipped", message=message).text = message
                undecided += 1
            else:
                ET.SubElement(case, "system-out").text = message
        suite.set("failures", str(bad))
        suite.set("skipped", str(undecided))
        total += len(cand.checks)
        failures += bad
        skipped += undecided
    root.set("tests", str(total))
    root.set("failures", str(failures))
    root.set("skipped", str(skipped))
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
