"""Multi-process load generation: one replay spread over N worker processes, each with its own event loop.

One Python event loop saturates long before the hundreds to thousands of concurrent streams a served
fleet is benchmarked at, and a saturated client reads its own queue as the server's TTFT. So:
- the trace (the same seeded arrivals as a single-loop replay) is scheduled centrally: request k goes to
  worker k mod N with its absolute arrival time; the concurrency limit is split over the workers;
- every worker opens its own event loop and connection pool (its share of the connections opened before
  the start, as a warm pool of a long-running load generator would be), reports ready, and waits for one shared
  start time on `perf_counter_ns` (CLOCK_MONOTONIC on Linux: one clock for every process of the
  machine), so arrivals, sends and deliveries of all workers are on one clock and merge as they are;
- http: the workers send on raw sockets (`open_raw`, `raw_replay`): requests serialized before the start,
  each written with one `send` at its arrival (its start stamped right before), responses parsed as they
  stream (HTTP/1.1, chunked / Content-Length / to the close, SSE), every read timed by the kernel's
  receive timestamp (infer_tune.endpoint.rxtime) where there is one, so a busy worker's read delay is not
  counted as server time; the client's limits, timeouts and failure kinds apply. https: aiohttp;
- every worker measures its own saturation while it sends: event-loop lag (a 5 ms sleep's overshoot),
  its CPU share (process time / wall time) and its timers' lateness at the arrivals. `saturation`
  turns them into `client_saturated` and the reason, which the endpoint runner writes into the result.
The single-loop client measures the same (`monitored`), so a saturated run is flagged either way.
Definitions and measured numbers: docs/endpoint.md ("Load generation across processes").
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from infer_tune.endpoint import replay as rp
from infer_tune.endpoint import rxtime
from infer_tune.endpoint.client import (
    MAX_ERROR_BODY_BYTES,
    STREAM_BYTES_PER_TOKEN,
    SSEParser,
    StreamRecord,
    StreamTooLarge,
    _handle_event,
    check_length,
    clean,
    describe_connect_error,
    describe_not_stream,
    encode_body,
    not_event_stream,
)
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.errors import ConfigError
from infer_tune.errors import InferTuneError as EndpointError

if TYPE_CHECKING:
    from infer_tune.runners.trace import TraceRequest

STREAMS_PER_WORKER = 128  # concurrent streams one worker's loop is given by default
LAG_PERIOD_S = 0.005
LAG_P50_LIMIT_MS = 2.0  # a loop this late on a typical tick delays a typical timestamp as much
LAG_P99_LIMIT_MS = 20.0
CPU_SHARE_LIMIT = 0.90  # a worker this busy has no slack left for the next read
LATENESS_P50_LIMIT_MS = 2.0
START_MARGIN_NS = 200_000_000  # the shared start lies this far after the last worker reported ready


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_workers(concurrency: int, available: int | None = None) -> int:
    """One worker per STREAMS_PER_WORKER concurrent streams, at most one per core."""
    return max(1, min(available or cores(), math.ceil(concurrency / STREAMS_PER_WORKER)))


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def monitored(coro):
    """Run `coro` while sampling this loop's lag and this process's CPU; (its result, the readings)."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            before = loop.time()
            await asyncio.sleep(LAG_PERIOD_S)
            lags.append(max(0.0, (loop.time() - before - LAG_PERIOD_S) * 1e3))

    watcher = asyncio.ensure_future(watch())
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        result = await coro
    finally:
        stop.set()
        await watcher
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    return result, {"loop_lag_ms_p50": _quantile(lags, 0.5), "loop_lag_ms_p99": _quantile(lags, 0.99),
                    "loop_lag_ms_max": max(lags, default=None), "lag_samples": len(lags),
                    "cpu_share": cpu / wall if wall > 0 else None, "wall_s": wall}


