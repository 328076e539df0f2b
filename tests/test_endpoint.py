"""The endpoint runner against the loopback server (infer_tune.endpoint.loopback): stream parsing, token
counting, result-document shape, bounded concurrency, failures counted by kind, every bad input -> exit 2,
drift against a baseline and the compare gate, the rate sweep, and the client's own overhead."""

from __future__ import annotations

import json
import math
import socket

import pytest
from typer.testing import CliRunner

from infer_tune.cli import app
from infer_tune.endpoint.arrivals import parse_rates, poisson_trace
from infer_tune.endpoint.client import SSEParser, StreamRecord
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.loopback import Behaviour, LoopbackServer
from infer_tune.endpoint.overhead import measure_client_overhead
from infer_tune.endpoint.replay import ReplayResult, collect, count_tokens, replay_trace
from infer_tune.errors import ConfigError
from infer_tune.metrics import saturation
from infer_tune.results import REQUIRED_KEYS, find_results
from infer_tune.runners.base import RequestTiming
from infer_tune.runners.trace import TraceRequest

runner = CliRunner()
FAST = ["--warmup", "1", "--min-iterations", "2", "--min-duration", "0", "--limit", "3", "--max-new-tokens", "8"]


@pytest.fixture()
def echo_suite(tmp_path):
    """Prompts whose references are the prompts themselves: the loopback server echoes prompt words."""
    rows = [{"prompt": f"alpha beta gamma delta {w} epsilon", "reference": f"alpha beta gamma delta {w} epsilon"}
            for w in ("one", "two", "three", "four")]
    path = tmp_path / "echo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bench(url: str, out, *extra: str):
    return runner.invoke(app, ["bench", "--endpoint", url, "--out", str(out), "--json", *FAST, *extra])


# --------------------------------------------------------------------------- parsing and counting
def test_sse_parser_handles_split_reads_crlf_comments_and_multiline_data():
    stream = b': keep-alive\r\n\r\ndata: {"a": 1}\r\n\r\nevent: x\ndata: line1\ndata: line2\n\ndata: [DONE]\n\ndata: tail'
    for size in (1, 3, 7, len(stream)):
        parser, events = SSEParser(), []
        for i in range(0, len(stream), size):
            events += parser.feed(stream[i:i + size])
        events += parser.close()
        assert events == ['{"a": 1}', "line1\nline2", "[DONE]", "tail"], size


def test_token_counting_groups_reads_and_places_unstreamed_tokens_at_the_finish():
    rec = StreamRecord(delivery_ns=[10, 20, 20, 30], texts=["a", "b", "c", "d"], usage={"completion_tokens": 5},
                       finish_ns=40)
    tokens, source, steps = count_tokens(rec)
    assert (tokens, source) == (5, "usage")
    assert steps == [(10, 1), (20, 2), (30, 1), (40, 1)]  # two events of one read are one delivery
    rec.finish_ns = 30  # finishing event in the same read as the last text: the token joins that delivery
    assert count_tokens(rec)[2][-1] == (30, 2)
    rec.usage = {"completion_tokens": 2}  # a usage below the events streamed is not believed
    assert count_tokens(rec)[:2] == (4, "deltas")
    assert count_tokens(StreamRecord(delivery_ns=[5], texts=["x"]))[:2] == (1, "deltas")


def test_a_tokens_event_without_text_is_a_token_and_the_role_and_finish_are_not():
    """A server streaming one event per token sends an empty `content` (chat) or `text` (completions) for a token
    that adds no text (end-of-sequence decoded under ignore_eos, bytes of an unfinished character): it counts, so
    the client's count matches `usage`; the role announcement, the finish and a usage chunk do not."""
    import json

    from infer_tune.endpoint.client import StreamRecord, _handle_event
    from infer_tune.endpoint.replay import check_token_count

    chat = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
            {"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]},
            {"choices": [{"delta": {"content": ""}, "finish_reason": None}]},
            {"choices": [{"delta": {}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 3}}]
    record = StreamRecord()
    for i, event in enumerate(chat):
        _handle_event(record, json.dumps(event), 10 * i, "chat")
    assert len(record.delivery_ns) == 2 and record.text == "Hi" and check_token_count(record)
    completions = [{"choices": [{"text": "", "finish_reason": None}]}, {"choices": [{"text": "x", "finish_reason": None}]},
                   {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 2}}]
    record = StreamRecord()
    for i, event in enumerate(completions):
        _handle_event(record, json.dumps(event), i, "completions")
    assert len(record.delivery_ns) == 2 and check_token_count(record)


