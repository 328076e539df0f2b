"""`infer-tune serve`'s HTTP side: an OpenAI-compatible server (aiohttp) in front of the slot engine
(infer_tune/tuners/batch/serving.py). docs/endpoint.md, "Serving".

Routes: `POST /v1/chat/completions` (the messages rendered with the model's chat template, as the
in-process runs render a prompt), `POST /v1/completions` (the prompt text, or a list of token ids, encoded
as the in-process runs encode a prompt without a template), both streaming (server-sent events, one
`data:` event per token, its text empty where the token adds none yet (a special token, bytes of an unfinished
character), so a client counting events counts the tokens `usage` counts; a last event with `finish_reason`,
`[DONE]`) or not; `usage`
(prompt_tokens, completion_tokens, total_tokens) in every non-streaming answer and, with
`stream_options.include_usage`, in a last streamed chunk with no choices; `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text).

Greedy decoding unless `temperature` > 0 (up to 2): then `top_p`, `top_k` and `seed` sample (the engine's
`Sampling`: a seeded request gets the same tokens again); `stop` (a string or up to 4) ends a request where its
text first holds one (the stop string not returned, finish_reason `stop`); `n` 1. Log probabilities (chat:
`logprobs: true` and `top_logprobs` 0-20; completions: `logprobs` 0-20) are each returned token's and its N most
likely alternatives', from the log-softmax of the logits row the token was picked from (before temperature or
truncation), in OpenAI's shapes (chat: `choices[].logprobs.content`; completions: `tokens`, `token_logprobs`,
`top_logprobs`), streamed with the delta that carries the tokens. `ignore_eos: true` (the llama.cpp / vLLM extension) decodes past
end-of-sequence up to `max_tokens`; without `max_tokens`, a request decodes until end-of-sequence or its
slot's cache is full. Bad requests get HTTP 400 with `{"error": {"message", "type", "code"}}`: a body that
is not a JSON object (JSON nested deeper than 64 levels, an integer of more than 4,300 digits included), a
missing or malformed field, a prompt longer than the context; an unknown model 404; a body over
`MAX_BODY_BYTES` 413; a POST whose Content-Type is not `application/json` 415; a full queue (`max_waiting`
requests waiting, counted over the engine's inbox and queue) 503 with `Retry-After`.

Exposure (docs/hardening.md, "Serving"): a request whose `Host` is not a name of this server (loopback names,
the bound address; any IP literal or this machine's name when bound to every interface) gets 421, so a web
page cannot reach the server through a rebound DNS name; with an API key every `/v1/` route needs
`Authorization: Bearer KEY` (401 otherwise; compared in constant time, never logged). A client that
disconnects cancels its handler (aiohttp's `handler_cancellation`), streaming or not, and its request leaves
its slot (or the queue) at the engine's next step. Errors are logged one line each (`--debug`: tracebacks).
Streamed text is the decoded text of all tokens
so far minus what was sent (held back while it ends in an incomplete character), so the concatenated
deltas equal the decoded output exactly.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import queue
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass

from infer_tune import jsonsafe
from infer_tune.errors import ConfigError

MAX_BODY_BYTES = 1 << 20
MAX_TOP_LOGPROBS = 20  # OpenAI's limit of top_logprobs
MAX_MESSAGES = 1024


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class Parsed:
    chat: bool
    ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    sampling: object = None  # tuners.batch.serving.Sampling, None: greedy
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: not asked; N: each token's log probability and the N most likely


def _number(body: dict, key: str, low: float, high: float, *, integer: bool = False, low_open: bool = False):
    """body[key] checked to lie in [low, high] ((low, high] with `low_open`); None when absent or null."""
    value = body.get(key)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if not isinstance(value, kinds) or isinstance(value, bool) or not (low < value if low_open else low <= value) \
            or not value <= high:
        shown = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise BadRequest(f"'{key}' must be {'an integer' if integer else 'a number'} in {shown}")
    return value


def stop_at(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first stop string begins in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


RETRY_AFTER_S = 1
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("", "0.0.0.0", "::")


METRICS = (  # (name, type, help, where LiveSlots.stats() keeps it: a key, or a block and its key)
    ("infer_tune_slots", "gauge", "slots of the engine", "slots"),
    ("infer_tune_slots_busy", "gauge", "slots holding a request", "busy"),
    ("infer_tune_requests_waiting", "gauge", "requests waiting for a slot (queue depth)", "waiting"),
    ("infer_tune_requests_served_total", "counter", "requests that ended with stop or length", "served"),
    ("infer_tune_generation_tokens_total", "counter", "tokens decoded", "generated_tokens"),
    ("infer_tune_engine_steps_total", "counter", "engine steps run", "steps"),
    ("infer_tune_prompt_tokens_total", "counter", "prompt tokens admitted (with the prefix cache on)",
     ("prefix_cache", "prompt_tokens")),
    ("infer_tune_prefix_cache_hit_tokens_total", "counter", "prompt tokens whose prefill the prefix cache skipped",
     ("prefix_cache", "cached_tokens")),
    ("infer_tune_prefix_cache_hit_rate", "gauge", "prefix cache hit tokens / prompt tokens since the start",
     ("prefix_cache", "hit_rate")),
    ("infer_tune_prefix_cache_store_bytes", "gauge", "host memory the prefix cache's store holds",
     ("prefix_cache", "store_bytes")),
    ("infer_tune_spec_draft_tokens_total", "counter", "prompt-lookup draft tokens verified", ("speculative", "drafted")),
    ("infer_tune_spec_accepted_tokens_total", "counter", "draft tokens accepted (the step chose them too)",
     ("speculative", "accepted")),
    ("infer_tune_spec_verify_passes_total", "counter", "a slot's drafts verified in a step",
     ("speculative", "verify_passes")),
)


def prometheus(stats: dict, alive: bool) -> str:
    """The engine's stats in Prometheus' text format (0.0.4); a metric the engine does not keep is left out."""
    lines = ["# HELP infer_tune_up 1 while the engine serves", "# TYPE infer_tune_up gauge",
             f"infer_tune_up {int(alive)}"]
    for name, kind, text, where in METRICS:
        block, key = where if isinstance(where, tuple) else (None, where)
        value = (stats.get(block) or {}).get(key) if block else stats.get(key)
        if value is None:
            continue
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}",
                  f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"]
    return "\n".join(lines) + "\n"


def _error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)


def _ip(text: str):
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def host_name(header: str) -> str:
    """The host of a `Host` header without its port, lowercased: `[::1]:8000` -> `::1`, `Localhost.:80` ->
    `localhost`."""
    text = header.strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    if text.count(":") == 1:
        text = text.split(":", 1)[0]
    return text.rstrip(".")


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address a server listens on) is loopback only."""
    ip = _ip(host.strip("[]"))
    return host.lower().rstrip(".") == "localhost" if ip is None else ip.is_loopback