def saturation(workers: list[dict], lateness_ms: Sequence[float] = ()) -> dict:
    """`client_saturated` and why, from the workers' readings (and the arrivals' timer lateness)."""
    reasons = []
    for i, w in enumerate(workers):
        who = f"worker {i}" if len(workers) > 1 else "the client loop"
        if (w.get("loop_lag_ms_p50") or 0) > LAG_P50_LIMIT_MS:
            reasons.append(f"{who}: event-loop lag p50 {w['loop_lag_ms_p50']:.1f} ms > {LAG_P50_LIMIT_MS:g} ms")
        elif (w.get("loop_lag_ms_p99") or 0) > LAG_P99_LIMIT_MS:
            reasons.append(f"{who}: event-loop lag p99 {w['loop_lag_ms_p99']:.1f} ms > {LAG_P99_LIMIT_MS:g} ms")
        if (w.get("cpu_share") or 0) > CPU_SHARE_LIMIT:
            reasons.append(f"{who}: CPU {100 * w['cpu_share']:.0f}% of a core > {100 * CPU_SHARE_LIMIT:.0f}%")
    late = _quantile(list(lateness_ms), 0.5)
    if late is not None and late > LATENESS_P50_LIMIT_MS:
        reasons.append(f"arrivals sent late: p50 {late:.1f} ms > {LATENESS_P50_LIMIT_MS:g} ms")
    return {"client_saturated": bool(reasons), "client_saturation_reason": "; ".join(reasons) or None}


async def open_connections(session, config: EndpointConfig, count: int) -> None:
    """Open `count` keep-alive connections before the start (GET /models on each), so the timed requests
    do not pay TCP setup: a served fleet's load generator runs on warm pools."""
    headers = config.headers()

    async def one() -> None:
        try:
            async with session.get(f"{config.url}/models", headers=headers) as response:
                await response.read()
        except Exception:  # noqa: BLE001  (a cold connection is only slower; the replay reports real failures)
            pass

    await asyncio.gather(*(one() for _ in range(count)))


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# ---- the workers' raw-socket sender (http only): pre-serialized requests, streaming HTTP/1.1 parsing ----

READ_BYTES = 1 << 18  # one recvmsg at most
MAX_HEAD_BYTES = 64 * 1024  # a response's status line and headers at most
MAX_CHUNK_LINE_BYTES = 1024  # a chunk-size line (with extensions) or trailer line at most
REDIRECTS = (301, 302, 303, 307, 308)


class _Malformed(Exception):
    """The response is not HTTP/1.1 as the raw sender reads it (status line, headers, chunk framing)."""


def request_bytes(config: EndpointConfig, body: bytes, headers: dict[str, str]) -> bytes:
    """One request, serialized once before the start: request line, Host, the config's headers, body."""
    parts = urlsplit(config.request_url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}", *(f"{k}: {v}" for k, v in headers.items()),
             f"Content-Length: {len(body)}", "Connection: keep-alive", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


