"""OpenVINO GenAI as a second local engine: the checkpoint exported to OpenVINO IR with compressed weights, run
in-process by `openvino_genai.LLMPipeline`, timed token by token (docs/engines.md, "OpenVINO").

- The runtime (`openvino-genai`, which brings `openvino` and `openvino-tokenizers`) installs beside the project
  in its own venv: it changes no package there (`pip install openvino-genai==2026.4.1.0`, ~200 MB). `available()`
  says why it cannot run (package missing, no CPU device), None when it can.
- The exporter (`optimum-intel[openvino]` 2.2.0 + `nncf`) pins `transformers<5.6`, older than the project's,
  so it lives in its own venv, `$INFER_TUNE_HOME/tools/openvino-export` (or the Python `$INFER_TUNE_OPENVINO_EXPORTER`
  names), made by `ensure_exporter()` on first use from PyPI with the project's CPU torch pinned, as the llama.cpp
  tools live outside the venv. `export(checkpoint, fmt)` runs `optimum-cli export openvino --weight-format
  int4|int8|fp16` (int4: nncf's group size, ratio and symmetric settings) there and caches the IR under
  `$INFER_TUNE_HOME/openvino/<checkpoint digest[:16]>/<settings key>/` (staged then renamed: atomic), with
  `export.json` beside it (the digest, the settings, the command, the seconds it took).
- `Settings`: the export's weight format and OpenVINO's runtime properties (`KV_CACHE_PRECISION` u8 / f16,
  `PERFORMANCE_HINT` LATENCY / THROUGHPUT, `INFERENCE_NUM_THREADS`), the continuous-batching scheduler
  (`SchedulerConfig`, with prefix caching) and prompt-lookup decoding (`prompt_lookup=True`, n-gram drafts from the
  prompt). `prepare()` builds the pipeline into a `PreparedModel` whose runner, `openvino`, is the closed loop of
  the generation runner (`measure_generation`) with OpenVINO's own decode: the rendered prompt's ids (the same
  tokenizer and chat template as an in-process row) given as `TokenizedInputs`, greedy, the step times stamped
  by a `StreamerBase` (one `write` per step: its tokens share the step's time). `protocol.pin_length`: every
  request decodes its full length (`ignore_eos`) and the output is cut where greedy first chose end-of-sequence.
- `perplexity()`: the exported model's logits (its `openvino_model.xml` compiled by `openvino.Core` with the
  same KV and hint properties), teacher-forced over the suite's references exactly as
  `metrics.perplexity.sequence_nll` scores the torch model: `ppl` of an OpenVINO row means what it means for an
  in-process row.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from infer_tune import atomic, contenthash, paths
from infer_tune.engines.base import Engine, register_engine
from infer_tune.errors import ConfigError, InferTuneError

if TYPE_CHECKING:  # torch and transformers are imported where used: the engine registry imports this module
    import torch

    from infer_tune.metrics.perplexity import Scored
    from infer_tune.runners.base import GenerationRun, Progress, Protocol, TokenClock
    from infer_tune.runners.prepared import PreparedModel

ENGINE = "openvino"
RUNTIME_PIN = "openvino-genai==2026.4.1.0"
# the exporter's venv: optimum-intel's exporter and nncf, the project's CPU torch kept (a constraint, so pip never
# swaps it); torchvision (an optimum-intel requirement, unused by a text model) is removed after: the wheel PyPI
# resolves is built against another torch and breaks `import transformers` (torchvision::nms)
EXPORTER_PINS = ("optimum-intel[openvino]==2.2.0", "nncf==3.4.0", RUNTIME_PIN)
EXPORTER_TORCH = "torch==2.13.0"
EXPORTER_DIR = "tools/openvino-export"
EXPORTER_MARK = "infer-tune-exporter.json"
WEIGHT_FORMATS = ("int4", "int8", "fp16")
KV_PRECISIONS = ("u8", "f16", "f32")
HINTS = ("LATENCY", "THROUGHPUT")
PRECISIONS = ("f32", "bf16", "f16")  # INFERENCE_PRECISION_HINT: on a CPU with bf16 the plugin's default is bf16
DEFAULT_FORMAT = "int8"  # optimum-intel's default for a model this size, and the default row of `tune --engine`
INT4_GROUP_SIZE = 64  # nncf's default 128 does not divide SmolLM2's 576 channels (InvalidGroupSizeError)
EXPORT_TIMEOUT_S = 900.0
INSTALL_TIMEOUT_S = 1200.0


class OpenVINOError(InferTuneError):
    """The exporter or the runtime failed (the message holds its last lines)."""

    exit_code = 1


# --------------------------------------------------------------------------- availability
def runtime_missing() -> str | None:
    """Why `openvino_genai` cannot run here (None: it can): not installed, or OpenVINO sees no CPU device."""
    try:
        import openvino as ov
        import openvino_genai  # noqa: F401
    except ImportError as exc:
        return f"openvino-genai is not installed ({exc}); pip install {RUNTIME_PIN}"
    try:
        devices = ov.Core().available_devices
    except Exception as exc:  # noqa: BLE001 (the plugin's own error, whatever it is, is the reason)
        return f"OpenVINO cannot start its CPU plugin: {str(exc).splitlines()[0][:200]}"
    if "CPU" not in devices:
        return f"OpenVINO sees no CPU device on this host (devices: {', '.join(devices) or 'none'})"
    return None


def exporter_python() -> Path | None:
    """The Python of the exporter venv: `$INFER_TUNE_OPENVINO_EXPORTER`, else `$INFER_TUNE_HOME/tools/openvino-export`
    once `ensure_exporter` finished there (None: none)."""
    given = os.environ.get("INFER_TUNE_OPENVINO_EXPORTER")
    if given:
        return Path(given).expanduser()
    root = paths.home() / EXPORTER_DIR
    return root / "bin" / "python" if (root / EXPORTER_MARK).is_file() else None


def available(*, export: bool = True) -> str | None:
    """None when OpenVINO can run here (and, with `export`, its exporter is installed or can be); else why."""
    why = runtime_missing()
    if why or not export:
        return why
    if exporter_python() is None and sys.version_info < (3, 10):
        return "the OpenVINO exporter needs Python >= 3.10"
    return None


def ensure_exporter(progress: Progress | None = None) -> Path:
    """The exporter's Python, its venv made first when there is none (about a minute and 1.5 GB: torch CPU,
    transformers 5.5, optimum-intel, nncf). Staged beside its place and renamed when the install succeeded; a
    venv's `bin/python` finds its site-packages relative to itself, so the renamed venv works when called as
    `bin/python -m ...` (what `export` does)."""
    found = exporter_python()
    if found is not None:
        return found
    final = paths.home() / EXPORTER_DIR
    if progress:
        progress("installing the OpenVINO exporter (optimum-intel, nncf)", 0, 1)
    start = time.monotonic()
    env = clean_env()  # a PYTHONPATH that holds openvino would make pip skip it here ("already satisfied")
    with atomic.staged_dir(final, exists="keep") as tmp:
        _run([sys.executable, "-m", "venv", str(tmp)], "python -m venv", INSTALL_TIMEOUT_S, env=env)
        pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        _run(pip + [EXPORTER_TORCH], "pip install torch", INSTALL_TIMEOUT_S, env=env)
        constraint = tmp / "constraints.txt"
        constraint.write_text(EXPORTER_TORCH + "\n")
        _run(pip + ["-c", str(constraint), *EXPORTER_PINS], "pip install optimum-intel", INSTALL_TIMEOUT_S, env=env)
        _run([str(tmp / "bin" / "python"), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision"],
             "pip uninstall torchvision", INSTALL_TIMEOUT_S, env=env)
        _run([str(tmp / "bin" / "python"), "-c", "import openvino, nncf, optimum.intel, transformers"],
             "the exporter's imports", INSTALL_TIMEOUT_S, env=env)
        (tmp / EXPORTER_MARK).write_text(json.dumps({"pins": [EXPORTER_TORCH, *EXPORTER_PINS],
                                                     "seconds": round(time.monotonic() - start, 1)}))
    return final / "bin" / "python"


def clean_env() -> dict:
    """This environment without PYTHONPATH / PYTHONHOME (the exporter's venv must see only its own packages),
    offline for hubs (the checkpoint is local: nothing is fetched at export time)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _run(argv: list[str], what: str, timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise OpenVINOError(f"{what} took over {timeout_s:.0f} s") from None
    if done.returncode != 0:
        tail = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()
                and not line.startswith("WARNING: Location")][-6:]
        raise OpenVINOError(f"{what} failed (exit {done.returncode}): " + " | ".join(tail))
    return done


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    """One OpenVINO configuration: how the weights were exported and how the pipeline runs them.

    Export: `weight_format` (int4 / int8 / fp16) and, for int4, nncf's `group_size`, `ratio` (the share of
    layers in 4 bits, the rest int8) and `sym`. Runtime: `kv_cache_precision` (None: the plugin's default,
    u8 on this CPU), `hint` (PERFORMANCE_HINT), `precision` (INFERENCE_PRECISION_HINT: the activations' type;
    None: the plugin's default, bf16 where the CPU has it), `threads` (INFERENCE_NUM_THREADS), `scheduler` (the
    continuous-batching pipeline, `SchedulerConfig`), `prefix_caching` (its prefix cache), `prompt_lookup`
    (n-gram drafts from the prompt: `num_assistant_tokens` per step, `max_ngram_size`)."""

    weight_format: str = DEFAULT_FORMAT
    group_size: int | None = None
    ratio: float | None = None
    sym: bool = False
    kv_cache_precision: str | None = None
    hint: str | None = None
    precision: str | None = None
    threads: int | None = None
    scheduler: bool = False
    prefix_caching: bool = False
    prompt_lookup: bool = False
    num_assistant_tokens: int = 5
    max_ngram_size: int = 3

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise ConfigError(f"openvino weight_format must be one of {', '.join(WEIGHT_FORMATS)}, "
                              f"got {self.weight_format!r}")
        if self.kv_cache_precision is not None and self.kv_cache_precision not in KV_PRECISIONS:
            raise ConfigError(f"openvino kv_cache_precision must be one of {', '.join(KV_PRECISIONS)}, "
                              f"got {self.kv_cache_precision!r}")
        if self.hint is not None and self.hint not in HINTS:
            raise ConfigError(f"openvino hint must be one of {', '.join(HINTS)}, got {self.hint!r}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(f"openvino precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.weight_format != "int4" and (self.group_size or self.ratio is not None or self.sym):
            raise ConfigError("openvino group_size / ratio / sym apply to weight_format=int4")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise ConfigError(f"openvino ratio must be in (0, 1], got {self.ratio}")
        if self.prefix_caching and not self.scheduler:
            raise ConfigError("openvino prefix_caching needs scheduler=true (it is the scheduler's cache)")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"openvino threads must be >= 1, got {self.threads}")

    @classmethod
    def from_dict(cls, values: dict) -> Settings:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown openvino setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)

    def export_settings(self) -> dict:
        group = self.group_size or (INT4_GROUP_SIZE if self.weight_format == "int4" else None)
        return {"weight_format": self.weight_format, "group_size": group, "ratio": self.ratio, "sym": self.sym}

    def to_dict(self) -> dict:
        """The settings that differ from the defaults (what a row's config and label show)."""
        defaults = Settings()
        return {k: v for k, v in asdict(self).items() if v != getattr(defaults, k) or k == "weight_format"}

    @property
    def label(self) -> str:
        parts = [f"{k}={v}" for k, v in self.to_dict().items()]
        return "openvino " + " ".join(parts)

    def properties(self) -> dict:
        """OpenVINO's CPU properties for these settings (what LLMPipeline and compile_model take)."""
        import openvino as ov

        props: dict = {}
        if self.kv_cache_precision:
            props["KV_CACHE_PRECISION"] = {"u8": ov.Type.u8, "f16": ov.Type.f16, "f32": ov.Type.f32}[
                self.kv_cache_precision]
        if self.hint:
            props["PERFORMANCE_HINT"] = self.hint
        if self.precision:
            props["INFERENCE_PRECISION_HINT"] = self.precision
        if self.threads:
            props["INFERENCE_NUM_THREADS"] = int(self.threads)
        return props


