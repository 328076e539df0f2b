"""The typed result document end to end: its metrics accessors, what may change after it is built, and that
the report and compare receive ResultDocuments whose data never says where they live (no `_path`)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

import pytest
from result_docs import make_result, save
from typer.testing import CliRunner

from infer_tune import results
from infer_tune.cli import app
from infer_tune.document import FrozenResultError, OverwriteError, ResultDocument, as_document


def _loaded(tmp_path, noise_figure: dict | None = None, **metrics) -> ResultDocument:
    doc = make_result("r", technique="quantize", **metrics)
    if noise_figure is not None:  # `noise` is make_result's sample spread; the noise figure is set here
        doc["metrics"]["noise"] = noise_figure
    return results.load_result(save(doc, tmp_path / "runs"))


def test_accessors_read_the_metrics_every_reader_needs(tmp_path):
    doc = _loaded(tmp_path, speedup_vs_baseline=2.5, speedup_vs_baseline_ci95=[2.25, 2.75], ppl_delta_pct=1.5,
                  bleu_drift=-0.25, ttft_speedup_vs_baseline_ci95=[1.5, 1.25],  # out of order: no interval
                  noise_figure={"noisy": True, "why": ["contention"]}, rounds={"rounds": 4, "group": "g1"})
    assert doc.speedup == 2.5 and doc.speedup_ci95 == (2.25, 2.75)
    assert doc.interval("ttft_speedup_vs_baseline") is None and doc.ttft_speedup is None
    assert doc.tpot_p50_ms == doc.metrics["tpot_ms"]["p50"] and doc.ttft_p50_ms == doc.metrics["ttft_ms"]["p50"]
    assert doc.stat("tpot_ms", "p99") == doc.metrics["tpot_ms"]["p99"] and doc.stat("nope") is None
    assert doc.throughput_tok_s == pytest.approx(25.0) and doc.ppl_delta_pct == 1.5 and doc.bleu_drift == -0.25
    assert doc.noisy and doc.rounds == {"rounds": 4, "group": "g1"}
    quiet = as_document(make_result("q", speedup_vs_baseline=True, ppl_delta_pct=math.inf))
    assert quiet.speedup is None and quiet.ppl_delta_pct is None  # a bool or an infinity is not a figure
    assert not quiet.noisy and quiet.noise == {} and quiet.rounds == {}


def test_as_document_keeps_a_document_and_types_a_mapping_made_by_hand(tmp_path):
    doc = _loaded(tmp_path)
    assert as_document(doc) is doc
    row = as_document({"run_id": "a", "technique": "quantize", "metrics": {"speedup_vs_baseline": 2.0},
                       "_path": "/elsewhere"})
    assert isinstance(row, ResultDocument) and row.speedup == 2.0 and row.samples == {} and row.model == {}
    assert "_path" not in row and "_path" not in row.to_dict() and row.location is None
    with pytest.raises(TypeError):
        as_document(["not", "a", "mapping"])


def test_facts_never_replace_a_measured_figure_but_may_fill_a_null_one(tmp_path):
    doc = as_document(make_result("r", technique="quantize", ppl=None))  # built, not saved yet
    doc.add_metrics({"ppl": 6.5, "ppl_source": "llama-perplexity"}, source="llama-perplexity")  # null: not measured
    assert doc.metrics["ppl"] == 6.5
    doc.add_metrics({"ppl": 6.5}, source="the same figure again")  # the same value: no clash
    with pytest.raises(OverwriteError, match="ppl"):
        doc.add_metrics({"ppl": 7.0}, source="another perplexity")
    assert doc.metrics["ppl"] == 6.5
    doc.set_sweep_metrics({"claim_check": {"statement": "x", "held": True}})
    doc.set_sweep_metrics({"claim_check": {"statement": "x", "held": False}})  # a sweep's claim: set again
    assert doc.metrics["claim_check"]["held"] is False
    with pytest.raises(TypeError):
        doc["metrics"] = {}  # no item assignment: changes go through the methods
    with pytest.raises(TypeError, match="read-only"):
        doc.metrics["ppl"] = 7.0  # nor on its metrics
    with pytest.raises(FrozenResultError):  # a saved result is never modified
        _loaded(tmp_path, ppl=None).add_metrics({"ppl": 6.5}, source="llama-perplexity")


def test_bench_engine_quality_keys_never_overwrite_a_measured_perplexity(tmp_path):
    """`bench --engine` adds llama-perplexity's figure to a row whose engine measured none (null), and the
    change against the default launch; a row that has a perplexity already is refused, not rewritten."""
    from infer_tune.scenarios.engine_tune import add_quality

    base, doc = as_document(make_result("b", ppl=None)), as_document(make_result("c", ppl=None))
    base.set_engine("llama.cpp")
    doc.set_engine("llama.cpp")
    add_quality(base, {"ppl": 8.0, "ppl_stderr": 0.1, "context": 512}, None)
    add_quality(doc, {"ppl": 8.4, "ppl_stderr": 0.1, "context": 512}, None)
    add_quality(doc, None, base)
    assert doc.ppl_delta_pct == pytest.approx(5.0) and doc.metrics["ppl_source"] == "llama-perplexity"
    with pytest.raises(OverwriteError):
        add_quality(doc, {"ppl": 9.0, "ppl_stderr": 0.1, "context": 512}, None)


def _walk_keys(value) -> set[str]:
    """Every key of every mapping inside `value`, however deep."""
    if isinstance(value, Mapping):
        return set(value) | {k for v in value.values() for k in _walk_keys(v)}
    if isinstance(value, (list, tuple)):
        return {k for v in value for k in _walk_keys(v)}
    return set()


def test_the_report_and_compare_receive_typed_documents_that_never_say_where_they_live(tmp_path, monkeypatch):
    """Results read from disk reach every reader of `leaderboard` and `compare` as ResultDocuments, with no
    `_path` key at any depth, even when a file forges one; where each lives is its `location`."""
    from infer_tune.report import claims, compare, gate, leaderboard, leads, recommend

    runs = tmp_path / "runs"
    rows = [make_result("base", seed=1),
            make_result("q8", technique="quantize", seed=2, tpot_ms=30.0, speedup_vs_baseline=1.3,
                        speedup_vs_baseline_ci95=[1.2, 1.4], claim_check={"statement": "int8 is faster", "held": True}),
            make_result("q4", technique="quantize", seed=3, tpot_ms=25.0, speedup_vs_baseline=1.6)]
    for row in rows:
        row["baseline_run_id"] = "base" if row["run_id"] != "base" else None
        row["_path"] = str(tmp_path / "elsewhere")  # forged: a file may not say where it lives
        row["metrics"]["extra_block"] = {"nested": 1}
        save(row, runs)
    received = []

    def spy(module, name):
        original = getattr(module, name)

        def wrapped(*args, **kwargs):
            received.extend((name, a) for a in args if isinstance(a, Mapping) and "run_id" in a)
            received.extend((name, d) for a in args if isinstance(a, list) for d in a
                            if isinstance(d, Mapping) and "run_id" in d)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    for module, name in ((leaderboard, "flatten"), (leads, "lead_for"), (recommend, "excluded_because"),
                         (recommend, "recommended_recipe"), (claims, "_candidates"), (compare, "judge"),
                         (compare, "check_rounds"), (gate, "timing_problem")):
        spy(module, name)
    out = CliRunner().invoke(app, ["leaderboard", str(runs), "--out", str(tmp_path / "lb"), "--json"])
    assert out.exit_code == 0, out.output
    assert "_path" not in _walk_keys(json.loads(out.stdout))
    out = CliRunner().invoke(app, ["compare", str(runs / "base"), str(runs / "q8"), "--fail-if", "tpot_ms.p50 > +50%",
                                   "--allow-mismatch", "--json"])
    assert out.exit_code in (0, 1, 4), out.output  # pass, regression or inconclusive: judged, not refused
    assert {name for name, _ in received} == {"flatten", "lead_for", "excluded_because", "recommended_recipe",
                                             "_candidates", "judge", "check_rounds", "timing_problem"}
    wrong = [(name, type(d).__name__) for name, d in received if not isinstance(d, ResultDocument)]
    assert not wrong, f"readers received untyped results: {wrong[:5]}"
    assert all("_path" not in _walk_keys(d.to_dict()) and str(d.location) == os.path.realpath(runs / d.run_id)
               for _, d in received)


def test_predicted_plans_are_built_as_documents_and_read_back_as_written(tmp_path):
    """`experts plan` rows (predictions, nothing measured) are ResultDocuments from the start, with the plans'
    claim in each; what is on disk loads back equal to what was saved."""
    from test_experts import synthetic_load

    from infer_tune.scenarios.experts import run_plan

    path = synthetic_load().save(tmp_path / "load.json")
    outcome = run_plan(path, devices=2, strategies=["round-robin", "load-balanced"], out_dir=tmp_path / "runs")
    assert len(outcome.docs) == 2 and all(isinstance(d, ResultDocument) for d in outcome.docs)
    for doc in outcome.docs:
        assert doc.metrics["measured"] is False and doc.metrics.get("claim_check") == outcome.claim
        back = results.load_result(doc.location)
        assert back.run_id == doc.run_id and back.technique == "experts" and back.config == doc.config
        assert "_path" not in _walk_keys(back.to_dict())