class _Exchange:
    """One request on one connection: the response read as it streams in (head, then the body framed by
    chunked transfer encoding, Content-Length or the connection's end), its SSE events timed by `when`,
    the receive time of the read that brought them."""

    def __init__(self, k: int, max_tokens: int, api: str) -> None:
        self.k, self.max_tokens, self.api = k, max_tokens, api
        self.record = StreamRecord()
        self.parser = SSEParser()
        self.byte_cap = (1 << 20) + max_tokens * STREAM_BYTES_PER_TOKEN
        self.head = bytearray()
        self.status: int | None = None
        self.mode = ""  # "chunked", "length" or "close" once the head is read
        self.state = "size"  # chunked: "size", "data", "crlf", "trailer"
        self.remaining = 0
        self.line = bytearray()
        self.error_body = bytearray()
        self.not_stream: str | None = None  # a 200's Content-Type that is not text/event-stream
        self.received = 0
        self.keep_alive = True
        self.finished = False  # the record is final ([DONE], a failure, or the body ended)
        self.ended = False  # the response's framing ended: the connection may carry the next request
        self.extra = False  # bytes after the response's end (nothing was asked for them)
        self.when = 0
        self.last_ns = 0

    def feed(self, data: bytes, when: int) -> None:
        """Bytes of one read, received at `when`; raises _Malformed / StreamTooLarge (the caller fails the record)."""
        self.when = when
        if self.status is None:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                if len(self.head) > MAX_HEAD_BYTES:
                    raise _Malformed(f"the response head is over {MAX_HEAD_BYTES} bytes")
                return
            if end > MAX_HEAD_BYTES:
                raise _Malformed(f"the response head is over {MAX_HEAD_BYTES} bytes")
            rest = bytes(self.head[end + 4:])
            self._head(bytes(self.head[:end]))
            if self.status is None:  # an interim 1xx answer: the real head follows
                self.head = bytearray()
                if rest:
                    self.feed(rest, when)
                return
            data = rest
            if self.finished or not data:
                if self.mode == "length" and self.remaining == 0:
                    self._end()
                return
        self._body(data)

    def _head(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise _Malformed(f"not an HTTP/1.x status line: {clean(lines[0], 80)!r}")
        status = int(code)
        if 100 <= status < 200:
            return
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise _Malformed(f"not a header line: {clean(line, 80)!r}")
            headers[name.strip().lower()] = value.strip()
        self.status = self.record.status = status
        if status == 200:
            self.not_stream = not_event_stream(headers.get("content-type"))
        connection = headers.get("connection", "").lower()
        self.keep_alive = "close" not in connection and (version == "HTTP/1.1" or "keep-alive" in connection)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.mode = "chunked"
        elif "content-length" in headers:
            value = headers["content-length"]
            if not value.isdigit():
                raise _Malformed(f"Content-Length is {clean(value, 40)!r}")
            self.mode, self.remaining = "length", int(value)
        else:
            self.mode, self.keep_alive = "close", False
        if status in REDIRECTS:
            target = clean(headers.get("location") or "(no Location header)", 200)
            self._fail("redirect", f"HTTP {status} redirect to {target}; redirects are not followed (give that "
                                   "URL as the endpoint if you trust it)")

    def _body(self, data: bytes) -> None:
        if self.mode == "length":
            take = min(self.remaining, len(data))
            self._payload(data[:take])
            self.remaining -= take
            self.extra = take < len(data)
            if self.remaining == 0:
                self._end()
            return
        if self.mode == "close":
            self._payload(data)
            return
        i, n = 0, len(data)
        while i < n and not self.ended:
            if self.state == "data":
                take = min(self.remaining, n - i)
                self._payload(data[i:i + take])
                i += take
                self.remaining -= take
                if self.remaining == 0:
                    self.state = "crlf"
                continue
            j = data.find(b"\n", i)
            piece = data[i:] if j < 0 else data[i:j]
            if len(self.line) + len(piece) > MAX_CHUNK_LINE_BYTES:
                raise _Malformed(f"a chunk-size line is over {MAX_CHUNK_LINE_BYTES} bytes")
            self.line += piece
            if j < 0:
                return
            i = j + 1
            line = bytes(self.line).rstrip(b"\r")
            self.line.clear()
            if self.state == "size":
                size = line.split(b";", 1)[0].strip()
                if not size or any(c not in b"0123456789abcdefABCDEF" for c in size):
                    raise _Malformed(f"not a chunk size: {clean(line.decode('latin-1'), 40)!r}")
                self.remaining = int(size, 16)
                self.state = "data" if self.remaining else "trailer"
            elif self.state == "crlf":
                if line:
                    raise _Malformed("a chunk is longer than its size")
                self.state = "size"
            elif not line:  # the blank line after the last chunk (and any trailers)
                self._end()
        self.extra = i < n

    def _payload(self, data: bytes) -> None:
        if self.finished or not data:
            return
        if self.status != 200 or self.not_stream:
            self.error_body += data[:MAX_ERROR_BODY_BYTES - len(self.error_body)]
            if len(self.error_body) >= MAX_ERROR_BODY_BYTES:
                self._http_error()
            return
        self.received += len(data)
        if self.received > self.byte_cap:
            self._fail("oversized", f"the stream passed {self.byte_cap} bytes for max_tokens {self.max_tokens}")
            return
        for payload in self.parser.feed(data):
            if _handle_event(self.record, payload, self.when, self.api):
                self._final()
                return
            if check_length(self.record, self.max_tokens):
                self.finished = True
                return

    def _final(self) -> None:
        check_length(self.record, self.max_tokens, final=True)
        self.finished = True

    def _http_error(self) -> None:
        if self.status == 200 and self.not_stream:
            self._fail("not_event_stream", describe_not_stream(self.not_stream, bytes(self.error_body)))
            return
        detail = clean(bytes(self.error_body).decode("utf-8", errors="replace").strip(), 300)
        self._fail("http", f"HTTP {self.status}: {detail or 'no body'}")

    def _fail(self, kind: str, message: str) -> None:
        if not self.finished:
            self.record.fail(kind, message)
            self.finished = True

    def _end(self) -> None:
        """The response's framing ended (or the connection did, for a body read to the close)."""
        self.ended = True
        if self.finished:
            return
        if self.status != 200 or self.not_stream:
            self._http_error()
            return
        for payload in self.parser.close():
            if _handle_event(self.record, payload, self.when, self.api):
                break
        self._final()

    def eof(self) -> None:
        """The server closed the connection."""
        if self.status is not None and self.mode == "close":
            self._end()
        elif not self.finished:
            what = "before answering" if self.status is None else "mid-response"
            self._fail("disconnected", f"the server closed the stream {what}")


class _Wire:
    """One keep-alive connection of the raw sender: a non-blocking socket read with `recvmsg` (kernel
    receive timestamps, infer_tune.endpoint.rxtime) and written with `send`."""

    def __init__(self, sender: _RawSender, sock: socket.socket) -> None:
        self.sender, self.sock, self.fd = sender, sock, sock.fileno()
        self.exchange: _Exchange | None = None  # the request whose response is being read
        self.pending = bytearray()
        self.closed = False
        sender.wires.add(self)
        sender.loop.add_reader(self.fd, self.readable)

    def send(self, exchange: _Exchange, data: bytes) -> None:
        self.exchange = exchange
        exchange.record.start_ns = exchange.last_ns = time.perf_counter_ns()
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            exchange._fail("disconnected", f"the connection failed on send: {clean(exc)}")
            self.sender.finish(self)
            return
        if sent < len(data):
            self.pending += data[sent:]
            self.sender.loop.add_writer(self.fd, self.writable)

    def writable(self) -> None:
        done = rxtime.drain(self.sock, self.pending)
        if done is None:
            self.readable_eof()
        elif done:
            self.sender.loop.remove_writer(self.fd)

    def readable(self) -> None:
        try:
            data, received_ns, read_ns = rxtime.read(self.sock, READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, received_ns, read_ns = b"", None, time.perf_counter_ns()
        exchange = self.exchange
        if exchange is None or exchange.ended:  # nothing asked for: an idle connection closed, or stray bytes
            self.sender.drop(self)
            return
        if not data:
            self.readable_eof()
            return
        if received_ns is not None:
            self.sender.kernel_reads += 1
        else:
            self.sender.plain_reads += 1
        exchange.last_ns = read_ns
        was_finished, broken = exchange.finished, False
        # nothing of a response arrives before its request went out: a receive time converted between the
        # clocks a little early (rxtime.realtime_offset_ns) is held at the send
        when = max(received_ns if received_ns is not None else read_ns, exchange.record.start_ns)
        try:
            exchange.feed(data, when)
        except StreamTooLarge as exc:
            exchange._fail("oversized", str(exc))
            broken = True
        except _Malformed as exc:
            exchange._fail("http", f"malformed HTTP response: {exc}")
            broken = True
        if broken or (exchange.finished and not was_finished) or exchange.ended:
            self.sender.finish(self, force_close=broken)

    def readable_eof(self) -> None:
        exchange = self.exchange
        if exchange is not None:
            exchange.eof()
            self.sender.finish(self, force_close=True)
        else:
            self.sender.drop(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sender.wires.discard(self)
            self.sender.loop.remove_reader(self.fd)
            self.sender.loop.remove_writer(self.fd)
            self.sock.close()


class _RawSender:
    """One worker's requests on raw keep-alive connections (at most `limit` open): arrivals from one timer
    over the sorted schedule, a request sent at once on an idle connection (or a new one while under the
    limit, else queued), responses read by `_Wire` / `_Exchange`, one sweep for both timeouts."""

    def __init__(self, config: EndpointConfig, requests: list[bytes], limits: list[int], limit: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.config, self.requests, self.limits, self.limit = config, requests, limits, max(1, limit)
        parts = urlsplit(config.url)
        self.address = (parts.hostname, parts.port or 80)
        self.idle: list[_Wire] = []
        self.wires: set[_Wire] = set()  # every open connection
        self.open = 0  # connections open or being opened
        self.queue: deque[int] = deque()
        self.records: list[StreamRecord | None] = [None] * len(requests)
        self.left = len(requests)
        self.done = self.loop.create_future()
        self.kernel_reads = self.plain_reads = 0
        self.sweeper: asyncio.TimerHandle | None = None

    async def connect(self) -> _Wire:
        infos = await self.loop.getaddrinfo(*self.address, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.timeout(self.config.connect_timeout_s):
                await self.loop.sock_connect(sock, address)
            rxtime.enable(sock)
        except BaseException:
            sock.close()
            raise
        return _Wire(self, sock)

    async def warm(self, count: int) -> None:
        """Open up to `count` connections before the start (a warm pool); one that fails is only missing."""
        async def one() -> None:
            try:
                self.idle.append(await self.connect())
                self.open += 1
            except (OSError, TimeoutError):
                pass

        await asyncio.gather(*(one() for _ in range(min(count, self.limit))))

    def arrive(self, k: int) -> None:
        if self.idle:
            self._send(self.idle.pop(), k)
        elif self.open < self.limit:
            self.open += 1
            self.loop.create_task(self._connect_and_send(k))
        else:
            self.queue.append(k)

    async def _connect_and_send(self, k: int) -> None:
        try:
            wire = await self.connect()
        except (OSError, TimeoutError) as exc:
            self.open -= 1
            record = StreamRecord(start_ns=time.perf_counter_ns())
            if isinstance(exc, TimeoutError):
                record.fail("connect", f"cannot connect to {self.config.host_port} within "
                                       f"{self.config.connect_timeout_s:g} s (connect_timeout_s)")
            else:
                record.fail("connect", clean(describe_connect_error(exc, self.config), 300))
            self._record(k, record)
            if self.queue and self.open < self.limit:
                self.arrive(self.queue.popleft())
            return
        self._send(wire, k)

    def _send(self, wire: _Wire, k: int) -> None:
        wire.send(_Exchange(k, self.limits[k], self.config.api), self.requests[k])

    def _record(self, k: int, record: StreamRecord) -> None:
        self.records[k] = record
        self.left -= 1
        if self.left == 0 and not self.done.done():
            self.done.set_result(None)

    def finish(self, wire: _Wire, force_close: bool = False) -> None:
        """The wire's request has its final record: keep the connection for the next request when its
        response ended cleanly, else close it (a fresh one is opened when needed)."""
        exchange = wire.exchange
        if exchange is None:
            return
        if exchange.finished and self.records[exchange.k] is None:
            self._record(exchange.k, exchange.record)
        if not force_close and not (exchange.ended and exchange.finished) and exchange.record.ok:
            return  # [DONE] came before the end of the body: the rest (the last chunk) is read first
        reusable = not force_close and exchange.keep_alive and exchange.record.ok and not exchange.extra
        wire.exchange = None
        if reusable:
            if self.queue:
                self._send(wire, self.queue.popleft())
            else:
                self.idle.append(wire)
            return
        self.drop(wire)

    def drop(self, wire: _Wire) -> None:
        if wire.closed:
            return
        wire.close()
        if wire in self.idle:
            self.idle.remove(wire)
        self.open -= 1
        if self.queue and self.open < self.limit:
            self.arrive(self.queue.popleft())

    def sweep(self) -> None:
        """Fail requests whose server stayed silent for idle_timeout_s, or that ran past timeout_s."""
        now = time.perf_counter_ns()
        idle_ns, total_ns = int(self.config.idle_timeout_s * 1e9), int(self.config.timeout_s * 1e9)
        for wire in list(self.wires):
            exchange = wire.exchange
            if wire.closed or exchange is None:
                continue
            if now - exchange.last_ns > idle_ns:
                exchange._fail("idle_timeout", f"the server sent nothing for {self.config.idle_timeout_s:g} s "
                                               "(idle_timeout_s)")
            elif now - exchange.record.start_ns > total_ns:
                exchange._fail("timeout", f"no complete answer within {self.config.timeout_s:g} s (timeout_s)")
            else:
                continue
            self.finish(wire, force_close=True)


SPIN_NS = 1_100_000  # the loop's timers wake up to 1 ms late (epoll's resolution): the last stretch is spun


def _spin_until(deadline_ns: int) -> None:
    while time.perf_counter_ns() < deadline_ns:
        pass


async def open_raw(config: EndpointConfig, trace: Sequence[TraceRequest], prompts: Sequence[str],
                   max_new_tokens: int, *, concurrency: int | None = None, warm: int | None = None) -> _RawSender:
    """The raw sender for `trace`, its requests serialized and `warm` keep-alive connections opened
    (default: as many as may be open, `concurrency`, at most one per request)."""
    headers = config.headers()
    unknown = sorted({r.prompt_index for r in trace if not 0 <= r.prompt_index < len(prompts)})
    if unknown:
        raise ConfigError(f"trace refers to prompt_index {unknown[:5]} but there are {len(prompts)} prompts")
    limits = [r.max_new_tokens or max_new_tokens for r in trace]
    requests = [request_bytes(config, encode_body(config, prompts[r.prompt_index], n), headers)
                for r, n in zip(trace, limits)]
    sender = _RawSender(config, requests, limits, concurrency or config.concurrency)
    await sender.warm(min(sender.limit, len(trace)) if warm is None else warm)
    return sender


async def raw_replay(sender: _RawSender, trace: Sequence[TraceRequest], *, closed_loop: bool = False,
                     origin_ns: int | None = None, stats: dict | None = None
                     ) -> tuple[rp.ReplayResult, list[tuple[StreamRecord, int | None, int]]]:
    """`replay.send_all` on the raw sender's connections (http only): the same records, timed at the wire.
    Each request is sent at its arrival (one timer over the sorted arrivals, set SPIN_NS early and the rest
    spun; `origin_ns`, the start on `perf_counter_ns`, is waited for the same way), its `start_ns` stamped
    right before the `send`; every read is
    timed by the kernel's receive timestamp where the platform gives one, else by the read's return.
    `stats` (when given) gets how many reads were timed either way. The connections are closed after."""
    loop = sender.loop
    result = rp.ReplayResult()
    try:
        if origin_ns is not None:
            await asyncio.sleep(max(0, origin_ns - time.perf_counter_ns() - SPIN_NS) / 1e9)
            _spin_until(origin_ns)
        result.origin_ns = origin_ns if origin_ns is not None else time.perf_counter_ns()
        origin_loop = loop.time() - (time.perf_counter_ns() - result.origin_ns) / 1e9
        order = sorted(range(len(trace)), key=lambda k: (0.0 if closed_loop else trace[k].arrival_s, k))
        arrival_ns = [result.origin_ns + int(r.arrival_s * 1e9) for r in trace]
        position = 0

        def due() -> None:
            nonlocal position
            while position < len(order):
                k = order[position]
                if not closed_loop and arrival_ns[k] > time.perf_counter_ns():
                    if arrival_ns[k] - time.perf_counter_ns() > SPIN_NS:
                        loop.call_at(origin_loop + trace[k].arrival_s - SPIN_NS / 1e9, due)
                        return
                    _spin_until(arrival_ns[k])
                if not closed_loop:
                    result.lateness_ms.append(max(0, time.perf_counter_ns() - arrival_ns[k]) / 1e6)
                position += 1
                sender.arrive(k)

        period = min(0.05, sender.config.idle_timeout_s / 10, sender.config.timeout_s / 10)

        def sweep() -> None:
            sender.sweep()
            sender.sweeper = loop.call_later(period, sweep)

        if trace:
            due()
            sender.sweeper = loop.call_later(period, sweep)
            await sender.done
        result.end_ns = time.perf_counter_ns()
    finally:
        if sender.sweeper is not None:
            sender.sweeper.cancel()
        for wire in list(sender.wires):
            wire.close()
    records = [(record, None if closed_loop else record.start_ns, record.start_ns if closed_loop else arrival_ns[k])
               for k, record in enumerate(sender.records)]
    if stats is not None:
        stats.update(reads_kernel_timed=sender.kernel_reads, reads_read_timed=sender.plain_reads)
    return result, records


async def raw_send_all(config: EndpointConfig, trace: Sequence[TraceRequest], prompts: Sequence[str],
                       max_new_tokens: int, *, closed_loop: bool = False, concurrency: int | None = None,
                       stats: dict | None = None) -> tuple[rp.ReplayResult, list[tuple[StreamRecord, int | None, int]]]:
    """`open_raw` then `raw_replay`, starting now."""
    sender = await open_raw(config, trace, prompts, max_new_tokens, concurrency=concurrency)
    return await raw_replay(sender, trace, closed_loop=closed_loop, stats=stats)


def _worker_main(conn, config: EndpointConfig, trace: list[TraceRequest], prompts: list[str], max_new_tokens: int,
                 closed_loop: bool, concurrency: int) -> None:
    """One worker process: open a pool, say ready, wait for the shared start, replay its share, send it back.
    http: the raw-socket sender (`raw_send_all`); https: aiohttp (`replay.send_all`), noted in the reading."""
    raw = urlsplit(config.url).scheme == "http"
    sender = {"sender": "raw" if raw else "aiohttp",
              "sender_note": None if raw else "https: the raw-socket sender speaks http only; aiohttp sent these"}

    async def started() -> int:  # ready once the pool is open; the shared start comes back
        conn.send(("ready", os.getpid()))
        return await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    async def run():
        if raw:
            stats: dict = {}
            pool = await open_raw(config, trace, prompts, max_new_tokens, concurrency=concurrency)
            origin_ns = await started()
            out = await monitored(raw_replay(pool, trace, closed_loop=closed_loop, origin_ns=origin_ns, stats=stats))
            sender.update(stats)
            return out
        async with rp.client_session(config) as session:
            await open_connections(session, config, min(concurrency, len(trace)))
            origin_ns = await started()
            return await monitored(rp.send_all(session, config, trace, prompts, max_new_tokens,
                                               closed_loop=closed_loop, origin_ns=origin_ns, concurrency=concurrency))

    try:
        (result, records), reading = asyncio.run(run())
        conn.send(("done", result.origin_ns, result.end_ns, result.lateness_ms, records, {**reading, **sender}))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which raises it)
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def replay_workers(config: EndpointConfig, trace: Sequence[TraceRequest], prompts: Sequence[str], max_new_tokens: int,
                   *, workers: int, closed_loop: bool = False, tokenizer=None, iteration: int = 0,
                   passes: int = 1, timeout_s: float | None = None) -> tuple[rp.ReplayResult, dict]:
    """Replay `trace` over `workers` processes (`passes` times back to back in one launch: closed-loop
    passes, numbered from `iteration`); (the merged result, the client's readings)."""
    import multiprocessing as mp

    single = list(trace)
    trace = single * max(1, passes)
    workers = max(1, min(workers, len(trace) or 1))
    ctx = mp.get_context("spawn")
    parts = [list(range(w, len(trace), workers)) for w in range(workers)]
    shares = _shares(max(config.concurrency, workers), workers)
    pipes, procs = [], []
    for w in range(workers):
        parent, child = ctx.Pipe()
        sub = [trace[k] for k in parts[w]]
        proc = ctx.Process(target=_worker_main, args=(child, config, sub, list(prompts), max_new_tokens, closed_loop,
                                                      shares[w]), daemon=True, name=f"infer-tune-loadgen-{w}")
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    limit = timeout_s or (config.timeout_s * max(1, passes) + max((r.arrival_s for r in trace), default=0.0) + 60)
    try:
        for pipe in pipes:
            _expect(pipe, "ready", 60)
        origin_ns = time.perf_counter_ns() + START_MARGIN_NS
        for pipe in pipes:
            pipe.send(origin_ns)
        answers = [_expect(pipe, "done", limit) for pipe in pipes]
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    result = rp.ReplayResult(origin_ns=origin_ns, end_ns=max(a[2] for a in answers))
    records: list = [None] * len(trace)
    readings = []
    for w, answer in enumerate(answers):
        _, _, _, lateness, part_records, reading = answer
        result.lateness_ms += lateness
        for k, record in zip(parts[w], part_records):
            records[k] = record
        readings.append(dict(reading, requests=len(parts[w]), concurrency=shares[w]))
    n = len(single)
    for p in range(max(1, passes)):
        rp.collect(result, single, records[p * n:(p + 1) * n], prompts, tokenizer, iteration + p)
    return result, {"workers": workers, "worker_readings": readings}


def _expect(pipe, kind: str, timeout: float):
    try:
        if not pipe.poll(timeout):
            raise EndpointError(f"a load-generator worker did not answer within {timeout:.0f} s")
        message = pipe.recv()
    except (EOFError, OSError):
        raise EndpointError("a load-generator worker exited before answering") from None
    if message[0] == "error":
        raise EndpointError(f"a load-generator worker failed: {message[1]}")
    if message[0] != kind:
        raise EndpointError(f"a load-generator worker sent {message[0]!r}, expected {kind!r}")
    return message
