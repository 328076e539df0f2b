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

from infer_tune import jsonsafe
from infer_tune.endpoint.config import EndpointConfig

FAILURE_KINDS = ("connect", "timeout", "idle_timeout", "http", "redirect", "malformed_sse", "stream_error",
                 "disconnected", "oversized", "too_many_tokens", "usage_mismatch", "not_event_stream",
                 "invalid_usage")
MAX_LINE_BYTES = 1 << 20  # one SSE line (one event's data) at most: a token's event is a few hundred bytes
MAX_ERROR_BODY_BYTES = 4096  # of an error answer, only this much is read (its first line is shown)
MAX_CHARS_PER_TOKEN = 256  # streamed text longer than max_tokens x this cannot be max_tokens tokens
MAX_PROMPT_TOKENS = 10_000_000  # a server's usage.prompt_tokens above this (no context is that long) is invalid
STREAM_BYTES_PER_TOKEN = 16384  # the raw stream may hold 1 MiB + this per requested token
_CONTROL = {c: None for c in [*range(0x00, 0x20), *range(0x7F, 0xA0), 0x200E, 0x200F, *range(0x202A, 0x202F),
                              *range(0x2066, 0x206A)]}


def clean(text: object, limit: int = 200) -> str:
    """Server text made safe for one terminal line: control characters (ESC sequences, BEL, newlines,
    bidi overrides) removed, cut to `limit` characters."""
    flat = " ".join(str(text).replace("\t", " ").splitlines())
    flat = flat.translate(_CONTROL)
    return flat if len(flat) <= limit else flat[:limit] + "..."


