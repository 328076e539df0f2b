"""Every figure taken against a baseline of the same workload, in one place.

speedup = baseline TPOT p50 / candidate TPOT p50 (decode), TTFT likewise; throughput ratio =
candidate output tok/s / baseline's; BLEU drift = BLEU(candidate) - BLEU(baseline); perplexity
change in percent; faithfulness to the baseline's own outputs (metrics.quality).

Whether those figures say the model is broken (then it is marked so and never called a speedup: a
broken model can decode fast, it emits garbage just as quickly). Only evidence that survives noise
counts (docs/architecture.md, "Verdicts"):
- perplexity more than doubled (`ppl_delta_pct` > MAX_PPL_DELTA_PCT), or
- overlap with the baseline's own outputs collapsed (BLEU against them under MIN_BLEU_VS_BASELINE,
  no output identical, outputs long enough for BLEU to mean something) TOGETHER WITH quality against
  the suite's references dropping: BLEU drift at most -MIN_BLEU_DROP with its whole 95% interval
  below zero. Greedy continuations part ways after a token or two under any numeric change (a base
  model without a chat template most of all), so overlap with the baseline alone is never enough.
`verdict_evidence` states the figures the verdict was taken from, intervals included.
"""

from __future__ import annotations

from infer_tune.document import ResultDocument, as_document
from infer_tune.metrics import quality


def ratio_of_p50(base: dict, cand: dict, key: str) -> float | None:
    """base[key].p50 / cand[key].p50: above 1 means the candidate is faster."""
    b, c = (base.get(key) or {}).get("p50"), (cand.get(key) or {}).get("p50")
    return b / c if b and c else None


def speedup(base: dict, cand: dict) -> float | None:
    """Decode speedup of `cand` over `base` (metrics dicts): ratio of TPOT medians."""
    return ratio_of_p50(base, cand, "tpot_ms")


def versus_baseline(metrics: dict, outputs: list[dict], baseline: ResultDocument,
                    baseline_outputs: list[dict]) -> dict:
    """Speedup, BLEU drift, faithfulness and perplexity change against a baseline of the same workload."""
    base = as_document(baseline).metrics  # a baseline made by hand (a test's) is typed here
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
MIN_BLEU_DROP = 1.0  # BLEU points against the references: the drop that, with its interval below 0, is damage
MIN_MEAN_TOKENS = 8  # shorter outputs: BLEU is noise, faithfulness is not judged


def _num(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value else None


def _interval(value) -> tuple[float, float] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_num(v) is not None for v in value):
        return float(value[0]), float(value[1])
    return None


def _long_enough(baseline_outputs: list[dict] | None, assumed: bool) -> bool:
    if baseline_outputs is None:
        return assumed
    lengths = [len(o.get("token_ids") or []) for o in baseline_outputs]
    return bool(lengths) and sum(lengths) / len(lengths) >= MIN_MEAN_TOKENS


def evidence(metrics: dict, baseline_outputs: list[dict] | None = None, *,
             outputs_long_enough: bool = False) -> tuple[list[str], str | None]:
    """(why the figures say broken, [] if they do not; the figures the verdict rests on, as one line).

    `baseline_outputs` decide whether outputs are long enough to judge overlap; without them (a stored
    row) `outputs_long_enough` says so (a row marked broken by overlap passed that test when measured).
    """
    why, facts = [], []
    ppl = _num(metrics.get("ppl_delta_pct"))
    if ppl is not None:
        facts.append(f"perplexity {ppl:+.2f}% (broken above +{MAX_PPL_DELTA_PCT:.0f}%)")
        if ppl > MAX_PPL_DELTA_PCT:
            why.append(f"perplexity {ppl:+.0f}% (more than doubled)")
    bleu, exact = _num(metrics.get("bleu_vs_baseline")), _num(metrics.get("exact_match_vs_baseline"))
    long_enough = _long_enough(baseline_outputs, outputs_long_enough)
    collapsed = bleu is not None and bleu < MIN_BLEU_VS_BASELINE and not exact and long_enough
    if bleu is not None:
        facts.append(f"BLEU vs the baseline's outputs {bleu:.2f}, {exact or 0.0:.0%} identical"
                     + (" (collapsed)" if collapsed else "" if long_enough else " (outputs too short to judge)"))
    drift, ci = _num(metrics.get("bleu_drift")), _interval(metrics.get("bleu_drift_ci95"))
    dropped = drift is not None and drift <= -MIN_BLEU_DROP and ci is not None and ci[1] < 0
    if drift is not None:
        facts.append(f"BLEU vs references {drift:+.2f}"
                     + (f" [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else " (no interval)")
                     + (" (dropped)" if dropped else " (no drop beyond noise)"))
    if collapsed and dropped:
        why.append(f"BLEU {bleu:.2f} against the baseline's own outputs (no output reproduced) and BLEU against "
                   f"the references {drift:+.2f} [{ci[0]:+.1f}, {ci[1]:+.1f}]")
    elif collapsed:
        facts.append("overlap with the baseline alone is not evidence of damage")
    return why, "; ".join(facts) or None


def broken_reasons(metrics: dict, baseline_outputs: list[dict] | None = None, *,
                   outputs_long_enough: bool = False) -> list[str]:
    """Why `metrics` (already holding the deltas against the baseline) describe a broken model; [] if not."""
    return evidence(metrics, baseline_outputs, outputs_long_enough=outputs_long_enough)[0]


def verdict(metrics: dict, baseline_outputs: list[dict] | None = None) -> dict:
    """{"broken", "broken_why", "verdict_evidence"} for a result's metrics (module docstring: the rules)."""
    why, facts = evidence(metrics, baseline_outputs)
    return {"broken": bool(why), "broken_why": "; ".join(why) or None, "verdict_evidence": facts}
