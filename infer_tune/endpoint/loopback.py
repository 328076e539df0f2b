"""A loopback OpenAI-compatible server that answers at once: the yardstick of the client's own overhead.

It streams `chunks` content events per request (words of the prompt, so outputs depend on the
input) over HTTP/1.1 chunked transfer with keep-alive, built on bare asyncio streams so the server
side adds as little as possible. `python -m infer_tune.endpoint.loopback --port 0` runs it in its own
process (bench/endpoint_overhead.py); `LoopbackServer` runs it on a thread (tests). Faults can be
injected on a fixed schedule (every k-th completion request), so tests of failure handling are
deterministic: HTTP 500 (every k-th, or every one from the n-th on), a malformed event, a stall
(client timeouts), an unknown model (HTTP 404), fields it refuses (HTTP 422).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import threading
from dataclasses import dataclass


@dataclass
class Behaviour:
    """What the loopback server does. `gap_s` paces events (a stand-in decode time; 0 answers at once)."""

    model: str = "loopback"
    chunks: int = 8
    tokens_per_chunk: int = 1
    fail_every: int = 0
    fail_from: int = 0
    malformed_every: int = 0
    stall_s: float = 0.0
    gap_s: float = 0.0
    usage: bool = True
    reject_fields: tuple[str, ...] = ()
    garble: bool = False


def _http(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"Server: infer-tune-loopback\r\n\r\n").encode() + body


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _event(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


class _Handler:
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.completions = 0  # completion requests seen (the fault schedule counts these)
        self.requests: list[dict] = []  # bodies received, for tests
        self.headers: list[dict[str, str]] = []  # their headers
        self.in_flight = 0
        self.max_in_flight = 0  # most completion requests served at once

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                await self.respond(method, path, body, writer, headers)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def respond(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter,
                      headers: dict[str, str]) -> None:
        b = self.behaviour
        if method == "GET" and path.endswith("/models"):
            writer.write(_http("200 OK", json.dumps(
                {"object": "list", "data": [{"id": b.model, "object": "model", "owned_by": "loopback"}]}).encode()))
            return
        if method == "GET" and path in ("/health", "/version"):
            writer.write(_http("200 OK", json.dumps({"version": "loopback"}).encode()))
            return
        if method != "POST" or not path.endswith("completions"):
            writer.write(_http("404 Not Found", b'{"error": "not found"}'))
            return
        request = json.loads(body)
        self.requests.append(request)
        self.headers.append(headers)
        self.completions += 1
        n = self.completions
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self.complete(request, n, writer)
        finally:
            self.in_flight -= 1

    async def complete(self, request: dict, n: int, writer: asyncio.StreamWriter) -> None:
        b = self.behaviour
        rejected = sorted(set(request) & set(b.reject_fields))
        if rejected:
            writer.write(_http("422 Unprocessable Entity", json.dumps({"detail": f"Unexpected fields: {rejected}"}).encode()))
            return
        if request.get("model") != b.model:
            writer.write(_http("404 Not Found", json.dumps(
                {"error": {"message": f"The model `{request.get('model')}` does not exist.", "code": 404}}).encode()))
            return
        if b.stall_s:
            await asyncio.sleep(b.stall_s)
        if (b.fail_every and n % b.fail_every == 0) or (b.fail_from and n >= b.fail_from):
            writer.write(_http("500 Internal Server Error", b'{"error": "injected failure"}'))
            return
        await self.stream(request, n, writer)

    async def stream(self, request: dict, n: int, writer: asyncio.StreamWriter) -> None:
        b = self.behaviour
        chat = "messages" in request
        prompt = request["messages"][-1]["content"] if chat else request.get("prompt", "")
        words = ["zzz"] if b.garble else (prompt.split() or ["empty"])
        count = max(0, min(b.chunks, -(-int(request.get("max_tokens") or b.chunks) // b.tokens_per_chunk)))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Server: infer-tune-loopback\r\n\r\n")
        base = {"id": f"req-{n}", "object": "chat.completion.chunk" if chat else "text_completion", "model": b.model}
        if chat:
            writer.write(_chunk(_event({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})))
        for k in range(count):
            if b.gap_s:
                await writer.drain()
                await asyncio.sleep(b.gap_s)
            if b.malformed_every and n % b.malformed_every == 0 and k == count // 2:
                writer.write(_chunk(b"data: {not json\n\n"))
                break
            text = f"{words[k % len(words)]}{k if b.garble else ''} "
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            writer.write(_chunk(_event({**base, "choices": [choice]})))
        final = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"} if chat
                                     else {"index": 0, "text": "", "finish_reason": "length"}]}
        if b.usage:
            final["usage"] = {"prompt_tokens": len(prompt.split()), "completion_tokens": count * b.tokens_per_chunk,
                              "total_tokens": len(prompt.split()) + count * b.tokens_per_chunk}
        writer.write(_chunk(_event(final)) + _chunk(_event(b"[DONE]")) + b"0\r\n\r\n")


class BackgroundServer:
    """An asyncio server on a daemon thread, for tests and benches: `start()` returns once `_serve` has
    called `ready()` (at most 10 s), `stop()` sets the stop event and joins the thread; also a context
    manager. Subclasses implement `_serve(stop, ready)` and set `self.port` before calling `ready()`."""

    name = "server"

    def __init__(self) -> None:
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    async def _serve(self, stop: asyncio.Event, ready) -> None:
        raise NotImplementedError

    def start(self):
        ready = threading.Event()

        async def main() -> None:
            self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
            await self._serve(self._stopping, ready.set)

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"the {self.name} did not start within 10 s")
        return self

    def stop(self) -> None:
        """Set the stop event (the server closes its connections), then join the thread."""
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stopping.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LoopbackServer(BackgroundServer):
    """The loopback server on a background thread: `with LoopbackServer(Behaviour(...)) as server: server.url`."""

    name = "loopback server"

    def __init__(self, behaviour: Behaviour | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__()
        self.handler = _Handler(behaviour or Behaviour())
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def requests(self) -> list[dict]:
        return self.handler.requests

    @property
    def headers(self) -> list[dict[str, str]]:
        return self.handler.headers

    @property
    def max_in_flight(self) -> int:
        return self.handler.max_in_flight

    async def _serve(self, stop: asyncio.Event, ready) -> None:
        server = await asyncio.start_server(self.handler.connection, self.host, self.port)
        self.port = server.sockets[0].getsockname()[1]
        ready()
        await stop.wait()
        server.close()
        for task in asyncio.all_tasks():  # open connections end with the server (wait_closed waits for them)
            if task is not asyncio.current_task():
                task.cancel()
        await server.wait_closed()


def main(argv: list[str] | None = None) -> None:
    """Run in the foreground (own process); prints `READY <port>` once listening."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    types = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(Behaviour):
        if f.type in types:
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=types[f.type], default=f.default)
    args = parser.parse_args(argv)
    behaviour = Behaviour(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Behaviour)
                             if hasattr(args, f.name)})
    handler = _Handler(behaviour)

    async def serve() -> None:
        server = await asyncio.start_server(handler.connection, args.host, args.port)
        print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
