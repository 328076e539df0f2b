"""`infer-tune serve` attacked (docs/hardening.md, "Serving: third attack pass"): clients that hang up, a
flood of requests, bodies that crash a parser, requests from web pages, a port in use. The HTTP side runs
in this process over a stand-in engine (`Paced`: LiveSlots' surface, one token per slot every few ms) or,
for the queue bound, the real LiveSlots on a tiny random model. Loopback only; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import queue
import socket
import threading
import time
from collections import deque
from contextlib import contextmanager

import pytest
from typer.testing import CliRunner

from infer_tune.cli import app
from infer_tune.endpoint.serving import OpenAIServer, serve_until_stopped

runner = CliRunner()


class Tokens:
    """A tokenizer stand-in: a character per token, token 5 decodes to 'a'."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [7] * len(text)}

    def __len__(self) -> int:
        return 100

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "a" * len(ids)


class Paced:
    """LiveSlots' surface for the HTTP side: `slots` requests decode together, a token each per step of
    `step_s`; a cancelled request leaves its slot (or the queue) at the next step, as in LiveSlots."""

    def __init__(self, slots: int = 2, max_waiting: int = 8, step_s: float = 0.005, max_context: int = 1 << 20):
        self.slots, self.max_waiting, self.step_s, self.max_context = slots, max_waiting, step_s, max_context
        self.busy: list = [None] * slots
        self.queue: deque = deque()
        self.lock = threading.Lock()
        self.aborted: list = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return not self.stopped.is_set()

    @property
    def busy_slots(self) -> int:
        return sum(r is not None for r in self.busy)

    def limit(self, prompt_tokens: int, max_tokens: int) -> int:
        return max(0, min(max_tokens, self.max_context - prompt_tokens))

    def submit(self, request) -> None:
        with self.lock:
            if len(self.queue) >= self.max_waiting:
                raise queue.Full
            self.queue.append(request)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)

    def _run(self) -> None:
        while not self.stopped.wait(self.step_s):
            with self.lock:
                for slot, request in enumerate(self.busy):
                    if request is not None and request.cancelled:
                        self.aborted.append(request)
                        request.emit(None, "abort")
                        self.busy[slot] = None
                for request in [r for r in self.queue if r.cancelled]:
                    self.queue.remove(request)
                    self.aborted.append(request)
                    request.emit(None, "abort")
                for slot in range(self.slots):
                    if self.busy[slot] is None and self.queue:
                        self.busy[slot] = self.queue.popleft()
                for slot, request in enumerate(self.busy):
                    if request is not None:
                        request.tokens.append(5)
                        done = len(request.tokens) >= request.max_tokens
                        request.emit(5, "length" if done else None)
                        if done:
                            self.busy[slot] = None


