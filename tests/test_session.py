"""Baseline-in-the-same-session: reuse of a matching baseline, --resume, and versus-baseline keys."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from infer_tune import env as envinfo
from infer_tune.results import find_results
from infer_tune.runners import PreparedModel, Protocol
from infer_tune.session import prepare_inputs, run_configs
from infer_tune.tuners import RunContext, TechniqueConfig, register_technique, unregister_technique
from infer_tune.workload import Workload

ONCE = Protocol(warmup=0, min_iterations=1, min_duration_s=0)


@dataclass
class NoiseConfig(TechniqueConfig):
    """Test technique: perturbs the weights so outputs drift."""

    technique: ClassVar[str] = "test-noise"
    scale: float = 0.0


def _apply_noise(loaded, config: NoiseConfig, ctx) -> PreparedModel:
    import copy

    model = copy.deepcopy(loaded.model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * config.scale)
    return PreparedModel(model, loaded.tokenizer, label=f"noise-{config.scale}")


@pytest.fixture()
def noise_technique():
    register_technique(NoiseConfig)(_apply_noise)
    yield NoiseConfig
    unregister_technique(NoiseConfig)


def test_run_configs_reuses_baseline_and_resumes(noise_technique, tiny_loaded, prompts_file, tmp_path):
    workload = Workload(suite=str(prompts_file), limit=3, max_new_tokens=6)
    inputs = prepare_inputs(tiny_loaded, workload)
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)
    configs = [NoiseConfig(scale=0.0), NoiseConfig(scale=0.5)]
    base1, docs1 = run_configs(tiny_loaded, inputs, workload, ONCE, configs, ctx)
    assert docs1[0]["metrics"]["exact_match_vs_baseline"] == 1.0  # no noise: identical outputs
    assert docs1[0]["metrics"]["bleu_drift"] == 0.0
    assert docs1[1]["metrics"]["output_mismatches"] > 0  # noise: outputs drift
    assert docs1[1]["metrics"]["ppl_delta_pct"] != 0.0
    assert all(d["baseline_run_id"] == base1["run_id"] for d in docs1)
    base2, docs2 = run_configs(tiny_loaded, inputs, workload, ONCE, configs, ctx, resume=True)
    assert base2["run_id"] == base1["run_id"]  # reused, not re-measured
    assert [d["run_id"] for d in docs2] == [d["run_id"] for d in docs1]  # resumed
    assert len(find_results(tmp_path)) == 3
    other = Workload(suite=str(prompts_file), limit=2, max_new_tokens=6)
    base3, _ = run_configs(tiny_loaded, prepare_inputs(tiny_loaded, other), other, ONCE, [], ctx)
    assert base3["run_id"] != base1["run_id"]  # a different workload gets its own baseline
    longer = Protocol(warmup=0, min_iterations=2, min_duration_s=0)
    base4, _ = run_configs(tiny_loaded, inputs, workload, longer, [], ctx)
    assert base4["run_id"] != base1["run_id"]  # another protocol is another measurement


def test_baseline_reuse_does_not_depend_on_the_date(noise_technique, tiny_loaded, prompts_file, tmp_path):
    """A baseline measured before midnight is still the same measurement after it."""
    import json

    workload = Workload(suite=str(prompts_file), limit=2, max_new_tokens=4)
    inputs = prepare_inputs(tiny_loaded, workload)
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)
    base1, _ = run_configs(tiny_loaded, inputs, workload, ONCE, [], ctx)
    stored = tmp_path / base1["run_id"] / "result.json"
    doc = json.loads(stored.read_text())
    doc["created_at"] = "1999-12-31T23:59:59+0000"
    stored.write_text(json.dumps(doc))
    base2, _ = run_configs(tiny_loaded, inputs, workload, ONCE, [NoiseConfig(scale=0.0)], ctx)
    assert base2["run_id"] == base1["run_id"]


def test_test_techniques_leave_the_registry_clean():
    from infer_tune.tuners import TECHNIQUES

    assert NoiseConfig not in TECHNIQUES
