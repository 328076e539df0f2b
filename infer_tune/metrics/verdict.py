"""Whether a result's drift says the model is broken: then it is marked so, never called a speedup.

A broken model can decode fast (it emits garbage just as quickly), so speed alone must never make it
a winner. Rules, on the figures measured against the baseline of the same workload:
- perplexity more than doubled (`ppl_delta_pct` > MAX_PPL_DELTA_PCT), or
- faithfulness to the baseline's own outputs near zero: BLEU against them under MIN_BLEU_VS_BASELINE
  with no output identical, when the baseline's outputs are long enough for BLEU to mean something.
"""

from __future__ import annotations

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
    """{"broken": bool, "broken_why": str | None} for a result's metrics."""
    why = broken_reasons(metrics, baseline_outputs)
    return {"broken": bool(why), "broken_why": "; ".join(why) or None}


def is_broken(doc: dict) -> bool:
    return bool((doc.get("metrics") or {}).get("broken"))