@contextmanager
def serving(engine, **kwargs):
    """The HTTP side over `engine` on 127.0.0.1 (a free port) in a thread; yields (host, port)."""
    server = OpenAIServer(engine, Tokens(), "m", max_waiting=engine.max_waiting, **kwargs)
    urls, control = [], {}
    thread = threading.Thread(target=lambda: asyncio.run(serve_until_stopped(server, "127.0.0.1", 0, urls.append,
                                                                             control)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not urls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert urls, "the server did not start in 20 s"
    try:
        yield "127.0.0.1", int(urls[0].rsplit(":", 1)[1].split("/")[0])
    finally:
        control["stop"]()
        thread.join(10)
        engine.stop()


def call(port: int, path: str, body=None, *, headers: dict | None = None, method: str | None = None):
    """(status, headers, parsed JSON body) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        sent = {"Content-Type": "application/json"} if data is not None else {}
        sent.update(headers or {})
        conn.request(method or ("POST" if data is not None else "GET"), path, body=data, headers=sent)
        response = conn.getresponse()
        raw = response.read()
        return response.status, dict(response.getheaders()), (json.loads(raw) if raw.startswith(b"{") else raw)
    finally:
        conn.close()


def until(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def raw_post(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_frees_its_slot_at_once(stream, caplog):
    """A request of a million tokens (~80 min at 5 ms a step): its client leaves, its slot is free within a
    second. Non-streaming, the handler was never cancelled and the slot stayed busy to the last token."""
    engine = Paced(slots=1)
    caplog.set_level(logging.DEBUG)
    with serving(engine) as (_, port):
        sock = raw_post(port, {"prompt": "hi", "max_tokens": 1_000_000, "stream": stream, "ignore_eos": True})
        assert until(lambda: engine.busy_slots == 1, 10)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.close()
        assert until(lambda: engine.busy_slots == 0 and engine.aborted, 3), "the slot was still busy 3 s later"
        # the next request gets the slot
        status, _, answer = call(port, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert status == 200 and answer["choices"][0]["text"] == "aaa"
    noisy = [r for r in caplog.records if r.exc_info and r.levelno >= logging.WARNING]
    assert not noisy, [r.getMessage() for r in noisy]


def test_a_full_queue_is_503_with_retry_after():
    engine = Paced(slots=1, max_waiting=1)
    with serving(engine) as (_, port):
        first = raw_post(port, {"prompt": "hi", "max_tokens": 1_000_000})
        assert until(lambda: engine.busy_slots == 1, 10)
        second = raw_post(port, {"prompt": "hi", "max_tokens": 1_000_000})
        assert until(lambda: len(engine.queue) == 1, 10)
        status, headers, answer = call(port, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and answer["error"]["type"] == "overloaded"
        assert int(headers["Retry-After"]) >= 1
        first.close(), second.close()


def test_the_queue_bound_counts_what_the_engine_took_in(tokenizer):
    """LiveSlots with 1 slot and max_waiting 2: a third waiting request is refused while the engine holds two
    in its own queue. Before, only the inbox was counted and the engine emptied it every step: never Full."""
    from infer_tune.tuners.batch.serving import LiveRequest, LiveSlots
    from tests.test_native_step import tiny_llama

    model = tiny_llama(tokenizer)
    engine = LiveSlots(model, [1], slots=1, max_context=128, compile=False, max_waiting=2)
    paused = {1: threading.Event(), 3: threading.Event()}
    release = {1: threading.Event(), 3: threading.Event()}
    ended: list[str] = []
    count = [0]

    def first(token, finish) -> None:  # holds the engine thread at its 1st token and at its 3rd
        count[0] += 1
        if count[0] in paused:
            paused[count[0]].set()
            release[count[0]].wait(30)

    def other(token, finish) -> None:
        if finish is not None:
            ended.append(finish)

    engine.start()
    try:
        engine.submit(LiveRequest(ids=[3, 4, 5], max_tokens=100, emit=first, ignore_eos=True))
        assert paused[1].wait(30)  # the first request holds the slot
        waiting = [LiveRequest(ids=[3, 4], max_tokens=2, emit=other) for _ in range(2)]
        for request in waiting:
            engine.submit(request)
        release[1].set()
        assert paused[3].wait(30)  # a step later: the engine has moved both from its inbox to its queue
        with pytest.raises(queue.Full):
            engine.submit(LiveRequest(ids=[3], max_tokens=2, emit=other))
        assert engine.waiting == 2 and engine.busy_slots == 1
        waiting[0].cancelled = True  # a client that left gives its place back at the next step
        release[3].set()
        assert until(lambda: engine.waiting == 1, 10)
        engine.submit(LiveRequest(ids=[3], max_tokens=2, emit=other))
    finally:
        for event in release.values():
            event.set()
        engine.stop()
    assert ended[0] == "abort"  # the cancelled one
    assert engine.failure is None
    assert engine.waiting == 0 and engine.busy_slots == 0


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import build_tiny_tokenizer

    return build_tiny_tokenizer()


def parse(body: bytes | dict, max_context: int = 1000):
    class Engine:
        def limit(self, n, max_tokens):
            return max(0, min(max_tokens, max_context - n))

    Engine.max_context = max_context
    server = OpenAIServer(Engine(), Tokens(), "m")
    return server.parse(body if isinstance(body, bytes) else json.dumps(body).encode(), chat=False)


def test_null_max_completion_tokens_means_absent():
    assert parse({"prompt": "hi", "max_tokens": 5, "max_completion_tokens": None}).max_tokens == 5
    assert parse({"prompt": "hi", "max_completion_tokens": 4, "max_tokens": 9}).max_tokens == 4
    assert parse({"prompt": "hi", "max_completion_tokens": None}).max_tokens == 998  # until the slot is full


@pytest.mark.parametrize("body, said", [
    (b'{"prompt": ' + b"[" * 500_000 + b"]" * 500_000 + b"}", "nested deeper than 64 levels"),
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "integer of 5000 digits"),
    (b'{"prompt": "\xff"}', "not JSON"),
])
def test_bodies_that_crash_a_parser_are_400(body, said):
    from infer_tune.endpoint.serving import BadRequest

    with pytest.raises(BadRequest, match=said):
        parse(body)
    engine = Paced()
    with serving(engine) as (_, port):
        status, _, answer = call(port, "/v1/completions", body)
    assert status == 400 and said in answer["error"]["message"], answer


def test_only_json_from_this_hosts_names_and_with_the_key():
    engine = Paced()
    ok = {"prompt": "hi", "max_tokens": 2}
    with serving(engine) as (_, port):
        # a web page's simple request (text/plain, no preflight) and a body without a type
        assert call(port, "/v1/completions", b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"})[0] == 415
        assert call(port, "/v1/completions", b'{"prompt": "hi"}', headers={"Content-Type": ""})[0] == 415
        assert call(port, "/v1/completions", ok, headers={"Content-Type": "application/json; charset=utf-8"})[0] == 200
        # DNS rebinding: a name of the attacker's resolving to 127.0.0.1
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io"):
            status, _, answer = call(port, "/v1/completions", ok, headers={"Host": host})
            assert status == 421 and answer["error"]["type"] == "misdirected_request", host
        assert call(port, "/health", headers={"Host": "evil.example"})[0] == 421
        for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}", f"[::1]:{port}",
                     "LOCALHOST."):
            assert call(port, "/v1/completions", ok, headers={"Host": host})[0] == 200, host
    with serving(Paced(), api_key="s3cret-key") as (_, port):
        assert call(port, "/v1/completions", ok)[0] == 401
        assert call(port, "/v1/models")[0] == 401
        assert call(port, "/v1/completions", ok, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert call(port, "/v1/completions", ok, headers={"Authorization": "Bearer s3cret-key"})[0] == 200
        assert call(port, "/health")[0] == 200  # for a load balancer's probe: says nothing but ok


def test_allowed_hosts_when_bound_everywhere():
    from infer_tune.endpoint.serving import allowed_hosts, host_name

    names, any_ip = allowed_hosts("0.0.0.0")
    assert any_ip and {"localhost", "127.0.0.1", "::1"} <= names
    names, any_ip = allowed_hosts("10.1.2.3", "box.lan")
    assert not any_ip and {"10.1.2.3", "box.lan"} <= names
    assert host_name("[::1]:8000") == "::1" and host_name("Box.Lan.:80") == "box.lan"


def _stop_at_load(monkeypatch):
    from infer_tune.errors import ConfigError

    def build(*args, **kwargs):
        raise ConfigError("LOAD REACHED")

    monkeypatch.setattr("infer_tune.scenarios.serve.build", build)


def test_a_port_in_use_is_one_line_before_the_model_loads(monkeypatch, tmp_path):
    _stop_at_load(monkeypatch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = runner.invoke(app, ["serve", "--model", str(tmp_path), "--method", "bf16", "--port", port])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot listen on 127.0.0.1:" in lines[0] and "in use" in lines[0], result.stderr
    assert "LOAD REACHED" not in result.output and "loading" not in result.output
    result = runner.invoke(app, ["serve", "--model", str(tmp_path), "--method", "bf16", "--host", "192.0.2.1",
                                 "--port", "0"])  # TEST-NET-1: no address of this machine
    assert result.exit_code == 2 and "cannot listen on 192.0.2.1:0" in result.stderr, result.output
    assert "LOAD REACHED" not in result.output


def test_listening_beyond_loopback_warns_and_the_key_is_never_printed(monkeypatch, tmp_path):
    _stop_at_load(monkeypatch)
    args = ["serve", "--model", str(tmp_path), "--method", "bf16", "--host", "0.0.0.0", "--port", "0"]
    result = runner.invoke(app, args)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "beyond loopback without --api-key-env" in warnings[0], result.stderr
    assert "LOAD REACHED" in result.output  # the warning comes first, then the load
    monkeypatch.setenv("SERVE_TEST_KEY", "k-123-secret")
    result = runner.invoke(app, [*args, "--api-key-env", "SERVE_TEST_KEY"])
    assert "warning:" not in result.stderr and "k-123-secret" not in result.output and "LOAD REACHED" in result.output
    result = runner.invoke(app, [*args, "--api-key-env", "SERVE_TEST_UNSET_VAR"])
    assert result.exit_code == 2 and "SERVE_TEST_UNSET_VAR" in result.stderr and "LOAD REACHED" not in result.output


def test_an_error_record_is_one_line_without_debug():
    import io

    from infer_tune.endpoint.serving import log_errors

    stream = io.StringIO()
    restore = log_errors(False, stream)
    try:
        try:
            raise ConnectionResetError("Cannot write to closing transport")
        except ConnectionResetError:
            logging.getLogger("aiohttp.server").exception("Error handling request from %s", "127.0.0.1")
    finally:
        restore()
    text = stream.getvalue()
    assert text.count("\n") == 1 and "Traceback" not in text
    assert "Error handling request from 127.0.0.1: ConnectionResetError: Cannot write" in text


def test_soak_with_clients_hanging_up(tiny_model_dir, _test_home):
    """bench/serve_soak.py's load for 6 s on a tiny model (2 slots): streamed and whole requests, a third of
    them abandoned mid-stream or before the answer, /health polled throughout. Every request that was not
    abandoned is answered, /health always, every slot is free at the end, and the log holds no traceback
    (before: one per client that left mid-stream)."""
    import os
    from pathlib import Path

    from bench.serve_soak import soak, start_server, stop_server

    env = dict(os.environ, INFER_TUNE_HOME=str(_test_home), PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    process, base = start_server(["--model", str(tiny_model_dir), "--method", "int4-rtn", "--no-compile",
                                  "--context", "256", "--slots", "2", "--threads", "1"], env=env, ready_s=120)
    try:
        report = soak(base, process.pid, 6.0, clients=4, warmup_s=2.0, seed=1, settle_s=10)
    finally:
        stopping = time.monotonic()
        code, log = stop_server(process)
    stop_s = time.monotonic() - stopping
    assert report["served"] >= 10 and report["hangups"] >= 5, report
    assert report["failures"] == {} and report["stuck_threads"] == 0, report
    assert report["health_failures"] == {} and report["health_polls"] >= 10, report
    assert report["slots"] == 2 and report["busy_at_end"] == 0 and report["waiting_at_end"] == 0, report
    assert code == 0 and "Traceback" not in log, log[-3000:]
    assert stop_s < 6, f"SIGTERM to exit took {stop_s:.1f} s (the HTTP thread waited 10 s for the main one)"
