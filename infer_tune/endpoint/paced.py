"""A loopback OpenAI-compatible server of known timing: the truth a load generator is judged against.

Every streaming completion request gets its first token `first_s` after the request was read, then one
token every `interval_s`, `tokens` in all (or `max_tokens` when smaller). The server records its own
achieved times, `read_ns` and the `perf_counter_ns` of every token it wrote (with the request's prompt,
so a client can pair its requests with the server's), so a client's TTFT and
TPOT can be compared with what the server actually did (not with what it meant to do). One
`asyncio.Protocol` per connection and one timer for all streams (a heap of due tokens), so a single
process serves 1,024 concurrent streams; the event bytes of a request are built once.
`perf_counter_ns` is CLOCK_MONOTONIC on Linux: one clock for every process of the machine.

    python -m infer_tune.endpoint.paced --port 0 --first-ms 120 --interval-ms 15 --tokens 16
    # prints `READY <port>`; GET /truth answers the recorded times as JSON (docs/endpoint.md)
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import time
from dataclasses import dataclass

from infer_tune.endpoint.loopback import BackgroundServer

FINAL = b'data: {"id":"p","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'


@dataclass
class Pace:
    """The server's timing: first token `first_s` after the request is read, then one per `interval_s`."""

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
    __slots__ = ("transport", "left", "event", "tail", "sends", "read_ns", "prompt")

    def __init__(self, transport, count: int, event: bytes, tail: bytes, read_ns: int, prompt: str = "") -> None:
        self.transport, self.left, self.event, self.tail = transport, count, event, tail
        self.sends: list[int] = []
        self.read_ns = read_ns
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
            s.transport.write(s.event)
            s.sends.append(time.perf_counter_ns())
            s.left -= 1
            if s.left > 0:
                heapq.heappush(self.heap, (due + interval, next(self.seq), s))
            else:
                s.transport.write(s.tail)
                self._finish(s)
            now = time.perf_counter_ns()
        self._arm()

    def _finish(self, s: _Stream) -> None:
        self.in_flight -= 1
        self.truth.append({"read_ns": s.read_ns, "send_ns": s.sends, "prompt": s.prompt})


class _Protocol(asyncio.Protocol):
    def __init__(self, state: PacedState) -> None:
        self.state = state
        self.buffer = b""
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            method, path, _ = head[0].split(" ", 2)
            self.handle(method, path, body, time.perf_counter_ns())

    def handle(self, method: str, path: str, body: bytes, read_ns: int) -> None:
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
        request = json.loads(body)
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
        state.add(_Stream(self.transport, count, event, tail, read_ns, prompt[:200]), read_ns + int(pace.first_s * 1e9))


async def serve(pace: Pace, host: str = "127.0.0.1", port: int = 0, ready=None, stop: asyncio.Event | None = None):
    """Serve until `stop` is set (forever when None); `ready(port, state)` once listening."""
    state = PacedState(pace)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Protocol(state), host, port, backlog=4096)
    if ready is not None:
        ready(server.sockets[0].getsockname()[1], state)
    async with server:
        if stop is None:
            await server.serve_forever()
        else:
            await stop.wait()


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
    """The server's achieved TTFT (request read -> first token written) and TPOT per request, medians in ms."""
    import statistics

    ttft = [(r["send_ns"][0] - r["read_ns"]) / 1e6 for r in truth if r["send_ns"]]
    tpot = [(r["send_ns"][-1] - r["send_ns"][0]) / 1e6 / (len(r["send_ns"]) - 1) for r in truth if len(r["send_ns"]) > 1]
    return {"requests": len(truth), "ttft_ms_p50": statistics.median(ttft) if ttft else None,
            "tpot_ms_p50": statistics.median(tpot) if tpot else None}


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