# --------------------------------------------------------------------------- export
def export_key(settings: Settings) -> str:
    s = settings.export_settings()
    key = s["weight_format"]
    if s["weight_format"] == "int4":
        key += f"-g{s['group_size']}" + (f"-r{s['ratio']:g}" if s["ratio"] is not None else "") + \
            ("-sym" if s["sym"] else "-asym")
    return key


def export_argv(python: Path, checkpoint: Path, settings: Settings, out: Path) -> list[str]:
    s = settings.export_settings()
    argv = [str(python), "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(checkpoint),
            "--task", "text-generation-with-past", "--weight-format", s["weight_format"]]
    if s["weight_format"] == "int4":
        argv += ["--group-size", str(s["group_size"])]
        if s["ratio"] is not None:
            argv += ["--ratio", f"{s['ratio']:g}"]
        if s["sym"]:
            argv.append("--sym")
    return argv + [str(out)]


def export_dir(checkpoint: str | Path, settings: Settings) -> Path:
    digest = contenthash.tree_digest(checkpoint)
    return paths.home() / "openvino" / digest[:16] / export_key(settings)


def export(checkpoint: str | Path, settings: Settings, progress: Progress | None = None) -> Path:
    """The checkpoint as OpenVINO IR with `settings`' weight format: cached (the folder `export_dir` names), else
    exported by the exporter venv into a staging folder renamed into place when complete."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise ConfigError(f"openvino export needs a local checkpoint folder with config.json, got {checkpoint}")
    final = export_dir(checkpoint, settings)
    if (final / "export.json").is_file():
        return final
    python = ensure_exporter(progress)
    if progress:
        progress(f"exporting to OpenVINO IR ({export_key(settings)})", 0, 1)
    start = time.monotonic()
    with atomic.staged_dir(final, exists="keep") as tmp:
        argv = export_argv(python, checkpoint, settings, tmp)
        _run(argv, "optimum-cli export openvino", EXPORT_TIMEOUT_S, env=clean_env())
        if not (tmp / "openvino_model.xml").is_file() or not (tmp / "openvino_tokenizer.xml").is_file():
            raise OpenVINOError(f"the export wrote no openvino_model.xml / openvino_tokenizer.xml in {tmp}")
        (tmp / "export.json").write_text(json.dumps({
            "checkpoint": str(checkpoint), "checkpoint_sha256": contenthash.tree_digest(checkpoint),
            "settings": settings.export_settings(), "command": shlex.join(argv[:-1] + ["OUT"]),
            "seconds": round(time.monotonic() - start, 2)}, indent=1))
    return final


def export_record(folder: Path) -> dict:
    try:
        record = json.loads((Path(folder) / "export.json").read_text())
    except (OSError, ValueError):
        record = {}
    record["ir_bytes"] = sum(f.stat().st_size for f in Path(folder).glob("openvino_model.*"))
    record["path"] = str(folder)
    return record


# --------------------------------------------------------------------------- the pipeline and its runner
def pipeline(folder: Path, settings: Settings):
    import openvino_genai as og

    kwargs = dict(settings.properties())
    if settings.scheduler:
        config = og.SchedulerConfig()
        config.enable_prefix_caching = settings.prefix_caching
        config.cache_size = 1  # GB of KV blocks: SmolLM2's 2k-token context x a few sequences fits in far less
        kwargs["scheduler_config"] = config
    if settings.prompt_lookup:
        kwargs["prompt_lookup"] = True
    try:
        return og.LLMPipeline(str(folder), "CPU", **kwargs)
    except Exception as exc:  # noqa: BLE001 (OpenVINO's own errors are RuntimeErrors of any wording)
        raise OpenVINOError(f"LLMPipeline({folder}) failed: {str(exc).splitlines()[0][:300]}") from None


PROBE_TOKENS = 4
PROBE_DEADLINE_S = 180.0  # building and compiling a pipeline of a 135M model takes a few seconds here


def probe(args: dict) -> None:
    """Build the pipeline of `args["folder"]` with `args["settings"]` and decode PROBE_TOKENS greedy tokens: what
    the child of `probe_command` runs before the configuration is loaded into infer-tune's process."""
    import openvino_genai as og

    settings = Settings.from_dict(dict(args["settings"]))
    pipe = pipeline(Path(args["folder"]), settings)
    config = og.GenerationConfig()
    config.max_new_tokens = int(args.get("tokens", PROBE_TOKENS))
    config.apply_chat_template = False
    if settings.prompt_lookup:
        config.num_assistant_tokens = settings.num_assistant_tokens
        config.max_ngram_size = settings.max_ngram_size
    pipe.generate("The capital of France is", config)


