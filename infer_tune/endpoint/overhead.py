"""What the client itself adds to TTFT: the endpoint client against a bare-socket yardstick, same server.

Against a server that answers at once (infer_tune.endpoint.loopback), the TTFT the client measures
is network + server + client. A bare asyncio socket client (one pre-built request, read until the
first content event, no HTTP library, no JSON) measures network + server alone. Rounds alternate
the two on warm keep-alive connections; the overhead is the median over rounds of
(client TTFT - bare TTFT), so drift of the machine hits both sides of each pair.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from urllib.parse import urlsplit

from infer_tune.endpoint.client import encode_body, stream_request
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.metrics.stats import summarize


class BareClient:
    """One keep-alive HTTP/1.1 connection: send a fixed request, time the first content event, drain the rest."""

    def __init__(self, config: EndpointConfig, body: bytes) -> None:
        parts = urlsplit(config.request_url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.request = (f"POST {parts.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def ttft_ns(self) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        start = time.perf_counter_ns()
        self.writer.write(self.request)
        buffer, first = b"", None
        while not buffer.endswith(b"0\r\n\r\n"):
            data = await self.reader.read(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            if first is None and (b'"content"' in buffer + data or b'"text"' in buffer + data):
                first = time.perf_counter_ns()
            buffer += data
        return (first or time.perf_counter_ns()) - start

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _measure(config: EndpointConfig, rounds: int, max_tokens: int) -> dict:
    from infer_tune.endpoint.replay import client_session

    body = encode_body(config, "client overhead probe", max_tokens)
    bare = BareClient(config, body)
    headers = config.headers()
    client_ms, bare_ms = [], []
    try:
        async with client_session(config) as session:
            for _ in range(3):  # connections opened and code paths warmed on both sides
                await bare.ttft_ns()
                await stream_request(session, config, body, headers)
            for _ in range(rounds):
                bare_ms.append(await bare.ttft_ns() / 1e6)
                record = await stream_request(session, config, body, headers)
                if not record.ok or not record.delivery_ns:
                    raise ConnectionError(f"client request failed: {record.message}")
                client_ms.append((record.delivery_ns[0] - record.start_ns) / 1e6)
    finally:
        bare.close()
    overheads = [c - b for c, b in zip(client_ms, bare_ms)]
    return {"rounds": rounds, "client_ttft_ms": summarize(client_ms), "bare_ttft_ms": summarize(bare_ms),
            "overhead_ms": summarize(overheads), "overhead_ms_p50": statistics.median(overheads)}


def measure_client_overhead(config: EndpointConfig, rounds: int = 200, max_tokens: int = 8) -> dict:
    """TTFT of the endpoint client and of the bare yardstick against `config`'s (instant) server, and their
    paired difference: `overhead_ms_p50` is what the client adds to TTFT at the median."""
    return asyncio.run(_measure(config, rounds, max_tokens))
