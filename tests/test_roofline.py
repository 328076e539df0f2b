"""The roofline ceiling and a row's fraction of it, paired round by round."""

import math

import pytest

from infer_tune.metrics import roofline


def test_each_rounds_decode_is_judged_against_the_read_taken_after_it():
    """Two memory states alternating: a decode at the slow read's rate is 1.0 of its rounds, 0.6 of the fast
    ones; the pooled figure (median decode over the median read) would say neither."""
    gb = 1e9  # bytes a decode step reads
    reads = [30.0, 50.0, 30.0, 50.0]
    tpot = [1000 / 30.0, 1000 / 30.0, 1000 / 30.0, 1000 / 30.0]  # 30 tok/s every round: 30 GB/s of reads
    paired = roofline.by_round(reads, tpot, gb)
    assert paired["roofline_fraction_by_round"] == pytest.approx([1.0, 0.6, 1.0, 0.6])
    assert paired["roofline_fraction"] == pytest.approx(math.sqrt(0.6))
    low, high = paired["roofline_fraction_ci95"]
    assert low < 0.6 < 1.0 < high  # two states: the interval says so
    steady = roofline.by_round([30.0, 30.5, 29.5], [1000 / 27.0] * 3, gb)
    assert steady["roofline_fraction_ci95"][0] > 0.85


def test_rounds_without_a_read_or_a_decode_are_left_out():
    assert roofline.by_round([None, 30.0, 30.0], [20.0, None, 40.0], 1e9) is None  # one round has both
    paired = roofline.by_round([None, 30.0, 30.0, 60.0], [20.0, None, 40.0, 40.0], 1e9)
    assert paired["roofline_fraction_by_round"][:2] == [None, None]
    assert paired["roofline_fraction_by_round"][2:] == pytest.approx([25 / 30, 25 / 60])
