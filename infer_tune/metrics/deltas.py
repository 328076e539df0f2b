"""Every figure taken against a baseline of the same workload, in one place.

speedup = baseline TPOT p50 / candidate TPOT p50 (decode), TTFT likewise; throughput ratio =
candidate output tok/s / baseline's; BLEU drift = BLEU(candidate) - BLEU(baseline); perplexity
change in percent; faithfulness to the baseline's own outputs (metrics.quality).
"""

from __future__ import annotations

from infer_tune.metrics import quality, verdict


def ratio_of_p50(base: dict, cand: dict, key: str) -> float | None:
    """base[key].p50 / cand[key].p50: above 1 means the candidate is faster."""
    b, c = (base.get(key) or {}).get("p50"), (cand.get(key) or {}).get("p50")
    return b / c if b and c else None


def speedup(base: dict, cand: dict) -> float | None:
    """Decode speedup of `cand` over `base` (metrics dicts): ratio of TPOT medians."""
    return ratio_of_p50(base, cand, "tpot_ms")


def versus_baseline(metrics: dict, outputs: list[dict], baseline: dict, baseline_outputs: list[dict]) -> dict:
    """Speedup, BLEU drift, faithfulness and perplexity change against a baseline of the same workload."""
    base = baseline["metrics"]
    out: dict = {"speedup_vs_baseline": speedup(base, metrics),
                 "ttft_speedup_vs_baseline": ratio_of_p50(base, metrics, "ttft_ms")}
    b_thr = base.get("output_throughput_tok_s")
    out["throughput_ratio_vs_baseline"] = metrics["output_throughput_tok_s"] / b_thr if b_thr else None
    out["bleu_drift"] = (metrics["bleu"] - base["bleu"]) \
        if metrics.get("bleu") is not None and base.get("bleu") is not None else None
    if metrics.get("pass_at_1") is not None and base.get("pass_at_1") is not None:
        out["pass_at_1_delta"] = metrics["pass_at_1"] - base["pass_at_1"]
    out["ppl_delta_pct"] = (100.0 * (metrics["ppl"] - base["ppl"]) / base["ppl"]
                            if metrics.get("ppl") and base.get("ppl") else None)
    if outputs:  # a run that generated nothing to compare (a multi-process kernel check, say) has none
        if out["bleu_drift"] is not None and len(outputs) == len(baseline_outputs):
            out["bleu_drift_ci95"] = quality.bleu_drift_interval(
                [o["output"] for o in outputs], [o["output"] for o in baseline_outputs],
                [o.get("reference") for o in outputs])
        out.update(quality.faithfulness([o["output"] for o in outputs], [o["output"] for o in baseline_outputs],
                                        [o["token_ids"] for o in outputs], [o["token_ids"] for o in baseline_outputs]))
    out.update(verdict.verdict(out, baseline_outputs))
    return out
