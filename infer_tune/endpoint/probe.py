"""Before measuring: reach the endpoint, learn what it serves and says about itself, and settle the request form.

`connect(config, prompt)` lists the server's models (`GET {url}/models`), reads what the engine
reports about itself where it has such a route (`/version`: vLLM, SGLang; `/info`: TGI; `/props`:
llama.cpp; the `Server` header always), then sends one short request that settles what the config
left open: the served model (the only one listed) and whether `stream_options.include_usage` is
accepted. Unreachable endpoints, refused credentials, unknown models and timeouts end here with one
clear line (`EndpointError`, exit 2), before any result is written.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from infer_tune import jsonsafe
from infer_tune.endpoint.client import (
    clean,
    describe_connect_error,
    encode_body,
    read_capped,
    redirect_target,
    stream_request,
)
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.errors import ConfigError, InferTuneError

SELF_REPORT_ROUTES = ("/version", "/info", "/props")
HANDSHAKE_TOKENS = 2
MAX_MODELS_BYTES = 4 << 20  # a model list is a few KiB; a larger answer is refused, not read
MAX_REPORT_BYTES = 1 << 20  # a self-report larger than this is left out


class EndpointError(InferTuneError):
    """An endpoint that cannot be reached or used, or a run in which every request failed."""


class EveryRequestFailed(EndpointError):
    """Every request sent failed (the handshake's first request, or all of a run's); `kinds`: the failures'
    kinds (endpoint.client.FAILURE_KINDS), so a caller tells a silent server from a refusing one by type."""

    def __init__(self, message: str, kinds: frozenset[str]) -> None:
        super().__init__(message)
        self.kinds = kinds


@dataclass
class ServerInfo:
    """What the endpoint says about itself: `models` it lists (None: no model list), the served model's
    entry, the `Server` header, self-report routes that answered JSON, and whether it sent `usage`."""

    models: list[str] | None = None
    model_entry: dict | None = None
    server_header: str | None = None
    reports: dict[str, Any] = field(default_factory=dict)
    reports_usage: bool | None = None
    entries: list[dict] = field(default_factory=list, repr=False)

    def select(self, served_model: str | None) -> None:
        """Keep the listing's entry of the served model (max_model_len, root, owner... where given)."""
        entry = next((m for m in self.entries if m.get("id") == served_model), None)
        self.model_entry = trim(entry) if entry else None

    def to_env(self, config: EndpointConfig) -> dict[str, Any]:
        """The result's `env.endpoint` block (never the API key)."""
        return {"url": config.url, "served_model": config.served_model, "api": config.api,
                "api_key_env": config.api_key_env, "server_header": self.server_header, "models": self.models,
                "model_entry": self.model_entry, "reports": self.reports, "stream_usage": config.stream_usage,
                "reports_usage": self.reports_usage}


def trim(value: Any, depth: int = 0) -> Any:
    """A self-report cut to a readable size (long strings shortened and their control characters
    removed, deep nesting dropped)."""
    if isinstance(value, str):
        return clean(value, 200)
    if isinstance(value, dict):
        return {k: trim(v, depth + 1) for k, v in list(value.items())[:40]} if depth < 3 else "{...}"
    if isinstance(value, list):
        return [trim(v, depth + 1) for v in value[:20]] if depth < 3 else "[...]"
    return value


def server_root(url: str) -> str:
    parts = urlsplit(url)
    path = parts.path[:-3] if parts.path.endswith("/v1") else parts.path
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class TooLarge(Exception):
    """A GET answer over its size limit."""


async def get_json(session, url: str, headers: dict[str, str], timeout_s: float,
                   limit: int = MAX_REPORT_BYTES) -> tuple[int, Any, str | None]:
    """(status, parsed JSON or None, Server header) of a GET: redirects are not followed (EndpointError
    naming the target), the body is read to `limit` bytes (TooLarge beyond)."""
    import aiohttp

    async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s),
                           allow_redirects=False) as response:
        if (target := redirect_target(response)) is not None:
            raise EndpointError(f"{clean(url)} answered HTTP {response.status} redirect to {target}; redirects are "
                                "not followed (give that URL as the endpoint if you trust it)")
        raw, more = await read_capped(response.content, limit)
        if more:
            raise TooLarge(f"GET {clean(url)} answered more than {limit >> 10} KiB")
        try:
            body = jsonsafe.loads(raw) if response.status == 200 else None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            body = None
        server = response.headers.get("Server")
        return response.status, body, clean(server, 120) if server is not None else None