def probe_command(folder: Path, settings: Settings) -> list[str]:
    """The child's command line (engines/probe.py): this Python, the engine, the folder and the settings."""
    args = {"folder": str(folder), "settings": asdict(settings), "tokens": PROBE_TOKENS}
    return [sys.executable, "-m", "infer_tune.engines.probe", ENGINE, json.dumps(args, sort_keys=True)]


class StepClock:
    """`openvino_genai.StreamerBase` subclass feeding a `TokenClock`: one `write` per decode step (a prompt-lookup
    step writes its accepted tokens at once), stamped with `perf_counter_ns` when it arrives."""

    def __new__(cls, clock: TokenClock):
        import openvino_genai as og

        class _Streamer(og.StreamerBase):
            def __init__(self) -> None:
                super().__init__()
                self.ids: list[int] = []

            def write(self, token):
                now = time.perf_counter_ns()
                tokens = list(token) if isinstance(token, (list, tuple)) else [int(token)]
                clock.step_ns.append(now)
                clock.step_tokens.append(len(tokens))
                self.ids.extend(int(t) for t in tokens)
                return og.StreamingStatus.RUNNING

            def end(self) -> None:
                pass

        return _Streamer()


def generation_config(pipe, settings: Settings, max_new_tokens: int, pin_length: bool):
    config = pipe.get_generation_config()
    config.max_new_tokens = max_new_tokens
    config.do_sample = False
    config.ignore_eos = bool(pin_length)
    if settings.prompt_lookup:
        config.num_assistant_tokens = settings.num_assistant_tokens
        config.max_ngram_size = settings.max_ngram_size
    return config