def test_cached_tokens_in_usage_give_the_prefix_cache_hit_rate():
    """usage.prompt_tokens_details.cached_tokens (infer-tune serve's and llama-server's) counted per request:
    a request without it, or with a count that is not one of its prompt's tokens, is left out of the rate."""
    def record(prompt: int, details) -> tuple:
        usage = {"prompt_tokens": prompt, "completion_tokens": 1}
        if details is not None:
            usage["prompt_tokens_details"] = details
        return StreamRecord(start_ns=1, delivery_ns=[2], texts=["x"], usage=usage, finish_reason="length"), 1, 1

    records = [record(40, {"cached_tokens": 0}), record(60, {"cached_tokens": 45}), record(50, None),
               record(30, {"cached_tokens": 31}), record(20, {"cached_tokens": True}), record(10, {})]
    trace = [TraceRequest(i, 0.0) for i in range(len(records))]
    result = collect(ReplayResult(), trace, records, ["p"] * len(records), None, 0)
    assert (result.cache_reports, result.cache_prompt_tokens, result.cached_tokens) == (2, 100, 45)
    assert result.hit_rate == pytest.approx(0.45)
    merged = ReplayResult()
    merged.merge(result)
    merged.merge(result)
    assert (merged.cache_reports, merged.cached_tokens, merged.hit_rate) == (4, 90, pytest.approx(0.45))
    assert ReplayResult().hit_rate is None


def test_config_validates_fields_and_reads_the_key_from_the_environment(monkeypatch):
    for bad, field in (({"url": "localhost:8000"}, "url"), ({"api": "responses"}, "api"),
                       ({"concurrency": 0}, "concurrency"), ({"timeout_s": 0}, "timeout_s"),
                       ({"api_key_env": "sk-123 x"}, "api_key_env")):
        with pytest.raises(ConfigError, match=field):
            EndpointConfig(**{"url": "http://h:1/v1", **bad})
    config = EndpointConfig(url="http://h:1/v1/", api_key_env="MY_KEY")
    assert config.url == "http://h:1/v1" and config.request_url == "http://h:1/v1/chat/completions"
    monkeypatch.delenv("MY_KEY", raising=False)
    with pytest.raises(ConfigError, match="MY_KEY"):
        config.headers()
    monkeypatch.setenv("MY_KEY", "s3cret")
    assert config.headers()["Authorization"] == "Bearer s3cret"
    assert "s3cret" not in json.dumps(config.to_dict())


# --------------------------------------------------------------------------- result documents
def test_bench_endpoint_document_has_the_in_process_shape(tiny_model_dir, echo_suite, tmp_path):
    local = runner.invoke(app, ["bench", "--model", str(tiny_model_dir), "--suite", str(echo_suite), "--out",
                                str(tmp_path / "local"), "--json", "--threads", "1", "--no-ppl", *FAST])
    assert local.exit_code == 0, local.output
    with LoopbackServer(Behaviour(gap_s=0.01)) as server:
        result = bench(server.url, tmp_path / "ep", "--suite", str(echo_suite))
    assert result.exit_code == 0, result.output
    doc, in_process = json.loads(result.stdout), json.loads(local.stdout)
    assert set(in_process) <= set(doc) and all(k in doc for k in REQUIRED_KEYS)
    assert set(in_process["metrics"]) <= set(doc["metrics"])  # same keys; the endpoint adds its own
    assert doc["technique"] == "endpoint" and doc["runner"] == "endpoint"
    m = doc["metrics"]
    assert m["model_bytes"] is None and m["ppl"] is None and m["peak_rss_bytes"] is None
    assert m["client_peak_rss_bytes"] > 0 and m["requests_ok"] == 6 and m["requests_failed"] == 0
    assert m["token_count_source"] == "usage" and m["generated_tokens"] == 6 * 8
    assert m["itl_ms"]["n"] == 6 * 7 and m["itl_ms"]["p50"] >= 5  # gaps between deliveries, paced 10 ms apart
    assert m["bleu"] > 30  # the echo of each prompt scored against its reference
    assert doc["env"]["endpoint"]["models"] == ["loopback"] and doc["env"]["endpoint"]["server_header"]
    assert doc["model"]["ref"] == "loopback" and doc["config"]["served_model"] == "loopback"
    assert len(find_results(tmp_path / "ep")) == 1


