"""Multi-process load generation against the paced loopback server (known timing, its achieved send times
recorded): merged timings on one clock, the client's saturation measured and flagged, `--workers` end to
end. The accuracy table at 1 to 1,024 streams is bench/endpoint_loadgen.py (docs/endpoint.md)."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time

import pytest
from typer.testing import CliRunner

from infer_tune.endpoint import loadgen, rxtime
from infer_tune.endpoint.client import encode_body
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


# ---- the paced server's truth from arrival timestamps; the workers' raw-socket sender ----

def _post(server, prompt: str) -> bytes:
    config = EndpointConfig(url=server.url, served_model="paced")
    return loadgen.request_bytes(config, encode_body(config, prompt, 3), {"Content-Type": "application/json"})


def _read_to_done(sock) -> bytes:
    data = b""
    while b"[DONE]" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.skipif(rxtime.SO_TIMESTAMPNS is None, reason="no kernel receive timestamps on this platform")
def test_paced_server_paces_from_arrival_and_records_what_it_did():
    pace = Pace(first_s=0.100, interval_s=0.010, tokens=3)
    with PacedServer(pace) as server:
        for prompt, blocked_s in (("held 60 ms", 0.060), ("held 180 ms", 0.180)):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                time.sleep(0.05)  # the connection is accepted and idle
                inside, sent, sent_at = threading.Event(), threading.Event(), []

                def hold(blocked_s=blocked_s, inside=inside, sent=sent, sent_at=sent_at):
                    inside.set()  # the server's loop stops reading until `blocked_s` after the request went out
                    sent.wait(10)
                    time.sleep(max(0.0, blocked_s - (time.perf_counter() - sent_at[0])))

                server._loop.call_soon_threadsafe(hold)
                assert inside.wait(10)
                sock.sendall(_post(server, prompt))
                sent_at.append(time.perf_counter())
                sent.set()
                assert b"[DONE]" in _read_to_done(sock)
        truth = {r["prompt"]: r for r in server.truth}
    held, late = truth["held 60 ms"], truth["held 180 ms"]
    for r in (held, late):
        assert r["arrival_from"] == "kernel" and r["read_ns"] >= r["arrival_ns"]
        assert len(r["send_ns"]) == 3
    # read ~60 ms after arrival, yet the first token still goes out 100 ms after arrival (after the read it
    # would be 160 ms or more)
    assert (held["read_ns"] - held["arrival_ns"]) / 1e6 > 50
    ttft = (held["send_ns"][0] - held["arrival_ns"]) / 1e6
    assert 100 <= ttft < 150
    assert all(t >= held["arrival_ns"] + 100_000_000 + k * 10_000_000 for k, t in enumerate(held["send_ns"]))
    # read after its first token was due: sent late, and the truth says so (the actual send, not the schedule)
    late_ttft = (late["send_ns"][0] - late["arrival_ns"]) / 1e6
    assert late_ttft >= (late["read_ns"] - late["arrival_ns"]) / 1e6 > 100
    assert truth_summary([late])["ttft_ms_p50"] == pytest.approx(late_ttft)


SSE = b"".join(b'data: {"choices":[{"index":0,"delta":{"content":"w%d "}}]}\n\n' % k for k in range(3))
TAIL = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":{"completion_tokens":3}}\n\n' \
       b"data: [DONE]\n\n"


def _chunks(*parts: bytes) -> bytes:
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts)


END = b"0\r\nX-Trailer: t\r\n\r\n"  # the last chunk, a trailer, the blank line


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
ANSWERS = {  # what the scripted server writes for every request: a list of writes (None: stay silent 5 s)
    "chunked": [HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + _chunks(SSE[:30])[:-1], b"\n" + _chunks(SSE[30:], TAIL),
                END[:-2], END[-2:]],
    "length": [HEAD + b"Content-Length: %d\r\n\r\n" % len(SSE + TAIL) + SSE, TAIL],
    "interim": [b"HTTP/1.1 100 Continue\r\n\r\n" + HEAD + b"Content-Length: %d\r\n\r\n" % len(SSE + TAIL) + SSE + TAIL],
    "to_close": [HEAD + b"Connection: close\r\n\r\n" + SSE + TAIL[:-15], "close"],
    "bad_chunk": [HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + SSE],
    "bad_status": [b"SMTP ready\r\n\r\n"],
    "endless": [HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + _chunks(*[SSE] * 400) + END],
    "long_line": [HEAD + b"Content-Length: 9999999\r\n\r\ndata: " + b"y" * (1 << 21)],
    "huge_head": [b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * (1 << 17) + b"\r\n\r\n"],
    "stall": [HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + _chunks(SSE[:30]), None],
    "cut": [HEAD + b"Content-Length: 5000\r\n\r\n" + SSE, "close"],
    "error": [b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\n\r\n\x1b[2J boom " % (8 << 20) + b"z" * (8 << 20)],
    "redirect": [b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:9/x\r\nContent-Length: 0\r\n\r\n"],
    "json_200": [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 27\r\n\r\n"
                 b'{"error": "model \x1b[2Jbusy"}'],
    "no_events": [HEAD + b"Content-Length: 12\r\n\r\n: keepalive\n"],
}


class Scripted:
    """A loopback server on a thread that reads each request (head + Content-Length body) and answers it
    with the writes of ANSWERS[kind]; counts its connections. Bounded: it writes a fixed amount."""

    def __init__(self, kind: str) -> None:
        self.kind, self.connections = kind, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self.serve, args=(sock,), daemon=True).start()

    def serve(self, sock) -> None:
        sock.settimeout(10)
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(buffer) < length:
                    buffer += sock.recv(65536)
                buffer = buffer[length:]
                for write in ANSWERS[self.kind]:
                    if write is None:
                        time.sleep(5)
                    elif write == "close":
                        return
                    else:
                        sock.sendall(write)
                        time.sleep(0.01)
        except OSError:
            return
        finally:
            sock.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("kind, failure, text", [
    ("chunked", None, "w0 w1 w2 "), ("length", None, "w0 w1 w2 "), ("interim", None, "w0 w1 w2 "),
    ("to_close", None, "w0 w1 w2 "),
    ("bad_chunk", "http", "not a chunk size"), ("bad_status", "http", "not an HTTP/1.x status line"),
    ("endless", "too_many_tokens", "streamed 4 text events for max_tokens 3"),
    ("long_line", "oversized", "bytes"), ("huge_head", "http", "head is over 65536 bytes"),
    ("stall", "idle_timeout", "sent nothing for 0.5 s"), ("cut", "disconnected", "closed the stream"),
    ("error", "http", "HTTP 500: [2J boom zzz"), ("redirect", "redirect", "redirect to http://127.0.0.1:9/x"),
    ("json_200", "not_event_stream", 'Content-Type application/json, not an event stream: {"error": "model [2Jbusy"}'),
    ("no_events", "not_event_stream", "without a single event-stream data event"),
])
def test_raw_sender_parses_streams_and_fails_bad_answers_by_kind(kind, failure, text):
    server = Scripted(kind)
    try:
        config = EndpointConfig(url=f"http://127.0.0.1:{server.port}/v1", served_model="m", concurrency=1,
                                idle_timeout_s=0.5, timeout_s=5)
        trace = [TraceRequest(0, 0.0, 3), TraceRequest(0, 0.0, 3)]
        start = time.monotonic()
        stats: dict = {}
        _, records = asyncio.run(asyncio.wait_for(
            loadgen.raw_send_all(config, trace, ["p"], 3, closed_loop=True, stats=stats), 20))
        assert time.monotonic() - start < 15
    finally:
        server.close()
    assert len(records) == 2
    for record, _, submit_ns in records:
        assert record.failure == failure, record.message
        assert submit_ns == record.start_ns > 0
        if failure is None:
            assert record.text == text and record.usage == {"completion_tokens": 3}
            assert len(record.delivery_ns) == 3 and all(t >= record.start_ns for t in record.delivery_ns)
        else:
            assert text in record.message and len(record.message) < 700 and "\x1b" not in record.message
    if kind in ("chunked", "length", "interim"):
        assert server.connections == 1  # keep-alive: the second request went on the same connection
    if kind == "to_close":
        assert server.connections == 2
    if failure is None:
        assert stats["reads_kernel_timed"] + stats["reads_read_timed"] > 0


def test_clock_offset_is_read_again_when_the_thread_was_switched_out(monkeypatch):
    """The realtime -> monotonic offset comes from the closest realtime pair around a monotonic read: a pair
    split by a thread switch (another thread took the GIL) would put receive times milliseconds early."""
    realtime = iter([1_000_000, 3_000_000,  # 2 ms apart: switched out in between
                     5_000_000, 5_000_010])  # 10 ns apart
    mono = iter([100, 4_000_000])
    monkeypatch.setattr(rxtime.time, "time_ns", lambda: next(realtime))
    monkeypatch.setattr(rxtime.time, "perf_counter_ns", lambda: next(mono))
    assert rxtime.realtime_offset_ns() == 5_000_005 - 4_000_000


def test_a_receive_time_converted_early_is_held_at_the_send(monkeypatch):
    """A kernel receive time converted 500 ms too early (before the request went out) is held at the send:
    no token of a response is timed before its request."""
    read = rxtime.read

    def early(sock, size):
        data, received, mono = read(sock, size)
        return data, mono - 500_000_000, mono

    monkeypatch.setattr(rxtime, "read", early)
    server = Scripted("chunked")
    try:
        config = EndpointConfig(url=f"http://127.0.0.1:{server.port}/v1", served_model="m", concurrency=1,
                                idle_timeout_s=2, timeout_s=5)
        _, records = asyncio.run(asyncio.wait_for(
            loadgen.raw_send_all(config, [TraceRequest(0, 0.0, 3)], ["p"], 3, closed_loop=True), 20))
    finally:
        server.close()
    record = records[0][0]
    assert record.failure is None and len(record.delivery_ns) == 3
    assert all(t >= record.start_ns for t in record.delivery_ns) and record.delivery_ns[0] == record.start_ns
