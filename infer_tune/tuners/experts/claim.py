"""The expert-placement claim check ("per-token communication -60%"), judged on plan metrics.

Predicted by `experts plan` from the load file, measured by `experts validate` and recipe stages on
real expert-parallel ranks; either way against round-robin placement (see docs/experts.md).
"""

from __future__ import annotations

from infer_tune.document import as_document

CLAIM = "MoE experts spread over devices (hot ones replicated or on fast devices): per-token communication -60%"
CLAIM_REDUCTION = 0.60


def communication_claim(rows: list[tuple[str, dict]], *, measured: bool) -> dict | None:
    """The claim judged on all-to-all bytes per token of each (strategy, metrics) against round-robin."""
    by = dict(rows)
    base = by.get("round-robin")
    others = [(name, m) for name, m in rows if name != "round-robin" and m.get("alltoall_bytes_per_token") is not None]
    if base is None or not others or not base.get("alltoall_bytes_per_token"):
        return None
    best_name, best = min(others, key=lambda r: r[1]["alltoall_bytes_per_token"])
    reduction = 1.0 - best["alltoall_bytes_per_token"] / base["alltoall_bytes_per_token"]
    claim = {"claim": CLAIM, "threshold_reduction": CLAIM_REDUCTION, "measured": measured,
             "baseline_strategy": "round-robin", "baseline_bytes_per_token": base["alltoall_bytes_per_token"],
             "best_strategy": best_name, "best_bytes_per_token": best["alltoall_bytes_per_token"],
             "reduction": reduction, "held": reduction >= CLAIM_REDUCTION,
             "by_strategy": {name: m["alltoall_bytes_per_token"] for name, m in rows}}
    claim["finding"] = finding(claim)
    return claim


def claim_line(claim: dict) -> str:
    """One human line: what was predicted or measured, then the verdict."""
    return f"{claim['finding']} -> {'held' if claim['held'] else 'did not hold here'}"


def finding(claim: dict) -> str:
    """Predicted or measured bytes per token, best strategy vs round-robin (the verdict apart)."""
    what = "measured" if claim["measured"] else "predicted"
    return (f"{what} all-to-all bytes/token {claim['best_bytes_per_token']:,.0f} ({claim['best_strategy']}) vs "
            f"{claim['baseline_bytes_per_token']:,.0f} (round-robin) = {-claim['reduction']:+.1%} "
            f"(claim -{claim['threshold_reduction']:.0%})")


def summarize(docs: list[dict]) -> dict | None:
    """The measured claim over a sweep's validation results (one per strategy)."""
    return communication_claim([(d["config"]["strategy"], as_document(d).metrics) for d in docs], measured=True)
