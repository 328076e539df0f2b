"""The seed's thesis on a stack row (tuners/stack/thesis.py): combined gain against the best single row and the
product of the parts' single gains, per round (the rounds' baseline shared), with intervals and a verdict from
the interval, and what a part adds on top of a stack lacking it against what it gives alone."""

from __future__ import annotations

import pytest

from infer_tune.document import as_document
from infer_tune.tuners.stack.thesis import thesis


def row(run_id, technique, tpots, *, label="", parts=None, group="g1", speedup=None):
    config = {"configs": [{"technique": p} for p in parts]} if parts else {}
    metrics = {"rounds": {"group": group, "per_round": {"tpot_ms": tpots}}}
    if speedup is not None:
        metrics["speedup_vs_baseline"] = speedup
    return as_document({"run_id": run_id, "technique": technique, "label": label, "config": config,
                        "metrics": metrics, "objective": "decode"})


BASE = [40.0, 44.0, 38.0, 42.0]


def rows(stack_tpots):
    quant = row("q", "quantize", [13.0, 14.5, 12.5, 14.0], label="int4", speedup=3.0)
    spec = row("s", "speculate", [20.0, 22.5, 19.0, 21.0], label="lookup-k8", speedup=2.0)
    spec4 = row("s4", "speculate", [25.0, 27.0, 24.0, 26.0], label="lookup-k4", speedup=1.6)
    native = row("qn", "stack", [5.0, 5.4, 4.8, 5.3], label="int4+native", parts=["quantize", "lean"], speedup=8.0)
    other_group = row("x", "quantize", [1.0, 1.0, 1.0, 1.0], label="elsewhere", group="g2", speedup=40.0)
    full = row("full", "stack", stack_tpots, label="int4+lookup-native", parts=["quantize", "speculate"])
    return row("base", "baseline", BASE), [quant, spec, spec4, native, other_group], full


def test_a_stack_far_above_the_product_holds_with_its_intervals():
    base, earlier, full = rows([3.1, 3.5, 3.0, 3.3])  # ~12.8x
    claim = thesis(full, base, earlier)
    assert claim["verdict"] == "held"
    assert claim["best_single_run_id"] == "q"  # 3x, not the other group's 40x
    assert claim["product_of"] == {"quantize": "q", "speculate": "s"}  # each part's best single
    over_best, over_product = claim["combined_over_best_single"], claim["combined_over_product"]
    assert over_best["ci95"][0] > 1 and over_best["point"] == pytest.approx(12.8 / 3.1, rel=0.05)
    assert over_product["point"] == pytest.approx(12.8 / 6.2, rel=0.06) and over_product["ci95"][0] > 1
    assert "more than the parts multiplied" in claim["finding"]
    assert "speculate on top of stack int4+native" in claim["finding"]  # what speculation adds on the native stack
    assert claim["interval"][0] < claim["value"] < claim["interval"][1]


def test_a_stack_below_its_best_part_does_not_hold_and_a_straddle_is_inconclusive():
    base, earlier, full = rows([15.0, 16.0, 14.0, 15.5])  # slower than int4 alone
    claim = thesis(full, base, earlier)
    assert claim["verdict"] == "did not hold here" and "less than the parts multiplied" in claim["finding"]
    base, earlier, full = rows([11.0, 16.5, 12.9, 13.0])  # about int4's speed, rounds spread around it
    assert thesis(full, base, earlier)["verdict"] == "inconclusive"


def test_no_thesis_without_two_parts_measured_alone_or_without_rounds():
    base, earlier, full = rows([3.1, 3.5, 3.0, 3.3])
    assert thesis(full, base, [d for d in earlier if d.technique != "speculate"]) is None
    assert thesis(full, None, earlier) is None


def test_per_prompt_tpots_give_the_rows_own_ratio_not_a_ratio_of_pass_medians():
    """A speculative row's pass median TPOT mixes prompts it speeds up unequally: the ratio is the geometric mean
    of each prompt's paired ratio, as the rows' own speedups are taken (rounds.round_ratio)."""
    def by_prompt(*values):
        return [{"0": a, "1": b, "2": c} for a, b, c in values]

    def doc(run_id, technique, tpots, parts=None):
        d = row(run_id, technique, [], parts=parts, speedup=2.0)
        d.metrics["rounds"]["per_round"] = {"tpot_ms": [1.0] * len(tpots)}
        d.metrics["rounds"]["tpot_ms_by_prompt_by_round"] = tpots
        return d

    base = doc("base", "baseline", by_prompt((40, 40, 40), (42, 42, 42), (41, 41, 41)))
    quant = doc("q", "quantize", by_prompt((20, 20, 20), (21, 21, 21), (20.5, 20.5, 20.5)))  # 2x everywhere
    spec = doc("s", "speculate", by_prompt((10, 40, 20), (10.5, 42, 21), (10.25, 41, 20.5)))  # 4x, 1x, 2x: 2x
    full = doc("full", "stack", by_prompt((5, 10, 5), (5.25, 10.5, 5.25), (5.125, 10.25, 5.125)), ["quantize", "speculate"])
    claim = thesis(full, base, [quant, spec])
    assert claim["value"] == pytest.approx((8 * 4 * 8) ** (1 / 3))  # not 1.0 from the pass medians
    assert claim["combined_over_product"]["point"] == pytest.approx((8 * 4 * 8) ** (1 / 3) / 4)
