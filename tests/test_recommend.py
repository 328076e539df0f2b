"""The recommender decides from intervals: highest lower bound wins, overlapping rows are its contenders, a
noise flag never removes a row, and each row is ranked on its technique's own objective."""

from infer_tune.report.recommend import Budget, recommend


def row(run_id, technique, speedup, ci=None, *, objective="decode", noisy=False, throughput=None, ppl=0.0):
    metrics = {"speedup_vs_baseline": speedup, "ppl_delta_pct": ppl, "bleu_drift": 0.0,
               "noise": {"noisy": noisy}, "throughput_ratio_vs_baseline": throughput}
    if ci:
        metrics["speedup_vs_baseline_ci95"] = ci
    return {"run_id": run_id, "technique": technique, "label": run_id, "baseline_run_id": "b", "objective": objective,
            "metrics": metrics, "config": {}, "workload": {}, "model": {"ref": "m"}}


def test_highest_lower_bound_wins_and_overlaps_are_contenders():
    docs = [row("a", "quantize", 3.6, [3.5, 3.7]), row("b", "quantize", 3.7, [3.1, 4.3]),
            row("c", "quantize", 2.0, [1.9, 2.1])]
    rec = recommend(docs, Budget())
    assert rec.doc["run_id"] == "a"  # 3.5 > 3.1: the tighter interval's lower bound wins over b's point
    assert rec.contenders == ["b"] and not rec.separated and "more rounds" in rec.decision()
    alone = recommend([docs[0], docs[2]], Budget())
    assert alone.separated and "separated from every other row" in alone.decision()
    assert "[3.50, 3.70]" in alone.decision()


def test_a_noisy_row_is_not_dropped_and_a_straddling_interval_does_not_beat_the_baseline():
    rec = recommend([row("a", "quantize", 3.6, [3.4, 3.8], noisy=True), row("b", "quantize", 2.7, [2.6, 2.8])],
                    Budget())
    assert rec.doc["run_id"] == "a"
    unsure = recommend([row("a", "quantize", 1.05, [0.97, 1.13])], Budget())
    assert unsure.doc is None and "whole interval" in unsure.reasons[-1]


def test_batching_rows_are_ranked_on_throughput_not_single_stream_decode():
    docs = [row("cb", "batch", 0.6, objective="throughput", throughput=0.8),
            row("int4+cb", "stack", 0.5, objective="throughput", throughput=1.1)]
    rec = recommend(docs, Budget())
    assert rec.objective == "throughput" and rec.doc["run_id"] == "int4+cb"
    # with decode rows present, auto ranks the decode rows and leaves the batching rows to their own ranking
    mixed = recommend(docs + [row("q", "quantize", 2.0, [1.9, 2.1])], Budget())
    assert mixed.objective == "decode" and mixed.doc["run_id"] == "q"