def decode_fn(prepared: PreparedModel, max_new_tokens: int, pin_length: bool):
    """`measure_generation`'s decode for an OpenVINO pipeline: each row of the batch one `generate` call on its
    own ids (no padding: OpenVINO's stateful pipeline runs one sequence), its steps stamped on the clock."""
    import openvino as ov
    import openvino_genai as og
    import torch

    pipe, settings = prepared.runner_options["pipeline"], prepared.runner_options["settings"]
    eos = set(prepared.runner_options["eos_ids"])
    config = generation_config(pipe, settings, max_new_tokens, pin_length)

    def decode(batch: dict[str, torch.Tensor], clock: TokenClock):
        rows, natural = [], []
        submit_ns = None
        for row in range(batch["input_ids"].shape[0]):
            ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].to(torch.int64).numpy()[None, :]
            inputs = og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(ids * 0 + 1))
            streamer = StepClock(clock)
            clock._prompt_seen = True
            start = time.perf_counter_ns()
            submit_ns = start if submit_ns is None else submit_ns
            result = pipe.generate(inputs, config, streamer)
            out = [int(t) for t in result.tokens[0]][:max_new_tokens]
            rows.append(out)
            natural.append(next((k for k, t in enumerate(out) if t in eos), None) if pin_length else None)
        width = max(len(r) for r in rows)
        generated = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], dtype=torch.long)
        return submit_ns, generated, natural

    return decode


