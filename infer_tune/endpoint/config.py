"""What to benchmark over HTTP: the endpoint, the served model, the API flavour and the client's limits.

The API key is never a field: `api_key_env` names an environment variable read when a request is
sent, so neither the command line nor a result document ever holds the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from infer_tune.errors import ConfigError

APIS = ("chat", "completions")


@dataclass
class EndpointConfig:
    """An OpenAI-compatible server and how the client talks to it.

    - `url`: the API root, `http://HOST:PORT/v1` (requests go to `{url}/chat/completions` or
      `{url}/completions`, the model list to `{url}/models`).
    - `served_model`: the `model` field of every request (None: the only model the server lists).
    - `api`: `chat` sends the prompt as a user message (the server applies its chat template);
      `completions` sends the prompt text as rendered by the local tokenizer's template.
    - `api_key_env`: name of an environment variable holding a bearer token (None: no auth header).
    - `concurrency`: most requests in flight at once (closed loop: 1 is one request at a time).
    - `timeout_s`: the whole-request limit; `connect_timeout_s`: the TCP connect limit;
      `idle_timeout_s`: the longest the server may stay silent (before its answer starts, and
      between reads): a stalled server fails the request then, not at `timeout_s`.
    - `ignore_eos`: send the vLLM / SGLang / llama.cpp extension `ignore_eos: true` (pins the output
      length for timing; servers that reject unknown fields answer 4xx).
    - `stream_usage`: ask for `stream_options.include_usage` (None: decided by the first request).
    - `label`: the result's label (None: served model @ host:port).
    - `workers`: load-generator processes for the timed requests (None: chosen from `concurrency` and
      the cores, `loadgen.default_workers`; 1: one event loop in this process).
    """

    url: str
    served_model: str | None = None
    api: str = "chat"
    api_key_env: str | None = None
    concurrency: int = 1
    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    idle_timeout_s: float = 60.0
    ignore_eos: bool = False
    stream_usage: bool | None = None
    label: str | None = None
    workers: int | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url or "")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"url must look like http://HOST:PORT/v1, got {self.url!r}")
        self.url = self.url.rstrip("/")
        if self.api not in APIS:
            raise ConfigError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.workers is not None and self.workers > _cores():  # each is a process with its own event loop
            raise ConfigError(f"workers must be at most the {_cores()} cores this process may use, got {self.workers}")
        for name in ("timeout_s", "connect_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not (0 < value < math.inf):
                raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value}")
        if self.api_key_env is not None and not self.api_key_env.replace("_", "").isalnum():
            raise ConfigError(f"api_key_env must name an environment variable (letters, digits, _), "
                              f"got {self.api_key_env!r}")

    @property
    def host_port(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"

    @property
    def request_url(self) -> str:
        return f"{self.url}/{'chat/completions' if self.api == 'chat' else 'completions'}"

    def headers(self) -> dict[str, str]:
        """Request headers; the bearer token is read from `api_key_env` now and never stored."""
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ConfigError(f"environment variable {self.api_key_env} (api_key_env) is not set or empty")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def display_label(self) -> str:
        if self.label:
            return self.label
        model = (self.served_model or "model").rstrip("/").rsplit("/", 1)[-1]
        return f"{model}@{self.host_port}"

    def to_dict(self) -> dict[str, Any]:
        """The result's `config` (the variable's name, never its value)."""
        return {"kind": "EndpointConfig", **dataclasses.asdict(self)}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
