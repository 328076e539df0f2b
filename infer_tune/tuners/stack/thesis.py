"""The thesis a stack tests: its techniques together give far more than any one alone. Judged on one stack row
against the rows measured in the same rounds (the same baseline, the same prompts, each round paired):

- the combined gain G (baseline TPOT / the stack's, per round);
- against the best single-technique row B of the rounds (G / B per round: the baseline cancels);
- against the product P of its parts' single gains, each part's best single row (G / P per round: is the whole
  more, or less, than the parts multiplied?);
- on top of each other stack of the rounds that lacks exactly one of its parts: what that part adds there against
  what it gives alone (where two techniques fight, by how much).

Each ratio is the geometric mean of its per-round values with a 95% t-interval (`stats.log_ratio_interval`);
the verdict is taken from the interval of G / B (held, did not hold here, inconclusive), never a point.
"""

from __future__ import annotations

import math

from infer_tune.document import ResultDocument
from infer_tune.metrics.stats import log_ratio_interval

STATEMENT = ("the techniques together give far more than any one alone (the combined effect greater than "
             "simple addition)")


def _tpots(doc: ResultDocument) -> list:
    """Per round, each prompt's TPOT ({prompt: ms}; rounds.py keeps them), else the pass's median TPOT."""
    block = doc.metrics.get("rounds") or {}
    return block.get("tpot_ms_by_prompt_by_round") or (block.get("per_round") or {}).get("tpot_ms") or []


def _speedup(slow, fast) -> float | None:
    """One round's speedup of `fast` over `slow`: as the rows' own ratios are taken (rounds.round_ratio), the
    geometric mean over the prompts both ran of each prompt's TPOT ratio; a pass median where none are kept."""
    if isinstance(slow, dict) and isinstance(fast, dict):
        logs = [math.log(slow[k] / fast[k]) for k in set(slow) & set(fast) if slow[k] and fast[k]]
        return math.exp(sum(logs) / len(logs)) if logs else None
    return slow / fast if isinstance(slow, (int, float)) and isinstance(fast, (int, float)) and fast else None


def _group(doc: ResultDocument):
    return (doc.metrics.get("rounds") or {}).get("group")


def _parts(doc: ResultDocument) -> list[str]:
    return [p.get("technique") for p in (doc.config or {}).get("configs") or [] if isinstance(p, dict)]


def _per_round(slow: list, fast: list) -> list:
    """The speedup of `fast` over `slow` per round (None where either is missing)."""
    return [_speedup(a, b) for a, b in zip(slow, fast)]


def _over(num: list, den: list) -> list:
    """num[r] / den[r] of two per-round gains."""
    return [a / b if a and b else None for a, b in zip(num, den)]


def _times(a: list, b: list) -> list:
    return [x * y if x and y else None for x, y in zip(a, b)]


def _fmt(iv: dict | None) -> str:
    return "n/a" if iv is None else f"{iv['point']:.2f}x [{iv['ci95'][0]:.2f}, {iv['ci95'][1]:.2f}]"


def _label(doc: ResultDocument) -> str:
    return f"{doc.technique} {doc.label or ''}".strip()


def _best(rows: list[ResultDocument]) -> ResultDocument | None:
    ranked = [d for d in rows if isinstance(d.metrics.get("speedup_vs_baseline"), (int, float))]
    return max(ranked, key=lambda d: d.metrics["speedup_vs_baseline"], default=None)


def thesis(stack: ResultDocument, baseline: ResultDocument | None, earlier: list[ResultDocument]) -> dict | None:
    """The thesis claim of `stack` against the rows of its rounds in `earlier` and their `baseline`; None where
    it cannot be judged (no rounds, or fewer than two of its parts have a single row of their own)."""
    group, base = _group(stack), _tpots(baseline) if baseline is not None else []
    if not group or not base or not _tpots(stack):
        return None
    mine = [d for d in earlier if d is not stack and _group(d) == group and d.objective in (None, "decode")]
    singles = [d for d in mine if d.technique not in ("stack", "baseline")]
    parts = _parts(stack)
    best_of_part = {p: _best([d for d in singles if d.technique == p]) for p in parts}
    best_of_part = {p: d for p, d in best_of_part.items() if d is not None}
    if len(best_of_part) < 2:
        return None
    combined = _per_round(base, _tpots(stack))
    best_single = _best(singles)
    over_best = log_ratio_interval(_per_round(_tpots(best_single), _tpots(stack)))
    product = None
    for d in best_of_part.values():
        gain = _per_round(base, _tpots(d))
        product = gain if product is None else _times(product, gain)
    over_product = log_ratio_interval(_over(combined, product))
    g, p = log_ratio_interval(combined), log_ratio_interval(product)
    name = _label(best_single)
    lines = [f"combined {_fmt(g)}; best single ({name}) {_fmt(log_ratio_interval(_per_round(base, _tpots(best_single))))}; "
             f"product of the parts' single gains ({' x '.join(_label(d) for d in best_of_part.values())}) "
             f"{_fmt(p)}; combined / best single {_fmt(over_best)}, combined / product {_fmt(over_product)}"]
    if over_product is not None:
        low, high = over_product["ci95"]
        lines.append("more than the parts multiplied" if low > 1 else "less than the parts multiplied" if high < 1
                     else "the parts multiplied, within the interval")
    for other in (d for d in mine if d.technique == "stack"):
        missing = set(parts) - set(_parts(other))
        if len(missing) != 1:  # the other stack lacks exactly one of this one's parts
            continue
        (part,) = missing
        on_top = log_ratio_interval(_per_round(_tpots(other), _tpots(stack)))
        alone = best_of_part.get(part)
        alone_iv = log_ratio_interval(_per_round(base, _tpots(alone))) if alone is not None else None
        lines.append(f"{part} on top of {_label(other)}: {_fmt(on_top)}, alone {_fmt(alone_iv)}")
    if over_best is None:
        verdict = "inconclusive"
    else:
        low, high = over_best["ci95"]
        verdict = "held" if low > 1 else "did not hold here" if high < 1 else "inconclusive"
    return {"statement": STATEMENT, "finding": "; ".join(lines), "verdict": verdict,
            "value": g["point"] if g else None, "interval": g["ci95"] if g else None,
            "combined_over_best_single": over_best, "combined_over_product": over_product,
            "best_single_run_id": best_single.run_id,
            "product_of": {p: d.run_id for p, d in best_of_part.items()}}