def run_openvino(prepared: PreparedModel, inputs, workload, protocol: Protocol,
                 progress: Progress | None = None) -> GenerationRun:
    """The closed loop of the generation runner over an OpenVINO pipeline (module docstring)."""
    from infer_tune.runners.generation import measure_generation

    if workload.batch_size != 1:
        raise ConfigError("the openvino runner decodes one sequence per call: use batch_size 1")
    return measure_generation(prepared, inputs.batches, workload.max_new_tokens, protocol, progress=progress,
                              decode=decode_fn(prepared, workload.max_new_tokens, protocol.pin_length))


def prepare(folder: Path, settings: Settings, tokenizer, eos_ids: list[int]) -> PreparedModel:
    """A `PreparedModel` whose runner is `openvino`: the pipeline in `runner_options`, the IR's bytes declared
    (`extra_model_bytes`, what its roofline reads), the export's record in its facts."""
    from infer_tune.runners.base import RUNNERS, register_runner
    from infer_tune.runners.prepared import PreparedModel

    if ENGINE not in RUNNERS:  # registered with the first pipeline (its module is imported by the engine registry)
        register_runner(ENGINE, passes=True)(run_openvino)
    record = export_record(folder)
    pipe = pipeline(folder, settings)
    facts = {"openvino_ir_bytes": record["ir_bytes"], "openvino_weight_format": settings.weight_format}
    return PreparedModel(model=None, tokenizer=tokenizer, label=settings.label, device="cpu", metrics=facts,
                         extra_model_bytes=record["ir_bytes"], runner=ENGINE,
                         runner_options={"pipeline": pipe, "settings": settings, "eos_ids": list(eos_ids),
                                         "export": record})


# --------------------------------------------------------------------------- perplexity
PPL_CHUNK = 8  # targets per forward after the context's: each chunk reads the context and earlier chunks from the cache


