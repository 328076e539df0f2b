"""A launch of a serving engine: the engine, its settings (KEY=VALUE) and the argv they make, started on
loopback, health-checked and always stopped (docs/endpoint.md, "Launching an engine").

The settings are the techniques of infer-tune as the engine's own flags (`SETTINGS`, one table per
engine). llama.cpp's `llama-server`:

| key | flag | technique |
|---|---|---|
| gguf | the `--model` file: f16, q8_0, q4_k_m, q4_k_s, q4_0, iq4_xs, iq4_nl, each 4-bit type as imatrix-<type>, or a .gguf path | quantization |
| cache_type_k / cache_type_v | `--cache-type-k` / `--cache-type-v` | KV cache |
| flash_attn | `--flash-attn on/off/auto` | KV cache |
| ctx_size | `--ctx-size` (per slot here: times `parallel`) | KV cache |
| draft, draft_max, draft_min, spec_type | `--model-draft`, `--spec-draft-n-max`, `--spec-draft-n-min`, `--spec-type` | speculative |
| parallel, batch_size, ubatch_size, cont_batching | `--parallel`, `--batch-size`, `--ubatch-size`, `--cont-batching` / `--no-cont-batching` | batching |
| override_tensor, n_cpu_moe | `--override-tensor`, `--n-cpu-moe` | experts |
| threads | `--threads` and `--threads-batch` | |
| repack | `--repack` / `--no-repack` (off: no weight repacking, no AMX buffer types at run time) | |
| amx | on: the llama-server of the AMX build (`$LLAMA_SERVER_AMX`, else `$INFER_TUNE_HOME/bin/amx/llama-server`: `GGML_AMX=ON VARIANT=amx TARGETS=llama-server scripts/build-llama-cpp.sh`), whose AMX matmul kernels the default build compiles out; refused where the CPU has no `amx_tile` or no such build is here | |

vLLM (`vllm serve`) and SGLang (`python -m sglang.launch_server`) take the same kind of table mapped to
their flags (`--quantization`, `--kv-cache-dtype`, `--speculative-config`, `--max-num-seqs`,
`--max-num-batched-tokens`, `--enable-expert-parallel` and SGLang's counterparts). Their executable is
`$INFER_TUNE_VLLM` / `$INFER_TUNE_SGLANG` (a command line, split like a shell's) when set, else `vllm` on PATH /
this Python's `-m sglang.launch_server`.

`preflight(launch)` says why a launch cannot run here (None when it can): a quantized V cache without flash
attention (llama.cpp refuses it), a cache type the engine does not have, a draft on more than one slot,
or memory: the weights (the GGUF's bytes) plus the KV cache (layers x context x KV heads x head size x
the cache types' bytes, from the checkpoint's config.json) against `MemAvailable`.
`started(launch)` starts the engine on 127.0.0.1 at a free port in its own process group, waits (bounded)
until `GET /v1/models` answers and stops the group on the way out, on errors and interrupts too. An engine
killed by a signal before it answered, or silent past the deadline, raises `engines.crash.EngineCrashed`
(the signal or the hang, its log's tail, a reproducer); one that exits with a code refused its argv.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from infer_tune.engines.base import ENGINES
from infer_tune.errors import ConfigError

# bytes per element of a KV cache type (blocks of 32 with their scales for the quantized ones)
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                    "iq4_nl": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32}
GGUF_TYPES = ("f16", "q8_0", "q4_k_m", "q4_k_s", "q4_0", "iq4_xs", "iq4_nl", "imatrix-q4_k_m", "imatrix-q4_k_s",
              "imatrix-q4_0", "imatrix-iq4_xs", "imatrix-iq4_nl")
FLASH = ("on", "off", "auto")
SPEC_TYPES = ("none", "draft-simple", "ngram-simple", "ngram-cache", "ngram-mod", "ngram-map-k")
MEMORY_HEADROOM = 1.15  # the estimate times this must fit in MemAvailable (buffers, the compute graph)


@dataclass(frozen=True)
class Setting:
    """One key of an engine's settings: its flag, the kind of value and, for a choice, the values."""

    flag: str | None  # None: handled by the engine's argv builder itself
    kind: str  # int, choice, bool, str
    choices: tuple[str, ...] = ()
    technique: str = ""
    help: str = ""

    def parse(self, key: str, raw: str):
        if self.kind == "int":
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"setting {key} takes an integer, got {raw!r}") from None
            if value < 0:
                raise ConfigError(f"setting {key} must be >= 0, got {value}")
            return value
        if self.kind == "bool":
            lowered = str(raw).lower()
            if lowered in ("1", "true", "on", "yes"):
                return True
            if lowered in ("0", "false", "off", "no"):
                return False
            raise ConfigError(f"setting {key} takes on or off, got {raw!r}")
        if self.kind == "choice" and raw.lower() not in self.choices:
            if key in ("gguf", "draft") and raw.lower().endswith(".gguf"):
                return raw
            raise ConfigError(f"setting {key} must be one of {', '.join(self.choices)}, got {raw!r}")
        return raw.lower() if self.kind == "choice" else raw