async def probe(session, config: EndpointConfig) -> ServerInfo:
    """The model list, the server header and the engine's self-reports (errors: EndpointError)."""
    import aiohttp

    headers = {**{k: v for k, v in config.headers().items() if k == "Authorization"}, "Accept": "application/json"}
    info = ServerInfo()
    limit = min(config.timeout_s, config.idle_timeout_s, 30.0)
    try:
        status, body, info.server_header = await get_json(session, f"{config.url}/models", headers, limit,
                                                          MAX_MODELS_BYTES)
    except TooLarge as exc:
        raise EndpointError(f"endpoint {config.url}: {exc}; not a model list") from None
    except aiohttp.ClientConnectorError as exc:
        raise EndpointError(f"cannot use endpoint {config.url}: {describe_connect_error(exc, config)}") from None
    except asyncio.TimeoutError:
        raise EndpointError(f"endpoint {config.url} did not answer GET /models within {limit:g} s") from None
    except aiohttp.ClientError as exc:
        raise EndpointError(f"endpoint {config.url} failed GET /models: {type(exc).__name__}: {clean(exc)}") from None
    if status in (401, 403):
        raise EndpointError(f"endpoint {config.url} refused the request (HTTP {status}); name the environment "
                            "variable holding its key in api_key_env")
    if isinstance(body, dict) and isinstance(body.get("data"), list):
        info.entries = [m for m in body["data"] if isinstance(m, dict)]
        info.models = [clean(m.get("id"), 120) for m in info.entries][:1000]
    for route in SELF_REPORT_ROUTES:
        try:
            status, body, _ = await get_json(session, server_root(config.url) + route, headers, 5.0)
        except (aiohttp.ClientError, asyncio.TimeoutError, TooLarge, EndpointError):
            continue  # a self-report is optional: a route that fails, redirects or floods is left out
        if status == 200 and isinstance(body, dict):
            info.reports[route.lstrip("/")] = trim(body)
    return info


def resolve_model(config: EndpointConfig, info: ServerInfo) -> EndpointConfig:
    """The config with `served_model` set: given, or the only model the endpoint lists."""
    if config.served_model:
        return config
    if not info.models:
        raise ConfigError(f"served_model is not set and {config.url} lists no models; give the served model's name")
    if len(info.models) > 1:
        raise ConfigError(f"served_model is not set and {config.url} serves several models: "
                          f"{', '.join(info.models)}; choose one")
    return dataclasses.replace(config, served_model=info.models[0])


async def handshake(session, config: EndpointConfig, info: ServerInfo, prompt: str) -> EndpointConfig:
    """One short request: checks the model name, credentials and request form; settles `stream_usage`."""
    usage = True if config.stream_usage is None else config.stream_usage
    last = None
    for _ in range(3):
        trial = dataclasses.replace(config, stream_usage=usage)
        record = await stream_request(session, trial, encode_body(trial, prompt, HANDSHAKE_TOKENS), trial.headers(),
                                      max_tokens=HANDSHAKE_TOKENS)
        if record.ok:
            info.reports_usage = record.usage is not None
            return trial
        last = record
        if record.failure in ("connect", "timeout", "idle_timeout", "redirect", "too_many_tokens", "usage_mismatch",
                              "oversized", "not_event_stream", "invalid_usage"):
            raise EveryRequestFailed(f"cannot use endpoint {config.url}: {record.message}", frozenset({record.failure}))
        if record.status in (400, 404, 422) and usage and config.stream_usage is None:
            usage = False  # a server that rejects stream_options: ask again without it
            continue
        if record.status is not None and 400 <= record.status < 500:
            break
    if last.status is None or last.status >= 500:
        raise EveryRequestFailed(f"endpoint {config.url} failed the first request 3 times: {last.message}",
                                 frozenset({last.failure}))
    hint = ""
    if info.models is not None and config.served_model not in info.models:
        hint = f"; served_model {config.served_model!r} is not among the models it lists ({', '.join(info.models)})"
    elif config.ignore_eos and last.status is not None and 400 <= last.status < 500:
        hint = "; the server may not accept the ignore_eos extension"
    raise EndpointError(f"endpoint {config.url} rejected the first request: {last.message}{hint}")


def connect(config: EndpointConfig, prompt: str) -> tuple[EndpointConfig, ServerInfo]:
    """Probe the endpoint and settle the config (see module docstring)."""
    from infer_tune.endpoint.replay import client_session

    async def main() -> tuple[EndpointConfig, ServerInfo]:
        async with client_session(config) as session:
            info = await probe(session, config)
            resolved = resolve_model(config, info)
            info.select(resolved.served_model)
            return await handshake(session, resolved, info, prompt), info

    return asyncio.run(main())
