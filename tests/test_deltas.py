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
