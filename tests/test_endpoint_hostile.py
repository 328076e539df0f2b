"""Hostile servers on 127.0.0.1 (docs/hardening.md, "Live servers are untrusted"): each case ends cleanly,
either exit 2 with one `error:` line, or a result whose bad requests are counted as failed by kind (and
a warning line says so). Every server here is bounded: it writes a fixed amount, or stalls for seconds.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from typer.testing import CliRunner

from infer_tune.cli import app
from infer_tune.endpoint.client import MAX_LINE_BYTES, SSEParser, StreamTooLarge, clean
from infer_tune.endpoint.loopback import Behaviour, LoopbackServer, _chunk, _event, _Handler, _http

runner = CliRunner()
FAST = ["--warmup", "1", "--min-iterations", "2", "--min-duration", "0", "--limit", "3", "--max-new-tokens", "8"]
SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Server: hostile\r\n\r\n")


class Hostile(_Handler):
    """The loopback server with one misbehaviour: `kind` on every completion request from the `start`-th
    on (the first one, the handshake, is honest unless start is 1), or on every `every`-th."""

    def __init__(self, kind: str, start: int = 1, every: int = 0, models: bytes | None = None) -> None:
        super().__init__(Behaviour(model="m"))
        self.kind, self.start, self.every, self.models = kind, start, every, models

    async def respond(self, method, path, body, writer, headers):
        if method == "GET" and path.endswith("/models") and self.models is not None:
            writer.write(self.models)
            return
        await super().respond(method, path, body, writer, headers)

    async def complete(self, request, n, writer):
        hostile = (n % self.every == 0) if self.every else n >= self.start
        if not hostile:
            return await super().complete(request, n, writer)
        base = {"id": f"r{n}", "object": "chat.completion.chunk", "model": "m"}

        def delta(text):
            return _chunk(_event({**base, "choices": [{"index": 0, "delta": {"content": text}}]}))

        if self.kind == "redirect":
            writer.write(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:9/steal\x1b[2J\r\n"
                         b"Content-Length: 0\r\n\r\n")
        elif self.kind == "endless":  # ~50 MB if read to the end; the client must stop after max_tokens
            writer.write(SSE_HEAD)
            for _ in range(200):
                writer.write(b"".join(delta("x" * 256) for _ in range(1000)))
                await writer.drain()
        elif self.kind in ("usage_huge", "usage_low"):
            writer.write(SSE_HEAD + b"".join(delta(f"w{k} ") for k in range(2)))
            tokens = 100000 if self.kind == "usage_huge" else 1
            final = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": tokens}}
            writer.write(_chunk(_event(final)) + _chunk(_event(b"[DONE]")) + b"0\r\n\r\n")
        elif self.kind == "long_line":  # 2 MiB without a newline
            writer.write(SSE_HEAD)
            for _ in range(32):
                writer.write(_chunk(b"data: " + b"y" * 65536))
                await writer.drain()
        elif self.kind == "stall":  # headers, then silence
            writer.write(SSE_HEAD + delta("first "))
            await writer.drain()
            await asyncio.sleep(20)
        elif self.kind == "json_200":  # an error answered with 200 and a JSON body, no event stream
            writer.write(_http("200 OK", b'{"error": {"message": "model overloaded"}}'))
        elif self.kind == "no_events":  # the right Content-Type, but not one data event
            writer.write(SSE_HEAD + _chunk(b": nothing to see\n\n") + b"0\r\n\r\n")
        elif self.kind in ("prompt_negative", "prompt_huge"):
            writer.write(SSE_HEAD + b"".join(delta(f"w{k} ") for k in range(2)))
            tokens = -1000000 if self.kind == "prompt_negative" else 10 ** 30
            final = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                     "usage": {"prompt_tokens": tokens, "completion_tokens": 2}}
            writer.write(_chunk(_event(final)) + _chunk(_event(b"[DONE]")) + b"0\r\n\r\n")
        elif self.kind == "deep_json":  # an event nested 200,000 levels deep (400 KB): RecursionError before
            writer.write(SSE_HEAD + _chunk(b"data: " + b"[" * 200_000 + b"]" * 200_000 + b"\n\n") + b"0\r\n\r\n")
        elif self.kind == "error_escape":
            text = b"\x1b[2J\x1b]0;pwned\x07 boom " + b"z" * (8 << 20)  # 8 MiB error body
            writer.write(_http("500 Internal Server Error", text, "text/plain"))
        else:
            raise AssertionError(self.kind)


def serve(handler: _Handler) -> LoopbackServer:
    server = LoopbackServer(Behaviour(model="m"))
    server.handler = handler
    return server


def bench(url: str, out, *extra: str):
    return runner.invoke(app, ["bench", "--endpoint", url, "--out", str(out), "--json", *FAST, *extra])


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output and "\x1b" not in result.stderr
    return lines[0]


@pytest.mark.parametrize("kind, extra, expected", [
    ("redirect", [], ("redirect to http://127.0.0.1:9/steal[2J; redirects are not followed",)),
    ("endless", [], ("streamed 3 text events for max_tokens 2",)),
    ("usage_huge", [], ("usage.completion_tokens 100000 exceeds max_tokens 2",)),
    ("long_line", [], ("line is over 1048576 bytes", "the stream passed 1081344 bytes")),
    ("stall", ["--idle-timeout", "0.5"], ("sent nothing for 0.5 s",)),
    ("error_escape", [], ("HTTP 500: [2J]0;pwned boom zzz",)),
    ("deep_json", [], ("event data is not JSON: '[[[[",)),
    ("json_200", [], ('HTTP 200 with Content-Type application/json, not an event stream: {"error"',)),
    ("no_events", [], ("without a single event-stream data event",)),
    ("prompt_negative", [], ("usage.prompt_tokens is -1000000",)),
    ("prompt_huge", [], ("usage.prompt_tokens is 1000000000000000000000000000000",)),
])
def test_a_hostile_first_answer_is_exit_2_in_one_line(tmp_path, kind, extra, expected):
    start = time.monotonic()
    with serve(Hostile(kind)) as server:
        result = bench(server.url, tmp_path, "--served-model", "m", *extra)
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert any(e in line for e in expected), line
    assert len(line) < 700, "a server's error body is cut, not printed whole"
    assert not list(tmp_path.rglob("result.json"))
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("kind, failure", [
    ("endless", "too_many_tokens"),
    ("usage_huge", "too_many_tokens"),
    ("usage_low", "usage_mismatch"),
    ("long_line", "oversized"),
    ("json_200", "not_event_stream"),
    ("no_events", "not_event_stream"),
    ("prompt_negative", "invalid_usage"),
    ("prompt_huge", "invalid_usage"),
])
def test_hostile_answers_later_count_as_failed_requests_and_warn(tmp_path, kind, failure):
    # completion requests: 1 handshake, 2 warmup, 3-8 timed: every 2nd is hostile -> 3 of the 6 timed
    with serve(Hostile(kind, every=2)) as server:
        result = bench(server.url, tmp_path, "--served-model", "m")
    assert result.exit_code == 0, result.output
    m = json.loads(result.stdout)["metrics"]
    assert m["failures_by_kind"] == {failure: 3} and m["requests_failed"] == 3 and m["requests_ok"] == 3
    assert m["generated_tokens"] == 3 * 8  # only honest requests' tokens: no 54.9M tok/s
    assert m["output_throughput_tok_s"] < 1e6
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "3 of 6 requests failed (50.0%" in warnings[0], result.stderr


def test_every_timed_request_answered_200_without_a_stream_is_exit_2(tmp_path):
    """A 200 with a JSON body after an honest handshake: not `requests 1 ok, 0 failed` with n=0 metrics."""
    with serve(Hostile("json_200", start=2)) as server:
        result = bench(server.url, tmp_path, "--served-model", "m")
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert "failed" in line and "not_event_stream" in line, line
    assert not list(tmp_path.rglob("result.json"))


def test_usage_prompt_tokens_written_are_bounded(tmp_path):
    """Only honest requests' usage reaches outputs.jsonl: no -1e6 or 1e30 prompt lengths."""
    with serve(Hostile("prompt_huge", every=2)) as server:
        result = bench(server.url, tmp_path, "--served-model", "m")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for path in tmp_path.rglob("outputs.jsonl") for line in path.read_text().splitlines()]
    assert rows and "1000000000000000000000000000000" not in json.dumps(rows)


