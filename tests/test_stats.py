import numpy as np

from infer_tune.metrics.stats import median_interval, ratio_interval, summarize


def test_summarize_percentiles_and_interval():
    s = summarize(list(range(1, 101)))
    assert s["n"] == 100
    assert s["p50"] == 50.5
    assert s["p90"] == np.percentile(range(1, 101), 90)
    low, high = s["p50_ci95"]
    assert low <= 50.5 <= high


def test_summarize_empty():
    assert summarize([])["n"] == 0 and summarize([])["p50"] is None


def test_ratio_interval_detects_shift():
    rng = np.random.default_rng(1)
    base = rng.normal(100, 3, 200)
    point, low, high = ratio_interval(base, base * 1.2)
    assert 1.15 < low <= point <= high < 1.25
    _, low_same, high_same = ratio_interval(base, rng.permutation(base))
    assert low_same <= 1.0 <= high_same


def test_median_interval_contains_median():
    data = np.arange(50.0)
    low, high = median_interval(data)
    assert low <= np.median(data) <= high
