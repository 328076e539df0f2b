"""`infer-tune bench` through typer's CliRunner: the JSON document, and every bad input -> exit 2."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer_tune.cli import app
from infer_tune.results import REQUIRED_KEYS

runner = CliRunner()
FAST = ["--warmup", "0", "--min-iterations", "1", "--min-duration", "0", "--threads", "1"]


def test_threads_default_to_omp_num_threads_when_set(monkeypatch):
    """A process told `OMP_NUM_THREADS` (a test worker's children, a job script's pinning) runs that many torch
    threads unless --threads says otherwise; unset or not a positive integer: the physical cores."""
    import psutil
    import torch

    from infer_tune.scenarios.common import setup_threads

    before = torch.get_num_threads()
    cores = psutil.cpu_count(logical=False) or 1
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert setup_threads(None) == 3 == torch.get_num_threads()
        assert setup_threads(1) == 1 == torch.get_num_threads()
        for value in ("0", "two", ""):
            monkeypatch.setenv("OMP_NUM_THREADS", value)
            assert setup_threads(None) == cores
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert setup_threads(None) == cores
    finally:
        torch.set_num_threads(before)


def test_bench_json_document(tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "runs"
    result = runner.invoke(app, ["bench", "--model", str(tiny_model_dir), "--suite", str(prompts_file),
                                 "--limit", "2", "--max-new-tokens", "5", "--out", str(out), "--json", *FAST])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    for key in REQUIRED_KEYS:
        assert key in doc
    m = doc["metrics"]
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(m[key]) >= {"p50", "p90", "p99", "mean", "stdev", "n"}
        assert m[key]["p50"] > 0
    for key in ("output_throughput_tok_s", "request_throughput_req_s", "peak_rss_bytes", "model_bytes",
                "roofline_tok_s", "roofline_fraction", "bleu", "chrf"):
        assert m[key] is not None, key
    assert doc["workload"]["prompts"] == 2 and doc["workload"]["max_new_tokens"] == 5
    assert len(doc["samples"]["ttft_ms"]) == 2
    run_dir = out / doc["run_id"]
    assert json.loads((run_dir / "result.json").read_text())["run_id"] == doc["run_id"]
    assert len((run_dir / "outputs.jsonl").read_text().splitlines()) == 2


@pytest.fixture()
def bad_files(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is text, not GGUF")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    other = tmp_path / "other.jsonl"
    other.write_text('{"question": "hi"}\n')
    return {"fake": fake, "empty": empty, "other": other}


BAD_INPUTS = {
    "unknown model": (["--model", "no-such-model"], "unknown model"),
    "missing path": (["--model", "./no/such/dir"], "not found"),
    "text renamed gguf": (["--model", "{fake}"], "not a GGUF file"),
    "empty suite": (["--suite", "{empty}"], "empty"),
    "missing suite": (["--suite", "./no/such/suite.jsonl"], "not found"),
    "unknown field": (["--suite", "{other}"], "no field 'prompt'"),
    "unknown reference field": (["--suite", "{other}", "--prompt-field", "question", "--reference-field", "ans"],
                                "no field 'ans'"),
    "limit 0": (["--limit", "0"], "--limit"),
    "negative max-new-tokens": (["--max-new-tokens", "-1"], "--max-new-tokens"),
    "threads 0": (["--threads", "0"], "--threads"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_no_run_dir(case, bad_files, tmp_path, tiny_model_dir):
    args, expected = BAD_INPUTS[case]
    args = [a.format(**bad_files) for a in args]
    if "--model" not in args:
        args = ["--model", str(tiny_model_dir), *args]
    out = tmp_path / "runs"
    result = runner.invoke(app, ["bench", *args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.output
    assert not out.exists() or not any(out.iterdir())


def test_debug_shows_traceback(tmp_path):
    """--debug lets the error itself out (with its traceback); without it the same input is one line."""
    import traceback

    from infer_tune.errors import ModelError

    result = runner.invoke(app, ["bench", "--model", "no-such-model", "--out", str(tmp_path), "--debug"])
    assert isinstance(result.exception, ModelError), result.exception
    text = "".join(traceback.format_exception(result.exception))
    assert "Traceback" in text and "models.py" in text and "unknown model" in text
    plain = runner.invoke(app, ["bench", "--model", "no-such-model", "--out", str(tmp_path)])
    assert plain.exit_code == 2 and isinstance(plain.exception, SystemExit)


def test_internal_error_is_exit_3_with_a_log(tmp_path, monkeypatch, tiny_model_dir):
    """An unexpected exception is not a regression (1) nor bad input (2): exit 3, one line, a log file."""
    from infer_tune.scenarios import bench as bench_scenario

    def boom(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(bench_scenario, "run_bench", boom)
    result = runner.invoke(app, ["bench", "--model", str(tiny_model_dir), "--out", str(tmp_path)])
    assert result.exit_code == 3, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "internal error: RuntimeError: simulated bug" in lines[0]
    log = lines[0].split("traceback in ")[1].split(";")[0]
    assert "simulated bug" in Path(log).read_text() and "Traceback" in Path(log).read_text()