LLAMA_CPP = {
    "gguf": Setting(None, "choice", GGUF_TYPES, "quantize", "the GGUF type served (or a .gguf path)"),
    "cache_type_k": Setting("--cache-type-k", "choice", tuple(CACHE_TYPE_BYTES), "kv-cache"),
    "cache_type_v": Setting("--cache-type-v", "choice", tuple(CACHE_TYPE_BYTES), "kv-cache"),
    "flash_attn": Setting("--flash-attn", "choice", FLASH, "kv-cache"),
    "ctx_size": Setting(None, "int", technique="kv-cache", help="context tokens per slot"),
    "draft": Setting(None, "choice", GGUF_TYPES, "speculate", "the draft GGUF (--model-draft)"),
    "draft_max": Setting("--spec-draft-n-max", "int", technique="speculate"),
    "draft_min": Setting("--spec-draft-n-min", "int", technique="speculate"),
    "spec_type": Setting("--spec-type", "choice", SPEC_TYPES, "speculate"),
    "parallel": Setting(None, "int", technique="batch"),
    "batch_size": Setting("--batch-size", "int", technique="batch"),
    "ubatch_size": Setting("--ubatch-size", "int", technique="batch"),
    "cont_batching": Setting(None, "bool", technique="batch"),
    "override_tensor": Setting("--override-tensor", "str", technique="experts"),
    "n_cpu_moe": Setting("--n-cpu-moe", "int", technique="experts"),
    "threads": Setting(None, "int"),
    "repack": Setting(None, "bool", help="weight repacking and the AMX buffer types (off: --no-repack)"),
    "amx": Setting(None, "bool", help="on: the AMX build's llama-server (its AMX matmul kernels; llamacpp.AMX_VARIANT)"),
}
VLLM_QUANT = ("awq", "gptq", "fp8", "bitsandbytes", "gguf", "compressed-tensors", "marlin", "awq_marlin",
              "gptq_marlin", "experts_int8")
