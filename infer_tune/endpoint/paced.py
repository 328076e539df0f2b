"""A loopback OpenAI-compatible server of known timing: the truth a load generator is judged against.

Every streaming completion request gets its first token `first_s` after the request arrived at the
server's socket, then one token every `interval_s` after that (a schedule, not a delay after each
send), `tokens` in all (or `max_tokens` when smaller). Arrival is the kernel's receive timestamp of
the read that completed the request (`SO_TIMESTAMPNS`, infer_tune.endpoint.rxtime), so the pace holds
while the server's one loop is still reading a burst of requests: a request read late is not served
late. Where the platform gives no timestamp, the read time stands in and the record says so
(`arrival_from`: "kernel" or "read"). The server records its own achieved times, `arrival_ns`,
`read_ns` and the `perf_counter_ns` of every token it actually wrote (late when its loop was behind:
the truth is what it did, not what it meant to do), with the request's prompt, so a client can pair
its requests with the server's. Raw non-blocking sockets on one event loop (`add_reader`, `recvmsg`)
and one timer for all streams (a heap of due tokens), so a single process serves 1,024 concurrent
streams; the event bytes of a request are built once. `perf_counter_ns` is CLOCK_MONOTONIC on Linux:
one clock for every process of the machine. docs/endpoint.md ("Load generation across processes").

    python -m infer_tune.endpoint.paced --port 0 --first-ms 120 --interval-ms 15 --tokens 16
    # prints `READY <port>`; GET /truth answers the recorded times as JSON (docs/endpoint.md)
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import socket
import time
from dataclasses import dataclass

from infer_tune.endpoint import rxtime
from infer_tune.endpoint.loopback import BackgroundServer

FINAL = b'data: {"id":"p","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'


@dataclass
class Pace:
    """The server's timing: first token `first_s` after the request arrived, then one per `interval_s`."""

    first_s: float = 0.120
    interval_s: float = 0.015
    tokens: int = 16
    model: str = "paced"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _json(status: str, obj) -> bytes:
    body = json.dumps(obj).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Server: infer-tune-paced\r\n\r\n").encode() + body


class _Stream:
    __slots__ = ("transport", "left", "event", "tail", "sends", "arrival_ns", "read_ns", "arrival_from", "prompt")

    def __init__(self, transport, count: int, event: bytes, tail: bytes, arrival_ns: int, read_ns: int,
                 arrival_from: str, prompt: str = "") -> None:
        self.transport, self.left, self.event, self.tail = transport, count, event, tail
        self.sends: list[int] = []
        self.arrival_ns, self.read_ns, self.arrival_from = arrival_ns, read_ns, arrival_from
        self.prompt = prompt


class PacedState:
    """The streams due next (one timer for all of them) and the recorded truth."""

    def __init__(self, pace: Pace) -> None:
        self.pace = pace
        self.heap: list[tuple[int, int, _Stream]] = []
        self.seq = itertools.count()
        self.timer: asyncio.TimerHandle | None = None
        self.timer_ns = 0
        self.truth: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.connections: set = set()

    def add(self, stream: _Stream, due_ns: int) -> None:
        heapq.heappush(self.heap, (due_ns, next(self.seq), stream))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self._arm()

    def _arm(self) -> None:
        if not self.heap:
            return
        due = self.heap[0][0]
        if self.timer is not None and self.timer_ns <= due:
            return
        if self.timer is not None:
            self.timer.cancel()
        loop = asyncio.get_running_loop()
        self.timer_ns = due
        self.timer = loop.call_at(loop.time() + max(0, due - time.perf_counter_ns()) / 1e9, self._tick)

    def _tick(self) -> None:
        self.timer = None
        interval = int(self.pace.interval_s * 1e9)
        now = time.perf_counter_ns()
        while self.heap and self.heap[0][0] <= now:
            due, _, s = heapq.heappop(self.heap)
            if s.transport.is_closing():
                self._finish(s)
                continue
            # the time the write starts: on loopback the peer's kernel stamps the bytes inside this call, so a time
            # read after it (late by a preemption under load) could follow the client's own receive stamp
            s.sends.append(time.perf_counter_ns())
            s.transport.write(s.event)
            s.left -= 1
            if s.left > 0:
                heapq.heappush(self.heap, (due + interval, next(self.seq), s))
            else:  # recorded before the tail goes out: a client that has read [DONE] finds its request in the truth
                self._finish(s)
                s.transport.write(s.tail)
            now = time.perf_counter_ns()
        self._arm()

    def _finish(self, s: _Stream) -> None:
        self.in_flight -= 1
        self.truth.append({"arrival_ns": s.arrival_ns, "read_ns": s.read_ns, "arrival_from": s.arrival_from,
                           "send_ns": s.sends, "prompt": s.prompt})


MAX_REQUEST_BYTES = 1 << 20  # a request's head and body at most (the fixture's own bound)


