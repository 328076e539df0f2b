"""Every figure taken against a baseline of the same workload, in one place.

speedup = baseline TPOT p50 / candidate TPOT p50 (decode), TTFT likewise; throughput ratio =
candidate output tok/s / baseline's; BLEU drift = BLEU(candidate) - BLEU(baseline); perplexity
change in percent; faithfulness to the baseline's own outputs (metrics.quality).

Whether those figures say the model is broken (then it is marked so and never called a speedup: a
broken model can decode fast, it emits garbage just as quickly):
- perplexity more than doubled (`ppl_delta_pct` > MAX_PPL_DELTA_PCT), or
- faithfulness to the baseline's own outputs near zero: BLEU against them under MIN_BLEU_VS_BASELINE
  with no output identical, when the baseline's outputs are long enough for BLEU to mean something.
"""

from __future__ import annotations

from infer_tune.metrics import quality


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
    if outputs and len(outputs) != len(baseline_outputs):  # a trace that repeats prompts: one row per prompt
        by_id = {o.get("prompt_id"): o for o in baseline_outputs}
        firsts = {o.get("prompt_id"): o for o in reversed(outputs) if o.get("prompt_id") in by_id}
        outputs = list(firsts.values())
        baseline_outputs = [by_id[k] for k in firsts]
    if outputs:  # a run that generated nothing to compare (a multi-process kernel check, say) has none
        if out["bleu_drift"] is not None and len(outputs) == len(baseline_outputs):
            out["bleu_drift_ci95"] = quality.bleu_drift_interval(
                [o["output"] for o in outputs], [o["output"] for o in baseline_outputs],
                [o.get("reference") for o in outputs])
        out.update(quality.faithfulness([o["output"] for o in outputs], [o["output"] for o in baseline_outputs],
                                        [o["token_ids"] for o in outputs], [o["token_ids"] for o in baseline_outputs]))
    out.update(verdict(out, baseline_outputs))
    return out


MAX_PPL_DELTA_PCT = 100.0
MIN_BLEU_VS_BASELINE = 1.0
MIN_MEAN_TOKENS = 8  # shorter outputs: BLEU is noise, faithfulness is not judged


def broken_reasons(metrics: dict, baseline_outputs: list[dict] | None = None) -> list[str]:
    """Why `metrics` (already holding the deltas against the baseline) describe a broken model; [] if not."""
    why = []
    ppl = metrics.get("ppl_delta_pct")
    if isinstance(ppl, (int, float)) and ppl > MAX_PPL_DELTA_PCT:
        why.append(f"perplexity {ppl:+.0f}% (more than doubled)")
    bleu, exact = metrics.get("bleu_vs_baseline"), metrics.get("exact_match_vs_baseline")
    lengths = [len(o.get("token_ids") or []) for o in baseline_outputs or []]
    long_enough = bool(lengths) and sum(lengths) / len(lengths) >= MIN_MEAN_TOKENS
    if isinstance(bleu, (int, float)) and bleu < MIN_BLEU_VS_BASELINE and not exact and long_enough:
        why.append(f"BLEU {bleu:.2f} against the baseline's own outputs (no output reproduced)")
    return why


def verdict(metrics: dict, baseline_outputs: list[dict] | None = None) -> dict:
    """{"broken": bool, "broken_why": str | None} for a result's metrics (module docstring: the rules)."""
    why = broken_reasons(metrics, baseline_outputs)
    return {"broken": bool(why), "broken_why": "; ".join(why) or None}
