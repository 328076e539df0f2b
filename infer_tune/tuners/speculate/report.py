"""What the combined report leads a speculative-decoding row with (docs/speculate.md): the decode speedup
(with its 95% interval when the result has one) and the mean acceptance length, against the baseline
decoding without a draft in the same session."""

from __future__ import annotations

from infer_tune.report.leads import Figure, Lead, interval, number


def report_columns(doc: dict, docs: list[dict]) -> Lead:
    m = doc.get("metrics") or {}
    return Lead((Figure("decode", number(m.get("speedup_vs_baseline")), "x", interval(m, "speedup_vs_baseline")),
                 Figure("acceptance", number(m.get("mean_acceptance_length")), "tokens")),
                "baseline without a draft", decode=True)
