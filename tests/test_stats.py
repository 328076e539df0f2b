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


# --------------------------------------------------------------------------- rounds x prompts: when the pairs are the samples
def test_f_tail_matches_the_tables():
    from infer_tune.metrics.stats import f_sf

    assert abs(f_sf(5.143, 2, 6) - 0.05) < 1e-3  # F(2, 6) 95% quantile
    assert abs(f_sf(3.863, 3, 9) - 0.05) < 1e-3  # F(3, 9)
    assert abs(f_sf(19.0, 2, 2) - 0.05) < 1e-3
    assert abs(f_sf(1.0, 4, 4) - 0.5) < 1e-3  # the median of F(d, d) is 1
    assert f_sf(0.0, 2, 6) == 1.0


def test_rounds_that_agree_are_pooled_with_their_pairs_and_rounds_that_differ_are_not():
    import numpy as np

    from infer_tune.metrics.stats import log_ratio_interval, paired_rounds_interval

    rng = np.random.default_rng(5)  # a draw whose rounds' F test gives p 0.56
    prompts = rng.normal(0, 0.5, (1, 4))  # prompts differ by design (a speculative row)
    agree = 0.3 + prompts + rng.normal(0, 0.05, (4, 4))
    iv = paired_rounds_interval(agree)
    by_round = log_ratio_interval(np.exp(agree.mean(axis=1)))
    assert iv["pooled"] and iv["df"] == 12 and iv["rounds_f_p"] > 0.5
    assert abs(iv["point"] - by_round["point"]) < 1e-12  # the same point either way
    assert iv["half_width_pct"] < by_round["half_width_pct"]
    differ = agree + np.array([[-0.3], [0.0], [0.3], [0.1]])  # each round shifted: the host changed
    iv = paired_rounds_interval(differ)
    by_round = log_ratio_interval(np.exp(differ.mean(axis=1)))
    assert not iv["pooled"] and iv["df"] == 3 and iv["rounds_f_p"] < 0.01
    assert iv["ci95"] == by_round["ci95"]
    one_prompt = paired_rounds_interval(agree[:, :1])  # nothing to pool with
    assert not one_prompt["pooled"] and one_prompt["rounds_f_p"] is None
    three = paired_rounds_interval(agree[:3])  # too few rounds for the F test to see a round effect
    assert not three["pooled"] and three["df"] == 2


def test_pooled_intervals_keep_their_coverage_when_the_rounds_differ_as_much_as_the_pairs():
    import numpy as np

    from infer_tune.metrics.stats import paired_rounds_interval

    rng = np.random.default_rng(1)
    for round_sd in (0.0, 0.1):
        covered = 0
        for _ in range(400):
            table = rng.normal(0, 0.14, (4, 4)) + rng.normal(0, round_sd, (4, 1))
            low, high = np.log(paired_rounds_interval(table)["ci95"])
            covered += low <= 0 <= high
        assert covered / 400 >= 0.92, (round_sd, covered)
