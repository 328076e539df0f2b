"""The real path: `bench` on SmolLM2-135M (provisioned from PyPI by `make test`) with two prompts."""

import json
import os

import pytest
from typer.testing import CliRunner

from infer_tune.cli import app

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _need_model(smollm2_available):
    if not smollm2_available:
        if os.environ.get("CI"):
            pytest.fail("SmolLM2 is not provisioned; `make test` runs `infer-tune models pull smollm2-135m` first")
        pytest.skip("run `infer-tune models pull smollm2-135m` first")


def test_bench_real_model_two_prompts(tmp_path):
    result = CliRunner().invoke(app, [
        "bench", "--model", "smollm2-135m", "--suite", "chat", "--limit", "2", "--max-new-tokens", "8",
        "--warmup", "1", "--min-iterations", "1", "--min-duration", "0", "--out", str(tmp_path), "--json",
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["model"]["params"] > 100_000_000
    assert doc["model"]["model_bytes"] > 400_000_000  # float32 checkpoint
    assert doc["metrics"]["ttft_ms"]["n"] == 2 and doc["metrics"]["tpot_ms"]["p50"] > 0
    assert doc["workload"]["chat_template_applied"] is True
    assert 1.0 < doc["metrics"]["ppl"] < 100.0  # a trained model, not random weights
    outputs = [json.loads(line) for line in (tmp_path / doc["run_id"] / "outputs.jsonl").read_text().splitlines()]
    assert all(o["output"].strip() for o in outputs)