def test_failed_requests_are_shown_in_the_table(tmp_path):
    with LoopbackServer(Behaviour(fail_every=3)) as server:
        result = runner.invoke(app, ["bench", "--endpoint", server.url, "--out", str(tmp_path), *FAST])
    assert result.exit_code == 0, result.output
    assert "2 of 6 requests failed" in result.stderr and "4 ok, 2 failed (2 http)" in result.stdout


def test_models_redirect_and_flood_are_refused(tmp_path):
    redirect = b"HTTP/1.1 302 Found\r\nLocation: http://elsewhere.invalid/v1/models\r\nContent-Length: 0\r\n\r\n"
    with serve(Hostile("redirect", models=redirect)) as server:
        result = bench(server.url, tmp_path)
    assert result.exit_code == 2 and "redirect to http://elsewhere.invalid/v1/models" in one_error_line(result)
    flood = _http("200 OK", b'{"data": [' + b'{"id": "m"},' * (1 << 19) + b'{"id": "m"}]}')  # 6 MiB
    with serve(Hostile("redirect", models=flood)) as server:
        result = bench(server.url, tmp_path)
    assert result.exit_code == 2 and "more than 4096 KiB" in one_error_line(result)


def test_served_model_with_rich_markup_does_not_crash(tmp_path):
    with LoopbackServer(Behaviour(model="x[/]")) as server:
        result = runner.invoke(app, ["bench", "--endpoint", server.url, "--served-model", "x[/]", "--out",
                                     str(tmp_path), *FAST])
    assert result.exit_code == 0, result.output
    assert "x[/]" in result.stdout


def test_control_characters_never_reach_the_terminal():
    assert clean("a\x1b[31mb\x07c\r\nd\u202ee") == "a[31mbc de"
    assert len(clean("q" * 1000)) == 203


def test_sse_parser_caps_a_line_and_parses_many_events_per_read():
    parser = SSEParser()
    with pytest.raises(StreamTooLarge):
        for _ in range(MAX_LINE_BYTES // 4096 + 2):
            parser.feed(b"y" * 4096)
    parser = SSEParser()
    events = parser.feed(b"".join(b"data: %d\n\n" % k for k in range(5000)))
    assert events == [str(k) for k in range(5000)] and not parser.buffer
    data_lines = SSEParser()
    with pytest.raises(StreamTooLarge):  # one event of many short data lines is capped too
        for _ in range(2000):
            data_lines.feed(b"data: " + b"z" * 1000 + b"\n")