def perplexity(folder: Path, settings: Settings, scored: list[Scored]) -> float | None:
    """exp(mean NLL) of the scored targets under the exported model compiled with the settings' properties: the
    figure `metrics.perplexity.sequence_nll` gives the torch model, from an empty state per sequence. The context
    runs as one forward, then the targets PPL_CHUNK at a time, so every target is scored against keys and values
    read back from the KV cache in its precision (a single teacher-forced forward attends to the fresh keys and
    scores a u8 and an f16 cache alike: 7.067 and 7.067 for int4 SmolLM2-135M)."""
    import numpy as np
    import openvino as ov
    import torch

    from infer_tune.metrics import perplexity as ppl_mod

    core = ov.Core()
    compiled = core.compile_model(str(Path(folder) / "openvino_model.xml"), "CPU", settings.properties())
    request = compiled.create_infer_request()
    names = {i.get_any_name() for i in compiled.inputs}
    total_nll, total_tokens = 0.0, 0
    for context, targets in scored:
        sequence = context + targets
        request.reset_state()
        logits_by_position = []
        bounds = [0, len(context)] + list(range(len(context) + PPL_CHUNK, len(sequence), PPL_CHUNK))
        bounds = sorted(set(b for b in bounds if b < len(sequence))) + [len(sequence)]
        for lo, hi in zip(bounds, bounds[1:]):
            ids = np.array([sequence[lo:hi]], dtype=np.int64)
            feed = {"input_ids": ids, "attention_mask": np.ones((1, hi), dtype=np.int64)}
            if "position_ids" in names:
                feed["position_ids"] = np.arange(lo, hi, dtype=np.int64)[None, :]
            if "beam_idx" in names:
                feed["beam_idx"] = np.zeros(1, dtype=np.int32)
            logits_by_position.append(np.asarray(request.infer(feed)[compiled.output("logits")][0], dtype=np.float32))
        logits = np.concatenate(logits_by_position)[len(context) - 1:-1]  # [R, V]: position p predicts p + 1
        total_nll += float(torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.tensor(targets),
                                                             reduction="sum"))
        total_tokens += len(targets)
    return ppl_mod.perplexity(total_nll, total_tokens)


_BOOLS = {"true": True, "on": True, "1": True, "yes": True, "false": False, "off": False, "0": False, "no": False}
_INTS = ("group_size", "threads", "num_assistant_tokens", "max_ngram_size")


def _value(key: str, value):
    """One `--set` value as the Settings field's type (a recipe's YAML values arrive typed already)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if isinstance(getattr(Settings(), key, None), bool):
            return _BOOLS[text.lower()]
        if key in _INTS:
            return int(text)
        if key == "ratio":
            return float(text)
    except (KeyError, ValueError):
        raise ConfigError(f"openvino {key} takes {'true / false' if key not in _INTS + ('ratio',) else 'a number'}, "
                          f"got {value!r}") from None
    return text.upper() if key in ("hint",) else text


def parse_settings(pairs) -> dict:
    """`KEY=VALUE` strings (`bench --engine openvino --set ...`) or a mapping (a recipe's `settings`) -> the
    checked settings that differ from OpenVINO's default (`Settings.to_dict`); ConfigError names a bad one."""
    if isinstance(pairs, dict):
        items = list(pairs.items())
    else:
        items = []
        for pair in pairs or ():
            key, sep, value = str(pair).partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--set takes KEY=VALUE, got {pair!r}")
            items.append((key.strip().replace("-", "_"), value))
    values = {key: _value(key, value) for key, value in items}
    return Settings.from_dict(values).to_dict()


def _version() -> dict:
    from importlib import metadata

    found = {}
    for package in ("openvino-genai", "openvino"):
        try:
            found[package.replace("-", "_")] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found


OPENVINO = register_engine(Engine(
    name=ENGINE, starts="in-process", runner=ENGINE, selectable=False,
    description="OpenVINO GenAI's LLMPipeline on the checkpoint exported to OpenVINO IR (engines/openvino.py); "
                "searched by tune --engine openvino",
    techniques={
        "quantize": "weight_format int4 / int8 / fp16 at export (nncf: group_size, ratio, sym)",
        "kv-cache": "kv_cache_precision (KV_CACHE_PRECISION u8 / f16 / f32)",
        "batch": "scheduler, prefix_caching (SchedulerConfig: continuous batching)",
        "speculate": "prompt_lookup, num_assistant_tokens, max_ngram_size (prompt-lookup decoding)",
    },
    unsupported={"lean": "the compiled loop is infer-tune's own engine",
                 "llama-cpp": "a GGUF runs on the llama.cpp engine"},
    version=_version, parse_settings=parse_settings, scenario="infer_tune.scenarios.openvino_tune", probe=probe,
    metric_keys=dict.fromkeys(("openvino_ir_bytes", "openvino_weight_format", "ppl_source"), "the exported IR"),
))
