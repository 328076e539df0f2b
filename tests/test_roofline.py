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


def test_a_fraction_above_one_is_refused_not_reported():
    """A decode faster than the read it is divided by is a wrong ceiling: no fraction, a reason instead."""
    gb = 1e9
    fine = roofline.roofline(30.0, int(gb), 0.0, 1, 1000 / 27.0)
    assert fine["roofline_fraction"] == pytest.approx(0.9) and fine["roofline_refused"] is None
    over = roofline.roofline(30.0, int(gb), 0.0, 1, 1000 / 36.0)  # 36 tok/s of 1 GB against a 30 GB/s read
    assert over["roofline_fraction"] is None
    assert "1.20x" in over["roofline_refused"] and over["decode_tok_s"] == pytest.approx(36.0)
    paired = roofline.by_round([30.0, 30.0, 30.0], [1000 / 33.0, 1000 / 34.0, 1000 / 33.0], gb)
    assert paired["roofline_fraction"] is None and paired["roofline_fraction_ci95"] is None
    assert paired["roofline_refused"] and len(paired["roofline_fraction_by_round"]) == 3


def test_the_report_never_prints_an_efficiency_above_100_percent():
    from infer_tune.report.display import COLUMNS

    column = next(c for c in COLUMNS if c.key == "roofline_fraction")
    assert column.render({"roofline_fraction": 0.93}) == "93%"
    assert "%" in column.render({"roofline_fraction": 1.43}) and "143" not in column.render({"roofline_fraction": 1.43})


def test_a_single_pass_rows_ceiling_is_a_read_of_its_own_weights():
    """Not the host's cached reading: a 1e-6 GB/s reading would put the fraction in the millions."""
    import torch

    from infer_tune.runners import PreparedModel
    from infer_tune.sweep.document import roofline_ceiling

    model = torch.nn.Linear(512, 512)
    prepared = PreparedModel(model=model, tokenizer=None)
    gb_s, source = roofline_ceiling(None, prepared, {"mem_bandwidth_gb_s": 1e-6})
    assert source == "read of the weights after the run" and gb_s > 0.01


def test_a_speculative_pass_reads_the_weights_once_for_every_token_it_verifies():
    """3 tokens a verify pass: the ceiling is three times the one-token-a-read one, so a decode at 2.4x a plain
    step's ceiling is 0.8 of its own, not a refused 2.4."""
    gb = 1e9
    plain = roofline.roofline(30.0, int(gb), 0.0, 1, 1000 / 72.0)  # 72 tok/s of a 1 GB model at 30 GB/s
    assert plain["roofline_fraction"] is None and plain["roofline_refused"]
    spec = roofline.roofline(30.0, int(gb), 0.0, 1, 1000 / 72.0, tokens_per_pass=3.0)
    assert spec["roofline_tok_s"] == pytest.approx(90.0) and spec["roofline_fraction"] == pytest.approx(0.8)
    paired = roofline.by_round([30.0, 30.0], [1000 / 72.0, 1000 / 72.0], gb, tokens_per_pass=3.0)
    assert paired["roofline_fraction"] == pytest.approx(0.8)