def test_api_key_is_sent_but_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_TUNE_TEST_KEY", "sk-very-secret")
    with LoopbackServer() as server:
        result = bench(server.url, tmp_path, "--api-key-env", "INFER_TUNE_TEST_KEY")
        sent = {h.get("authorization") for h in server.headers}
    assert result.exit_code == 0, result.output
    assert sent == {"Bearer sk-very-secret"}
    written = "".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl"))
    assert "sk-very-secret" not in written and "sk-very-secret" not in result.stdout
    assert '"api_key_env": "INFER_TUNE_TEST_KEY"' in result.stdout


def test_server_rejecting_stream_options_gets_requests_without_them(tmp_path):
    with LoopbackServer(Behaviour(reject_fields=("stream_options",), usage=False)) as server:
        result = bench(server.url, tmp_path)
        bodies = server.requests
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["env"]["endpoint"]["stream_usage"] is False and doc["metrics"]["token_count_source"] == "deltas"
    assert "stream_options" in bodies[0] and all("stream_options" not in b for b in bodies[1:])
    assert bodies[1]["max_tokens"] == 2  # the handshake, asked again without stream_options
    assert all(b["temperature"] == 0.0 and b["stream"] is True and b["max_tokens"] == 8 for b in bodies[2:])


# --------------------------------------------------------------------------- failures and bad input
def test_failed_requests_are_counted_by_kind_not_raised(tmp_path):
    # completion requests: 1 handshake, 2 warmup, 3-8 timed (2 passes x 3 prompts, one at a time)
    with LoopbackServer(Behaviour(fail_every=3, malformed_every=4)) as server:
        result = bench(server.url, tmp_path)
    assert result.exit_code == 0, result.output
    m = json.loads(result.stdout)["metrics"]
    assert m["failures_by_kind"] == {"http": 2, "malformed_sse": 2}  # 500 at #3 and #6, bad SSE at #4 and #8
    assert (m["requests_sent"], m["requests_ok"], m["requests_failed"]) == (6, 2, 4)
    assert m["ttft_ms"]["n"] == 2 and {f["status"] for f in m["failures"]} == {500, 200}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("behaviour, extra, expected", [
    (None, [], "connection refused"),
    (Behaviour(), ["--served-model", "nope"], "not among the models it lists (loopback)"),
    (Behaviour(stall_s=2.0), ["--request-timeout", "0.5"], "no complete answer within 0.5 s"),
    (Behaviour(fail_from=3), [], "every request to"),
    (Behaviour(fail_every=1), [], "failed the first request 3 times"),
    (Behaviour(reject_fields=("ignore_eos",)), ["--ignore-eos"], "may not accept the ignore_eos"),
])
def test_bad_endpoints_end_with_one_line_and_exit_2(tmp_path, behaviour, extra, expected):
    if behaviour is None:
        result = bench(f"http://127.0.0.1:{_closed_port()}/v1", tmp_path, *extra)
    else:
        with LoopbackServer(behaviour) as server:
            result = bench(server.url, tmp_path, *extra)
    assert result.exit_code == 2, result.output
    assert expected in result.output and "Traceback" not in result.output
    assert not tmp_path.exists() or not list(tmp_path.rglob("result.json"))