class _Connection:
    """One accepted connection on a raw non-blocking socket: reads with `recvmsg` (the kernel's receive
    timestamp), writes with `send` (what the socket does not take is kept and sent when it is writable)."""

    def __init__(self, state: PacedState, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.state, self.sock, self.loop = state, sock, loop
        self.fd = sock.fileno()
        self.buffer = b""
        self.pending = bytearray()
        self.closed = False
        self.transport = self  # the streams write through `transport.write` / `transport.is_closing`
        state.connections.add(self)
        loop.add_reader(self.fd, self.readable)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.state.connections.discard(self)
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        self.sock.close()

    def write(self, data: bytes) -> None:
        if self.closed:
            return
        if self.pending:
            self.pending += data
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.close()
            return
        if sent < len(data):
            self.pending += data[sent:]
            self.loop.add_writer(self.fd, self.writable)

    def writable(self) -> None:
        done = rxtime.drain(self.sock, self.pending)
        if done is None:
            self.close()
        elif done:
            self.loop.remove_writer(self.fd)

    def readable(self) -> None:
        try:
            data, received_ns, read_ns = rxtime.read(self.sock, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        if not data:
            self.close()
            return
        arrival_ns, arrival_from = (received_ns, "kernel") if received_ns is not None else (read_ns, "read")
        self.buffer += data
        while not self.closed:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                break
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip()) if value.strip().isdigit() else -1
            if length < 0 or length > MAX_REQUEST_BYTES or len(head[0].split(" ")) != 3:
                self.write(_json("400 Bad Request", {"error": "bad request"}))
                self.close()
                return
            if len(self.buffer) < end + 4 + length:
                break
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            method, path, _ = head[0].split(" ", 2)
            self.handle(method, path, body, arrival_ns, read_ns, arrival_from)
        if len(self.buffer) > MAX_REQUEST_BYTES:
            self.close()

    def handle(self, method: str, path: str, body: bytes, arrival_ns: int, read_ns: int, arrival_from: str) -> None:
        state, pace = self.state, self.state.pace
        if method == "GET" and path.endswith("/models"):
            self.transport.write(_json("200 OK", {"object": "list", "data": [{"id": pace.model, "object": "model"}]}))
            return
        if method == "GET" and path.endswith("/truth"):
            self.transport.write(_json("200 OK", {"pace": pace.__dict__, "requests": state.truth,
                                                   "max_in_flight": state.max_in_flight}))
            state.truth, state.max_in_flight = [], state.in_flight  # each read starts a new record
            return
        if method != "POST" or not path.endswith("completions"):
            self.transport.write(_json("404 Not Found", {"error": "not found"}))
            return
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            self.transport.write(_json("400 Bad Request", {"error": "the body is not a JSON object"}))
            return
        if request.get("model") != pace.model:
            self.transport.write(_json("404 Not Found", {"error": {"message": f"no model {request.get('model')!r}"}}))
            return
        count = max(1, min(pace.tokens, int(request.get("max_tokens") or pace.tokens)))
        chat = "messages" in request
        choice = {"index": 0, "delta": {"content": "tok "}} if chat else {"index": 0, "text": "tok "}
        event = _chunk(b"data: " + json.dumps({"id": "p", "choices": [choice]}, separators=(",", ":")).encode()
                       + b"\n\n")
        tail = FINAL
        if (request.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "p", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": count,
                                                         "total_tokens": count + 1}}
            tail += b"data: " + json.dumps(usage).encode() + b"\n\n"
        tail = _chunk(tail + b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                             b"Server: infer-tune-paced\r\n\r\n")
        prompt = request["messages"][-1].get("content", "") if chat else str(request.get("prompt", ""))
        state.add(_Stream(self.transport, count, event, tail, arrival_ns, read_ns, arrival_from, prompt[:200]),
                  arrival_ns + int(pace.first_s * 1e9))


async def serve(pace: Pace, host: str = "127.0.0.1", port: int = 0, ready=None, stop: asyncio.Event | None = None):
    """Serve until `stop` is set (forever when None); `ready(port, state)` once listening."""
    state = PacedState(pace)
    loop = asyncio.get_running_loop()
    listener = socket.create_server((host, port), backlog=4096)
    listener.setblocking(False)
    rxtime.enable(listener)  # accepted sockets inherit it: a request is stamped even before accept returns

    def accept() -> None:
        for _ in range(256):
            try:
                sock, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rxtime.enable(sock)
            _Connection(state, sock, loop)

    loop.add_reader(listener.fileno(), accept)
    if ready is not None:
        ready(listener.getsockname()[1], state)
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        loop.remove_reader(listener.fileno())
        listener.close()
        for connection in list(state.connections):
            connection.close()
        if state.timer is not None:
            state.timer.cancel()


class PacedServer(BackgroundServer):
    """The paced server on a background thread (tests): `with PacedServer(Pace()) as s: s.url, s.truth`."""

    name = "paced server"

    def __init__(self, pace: Pace | None = None) -> None:
        super().__init__()
        self.pace = pace or Pace()
        self.state: PacedState | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def truth(self) -> list[dict]:
        return list(self.state.truth) if self.state else []

    async def _serve(self, stop: asyncio.Event, ready) -> None:
        def listening(port, state) -> None:
            self.port, self.state = port, state
            ready()

        await serve(self.pace, ready=listening, stop=stop)


def truth_summary(truth: list[dict]) -> dict:
    """The server's achieved TTFT (request arrived at its socket -> first token written) and TPOT per
    request, medians in ms; `from_kernel`: how many arrivals are kernel receive timestamps (the rest: read
    times)."""
    import statistics

    ttft = [(r["send_ns"][0] - r.get("arrival_ns", r["read_ns"])) / 1e6 for r in truth if r["send_ns"]]
    tpot = [(r["send_ns"][-1] - r["send_ns"][0]) / 1e6 / (len(r["send_ns"]) - 1) for r in truth if len(r["send_ns"]) > 1]
    return {"requests": len(truth), "ttft_ms_p50": statistics.median(ttft) if ttft else None,
            "tpot_ms_p50": statistics.median(tpot) if tpot else None,
            "from_kernel": sum(1 for r in truth if r.get("arrival_from") == "kernel")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--first-ms", type=float, default=120.0)
    parser.add_argument("--interval-ms", type=float, default=15.0)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args(argv)
    pace = Pace(first_s=args.first_ms / 1e3, interval_s=args.interval_ms / 1e3, tokens=args.tokens)
    try:
        asyncio.run(serve(pace, args.host, args.port, ready=lambda port, _s: print(f"READY {port}", flush=True)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