VLLM_KV = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
VLLM = {
    "quantization": Setting("--quantization", "choice", VLLM_QUANT, "quantize"),
    "kv_cache_dtype": Setting("--kv-cache-dtype", "choice", VLLM_KV, "kv-cache"),
    "max_model_len": Setting("--max-model-len", "int", technique="kv-cache"),
    "draft": Setting(None, "str", technique="speculate", help="the draft model (--speculative-config)"),
    "speculative_method": Setting(None, "choice", ("draft_model", "ngram", "eagle", "eagle3", "mtp"), "speculate"),
    "num_speculative_tokens": Setting(None, "int", technique="speculate"),
    "max_num_seqs": Setting("--max-num-seqs", "int", technique="batch"),
    "max_num_batched_tokens": Setting("--max-num-batched-tokens", "int", technique="batch"),
    "expert_parallel": Setting("--enable-expert-parallel", "bool", technique="experts"),
    "tensor_parallel_size": Setting("--tensor-parallel-size", "int"),
    "gpu_memory_utilization": Setting("--gpu-memory-utilization", "str"),
}
SGLANG_QUANT = ("awq", "gptq", "fp8", "w8a8_int8", "w8a8_fp8", "bitsandbytes", "gguf", "compressed-tensors")
SGLANG_KV = ("auto", "fp8_e4m3", "fp8_e5m2")
SGLANG = {
    "quantization": Setting("--quantization", "choice", SGLANG_QUANT, "quantize"),
    "kv_cache_dtype": Setting("--kv-cache-dtype", "choice", SGLANG_KV, "kv-cache"),
    "max_model_len": Setting("--context-length", "int", technique="kv-cache"),
    "draft": Setting("--speculative-draft-model-path", "str", technique="speculate"),
    "speculative_method": Setting("--speculative-algorithm", "choice", ("eagle", "eagle3", "nextn", "standalone"),
                                  "speculate"),
    "num_speculative_tokens": Setting("--speculative-num-draft-tokens", "int", technique="speculate"),
    "max_num_seqs": Setting("--max-running-requests", "int", technique="batch"),
    "max_num_batched_tokens": Setting("--chunked-prefill-size", "int", technique="batch"),
    "expert_parallel": Setting(None, "bool", technique="experts", help="--ep-size = tensor_parallel_size"),
    "tensor_parallel_size": Setting("--tp-size", "int"),
    "gpu_memory_utilization": Setting("--mem-fraction-static", "str"),
}
SETTINGS = {"llama.cpp": LLAMA_CPP, "vllm": VLLM, "sglang": SGLANG}


def check_engine(engine: str) -> str:
    """`engine` when it is a registered engine launched from a settings table (engines/launched.py)."""
    launched = [e.name for e in ENGINES.values() if e.setting_table is not None]
    if engine not in launched:
        raise ConfigError(f"--engine must be one of {', '.join(launched)}, got {engine!r}")
    return engine


def parse_settings(engine: str, pairs) -> dict:
    """`KEY=VALUE` strings (or a mapping) -> checked settings of `engine` (ConfigError names the bad one)."""
    table = SETTINGS[check_engine(engine)]
    items = pairs.items() if isinstance(pairs, dict) else []
    if not isinstance(pairs, dict):
        parsed = []
        for pair in pairs or ():
            key, sep, value = str(pair).partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--set takes KEY=VALUE, got {pair!r}")
            parsed.append((key.strip().replace("-", "_"), value.strip()))
        items = parsed
    out: dict = {}
    for key, value in items:
        if key not in table:
            raise ConfigError(f"{engine} has no setting {key!r}; settings: {', '.join(table)}")
        out[key] = table[key].parse(key, _show(value))
    return out


@dataclass
class Launch:
    """An engine and its settings; `model` is the infer-tune model reference (its checkpoint, or GGUFs of it)."""

    engine: str
    model: str
    settings: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.settings = parse_settings(self.engine, dict(self.settings))

    @property
    def label(self) -> str:
        if not self.settings:
            return f"{self.engine} default"
        return f"{self.engine} " + " ".join(f"{k}={_show(v)}" for k, v in self.settings.items())

    def get(self, key: str, default=None):
        return self.settings.get(key, default)

    def parallel(self) -> int:
        return int(self.get("parallel", 1) or 1)

    def to_dict(self) -> dict:
        return {"engine": self.engine, "model": self.model, "settings": {k: _show(v) for k, v in self.settings.items()}}


