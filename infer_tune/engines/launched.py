"""The engines infer-tune launches on loopback: `llama.cpp` (llama-server), `vllm`, `sglang`; their settings
are engines/launch.py's tables (`SETTINGS`), each key tagged with the technique it is. Registered on import
(engines/base.py); started by `launch.started`, measured by the endpoint runner."""

from __future__ import annotations

from infer_tune.engines import launch
from infer_tune.engines.base import Engine, register_engine


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
    name="llama.cpp", starts="server", runner="endpoint", aliases=("llama-cpp",),
    description="llama.cpp's llama-server on a GGUF of the checkpoint (engines/launch.py, engines/llamacpp.py)",
    techniques={**_techniques(launch.LLAMA_CPP), "llama-cpp": "the llama-cpp technique's GGUF and server"},
    unsupported=_OWN, version=_llama_version, argv=_argv, setting_table=launch.LLAMA_CPP, selectable=False,
    parse_settings=_parser("llama.cpp"), scenario=SCENARIO,
    searched_here=True,
))
VLLM = register_engine(Engine(
    name="vllm", starts="server", runner="endpoint", selectable=False,
    description="vLLM's `vllm serve` ($INFER_TUNE_VLLM or vllm on PATH)",
    techniques=_techniques(launch.VLLM), unsupported=_OWN, version=_package_version("vllm"), argv=_argv,
    setting_table=launch.VLLM, parse_settings=_parser("vllm"), scenario=SCENARIO,
))
SGLANG = register_engine(Engine(
    name="sglang", starts="server", runner="endpoint", selectable=False,
    description="SGLang's `python -m sglang.launch_server` ($INFER_TUNE_SGLANG)",
    techniques=_techniques(launch.SGLANG), unsupported=_OWN, version=_package_version("sglang"), argv=_argv,
    setting_table=launch.SGLANG, parse_settings=_parser("sglang"), scenario=SCENARIO,
))
