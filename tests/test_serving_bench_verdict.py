"""bench/serving_vs_llamacpp.py's target verdicts come from the interval of the paired ratios, not their point."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "serving_vs_llamacpp.py"


def _module():
    spec = importlib.util.spec_from_file_location("serving_vs_llamacpp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _rows(ours: list[float], theirs: list[float]) -> list[dict]:
    rows = []
    for repeat, (a, b) in enumerate(zip(ours, theirs)):
        rows += [{"rate": 1.0, "repeat": repeat, "engine": "ours", "goodput_req_s": a},
                 {"rate": 1.0, "repeat": repeat, "engine": "theirs", "goodput_req_s": b}]
    return rows


def test_a_target_is_met_or_missed_only_where_the_interval_says_so():
    mod = _module()
    metric = (("goodput_req_s", "goodput", True),)

    def judged(ours, theirs, bound=1.0, higher=True):
        return mod.against(mod.paired_ratios(_rows(ours, theirs), 1.0, "ours", "theirs", metric)["goodput_req_s"],
                           bound, higher)

    assert judged([1.10, 1.12, 1.09], [1.0, 1.0, 1.0]) == "met"
    assert judged([0.80, 0.82, 0.79], [1.0, 1.0, 1.0]) == "missed"
    # a point above 1 whose interval holds 1: not met, whatever the point says
    assert judged([1.5, 0.8, 1.2], [1.0, 1.0, 1.0]) == "inconclusive"
    assert judged([1.2], [1.0]) == "inconclusive"  # one repeat: no interval
    assert judged([0.5, 0.52, 0.49], [1.0, 1.0, 1.0], bound=0.6, higher=False) == "met"
    assert judged([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]) == "met"  # only ours met the SLOs in every repeat
