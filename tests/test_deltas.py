"""Baseline deltas: one home for speedup, drift and the BLEU drift interval."""

from infer_tune.metrics import deltas, quality


def _outputs(texts, refs):
    return [{"output": t, "token_ids": [ord(c) for c in t], "reference": r} for t, r in zip(texts, refs)]


def test_bleu_drift_interval_is_zero_for_identical_outputs_and_brackets_a_real_drift():
    refs = ["the cat sat on the mat", "a quick brown fox", "hello there my friend", "one two three four five"]
    base = ["the cat sat on a mat", "a quick brown fox", "hello my friend", "one two three four"]
    assert quality.bleu_drift_interval(base, base, refs) == [0.0, 0.0]
    worse = ["dog", "slow green turtle", "goodbye", "six seven"]
    low, high = quality.bleu_drift_interval(worse, base, refs)
    assert low <= high < 0  # every resample agrees the candidate is worse


def test_versus_baseline_speedup_and_interval():
    refs = ["the cat sat on the mat", "a quick brown fox", "hello there my friend"]
    base_doc = {"metrics": {"tpot_ms": {"p50": 20.0}, "ttft_ms": {"p50": 100.0}, "output_throughput_tok_s": 50.0,
                            "bleu": 40.0, "ppl": 5.0}}
    cand = {"tpot_ms": {"p50": 10.0}, "ttft_ms": {"p50": 50.0}, "output_throughput_tok_s": 100.0, "bleu": 40.0,
            "ppl": 5.5}
    outs = _outputs(["the cat sat on the mat", "a quick brown fox", "hello there"], refs)
    out = deltas.versus_baseline(cand, outs, base_doc, outs)
    assert out["speedup_vs_baseline"] == 2.0 and out["ttft_speedup_vs_baseline"] == 2.0
    assert out["throughput_ratio_vs_baseline"] == 2.0
    assert abs(out["ppl_delta_pct"] - 10.0) < 1e-9
    assert out["bleu_drift"] == 0.0 and out["bleu_drift_ci95"] == [0.0, 0.0]
    assert out["output_mismatches"] == 0


def test_one_overlap_figure_never_makes_broken():
    """The issue's case: a base model (no chat template), lean + compile on int4-rtn, 32 tokens: perplexity
    27.30 against 29.87 (-8.58%) and BLEU 0.90 against the baseline's own outputs. Not broken."""
    from infer_tune.report import display
    from infer_tune.report.leaderboard import flatten

    outputs = [{"token_ids": list(range(32))}] * 3
    case = {"ppl_delta_pct": -8.58, "bleu_vs_baseline": 0.90, "exact_match_vs_baseline": 0.0,
            "bleu_drift": -0.4, "bleu_drift_ci95": [-3.1, 2.2]}
    got = deltas.verdict(case, outputs)
    assert not got["broken"] and got["broken_why"] is None
    assert "perplexity -8.58%" in got["verdict_evidence"] and "BLEU vs the baseline's outputs 0.90" in got["verdict_evidence"]
    assert "[-3.1, +2.2]" in got["verdict_evidence"] and "alone is not evidence" in got["verdict_evidence"]
    assert not deltas.verdict({k: v for k, v in case.items() if not k.startswith("bleu_drift")}, outputs)["broken"]
    # a stored row marked broken by the old overlap-only rule is judged again in the report
    old = {"run_id": "r", "technique": "quantize", "label": "int4-rtn+lean+compile", "metrics": {
        "speedup_vs_baseline": 3.1, "broken": True, "broken_why": "BLEU 0.90 against the baseline's own outputs",
        "ppl_delta_pct": -8.58, "bleu_vs_baseline": 0.90, "exact_match_vs_baseline": 0.0}}
    row = flatten(old)
    assert not display.is_broken(row) and row["speedup_vs_baseline"] == 3.1 and display.verdict(row) != "broken"
    # a new row carries its evidence, and the report trusts the verdict it was measured with
    new = {**old, "metrics": {**old["metrics"], **got}}
    assert display.verdict(flatten(new)) != "broken"
    evidence = next(c for c in display.COLUMNS if c.key == "verdict_evidence")
    assert "perplexity -8.58%" in evidence.render(flatten(new))


def test_broken_needs_evidence_that_survives_noise():
    outputs = [{"token_ids": list(range(20))}] * 4
    collapsed = {"bleu_vs_baseline": 0.2, "exact_match_vs_baseline": 0.0}
    assert deltas.verdict({"ppl_delta_pct": 250.0}, outputs)["broken"]
    assert not deltas.verdict({"ppl_delta_pct": 90.0}, outputs)["broken"]
    drop = {**collapsed, "bleu_drift": -12.0, "bleu_drift_ci95": [-18.0, -6.0]}
    broken = deltas.verdict(drop, outputs)
    assert broken["broken"] and "[-18.0, -6.0]" in broken["broken_why"] and "(dropped)" in broken["verdict_evidence"]
    assert not deltas.verdict({**drop, "bleu_drift_ci95": [-18.0, 1.0]}, outputs)["broken"]  # the drop is within noise
    assert not deltas.verdict({**drop, "bleu_drift_ci95": None}, outputs)["broken"]  # no interval, no evidence
    assert not deltas.verdict({**drop, "bleu_vs_baseline": 35.0}, outputs)["broken"]  # outputs still overlap
    assert not deltas.verdict({**drop, "exact_match_vs_baseline": 0.25}, outputs)["broken"]
    assert not deltas.verdict(drop, [{"token_ids": [1, 2]}] * 4)["broken"]  # too short to judge overlap