def allowed_hosts(*bound: str) -> tuple[set[str], bool]:
    """The `Host` names a server listening on `bound` (the address as bound, the name it was given) answers,
    and whether any IP literal is one of them (bound to every interface: clients name it by any of its
    addresses; a rebound DNS name is never an IP literal)."""
    names = set(LOOPBACK_NAMES)
    wildcard = False
    for host in filter(None, bound):
        if host.strip("[]") in WILDCARDS:
            wildcard = True
        else:
            names.add(host_name(host if ":" not in host or host.startswith("[") else f"[{host}]"))
    if wildcard:
        for name in (socket.gethostname(), socket.getfqdn()):
            if name:
                names.add(name.lower().rstrip("."))
    return names, wildcard


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), made before anything slow is loaded; an address
    in use, not of this machine or unknown is a ConfigError (one line, exit 2)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


class OneLine(logging.Formatter):
    """A log record as one line: its message and, for an exception, its type and first line, no traceback."""

    def format(self, record: logging.LogRecord) -> str:
        from infer_tune.endpoint.client import clean

        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            text += f": {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        return f"warning: serve: {clean(text, 300)}"


def log_errors(debug: bool = False, stream=None):
    """Send aiohttp's and asyncio's error records to stderr, one line each (with `debug`: with tracebacks);
    returns a function that puts the loggers back as they were."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s") if debug else OneLine())
    saved = []
    for name in ("aiohttp", "asyncio"):
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate, logger.level))
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET or logger.level > logging.WARNING:
            logger.setLevel(logging.WARNING)

    def restore() -> None:
        for logger, propagate, level in saved:
            logger.removeHandler(handler)
            logger.propagate, logger.level = propagate, level

    return restore


class OpenAIServer:
    """The routes over one `LiveSlots` engine, its tokenizer and the model name it serves."""

    def __init__(self, engine, tokenizer, served_model: str, *, max_waiting: int = 256,
                 api_key: str | None = None) -> None:
        self.engine, self.tokenizer, self.served_model = engine, tokenizer, served_model
        self.max_waiting = max_waiting
        self._bearer = f"Bearer {api_key}".encode() if api_key else None
        self.hosts, self.any_ip = allowed_hosts("127.0.0.1")
        self.created = int(time.time())

    def bind(self, *hosts: str) -> None:
        """Answer the `Host` names of a server listening on `hosts` (its address as bound, the name given)."""
        self.hosts, self.any_ip = allowed_hosts(*hosts)

    def host_ok(self, header: str | None) -> bool:
        if not header:
            return False
        name = host_name(header)
        return name in self.hosts or (self.any_ip and _ip(name) is not None)

    def refusal(self, request):
        """The answer to a request this server does not serve (wrong Host, no API key, not JSON), or None."""
        if not self.host_ok(request.headers.get("Host")):
            return _error(421, "this server does not answer for this Host", "misdirected_request")
        if self._bearer is not None and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, self._bearer):
                return _error(401, "a valid API key is needed: Authorization: Bearer KEY", "authentication_error",
                              {"WWW-Authenticate": "Bearer"})
        if request.method == "POST" and request.content_type != "application/json":
            return _error(415, "the body must be JSON sent with Content-Type: application/json",
                          "unsupported_media_type")
        return None

    # ------------------------------------------------------------------ requests
    def encode(self, body: dict, chat: bool) -> list[int]:
        tok = self.tokenizer
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
                raise BadRequest(f"'messages' must be a non-empty list of at most {MAX_MESSAGES} messages")
            clean = []
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise BadRequest(f"messages[{i}] must be an object with string 'role' and 'content'")
                clean.append({"role": m["role"], "content": m["content"]})
            if not getattr(tok, "chat_template", None):
                raise BadRequest("this model has no chat template: use /v1/completions")
            try:
                text = tok.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001 (a template that refuses these messages: the client's input)
                raise BadRequest(f"the chat template refused these messages: {str(exc).splitlines()[0]}") from None
            return list(tok(text, add_special_tokens=False)["input_ids"])
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("'prompt' is empty")
            return list(tok(prompt)["input_ids"])
        vocab = len(tok)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                       for t in prompt):
            return list(prompt)
        raise BadRequest("'prompt' must be a string or a non-empty list of token ids (one prompt per request)")

    def parse(self, raw: bytes, chat: bool) -> Parsed:
        try:
            body = jsonsafe.loads(raw)
        except ValueError as exc:  # not JSON, not UTF-8, too deep, an integer of hundreds of digits (jsonsafe)
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise BadRequest(f"the body is not JSON: {reason[:200]}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.served_model:
            raise BadRequest(f"the model `{model}` does not exist; this server serves `{self.served_model}`", 404,
                             "model_not_found")
        from infer_tune.tuners.batch.serving import Sampling

        temperature = _number(body, "temperature", 0, 2)
        top_p = _number(body, "top_p", 0, 1, low_open=True)
        top_k = _number(body, "top_k", 0, 2**31, integer=True)
        seed = _number(body, "seed", -2**63, 2**64 - 1, integer=True)
        sampling = None
        if temperature:  # absent, null or 0: greedy (top_p / top_k change nothing then)
            sampling = Sampling(float(temperature), float(top_p if top_p is not None else 1.0), int(top_k or 0),
                                None if seed is None else seed % 2**63)
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                                 or not all(isinstance(x, str) and x for x in stop)):
            raise BadRequest("'stop' must be a non-empty string or a list of at most 4")
        if body.get("n", 1) != 1:
            raise BadRequest("'n' must be 1")
        logprobs = self._logprobs(body, chat)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise BadRequest("'ignore_eos' must be true or false")
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:  # absent or null: `max_tokens` (null there too: until the slot is full)
            max_tokens = body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
            raise BadRequest("'max_tokens' must be an integer >= 1")
        ids = self.encode(body, chat)
        room = self.engine.limit(len(ids), max_tokens or self.engine.max_context)
        if room < 1:
            raise BadRequest(f"the prompt is {len(ids)} tokens; this server's context is {self.engine.max_context}")
        return Parsed(chat, ids, room, stream, bool(options.get("include_usage")), ignore_eos, sampling,
                      tuple(stop or ()), logprobs)

    @staticmethod
    def _logprobs(body: dict, chat: bool) -> int | None:
        """How many top log probabilities a token gets (None: none asked): chat's `logprobs: true` with
        `top_logprobs` 0-20; completions' `logprobs` 0-20 (the chosen token's always comes with them)."""
        if chat:
            asked = body.get("logprobs")
            if asked is not None and not isinstance(asked, bool):
                raise BadRequest("'logprobs' must be true or false")
            top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
            if top is not None and not asked:
                raise BadRequest("'top_logprobs' needs 'logprobs': true")
            return int(top or 0) if asked else None
        top = _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
        return None if top is None else int(top)

    def _logprob_block(self, parsed: Parsed, entries: list) -> dict:
        """OpenAI's `logprobs` of a choice for `entries` ((token, log probability, top) per token): chat's
        `content` list, or completions' parallel lists."""
        def text(token: int) -> str:
            return self.tokenizer.decode([token])

        if parsed.chat:
            return {"content": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode()),
                                 "top_logprobs": [{"token": text(i), "logprob": v, "bytes": list(text(i).encode())}
                                                  for i, v in top]} for t, lp, top in entries]}
        return {"tokens": [text(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{text(i): v for i, v in top} for _, _, top in entries]}

    # ------------------------------------------------------------------ routes
    async def models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": self.served_model, "object": "model", "created": self.created, "owned_by": "infer-tune"}]})

    async def health(self, request):
        from aiohttp import web

        if not self.engine.alive:
            return _error(503, "the engine is not serving", "unavailable")
        state = {"status": "ok"}
        for key, attribute in (("slots", "slots"), ("busy", "busy_slots"), ("waiting", "waiting")):
            value = getattr(self.engine, attribute, None)
            if isinstance(value, int):
                state[key] = value
        prefix = self.engine.stats().get("prefix_cache") if hasattr(self.engine, "stats") else None
        if prefix:
            state["prefix_cache_hit_rate"] = round(prefix["hit_rate"], 4)
        return web.json_response(state)

    async def metrics(self, request):
        """Prometheus text (docs/endpoint.md, "Metrics"): the engine's counters and gauges at this moment."""
        from aiohttp import web

        return web.Response(text=prometheus(self.engine.stats() if hasattr(self.engine, "stats") else {},
                                            self.engine.alive),
                            content_type="text/plain", charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})

    async def chat(self, request):
        return await self.complete(request, chat=True)

    async def completions(self, request):
        return await self.complete(request, chat=False)

    async def complete(self, request, chat: bool):
        from aiohttp import web

        from infer_tune.tuners.batch.serving import EngineStopped, LiveRequest

        try:
            raw = await request.read()
            parsed = self.parse(raw, chat)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the body is over {MAX_BODY_BYTES} bytes")
        except BadRequest as exc:
            return _error(exc.status, str(exc), exc.kind)
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()

        def emit(token, finish) -> None:  # on the engine thread
            if loop.is_closed():  # the server stopped while this request was still in the engine: nobody reads it
                return
            try:
                loop.call_soon_threadsafe(tokens.put_nowait, (token, finish))
            except RuntimeError:  # closed between the check and the call
                pass

        live = LiveRequest(ids=parsed.ids, max_tokens=parsed.max_tokens, emit=emit, ignore_eos=parsed.ignore_eos,
                           sampling=parsed.sampling, logprobs=parsed.logprobs)
        try:
            self.engine.submit(live)
        except queue.Full:
            return _error(503, f"{self.max_waiting} requests are waiting; try again later", "overloaded",
                          {"Retry-After": str(RETRY_AFTER_S)})
        except EngineStopped as exc:
            return _error(503, str(exc), "unavailable")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            if parsed.stream:
                return await self.stream(request, parsed, rid, tokens, live)
            return await self.whole(parsed, rid, tokens, live)
        finally:  # also when the handler is cancelled: a client that left frees its slot at the next step
            live.cancelled = True

    def _usage(self, parsed: Parsed, n: int, live) -> dict:
        """OpenAI's usage, with `prompt_tokens_details.cached_tokens`: the prompt tokens the prefix cache gave."""
        return {"prompt_tokens": len(parsed.ids), "completion_tokens": n, "total_tokens": len(parsed.ids) + n,
                "prompt_tokens_details": {"cached_tokens": int(getattr(live, "cached", 0))}}

    async def whole(self, parsed: Parsed, rid: str, tokens: asyncio.Queue, live=None):
        from aiohttp import web

        out: list[int] = []
        text = None
        while True:
            token, finish = await tokens.get()
            if token is not None:
                out.append(token)
                if parsed.stop:
                    text = self.tokenizer.decode(out, skip_special_tokens=True)
                    cut = stop_at(text, parsed.stop)
                    if cut is not None:  # the stop string and what follows are not returned; the request ends
                        text, finish = text[:cut], "stop"
                        if live is not None:
                            live.cancelled = True
            if finish is not None:
                break
        if finish in ("abort", "error"):
            return _error(503 if finish == "abort" else 500, f"the request ended early ({finish})", "unavailable")
        if text is None or not parsed.stop:
            text = self.tokenizer.decode(out, skip_special_tokens=True)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if parsed.chat else {"index": 0, "text": text, "finish_reason": finish})
        if parsed.logprobs is not None and live is not None:  # the tokens returned (a stop string's cut: all run)
            choice["logprobs"] = self._logprob_block(parsed, live.token_logprobs[:len(out)])
        return web.json_response({"id": rid, "object": "chat.completion" if parsed.chat else "text_completion",
                                  "created": int(time.time()), "model": self.served_model, "choices": [choice],
                                  "usage": self._usage(parsed, len(out), live)})

    async def stream(self, request, parsed: Parsed, rid: str, tokens: asyncio.Queue, live=None):
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await self._stream(request, response, parsed, rid, tokens, live)
        except ConnectionError:  # the client left: its request is cancelled (complete's finally), nothing to log
            pass
        return response

    async def _stream(self, request, response, parsed: Parsed, rid: str, tokens: asyncio.Queue, live=None) -> None:
        await response.prepare(request)
        base = {"id": rid, "object": "chat.completion.chunk" if parsed.chat else "text_completion",
                "created": int(time.time()), "model": self.served_model}

        def event(obj) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        given = [0]  # tokens whose log probabilities an event carried

        def choice(text: str, finish=None, role: bool = False, upto: int = 0, token: bool = False) -> dict:
            if parsed.chat:  # a token's event carries `content` even when empty; the finish's delta is {}
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text or token else {})
                out = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                out = {"index": 0, "text": text, "finish_reason": finish}
            if parsed.logprobs is not None and live is not None and upto > given[0]:
                out["logprobs"] = self._logprob_block(parsed, live.token_logprobs[given[0]:upto])
                given[0] = upto
            return out

        if parsed.chat:
            await response.write(event({**base, "choices": [choice("", role=True)]}))
        out: list[int] = []
        sent = ""
        hold = max((len(x) for x in parsed.stop), default=1) - 1  # a stop string may be still arriving
        while True:
            token, finish = await tokens.get()
            if token is not None:
                out.append(token)
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            if parsed.stop and finish not in ("abort", "error"):
                cut = stop_at(text, parsed.stop)
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    if live is not None:
                        live.cancelled = True
                elif finish is None and hold:
                    text = text[:max(len(sent), len(text) - hold)]
            if finish is None and (text.endswith("\ufffd") or not text.startswith(sent)):
                # an incomplete character (or a re-spelled prefix): the token's event carries no text yet
                if token is not None:
                    await response.write(event({**base, "choices": [choice("", upto=len(out), token=True)]}))
                continue
            delta, sent = (text[len(sent):] if text.startswith(sent) else ""), text
            if finish in ("abort", "error"):
                await response.write(event({"error": {"message": f"the request ended early ({finish})",
                                                      "type": "unavailable", "code": 503}}))
                break
            if delta or token is not None:  # one event per token, empty where it adds no text (a special token)
                await response.write(event({**base, "choices": [choice(delta, upto=len(out), token=True)]}))
            if finish is not None:
                await response.write(event({**base, "choices": [choice("", finish)]}))
                if parsed.include_usage:
                    await response.write(event({**base, "choices": [], "usage": self._usage(parsed, len(out), live)}))
                break
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    def app(self):
        from aiohttp import web

        @web.middleware
        async def guard(request, handler):
            refused = self.refusal(request)
            return refused if refused is not None else await handler(request)

        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[guard])
        app.add_routes([web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
                        web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/metrics", self.metrics),
                        web.get("/v1/health", self.health)])
        return app


