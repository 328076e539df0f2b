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


def check_row(c: Check) -> list[str]:
    return [c.expr, fmt_observed(c), fmt_interval(c.interval, c.relative), c.method,
            "REGRESSED" if c.regressed else "pass"]


DELTA_HEADER = ["metric", "base", "candidate", "change", "95% CI of change"]
CHECK_HEADER = ["--fail-if", "observed", "95% CI", "method", "verdict"]


def md_table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])


def to_markdown(comparison: Comparison) -> str:
    """A job-summary section: verdict, then per candidate the gate checks and the deltas."""
    verdict = "❌ regression" if comparison.regressed else "✅ pass"
    parts = [f"## infer-tune compare: {verdict}", "", f"Base: `{comparison.base_run_id}`", ""]
    parts += [f"> ⚠️ warning: {w}" for w in comparison.warnings] + ([""] if comparison.warnings else [])
    for cand in comparison.candidates:
        parts += [f"### `{cand.run_id}` ({cand.technique})", "", f"Timing medians: {cand.pairing}.", ""]
        if cand.checks:
            parts += [md_table(CHECK_HEADER, [check_row(c) for c in cand.checks]), ""]
        parts += [md_table(DELTA_HEADER, [delta_row(d) for d in cand.deltas]), ""]
    parts.append("A timing check fails only when its whole bootstrap 95% interval is past the threshold.")
    return "\n".join(parts) + "\n"


def to_junit(comparison: Comparison) -> str:
    """JUnit XML: one testsuite per candidate, one testcase per expression, a failure when regressed."""
    root = ET.Element("testsuites", name="infer-tune compare")
    total = failures = 0
    for cand in comparison.candidates:
        bad = sum(c.regressed for c in cand.checks)
        suite = ET.SubElement(root, "testsuite", name=cand.run_id, tests=str(len(cand.checks)), failures=str(bad))
        for check in cand.checks:
            case = ET.SubElement(suite, "testcase", classname=f"infer-tune.{cand.run_id}", name=check.expr)
            message = (f"{check.metric}: observed {fmt_observed(check)}, 95% CI "
                       f"{fmt_interval(check.interval, check.relative)} ({check.method}) vs base "
                       f"{comparison.base_run_id}")
            if check.regressed:
                ET.SubElement(case, "failure", message=message, type="regression").text = message
            else:
                ET.SubElement(case, "system-out").text = message
        total += len(cand.checks)
        failures += bad
    root.set("tests", str(total))
    root.set("failures", str(failures))
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
