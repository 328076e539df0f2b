"""Typed metrics (metrics/schema.py): a result's `metrics` are a read-only mapping with a typed core, a key
a technique, an engine or the sweep adds must be declared by its namespace, a measured figure is never
replaced, a saved result is never modified (in memory or on disk), and a sweep's conclusion is saved beside
its rows' result.json, which stays byte for byte what was saved."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
from result_docs import make_result, save

from infer_tune import results
from infer_tune.document import FrozenResultError, OverwriteError, as_document
from infer_tune.engines.base import ENGINES
from infer_tune.metrics.schema import CORE, SWEEP_KEYS, Metrics, UndeclaredMetricError, check_declared
from infer_tune.tuners.base import TECHNIQUES, load_techniques


def test_a_key_no_namespace_declares_is_refused_naming_the_source_and_the_key():
    doc = as_document(make_result("r", technique="quantize", ppl=None))
    doc.add_metrics({"bytes_ratio_vs_16bit": 0.5}, source="quantize's facts")  # quantize declares it
    doc.add_metrics({"ppl": 6.0}, source="a perplexity")  # a core figure (null before: not measured)
    with pytest.raises(UndeclaredMetricError, match=r"my finish adds metric\(s\) made_up_key .*quantize"):
        doc.add_metrics({"made_up_key": 1}, source="my finish")
    with pytest.raises(UndeclaredMetricError, match="acceptance_rate"):  # speculate's key, not quantize's
        doc.add_metrics({"acceptance_rate": 0.5}, source="a stray counter")
    with pytest.raises(UndeclaredMetricError, match="claim_check"):  # the sweep's: only through its namespace
        doc.add_metrics({"claim_check": {"statement": "x"}}, source="a row's finish")
    doc.add_metrics({"predicted_peak_bytes": 1}, source="the sweep's admission", namespace="sweep")
    assert "made_up_key" not in doc.metrics and doc.metrics["bytes_ratio_vs_16bit"] == 0.5
    # an engine's namespace: the row's engine declares its own keys
    row = as_document(make_result("e", technique="endpoint"))
    row.set_engine("llama.cpp")
    row.add_metrics({"ppl_context": 512, "requests_sent": 8}, source="llama.cpp")
    with pytest.raises(UndeclaredMetricError, match="openvino_ir_bytes"):
        row.add_metrics({"openvino_ir_bytes": 1}, source="not llama.cpp's")


def test_a_measured_figure_is_never_overwritten():
    doc = as_document(make_result("r", technique="quantize"))
    measured = doc.metrics["output_throughput_tok_s"]
    with pytest.raises(OverwriteError, match="output_throughput_tok_s"):
        doc.add_metrics({"output_throughput_tok_s": measured * 2}, source="a technique")
    assert doc.metrics["output_throughput_tok_s"] == measured


def test_metrics_are_a_read_only_mapping_with_typed_reads_of_the_core():
    doc = as_document(make_result("r", technique="quantize", speedup_vs_baseline=1.5, ppl_delta_pct=2.0))
    m = doc.metrics
    assert isinstance(m, Metrics) and m.number("speedup_vs_baseline") == 1.5 and m.number("ppl_delta_pct") == 2.0
    assert m.stat("tpot_ms") == doc.metrics["tpot_ms"]["p50"] == doc.tpot_p50_ms
    assert m.number("output_throughput_tok_s") == doc.throughput_tok_s
    for change in (lambda: m.__setitem__("x", 1), lambda: m.update(x=1), lambda: m.setdefault("x", 1),
                   lambda: m.pop("speedup_vs_baseline"), lambda: m.clear(), lambda: m.__delitem__("ppl")):
        with pytest.raises(TypeError, match="read-only"):
            change()
    assert json.loads(json.dumps(m)) == dict(m)  # written as a plain object
    assert pickle.loads(pickle.dumps(m)) == m and copy.deepcopy(m) == m and type(copy.deepcopy(m)) is Metrics
    assert set(SWEEP_KEYS).isdisjoint(CORE)


def test_a_saved_result_refuses_every_change_and_update_result_is_gone(tmp_path):
    doc = as_document(make_result("r", technique="quantize"))
    saved = results.save_run(tmp_path, doc, []).result
    assert saved is doc and doc.frozen
    for change in (lambda: doc.add_metrics({"ppl": 1.0}, source="late"), lambda: doc.set_engine("torch"),
                   lambda: doc.set_sweep_metrics({"claim_check": {"statement": "x"}}),
                   lambda: doc.set_section("sweep", {}), lambda: doc.add_workload({"x": 1}, source="late"),
                   lambda: setattr(doc, "objective", "decode")):
        with pytest.raises(FrozenResultError, match="never modified"):
            change()
    loaded = results.load_result(tmp_path / "r")
    assert loaded.frozen
    with pytest.raises(FrozenResultError):
        loaded.add_metrics({"ppl": 1.0}, source="a reader")
    with pytest.raises(results.ResultError, match="already saved"):
        results.save_run(tmp_path, loaded, [])
    assert not hasattr(results, "update_result")


def test_a_conclusion_is_a_new_document_saved_beside_result_json_and_read_back_merged(tmp_path):
    folder = save(make_result("r", technique="batch"), tmp_path)
    before = (folder / "result.json").read_bytes()
    doc = results.load_result(folder)
    claim = {"statement": "s", "held": True}
    concluded = doc.with_conclusion({"claim_check": claim, "knee_batch_size": 4}, {"sweep": {"rows": 1}})
    assert concluded is not doc and concluded.frozen and "claim_check" not in doc.metrics
    assert concluded.metrics["claim_check"] == claim and concluded.sweep == {"rows": 1}
    with pytest.raises(UndeclaredMetricError):  # a conclusion adds keys of the sweep's (or the row's) namespace only
        doc.with_conclusion({"made_up": 1})
    assert results.save_conclusion(concluded) == folder / "conclusion.json"
    assert results.save_conclusion(concluded) is None  # the same conclusion: nothing written again
    again = concluded.with_conclusion({"claim_check": {**claim, "held": False}})
    assert results.save_conclusion(again) == folder / "conclusion.2.json"  # a new version, never a rewrite
    assert (folder / "result.json").read_bytes() == before
    back = results.load_result(folder)
    assert back.metrics["claim_check"]["held"] is False and back.metrics["knee_batch_size"] == 4
    assert back.sweep == {"rows": 1} and back.frozen
    assert [d.run_id for d in results.find_results(tmp_path)] == ["r"]


def test_result_json_is_unchanged_byte_for_byte_when_a_sweep_concludes(tiny_model_dir, tmp_path, monkeypatch):
    """A batch-size sweep (its technique concludes the knee, its plan the memory-limit keys): each row's
    result.json is what the row saved; the conclusion lies beside it and is read back merged."""
    import infer_tune.sweep.engine as engine
    from infer_tune.runners import Protocol
    from infer_tune.scenarios import batch as scenario
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.workload import Workload

    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} plus {i}?", "reference": str(2 * i)})
                             + "\n" for i in range(4)))
    written: dict = {}
    real = engine.conclude_sweep

    def snapshot_then_conclude(docs, plan=None, *, own):
        written.update({d.run_id: (d.location / "result.json").read_bytes() for d in docs})
        return real(docs, plan, own=own)

    monkeypatch.setattr(engine, "conclude_sweep", snapshot_then_conclude)
    out = tmp_path / "runs"
    spec = RunSpec(model=str(tiny_model_dir), threads=1, out_dir=out,
                   protocol=Protocol(warmup=0, min_iterations=1, min_duration_s=0),
                   workload=Workload(suite=str(suite), limit=2, max_new_tokens=3, chat_template=False))
    result = scenario.run_sweep(spec, scenario.SweepSpec(batch_sizes=[1, 2], memory_limit_bytes=2**50))
    assert len(written) == 2 and "knee_batch_size" in result.docs[0].metrics
    for doc in result.docs:
        assert (doc.location / "result.json").read_bytes() == written[doc.run_id]
        assert (doc.location / "conclusion.json").is_file() and doc.frozen
        assert doc.metrics["knee_batch_size"] == result.knee and doc.metrics["exceeded_memory_limit"] is False
        back = results.load_result(doc.location)
        assert back.metrics["knee_batch_size"] == result.knee and back.to_dict() == doc.to_dict()


def test_every_namespace_is_declared_as_a_mapping_and_an_undeclared_fact_fails_the_sweep():
    """Each registered technique and engine declares its keys (`metric_keys`: key -> what it is); the
    suite's sweeps run with the refusal on, so a key a technique or an engine writes without declaring it
    fails the test that runs it."""
    load_techniques()
    for entry in TECHNIQUES.values():
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in entry.metric_keys.items()), entry.name
    for engine in ENGINES.values():
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in engine.metric_keys.items()), engine.name
    declared = {e.name for e in TECHNIQUES.values() if e.metric_keys}
    assert {"quantize", "batch", "speculate", "kv-cache", "experts", "lean", "stack", "llama-cpp"} <= declared
    with pytest.raises(UndeclaredMetricError, match="test-x's prepared facts"):
        check_declared({"surprise": 1}, ["test-x", "engine:torch"], "test-x's prepared facts")
