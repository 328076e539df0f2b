"""The streaming HTTP client: one OpenAI-compatible request, timed from the client's side.

Every server-sent event is timestamped (`time.perf_counter_ns()`) when the network read that
completed it returns; events that arrive in one read share that time (one delivery). Nothing is
printed; a failed request comes back as a `StreamRecord` with `failure` set, never as an exception.
"""

from __future__ import annotations

import asyncio
import errno
import json
import time
from dataclasses import dataclass, field
from typing import Any

from infer_tune.endpoint.config import EndpointConfig

FAILURE_KINDS = ("connect", "timeout", "http", "malformed_sse", "stream_error", "disconnected")


@dataclass
class StreamRecord:
    """One request as the client saw it.

    `start_ns`: when the request was handed to the connection; `delivery_ns[k]` / `texts[k]`: the
    time and text of the k-th content-bearing event (role-only, finish-only and usage events carry no
    text and are not deliveries); `usage`: the server's `usage` block when it sent one; `finish_ns`:
    when the event with `finish_reason` arrived.
    `failure` (None on success) is one of FAILURE_KINDS; `status` the HTTP status; `message` a
    short explanation.
    """

    start_ns: int = 0
    delivery_ns: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    usage: dict | None = None
    finish_reason: str | None = None
    finish_ns: int | None = None
    status: int | None = None
    failure: str | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def fail(self, kind: str, message: str) -> StreamRecord:
        self.failure, self.message = kind, message
        return self


class SSEParser:
    """Incremental `text/event-stream` parser: feed bytes, get the `data` payload of each complete event."""

    def __init__(self) -> None:
        self.buffer = b""
        self.data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self.buffer += chunk
        events = []
        while True:
            end = self.buffer.find(b"\n")
            if end < 0:
                return events
            line = self.buffer[:end].rstrip(b"\r").decode("utf-8", errors="replace")
            self.buffer = self.buffer[end + 1:]
            if not line:  # a blank line ends the event
                if self.data:
                    events.append("\n".join(self.data))
                    self.data = []
            elif line.startswith("data:"):
                self.data.append(line[5:].removeprefix(" "))
            # comments (":...") and other fields (event:, id:, retry:) carry nothing we time

    def close(self) -> list[str]:
        """An event the server did not terminate with a blank line still counts."""
        events = self.feed(b"\n\n") if self.buffer or self.data else []
        return events


def build_payload(config: EndpointConfig, prompt: str, max_new_tokens: int) -> dict[str, Any]:
    """The request body: greedy (temperature 0), streaming, `max_tokens` new tokens."""
    body: dict[str, Any] = {"model": config.served_model, "max_tokens": max_new_tokens, "stream": True,
                            "temperature": 0.0}
    if config.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if config.stream_usage:
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


def _event_text(event: dict, api: str) -> str | None:
    choices = event.get("choices")
    if not choices:
        return None
    choice = choices[0]
    if api == "completions":
        return choice.get("text") or None
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or None


def _handle_event(record: StreamRecord, payload: str, now: int, api: str) -> bool:
    """Apply one event's data; True when the stream is finished (`[DONE]`)."""
    if payload.strip() == "[DONE]":
        return True
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        record.fail("malformed_sse", f"event data is not JSON: {payload[:80]!r}")
        return True
    if not isinstance(event, dict):
        record.fail("malformed_sse", f"event data is not a JSON object: {payload[:80]!r}")
        return True
    if "error" in event:
        error = event["error"]
        record.fail("stream_error", str(error.get("message", error) if isinstance(error, dict) else error)[:200])
        return True
    if "choices" not in event and "usage" not in event:
        record.fail("malformed_sse", f"event has neither choices nor usage: {payload[:80]!r}")
        return True
    text = _event_text(event, api)
    if text:
        record.delivery_ns.append(now)
        record.texts.append(text)
    choices = event.get("choices") or []
    if choices and choices[0].get("finish_reason"):
        record.finish_reason, record.finish_ns = choices[0]["finish_reason"], now
    if isinstance(event.get("usage"), dict):
        record.usage = event["usage"]
    return False


def describe_connect_error(exc: BaseException, config: EndpointConfig) -> str:
    os_error = getattr(exc, "os_error", None) or exc
    if getattr(os_error, "errno", None) == errno.ECONNREFUSED:
        return f"connection refused by {config.host_port} (is the server running?)"
    return f"cannot connect to {config.host_port}: {os_error}"


async def stream_request(session, config: EndpointConfig, body: bytes, headers: dict[str, str]) -> StreamRecord:
    """Send one streaming request on `session` (an aiohttp ClientSession) and time its events."""
    import aiohttp

    record = StreamRecord()
    parser = SSEParser()
    try:
        record.start_ns = time.perf_counter_ns()
        async with session.post(config.request_url, data=body, headers=headers) as response:
            record.status = response.status
            if response.status != 200:
                detail = (await response.read())[:300].decode("utf-8", errors="replace").strip()
                return record.fail("http", f"HTTP {response.status}: {detail or response.reason}")
            done = False
            async for chunk in response.content.iter_any():
                now = time.perf_counter_ns()
                for payload in parser.feed(chunk):
                    if _handle_event(record, payload, now, config.api):
                        done = True
                        break
                if done:
                    break
            if not done:
                now = time.perf_counter_ns()
                for payload in parser.close():
                    if _handle_event(record, payload, now, config.api):
                        break
    except aiohttp.ClientConnectorError as exc:
        return record.fail("connect", describe_connect_error(exc, config))
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
        return record.fail("timeout", f"no complete answer within {config.timeout_s:g} s (timeout_s)")
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        return record.fail("disconnected", f"the server closed the stream: {exc}")
    except aiohttp.ClientError as exc:
        return record.fail("http", f"{type(exc).__name__}: {exc}")
    return record  # a stream with no text (immediate end-of-sequence) is a success with no tokens


def encode_body(config: EndpointConfig, prompt: str, max_new_tokens: int) -> bytes:
    return json.dumps(build_payload(config, prompt, max_new_tokens)).encode()