async def serve_until_stopped(server: OpenAIServer, host: str, port: int, ready, control: dict,
                              sock: socket.socket | None = None) -> None:
    """Listen on `sock` (a socket of `listen`) or else host:port (0: a free port), call `ready(url)`, serve
    until `control["stop"]()` is called (from any thread: it sets this loop's stop event), then stop accepting
    and close the listener; streams of requests the engine ended early have their error event written first
    (a shutdown grace of 5 s). A client that disconnects cancels its handler (module docstring)."""
    from aiohttp import web

    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = (web.SockSite(runner, sock, shutdown_timeout=5.0) if sock is not None
            else web.TCPSite(runner, host, port, shutdown_timeout=5.0))
    await site.start()
    bound = runner.addresses[0]
    server.bind(bound[0], host)
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    control["stop"] = lambda: loop.call_soon_threadsafe(stop.set)
    if control.get("stopping"):  # asked to stop before it was listening
        stop.set()
    ready(f"http://{shown}:{bound[1]}/v1")
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def serve_until_signal(server: OpenAIServer, host: str, port: int, ready, *, sock: socket.socket | None = None,
                       debug: bool = False) -> None:
    """Serve until SIGINT or SIGTERM: the engine (`server.engine`, a LiveSlots) runs in this thread, which
    must be the main one (infer_tune/tuners/batch/serving.py says why), the HTTP server on a thread of its own,
    on `sock` when given (`listen`: the port is taken before the model loads) or else host:port.
    A signal stops the engine (requests still decoding end: their streams get an error event), then the
    listener closes. A server that cannot listen (a port in use) stops the engine and its error is raised.
    aiohttp's and asyncio's errors are logged one line each (`debug`: with tracebacks)."""
    import threading

    engine = server.engine
    control: dict = {}
    failed: list[BaseException] = []

    def http() -> None:
        try:
            asyncio.run(serve_until_stopped(server, host, port, ready, control, sock))
        except BaseException as exc:  # noqa: BLE001 (raised again in the main thread)
            failed.append(exc)
        finally:
            engine.stop()

    signalled: list[int] = []

    def on_signal(signum, frame) -> None:
        signalled.append(signum)
        engine.stop()

    restore_logs = log_errors(debug)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="infer-tune http", daemon=True)
    thread.start()
    try:
        engine.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        control["stopping"] = True
        if "stop" in control:
            control["stop"]()
        thread.join(15.0)
        restore_logs()
    if failed:
        raise failed[0]
    if engine.failure is not None and not signalled:
        from infer_tune.errors import InferTuneError

        raise InferTuneError(f"the engine failed: {engine.failure}") from engine.failure
