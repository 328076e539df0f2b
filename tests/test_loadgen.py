"""Multi-process load generation against the paced loopback server (known timing, its achieved send times
recorded): merged timings on one clock, the client's saturation measured and flagged, `--workers` end to
end. The accuracy table at 1 to 1,024 streams is bench/endpoint_loadgen.py (docs/endpoint.md)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import pytest
from typer.testing import CliRunner

from infer_tune.endpoint import loadgen
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.paced import Pace, PacedServer, truth_summary
from infer_tune.runners.trace import TraceRequest

PACE = Pace(first_s=0.060, interval_s=0.010, tokens=6)


def test_workers_merge_onto_one_clock_and_match_the_servers_timing():
    with PacedServer(PACE) as server:
        config = EndpointConfig(url=server.url, served_model="paced", concurrency=8, stream_usage=True, timeout_s=30)
        trace = [TraceRequest(i % 3, 0.02 * i, 6) for i in range(8)]
        result, client = loadgen.replay_workers(config, trace, ["a b", "c d", "e f"], 6, workers=2)
        truth = truth_summary(server.truth)
    assert client["workers"] == 2 and [r["requests"] for r in client["worker_readings"]] == [4, 4]
    assert len(result.timings) == 8 and not result.failures
    assert [t.prompt_index for t in result.timings] == [i % 3 for i in range(8)]  # trace order after the merge
    for request, timing in zip(trace, result.timings):
        assert timing.submit_ns == result.origin_ns + int(request.arrival_s * 1e9)  # arrivals on the shared clock
        assert timing.start_ns >= timing.submit_ns and len(timing.token_ns) == 6
    ttft = statistics.median(t.ttft_ms for t in result.timings)
    tpot = statistics.median((t.e2e_ms - t.ttft_ms) / 5 for t in result.timings)
    assert truth["requests"] == 8
    assert truth["ttft_ms_p50"] - 1 <= ttft < truth["ttft_ms_p50"] + 40  # the client cannot see a token before it is sent
    assert tpot == pytest.approx(truth["tpot_ms_p50"], abs=2.0)
    assert all(r["cpu_share"] is not None and r["lag_samples"] > 0 for r in client["worker_readings"])


def test_a_blocked_client_loop_is_flagged():
    async def busy():
        for _ in range(8):
            time.sleep(0.03)  # the loop does not run: timers and reads wait
            await asyncio.sleep(0)

    _, reading = asyncio.run(loadgen.monitored(busy()))
    verdict = loadgen.saturation([reading])
    assert verdict["client_saturated"] and "event-loop lag" in verdict["client_saturation_reason"]
    calm = loadgen.saturation([{"loop_lag_ms_p50": 0.1, "loop_lag_ms_p99": 1.0, "cpu_share": 0.2}], [0.1, 0.2])
    assert calm == {"client_saturated": False, "client_saturation_reason": None}
    late = loadgen.saturation([{"loop_lag_ms_p50": 0.1, "loop_lag_ms_p99": 1.0, "cpu_share": 0.95}], [5.0, 6.0])
    assert "CPU 95%" in late["client_saturation_reason"] and "arrivals sent late" in late["client_saturation_reason"]


def test_default_workers_follow_concurrency_and_cores():
    assert loadgen.default_workers(1, 16) == 1
    assert loadgen.default_workers(256, 16) == 2
    assert loadgen.default_workers(1024, 16) == 8
    assert loadgen.default_workers(1024, 2) == 2


def test_endpoint_sim_with_workers_records_the_client(tmp_path):
    from infer_tune.cli import app

    with PacedServer(PACE) as server:
        result = CliRunner().invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--rates", "inf", "--requests",
                                          "6", "--concurrency", "6", "--workers", "2", "--max-new-tokens", "6",
                                          "--warmup", "0", "--out", str(tmp_path), "--json"])
        bad = CliRunner().invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--workers", "0",
                                       "--out", str(tmp_path / "bad")])
    assert result.exit_code == 0, result.output
    m = json.loads(result.output)[0]["metrics"]
    assert m["client"]["workers"] == 2 and len(m["client"]["worker_readings"]) == 2
    assert m["requests_ok"] == 6 and isinstance(m["client_saturated"], bool)
    assert m["ttft_ms"]["p50"] >= 59  # the server's 60 ms first-token delay is a floor
    assert bad.exit_code == 2 and "--workers must be >= 1" in bad.output and not (tmp_path / "bad").exists()


def test_bench_endpoint_closed_loop_passes_over_workers(tmp_path, prompts_file):
    from infer_tune.cli import app

    with PacedServer(Pace(first_s=0.02, interval_s=0.005, tokens=4)) as server:
        result = CliRunner().invoke(app, ["bench", "--endpoint", server.url, "--served-model", "paced", "--suite",
                                          str(prompts_file), "--limit", "3", "--concurrency", "3", "--workers", "2",
                                          "--max-new-tokens", "4", "--warmup", "0", "--min-iterations", "3",
                                          "--min-duration", "0.5", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    m = json.loads(result.output)["metrics"]
    launches = len(m["client"]["worker_readings"]) // 2
    assert m["requests_ok"] == 3 * m["iterations"] and m["iterations"] >= 3
    assert launches <= 4  # passes after the first go out in as few launches as the estimate allows
    assert m["tpot_ms"]["p50"] == pytest.approx(5.0, abs=2.0)
