from infer_tune import env as envinfo
from infer_tune.runners import Protocol
from infer_tune.runners.prepared import PreparedModel
from infer_tune.sweep import measure_prepared, prepare_inputs
from infer_tune.workload import Workload


def test_tiny_bench_end_to_end(tiny_loaded, prompts_file):
    workload = Workload(suite=str(prompts_file), limit=3, max_new_tokens=6)
    inputs = prepare_inputs(tiny_loaded, workload)
    prepared = PreparedModel(tiny_loaded.model, tiny_loaded.tokenizer)
    doc, outputs = measure_prepared(tiny_loaded, prepared, inputs, workload,
                                    Protocol(warmup=1, min_iterations=1, min_duration_s=0),
                                    technique="baseline", config={}, env=envinfo.collect_env(1))
    assert doc["metrics"]["ttft_ms"]["n"] == 3
    assert doc["metrics"]["tpot_ms"]["n"] == 3
    assert len(outputs) == 3
