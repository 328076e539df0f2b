"""Reference engines started on loopback: each engine of the registry that declares `serve_here`
(engines/base.py `ServeHere`; e.g. `transformers serve` for torch, llama-server for llama.cpp).

`local_server(engine, model_ref)` takes the engine's command line from its registry entry, starts it on
127.0.0.1 at a free port in its own process group, waits (bounded) until `GET /v1/models` answers, yields a
`LocalServer` (url, served model, the engine's log file) and always stops the process group on the way out
(terminate, then kill). What the engine serves (a checkpoint directory, a GGUF file), its options (`parallel`
slots, continuous batching) and the modules it needs are the engine's own knowledge (infer_tune/engines).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from infer_tune.endpoint.probe import EndpointError
from infer_tune.engines.base import Engine, served_here
from infer_tune.errors import ConfigError


@dataclass
class LocalServer:
    """A started engine: where to send requests, the model name it serves, and its log."""

    engine: str
    url: str
    served_model: str
    log_path: Path
    process: subprocess.Popen
    command: list[str]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def served_engine(engine: str) -> Engine:
    """The registry entry `local_server` starts for `engine` (a name or alias), ConfigError naming the choices."""
    served = served_here()
    if engine not in served:
        raise ConfigError(f"engine must be one of {', '.join(served)}, got {engine!r}")
    return served[engine]


def missing_modules(engine: str) -> list[str]:
    """The Python modules the engine's server needs that are not installed here."""
    return served_engine(engine).serve_here.missing()


def check_engine(engine: str, parallel: int = 1) -> None:
    entry = served_engine(engine)
    if not isinstance(parallel, int) or parallel < 1:
        raise ConfigError(f"parallel must be an integer >= 1, got {parallel}")
    entry.serve_here.check(parallel)
    missing = missing_modules(engine)
    if missing:
        raise ConfigError(f"engine {engine} needs {', '.join(missing)}; install them with "
                          f"pip install 'infer-tune[{entry.serve_here.extra}]'")


def engine_command(engine: str, model_ref: str, port: int, *, continuous_batching: bool = False,
                   threads: int | None = None, context_tokens: int = 2048, parallel: int = 1,
                   extra_args: Sequence[str] = ()) -> tuple[list[str], str]:
    """(command line, served model name) of an engine on 127.0.0.1:port, as its registry entry builds it;
    `extra_args` go to the engine as given."""
    return served_engine(engine).serve_here.command(model_ref, port, continuous_batching=continuous_batching,
                                                    threads=threads, context_tokens=context_tokens,
                                                    parallel=parallel, extra_args=extra_args)


class ServerExited(EndpointError):
    """The server process ended before it answered (`returncode`: negative, the signal that killed it)."""

    def __init__(self, message: str, returncode: int, log_path: Path) -> None:
        super().__init__(message)
        self.returncode, self.log_path = returncode, log_path


class ServerHung(EndpointError):
    """The server process lived but did not answer within `timeout_s` (it is stopped on the way out)."""

    def __init__(self, message: str, timeout_s: float, log_path: Path) -> None:
        super().__init__(message)
        self.timeout_s, self.log_path = timeout_s, log_path


def wait_ready(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Poll `GET {url}/models` until it answers 200; fail with the log's tail if the process exits
    (`ServerExited`) or time runs out (`ServerHung`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise ServerExited(f"the server exited with code {process.returncode} before it was ready: "
                               + " | ".join(tail), process.returncode, log_path)
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2) as response:  # noqa: S310 (loopback only)
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)  # polling interval while the engine loads its model
    if process.poll() is not None:  # it died while the last poll waited
        raise ServerExited(f"the server exited with code {process.returncode} before it was ready",
                           process.returncode, log_path)
    raise ServerHung(f"the server did not answer {url}/models within {timeout_s:g} s (log: {log_path})", timeout_s,
                     log_path)


def stop(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Terminate the server's process group, then kill what is left after `grace_s`."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(grace_s)


@contextlib.contextmanager
def local_server(engine: str, model_ref: str, *, continuous_batching: bool = False, threads: int | None = None,
                 startup_timeout_s: float = 300.0, log_dir: Path | None = None, parallel: int = 1,
                 extra_args: Sequence[str] = (), context_tokens: int = 2048) -> Iterator[LocalServer]:
    """Start `engine` serving `model_ref` on loopback; always stopped on exit (see module docstring)."""
    check_engine(engine, parallel)
    port = free_port()
    cmd, served = engine_command(engine, model_ref, port, continuous_batching=continuous_batching, threads=threads,
                                 parallel=parallel, extra_args=extra_args, context_tokens=context_tokens)
    env = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    with spawned(cmd, engine, port, env=env, log_dir=log_dir, startup_timeout_s=startup_timeout_s) as (url, process,
                                                                                                       log_path):
        yield LocalServer(engine, url, served, log_path, process, cmd)


@contextlib.contextmanager
def spawned(cmd: Sequence[str], name: str, port: int, *, env: dict[str, str] | None = None,
            log_dir: Path | None = None, startup_timeout_s: float = 300.0) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """Run a server command in its own session (offline, its output in a log), wait until it answers on
    127.0.0.1:`port`, and always stop its process group on the way out. Yields (url, process, log path)."""
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **(env or {}))
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="infer-tune-server-"))
    log_path = log_dir / f"{name.replace('.', '')}-{port}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=full_env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        wait_ready(url, process, log_path, startup_timeout_s)
        yield url, process, log_path
    finally:
        stop(process)