class StreamTooLarge(Exception):
    """An SSE line (or one event's data) longer than MAX_LINE_BYTES."""


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
    text_chars: int = 0
    events: int = 0  # data events seen ([DONE] included): a 200 with none is not an event stream
    resent: int = 0  # sent again on a new connection: the pooled one was closed while the body was written

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
    """Incremental `text/event-stream` parser: feed bytes, get the `data` payload of each complete event.

    Linear in the bytes fed: the buffer is a bytearray consumed once per feed, and a line's end is
    searched for only in bytes not yet scanned. A line (or an event's data) over `max_line` bytes raises
    StreamTooLarge instead of growing without bound.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self.buffer = bytearray()
        self.scanned = 0  # bytes of `buffer` known to hold no newline
        self.data: list[str] = []
        self.data_bytes = 0
        self.max_line = max_line

    def feed(self, chunk: bytes) -> list[str]:
        self.buffer += chunk
        events: list[str] = []
        start = 0
        while True:
            end = self.buffer.find(b"\n", max(start, self.scanned))
            if end < 0:
                break
            length = end - start
            line = bytes(self.buffer[start:end]).rstrip(b"\r").decode("utf-8", errors="replace")
            start = end + 1
            if not line:  # a blank line ends the event
                if self.data:
                    events.append("\n".join(self.data))
                    self.data, self.data_bytes = [], 0
            elif line.startswith("data:"):
                self.data.append(line[5:].removeprefix(" "))
                self.data_bytes += length
                if self.data_bytes > self.max_line:
                    raise StreamTooLarge(f"an event's data is over {self.max_line} bytes")
            # comments (":...") and other fields (event:, id:, retry:) carry nothing we time
        del self.buffer[:start]
        self.scanned = len(self.buffer)
        if self.scanned > self.max_line:
            raise StreamTooLarge(f"an event-stream line is over {self.max_line} bytes")
        return events

    def close(self) -> list[str]:
        """An event the server did not terminate with a blank line still counts."""
        events = self.feed(b"\n\n") if self.buffer or self.data else []
        return events


def build_payload(config: EndpointConfig, prompt: str | list[dict], max_new_tokens: int) -> dict[str, Any]:
    """The request body: greedy (temperature 0), streaming, `max_tokens` new tokens. A list `prompt` is
    the chat messages themselves (a conversation so far, a system prompt)."""
    body: dict[str, Any] = {"model": config.served_model, "max_tokens": max_new_tokens, "stream": True,
                            "temperature": 0.0}
    if config.api == "chat":
        body["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if config.stream_usage:
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


def _token_event(event: dict, api: str) -> bool:
    """An event that delivers a token without text: its choice has an empty text (completions) or an empty
    `content` (chat), no `finish_reason` and no `role` (a server streaming one event per token sends these for an
    end-of-sequence token or the bytes of an unfinished character; the role announcement and the finish are not
    tokens)."""
    choices = event.get("choices")
    if not choices or choices[0].get("finish_reason"):
        return False
    if api == "completions":
        return choices[0].get("text") == ""
    delta = choices[0].get("delta") or {}
    return "role" not in delta and delta.get("content") == ""


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
    record.events += 1
    if payload.strip() == "[DONE]":
        return True
    try:
        event = jsonsafe.loads(payload)
    except json.JSONDecodeError:
        record.fail("malformed_sse", f"event data is not JSON: {clean(payload, 80)!r}")
        return True
    if not isinstance(event, dict):
        record.fail("malformed_sse", f"event data is not a JSON object: {clean(payload, 80)!r}")
        return True
    if "error" in event:
        error = event["error"]
        record.fail("stream_error", clean(error.get("message", error) if isinstance(error, dict) else error))
        return True
    if "choices" not in event and "usage" not in event:
        record.fail("malformed_sse", f"event has neither choices nor usage: {clean(payload, 80)!r}")
        return True
    choices = event.get("choices")
    if choices is not None and not (isinstance(choices, list) and all(isinstance(c, dict) for c in choices)):
        record.fail("malformed_sse", f"event choices are not a list of objects: {clean(payload, 80)!r}")
        return True
    text = _event_text(event, api)
    if text is not None and not isinstance(text, str):
        record.fail("malformed_sse", f"event text is not a string: {clean(payload, 80)!r}")
        return True
    if text or _token_event(event, api):  # a token's event, its text possibly empty
        record.delivery_ns.append(now)
        record.texts.append(text or "")
        record.text_chars += len(text or "")
    choices = choices or []
    if choices and choices[0].get("finish_reason"):
        record.finish_reason, record.finish_ns = clean(choices[0]["finish_reason"], 40), now
    if isinstance(event.get("usage"), dict):
        record.usage = event["usage"]
    return False


def not_event_stream(content_type: str | None) -> str | None:
    """None when a 200 answer's Content-Type allows an event stream (`text/event-stream`, or none given:
    its data events decide); else the type it named."""
    if content_type is None or not content_type.strip():
        return None
    media = content_type.split(";", 1)[0].strip().lower()
    return None if media == "text/event-stream" else clean(media, 60)


def describe_not_stream(content_type: str, body: bytes) -> str:
    """The message of a 200 answer that is not an event stream (say, a JSON error body)."""
    detail = clean(body.decode("utf-8", errors="replace").strip(), 300)
    return f"HTTP 200 with Content-Type {content_type}, not an event stream: {detail or 'no body'}"


def check_length(record: StreamRecord, max_tokens: int | None, *, final: bool = False) -> bool:
    """Fail `record` when what it streamed cannot be at most `max_tokens` tokens or (`final`: the stream
    ended, usage arrives last) its `usage.completion_tokens` disagrees with what was streamed, its
    `usage.prompt_tokens` is not a count from 0 to MAX_PROMPT_TOKENS (invalid_usage), or no data
    event came at all (a 200 that is not an event stream); True when the record has failed. Called as
    events arrive, so a server streaming without end is cut off at once."""
    if final and record.ok and record.events == 0:
        record.fail("not_event_stream", "HTTP 200 without a single event-stream data event (not an event stream)")
    if final and record.ok and record.usage is not None and "prompt_tokens" in record.usage:
        reported = record.usage["prompt_tokens"]
        if not isinstance(reported, int) or isinstance(reported, bool) or not 0 <= reported <= MAX_PROMPT_TOKENS:
            record.fail("invalid_usage", f"usage.prompt_tokens is {clean(repr(reported), 40)}, not a count from 0 to "
                                         f"{MAX_PROMPT_TOKENS}")
    if max_tokens is None or not record.ok:
        return not record.ok
    events = len(record.delivery_ns)
    problem = None
    if events > max_tokens:
        problem = "too_many_tokens", f"streamed {events} text events for max_tokens {max_tokens}"
    elif record.text_chars > max_tokens * MAX_CHARS_PER_TOKEN:
        problem = "too_many_tokens", f"streamed {record.text_chars} characters for max_tokens {max_tokens}"
    elif final and record.usage is not None and "completion_tokens" in record.usage:
        reported = record.usage["completion_tokens"]
        if not isinstance(reported, int) or isinstance(reported, bool) or reported < 0:
            problem = "usage_mismatch", f"usage.completion_tokens is {clean(reported, 40)!r}"
        elif reported > max_tokens:
            problem = "too_many_tokens", f"usage.completion_tokens {reported} exceeds max_tokens {max_tokens}"
        elif reported < events:
            problem = "usage_mismatch", f"usage.completion_tokens {reported} but {events} tokens were streamed"
    if problem is not None:
        record.fail(*problem)
    return not record.ok


async def read_capped(content, limit: int) -> tuple[bytes, bool]:
    """At most `limit` bytes of a response body, and whether there was more (the rest is not read)."""
    data = bytearray()
    while len(data) <= limit:
        chunk = await content.read(limit + 1 - len(data))
        if not chunk:
            return bytes(data), False
        data += chunk
    return bytes(data[:limit]), True


def redirect_target(response) -> str | None:
    """The Location of a redirect answer (None when `response` is not one): redirects are never followed."""
    if response.status not in (301, 302, 303, 307, 308):
        return None
    return clean(response.headers.get("Location") or "(no Location header)", 200)


def describe_connect_error(exc: BaseException, config: EndpointConfig) -> str:
    os_error = getattr(exc, "os_error", None) or exc
    if getattr(os_error, "errno", None) == errno.ECONNREFUSED:
        return f"connection refused by {config.host_port} (is the server running?)"
    return f"cannot connect to {config.host_port}: {os_error}"


async def stream_request(session, config: EndpointConfig, body: bytes, headers: dict[str, str],
                         max_tokens: int | None = None, *, first_start_ns: int | None = None) -> StreamRecord:
    """Send one streaming request on `session` (an aiohttp ClientSession) and time its events.

    Redirects are not followed (a failure naming the target); the server has `config.idle_timeout_s`
    for its answer and between reads, `config.timeout_s` for the whole request; an error body is read
    to MAX_ERROR_BODY_BYTES, an event line to MAX_LINE_BYTES, the stream to 1 MiB + max_tokens x
    STREAM_BYTES_PER_TOKEN; more text than `max_tokens` tokens, or usage that disagrees, fails the
    request (`check_length`).

    A keep-alive connection the server closed just as the client reused it fails while the request body is
    written (`ClientOSError`, before any answer): the server never got the request, so it is sent once more
    on a new connection, timed from the first send (`first_start_ns`), and `resent` says so."""
    import aiohttp

    record = StreamRecord()
    parser = SSEParser()
    loop = asyncio.get_running_loop()
    idle = config.idle_timeout_s
    byte_cap = (1 << 20) + (max_tokens or 0) * STREAM_BYTES_PER_TOKEN if max_tokens else None
    received = 0
    watch = None
    try:
        record.start_ns = first_start_ns or time.perf_counter_ns()
        async with asyncio.timeout(idle) as watch:
            async with session.post(config.request_url, data=body, headers=headers, allow_redirects=False) as response:
                record.status = response.status
                if (target := redirect_target(response)) is not None:
                    return record.fail("redirect", f"HTTP {response.status} redirect to {target}; redirects are "
                                                   "not followed (give that URL as the endpoint if you trust it)")
                if response.status != 200:
                    raw, _ = await read_capped(response.content, MAX_ERROR_BODY_BYTES)
                    detail = clean(raw.decode("utf-8", errors="replace").strip(), 300)
                    return record.fail("http", f"HTTP {response.status}: {detail or clean(response.reason or '')}")
                if (kind := not_event_stream(response.headers.get("Content-Type"))) is not None:
                    raw, _ = await read_capped(response.content, MAX_ERROR_BODY_BYTES)
                    return record.fail("not_event_stream", describe_not_stream(kind, raw))
                done = False
                while not done:
                    watch.reschedule(loop.time() + idle)
                    chunk = await response.content.readany()
                    if not chunk:
                        break
                    now = time.perf_counter_ns()
                    received += len(chunk)
                    if byte_cap is not None and received > byte_cap:
                        return record.fail("oversized", f"the stream passed {byte_cap} bytes for max_tokens "
                                                        f"{max_tokens}")
                    for payload in parser.feed(chunk):
                        if _handle_event(record, payload, now, config.api) or check_length(record, max_tokens):
                            done = True
                            break
                watch.reschedule(None)
                if not done:
                    now = time.perf_counter_ns()
                    for payload in parser.close():
                        if _handle_event(record, payload, now, config.api):
                            break
    except StreamTooLarge as exc:
        return record.fail("oversized", str(exc))
    except aiohttp.ClientConnectorError as exc:
        return record.fail("connect", clean(describe_connect_error(exc, config), 300))
    except (TimeoutError, asyncio.TimeoutError, aiohttp.ServerTimeoutError):
        if watch is not None and watch.expired():
            return record.fail("idle_timeout", f"the server sent nothing for {idle:g} s (idle_timeout_s)")
        return record.fail("timeout", f"no complete answer within {config.timeout_s:g} s (timeout_s)")
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        return record.fail("disconnected", f"the server closed the stream: {clean(exc)}")
    except aiohttp.ClientOSError as exc:
        if first_start_ns is None and record.status is None and "request body" in str(exc):
            again = await stream_request(session, config, body, headers, max_tokens, first_start_ns=record.start_ns)
            again.resent += 1
            return again
        return record.fail("http", f"{type(exc).__name__}: {clean(exc)}")
    except aiohttp.ClientError as exc:
        return record.fail("http", f"{type(exc).__name__}: {clean(exc)}")
    check_length(record, max_tokens, final=True)
    return record  # a stream with no text (immediate end-of-sequence) is a success with no tokens


def encode_body(config: EndpointConfig, prompt: str | list[dict], max_new_tokens: int) -> bytes:
    return json.dumps(build_payload(config, prompt, max_new_tokens)).encode()