@pytest.mark.parametrize("args, expected", [
    (["--endpoint", "localhost:8000"], "url must look like"),
    (["--endpoint", "http://127.0.0.1:1/v1", "--concurrency", "0"], "--concurrency"),
    (["--endpoint", "http://127.0.0.1:1/v1", "--recipe", "quantize"], "--recipe"),
    (["--endpoint", "http://127.0.0.1:1/v1", "--api-key-env", "NO_SUCH_VAR_X"], "NO_SUCH_VAR_X"),
])
def test_bad_options_exit_2(tmp_path, args, expected):
    result = runner.invoke(app, ["bench", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2 and expected in result.output, result.output


# --------------------------------------------------------------------------- open loop, concurrency
def test_a_closed_keep_alive_connection_sends_the_request_once_more_timed_from_the_first_send():
    import asyncio
    import time

    import aiohttp

    from infer_tune.endpoint.client import encode_body, stream_request
    from infer_tune.endpoint.replay import KEEPALIVE_S, client_session

    assert KEEPALIVE_S < 5  # idle connections dropped before llama-server / uvicorn close them

    class ClosedFirst:  # the pooled connection closed under the client's first `fails` writes
        def __init__(self, real, fails, message="Can not write request body for http://127.0.0.1/v1"):
            self.real, self.fails, self.message, self.posts = real, fails, message, 0

        def post(self, *args, **kwargs):
            self.posts += 1
            if self.posts <= self.fails:
                time.sleep(0.05)
                raise aiohttp.ClientOSError(32, self.message)
            return self.real.post(*args, **kwargs)

    with LoopbackServer(Behaviour(chunks=3)) as server:
        config = EndpointConfig(url=server.url, served_model="loopback", concurrency=1, timeout_s=10)
        body = encode_body(config, "a b c", 3)

        async def send(fails, message=None):
            async with client_session(config) as real:
                session = ClosedFirst(real, fails, *([message] if message else []))
                before = time.perf_counter_ns()
                record = await stream_request(session, config, body, config.headers(), max_tokens=3)
                return record, session.posts, before

        record, posts, before = asyncio.run(send(1))
        assert record.ok and record.resent == 1 and posts == 2 and record.text == "a b c "
        assert before <= record.start_ns and record.delivery_ns[0] - record.start_ns >= 50_000_000  # first send
        record, posts, _ = asyncio.run(send(2))  # sent again once only: a second failure is the request's
        assert record.failure == "http" and "request body" in record.message and posts == 2
        record, posts, _ = asyncio.run(send(1, "Connection reset by peer"))  # not a write: not sent again
        assert record.failure == "http" and posts == 1 and record.resent == 0


def test_open_loop_replay_bounds_concurrency_and_times_from_arrival():
    with LoopbackServer(Behaviour(chunks=4, gap_s=0.01)) as server:
        config = EndpointConfig(url=server.url, served_model="loopback", concurrency=2, stream_usage=True)
        trace = [TraceRequest(i % 2, 0.0) for i in range(6)]
        result = replay_trace(config, trace, ["one two", "three four"], 4)
        assert server.max_in_flight == 2
    assert not result.failures and len(result.timings) == 6
    queued = sorted(t.queue_ms for t in result.timings)
    assert queued[-1] > queued[0]  # the last requests waited for a slot: TTFT counts from their arrival
    for t in result.timings:
        assert t.start_ns >= t.submit_ns and t.ttft_ms >= t.queue_ms
    assert [o.text for o in result.outputs[:2]] == ["one two one two ", "three four three four "]


def test_poisson_trace_is_seeded_with_the_asked_rate_and_burstiness():
    a, b = poisson_trace(4000, 5.0, 3, seed=1), poisson_trace(4000, 5.0, 3, seed=1)
    assert a == b and a[0].arrival_s == 0.0 and [r.prompt_index for r in a[:4]] == [0, 1, 2, 0]
    gaps = [y.arrival_s - x.arrival_s for x, y in zip(a, a[1:])]
    assert abs(sum(gaps) / len(gaps) - 0.2) < 0.02
    bursty = poisson_trace(4000, 5.0, 3, seed=1, burstiness=0.25)
    bgaps = [y.arrival_s - x.arrival_s for x, y in zip(bursty, bursty[1:])]
    cv = lambda g: (sum((x - sum(g) / len(g)) ** 2 for x in g) / len(g)) ** 0.5 / (sum(g) / len(g))  # noqa: E731
    assert cv(bgaps) > 1.5 > cv(gaps) > 0.8  # gamma shape 1/4: CV 2; Poisson: CV 1
    assert all(r.arrival_s == 0.0 for r in poisson_trace(3, math.inf, 1))
    assert parse_rates("4, 1,2,inf") == [1.0, 2.0, 4.0, math.inf]
    for bad in ("", "a,b", "0,1", "-1"):
        with pytest.raises(ConfigError):
            parse_rates(bad)


def _timing(ttft_ms: float, tpot_ms: float, n: int = 3) -> RequestTiming:
    first = int(ttft_ms * 1e6)
    return RequestTiming(0, 0, 1, 0, [first + int(k * tpot_ms * 1e6) for k in range(n)])


def test_goodput_and_knee():
    timings = [_timing(10, 5), _timing(100, 5), _timing(10, 50)]
    g = saturation.goodput(timings, saturation.SLO(ttft_ms=50, tpot_ms=20), 2.0, submitted=len(timings) + 1)
    assert (g["good_requests"], g["goodput_req_s"], g["slo_attainment"]) == (1, 0.5, 0.25)
    assert saturation.goodput(timings, saturation.SLO(), 1.0)["goodput_req_s"] is None  # no objectives, no goodput
    assert saturation.knee([1, 2, 4, 8], [10, 12, 25, 90]) == (2, [False, False, True, True], "within")
    assert saturation.knee([1, 2], [10, 11]) == (None, [False, False], "beyond")
    assert saturation.knee([1, 2], [10, None]) == (1, [False, True], "within")  # nothing succeeded: saturated
    # the server served 0.1 req/s of the 1 req/s offered: the lowest rate is no reference, the knee is below
    assert saturation.knee([1, 2], [900, 950], achieved=[0.1, 0.1]) == (None, [True, True], "below")
    assert saturation.knee([1, 2], [10, 30], achieved=[0.9, 1.1])[2] == "within"


def test_endpoint_sim_sweeps_rates_and_marks_the_knee(tmp_path):
    with LoopbackServer(Behaviour(chunks=4, gap_s=0.005)) as server:
        result = runner.invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--rates", "20,inf", "--requests",
                                     "6", "--concurrency", "2", "--slo-ttft-ms", "10000", "--max-new-tokens", "4",
                                     "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    docs = json.loads(result.stdout)
    assert [d["metrics"]["offered_rate_req_s"] for d in docs] == [20.0, None]
    for doc in docs:
        m = doc["metrics"]
        assert m["requests_ok"] == 6 and m["trace_requests"] == 6 and m["slo"] == {"ttft_ms": 10000}
        assert m["goodput_req_s"] > 0 and m["slo_attainment"] == 1.0 and "queue_ms" in m
        assert m["sweep_rates"] == [20.0, None] and "knee_rate_req_s" in m and isinstance(m["saturated"], bool)
        assert m["knee_status"] in ("within", "beyond", "below")
        assert (tmp_path / doc["run_id"] / "rates.png").stat().st_size > 1000
    assert docs[0]["config"]["trace"]["rate_req_s"] == 20.0 and docs[1]["config"]["trace"]["requests"] == 6
    assert [d["label"].rsplit(" ", 1)[-1] for d in docs] == ["@20rps", "@infrps"]  # one leaderboard row per rate


# --------------------------------------------------------------------------- quality gate
def test_drift_against_a_baseline_gates_a_deployment(tiny_model_dir, echo_suite, tmp_path):
    common = ["--model", str(tiny_model_dir), "--suite", str(echo_suite)]
    with LoopbackServer(Behaviour(model="m")) as good:
        base = bench(good.url, tmp_path / "base", *common)
        assert base.exit_code == 0, base.output
        same = bench(good.url, tmp_path / "same", *common, "--baseline", json.loads(base.stdout)["location"])
    with LoopbackServer(Behaviour(model="m", garble=True)) as bad:
        worse = bench(bad.url, tmp_path / "worse", *common, "--baseline", json.loads(base.stdout)["location"])
    assert same.exit_code == 0 and worse.exit_code == 0, same.output + worse.output
    s, w = json.loads(same.stdout)["metrics"], json.loads(worse.stdout)["metrics"]
    assert s["bleu_drift"] == 0.0 and s["exact_match_vs_baseline"] == 1.0
    assert w["bleu_drift"] < -1.0 and w["exact_match_vs_baseline"] == 0.0 and w["output_mismatches"] == 3
    base_path = json.loads(base.stdout)["location"]
    gate = ["compare", base_path, "--fail-if", "bleu_drift < -1.0"]
    passed = runner.invoke(app, [*gate, json.loads(same.stdout)["location"]])
    assert passed.exit_code == 0, passed.output
    assert runner.invoke(app, [*gate, json.loads(worse.stdout)["location"]]).exit_code == 1


def test_baseline_of_another_workload_is_refused(tiny_model_dir, echo_suite, tmp_path):
    with LoopbackServer() as server:
        base = bench(server.url, tmp_path, "--model", str(tiny_model_dir), "--suite", str(echo_suite))
        other = bench(server.url, tmp_path, "--model", str(tiny_model_dir), "--suite", str(echo_suite),
                      "--max-new-tokens", "4", "--baseline", json.loads(base.stdout)["location"])
        no_tokenizer = bench(server.url, tmp_path, "--suite", str(echo_suite), "--baseline",
                             json.loads(base.stdout)["location"])
    assert other.exit_code == 2 and "max_new_tokens" in other.output
    assert no_tokenizer.exit_code == 2 and "name the served weights as model" in no_tokenizer.output


# --------------------------------------------------------------------------- client overhead
def test_client_overhead_on_ttft_is_small():
    """Speed targets live in bench/endpoint_overhead.py (< 1 ms p50); this only catches a gross regression."""
    with LoopbackServer() as server:
        result = measure_client_overhead(EndpointConfig(url=server.url, served_model="loopback"), rounds=40)
    assert result["overhead_ms"]["n"] == 40 and result["overhead_ms_p50"] < 50.0


# --------------------------------------------------------------------------- reference engines
def test_reference_engine_input_is_checked_before_anything_starts(tmp_path, monkeypatch):
    from infer_tune.endpoint import servers

    bad = runner.invoke(app, ["endpoint", "reference", "--engine", "vllm", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "engine must be one of llama.cpp, llama-cpp, torch, hf, transformers" in bad.output
    monkeypatch.setattr(servers, "missing_modules", lambda engine: ["llama_cpp"])
    missing = runner.invoke(app, ["endpoint", "reference", "--engine", "llama.cpp", "--out", str(tmp_path)])
    assert missing.exit_code == 2 and "pip install 'infer-tune[llamacpp]'" in missing.output
    from infer_tune.engines.launched import gguf_for

    with pytest.raises(ConfigError, match="GGUF"):
        gguf_for(str(tmp_path))
    cmd, served = servers.engine_command("transformers", str(_tiny_checkpoint(tmp_path)), 8123,
                                         continuous_batching=True)
    assert "--continuous-batching" in cmd and "127.0.0.1" in cmd and served == str(tmp_path / "ckpt")


def _tiny_checkpoint(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    return tmp_path / "ckpt"


def test_batch_serve_sim_replays_its_trace_against_an_endpoint(tmp_path):
    """`batch serve-sim --endpoint` sends the seeded arrival trace to the server instead of batching in process."""
    with LoopbackServer(Behaviour(chunks=3, gap_s=0.002)) as server:
        result = runner.invoke(app, ["batch", "serve-sim", "--endpoint", server.url, "--rates", "25", "--requests", "4",
                                     "--max-new-tokens", "3", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    [doc] = json.loads(result.stdout)
    assert doc["runner"] == "endpoint" and doc["metrics"]["requests_ok"] == 4
    assert doc["config"]["trace"]["rate_req_s"] == 25.0


def test_llama_server_command_and_parallel_checks(tmp_path, monkeypatch):
    """llama.cpp's C++ server is preferred when found; parallel slots need it, each slot the asked context."""
    from infer_tune.endpoint import servers

    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("LLAMA_SERVER", str(fake))
    cmd, served = servers.engine_command("llama.cpp", str(gguf), 8123, threads=2, parallel=4, context_tokens=1024)
    assert cmd[0] == str(fake) and served == "m"
    assert cmd[cmd.index("--parallel") + 1] == "4" and cmd[cmd.index("--ctx-size") + 1] == "4096"
    assert "--no-cache-prompt" in cmd and cmd[cmd.index("--threads") + 1] == "2"
    servers.check_engine("llama.cpp", 4)
    with pytest.raises(ConfigError, match="continuous-batching"):
        servers.check_engine("transformers", 2)
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "home"))  # no bin/llama-server there
    with pytest.raises(ConfigError, match="build-llama-cpp"):
        servers.check_engine("llama.cpp", 2)
    cmd, _ = servers.engine_command("llama.cpp", str(gguf), 8123)
    assert cmd[1:3] == ["-m", "llama_cpp.server"]