def _show(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


# --------------------------------------------------------------------------- argv
def argv(launch: Launch, port: int, *, files: dict[str, Path] | None = None, threads: int | None = None) -> list[str]:
    """The engine's command line on 127.0.0.1:port. `files`: the resolved GGUFs of llama.cpp (`model`,
    `draft`); for vLLM / SGLang the model is `launch.model` as given (a checkpoint or hub id)."""
    if launch.engine == "llama.cpp":
        return _llama_argv(launch, port, files or {}, threads)
    if launch.engine == "vllm":
        return _vllm_argv(launch, port)
    return _sglang_argv(launch, port)


def _flags(table: dict[str, Setting], settings: dict) -> list[str]:
    out: list[str] = []
    for key, value in settings.items():
        flag = table[key].flag
        if flag is None:
            continue
        if table[key].kind == "bool":
            out += [flag] if value else []
        else:
            out += [flag, str(value)]
    return out


def _llama_argv(launch: Launch, port: int, files: dict[str, Path], threads: int | None) -> list[str]:
    from infer_tune.engines import llamacpp

    binary = llamacpp.tool("llama-server", variant=llamacpp.AMX_VARIANT if launch.get("amx") else None)
    if binary is None:
        raise ConfigError(f"llama.cpp's llama-server is not built here: {llamacpp.BUILD_HINT}"
                          + (f" ({llamacpp.AMX_HINT})" if launch.get("amx") else ""))
    if "model" not in files:
        raise ConfigError("a llama.cpp launch needs its GGUF resolved (engines.launch.resolve_files)")
    parallel = launch.parallel()
    ctx = int(launch.get("ctx_size", 2048))
    cmd = [str(binary), "--model", str(files["model"]), "--alias", launch.model, "--host", "127.0.0.1",
           "--port", str(port), "--ctx-size", str(ctx * parallel), "--parallel", str(parallel),
           "--no-cache-prompt", "--cache-ram", "0", "--no-webui"]
    cmd.append("--cont-batching" if launch.get("cont_batching", True) else "--no-cont-batching")
    if "draft" in files:
        cmd += ["--model-draft", str(files["draft"])]
    threads = launch.get("threads", threads)
    if threads:
        cmd += ["--threads", str(threads), "--threads-batch", str(threads)]
    if "repack" in launch.settings:
        cmd.append("--repack" if launch.get("repack") else "--no-repack")
    return cmd + _flags(LLAMA_CPP, launch.settings)


def _engine_prefix(engine: str) -> list[str]:
    given = os.environ.get(f"INFER_TUNE_{engine.upper()}")
    if given:
        return shlex.split(given)
    if engine == "vllm":
        found = shutil.which("vllm")
        if found is None:
            raise ConfigError("vLLM is not installed here (no vllm on PATH; set INFER_TUNE_VLLM to its command)")
        return [found, "serve"]
    return [sys.executable, "-m", "sglang.launch_server"]


def _vllm_argv(launch: Launch, port: int) -> list[str]:
    cmd = _engine_prefix("vllm") + [launch.model, "--host", "127.0.0.1", "--port", str(port),
                                    "--served-model-name", launch.model]
    s = launch.settings
    if "draft" in s or "speculative_method" in s:
        method = s.get("speculative_method", "draft_model" if "draft" in s else "ngram")
        config = {"method": method, "num_speculative_tokens": s.get("num_speculative_tokens", 3)}
        if "draft" in s:
            config["model"] = s["draft"]
        if method == "ngram":
            config.update(prompt_lookup_max=4, prompt_lookup_min=2)
        cmd += ["--speculative-config", json.dumps(config, sort_keys=True)]
    return cmd + _flags(VLLM, s)


def _sglang_argv(launch: Launch, port: int) -> list[str]:
    cmd = _engine_prefix("sglang") + ["--model-path", launch.model, "--host", "127.0.0.1", "--port", str(port),
                                      "--served-model-name", launch.model]
    s = launch.settings
    if "draft" in s and "speculative_method" not in s:
        cmd += ["--speculative-algorithm", "standalone"]
    if s.get("expert_parallel"):
        cmd += ["--ep-size", str(s.get("tensor_parallel_size", 1))]
    return cmd + _flags(SGLANG, s)


# --------------------------------------------------------------------------- files and preflight
def checkpoint_of(launch: Launch) -> Path:
    from infer_tune import models

    return Path(models.resolve(launch.model))


def gguf_path(checkpoint: Path, choice: str, *, threads: int | None = None, calibration: Path | None = None) -> Path:
    """The GGUF a `gguf` / `draft` setting names: a path as given, a type made by engines.llamacpp, or an
    imatrix-calibrated type made by engines.calibrate on `calibration` (the suite's own text)."""
    from infer_tune.engines import calibrate, llamacpp

    if choice.lower().endswith(".gguf"):
        path = Path(choice).expanduser()
        if not path.is_file():
            raise ConfigError(f"no GGUF at {path}")
        return path
    if choice.startswith("imatrix-"):
        if calibration is None:
            raise ConfigError(f"{choice} is calibrated on the suite's text: no calibration text was given")
        return calibrate.imatrix_gguf(checkpoint, choice.removeprefix("imatrix-"), calibration, threads=threads)
    return llamacpp.gguf(checkpoint, choice, threads=threads)


def resolve_files(launch: Launch, *, threads: int | None = None, calibration: Path | None = None) -> dict[str, Path]:
    """llama.cpp: the GGUFs the launch serves (made and cached on first use); other engines: none."""
    if launch.engine != "llama.cpp":
        return {}
    if launch.model.lower().endswith(".gguf"):
        files = {"model": Path(launch.model).expanduser()}
    else:
        checkpoint = checkpoint_of(launch)
        files = {"model": gguf_path(checkpoint, launch.get("gguf", "f16"), threads=threads, calibration=calibration)}
        if launch.get("draft"):
            files["draft"] = gguf_path(checkpoint, launch.get("draft"), threads=threads, calibration=calibration)
    return files


def kv_cache_bytes(config: dict, tokens: int, type_k: str = "f16", type_v: str = "f16") -> int:
    """Bytes of a KV cache of `tokens` positions for a model config (config.json's keys)."""
    layers = int(config.get("num_hidden_layers") or config.get("n_layer") or 0)
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size") or 0) // heads))
    per_token = layers * kv_heads * head_dim * (CACHE_TYPE_BYTES[type_k] + CACHE_TYPE_BYTES[type_v])
    return int(per_token * tokens)


def available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def estimate_bytes(launch: Launch, files: dict[str, Path], model_config: dict | None) -> int | None:
    """Weights (the GGUFs' bytes) plus the KV cache of every slot; None when unknown."""
    if not files:
        return None
    weights = sum(p.stat().st_size for p in files.values() if p.is_file())
    kv = 0
    if model_config:
        tokens = int(launch.get("ctx_size", 2048)) * launch.parallel()
        kv = kv_cache_bytes(model_config, tokens, launch.get("cache_type_k", "f16"), launch.get("cache_type_v", "f16"))
        if "draft" in files:
            kv *= 2  # the draft has its own cache (the same shape at worst: a smaller model's is smaller)
    return weights + kv


def preflight(launch: Launch, files: dict[str, Path] | None = None, model_config: dict | None = None,
              available: int | None = None) -> str | None:
    """Why `launch` cannot run on this host, or None (see the module docstring)."""
    s = launch.settings
    if launch.engine == "llama.cpp":
        type_v = s.get("cache_type_v", "f16")
        if type_v not in ("f16", "f32", "bf16") and s.get("flash_attn") == "off":
            return f"a {type_v} V cache needs flash attention (llama.cpp quantizes V only inside it), flash_attn=off"
        if (s.get("draft") or s.get("spec_type") == "draft-simple") and launch.parallel() > 1:
            return "a draft model speculates for one slot here: parallel > 1 with a draft is not measured"
        if s.get("spec_type") == "draft-simple" and not s.get("draft"):
            return "spec_type draft-simple needs a draft GGUF (draft=...)"
        if s.get("ubatch_size") and s.get("batch_size") and s["ubatch_size"] > s["batch_size"]:
            return f"ubatch_size {s['ubatch_size']} > batch_size {s['batch_size']}"
        if launch.parallel() < 1:
            return "parallel must be >= 1"
        if s.get("amx"):
            from infer_tune import env as envinfo
            from infer_tune.engines import llamacpp

            if "amx_tile" not in envinfo.cpu_flags():
                return "amx=on: this CPU has no AMX (no amx_tile flag)"
            if llamacpp.tool("llama-server", variant=llamacpp.AMX_VARIANT) is None:
                return f"amx=on: no AMX build of llama-server here ({llamacpp.AMX_HINT})"
        needed = estimate_bytes(launch, files or {}, model_config)
        free = available_bytes() if available is None else available
        if needed is not None and free is not None and needed * MEMORY_HEADROOM > free:
            return (f"needs about {needed / 2**20:.0f} MiB (weights + KV cache) x {MEMORY_HEADROOM:g}, "
                    f"{free / 2**20:.0f} MiB available")
        return None
    if launch.engine == "vllm" and s.get("speculative_method") == "draft_model" and not s.get("draft"):
        return "speculative_method draft_model needs draft=<model>"
    if launch.engine == "sglang" and s.get("speculative_method") and not s.get("draft") \
            and s["speculative_method"] in ("eagle", "eagle3", "standalone"):
        return f"speculative_method {s['speculative_method']} needs draft=<model>"
    return None


def amx_ready() -> bool:
    """Whether an `amx=on` launch can start here: the CPU has AMX and the AMX build of llama-server is present."""
    from infer_tune import env as envinfo
    from infer_tune.engines import llamacpp

    try:
        return "amx_tile" in envinfo.cpu_flags() and llamacpp.tool("llama-server", variant=llamacpp.AMX_VARIANT) is not None
    except ConfigError:  # an AMX build another account could have written: not tried (preflight says why)
        return False


def model_config(launch: Launch) -> dict | None:
    try:
        return json.loads((checkpoint_of(launch) / "config.json").read_text())
    except (OSError, ValueError, ConfigError):
        return None


# --------------------------------------------------------------------------- running
@dataclass
class Started:
    """A running launch: where it answers, the argv, its files and log."""

    launch: Launch
    url: str
    served_model: str
    command: list[str]
    files: dict[str, Path]
    log_path: Path
    process: subprocess.Popen

    def record(self) -> dict:
        """What a result row keeps of the launch (`config.launch`)."""
        from infer_tune import contenthash
        from infer_tune.engines import llamacpp

        out = {**self.launch.to_dict(), "argv": [Path(self.command[0]).name] + self.command[1:]}
        if self.launch.engine == "llama.cpp":
            out["gguf"] = {k: {"path": str(p), "bytes": p.stat().st_size, "sha256": contenthash.file_digest(p),
                               **({"imatrix": llamacpp.gguf_facts(p).get("imatrix")}
                                  if llamacpp.gguf_facts(p).get("imatrix") else {})}
                           for k, p in self.files.items()}
            info = llamacpp.build_info()
            out["llama_cpp"] = {k: info.get(k) for k in ("commit", "build_number", "source_package", "system_info")
                                if info.get(k)}
        return out

    def weight_bytes(self) -> int | None:
        path = self.files.get("model")
        return path.stat().st_size if path is not None and path.is_file() else None


@contextlib.contextmanager
def started(launch: Launch, *, threads: int | None = None, calibration: Path | None = None,
            startup_timeout_s: float = 300.0, log_dir: Path | None = None, check: bool = True) -> Iterator[Started]:
    """Start `launch` on loopback (after its preflight), wait until it answers, stop it on the way out."""
    from infer_tune.endpoint import servers
    from infer_tune.engines import crash

    files = resolve_files(launch, threads=threads, calibration=calibration)
    if check:
        why = preflight(launch, files, model_config(launch) if launch.engine == "llama.cpp" else None)
        if why:
            raise ConfigError(f"{launch.label}: refused in preflight: {why}")
    port = servers.free_port()
    cmd = argv(launch, port, files=files, threads=threads)
    try:
        with servers.spawned(cmd, launch.engine, port, log_dir=log_dir, startup_timeout_s=startup_timeout_s) as (
                url, process, log_path):
            yield Started(launch, url, launch.model, cmd, files, log_path, process)
    except servers.ServerHung as exc:  # a hang before it answered: a crash (engines.crash), stopped by spawned
        raise crash.EngineCrashed(crash.crash_of(launch, cmd, files, phase="start", hung_after_s=exc.timeout_s,
                                                 log_path=exc.log_path)) from exc
    except servers.ServerExited as exc:  # killed by a signal: a crash; an exit code: the engine refused its argv
        if not crash.is_crash(exc.returncode, "start"):
            raise
        raise crash.EngineCrashed(crash.crash_of(launch, cmd, files, phase="start", returncode=exc.returncode,
                                                 log_path=exc.log_path)) from exc
