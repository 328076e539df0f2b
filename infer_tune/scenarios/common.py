"""What every scenario does first: threads, device, suite, model, inputs, environment, run context."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

from infer_tune import models
from infer_tune.errors import ConfigError, InferTuneError
from infer_tune.runners.base import Progress
from infer_tune.tuners.base import RunContext
from infer_tune.workload import Inputs, Protocol, Workload, check_context, iter_prompts, prepare_inputs


@dataclass
class RunSpec:
    """Where and how to measure: the model, the workload, the protocol and the run's settings."""

    model: str = models.DEFAULT_MODEL
    weights: str = "pretrained"  # or random / random:SEED (weights.py)
    workload: Workload = field(default_factory=Workload)
    protocol: Protocol = field(default_factory=Protocol)
    threads: int | None = None
    device: str = "cpu"
    dtype: str = "auto"
    out_dir: Path = Path("runs")
    trust_remote_code: bool = False
    measure_ppl: bool = True
    execute: bool | str = False  # True: pass@1 in the OS sandbox; "unsafe": without one (see open_run)
    unsafe_execute: bool = False  # allow running generated code unsandboxed where no sandbox works
    resume: bool = False


@dataclass
class OpenRun:
    loaded: models.LoadedModel
    inputs: Inputs
    ctx: RunContext


def setup_threads(threads: int | None) -> int:
    """Apply a thread count to torch before any work. Default: `OMP_NUM_THREADS` when it is set to a positive
    integer (what torch itself starts with), else the physical cores."""
    import psutil
    import torch

    if threads is not None and threads < 1:
        raise InferTuneError(f"threads must be >= 1, got {threads}")
    n = threads or omp_threads() or psutil.cpu_count(logical=False) or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def omp_threads() -> int | None:
    """`OMP_NUM_THREADS` as a positive integer; None when unset or not one (OpenMP ignores those too)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InferTuneError("device cuda asked for, but torch sees no CUDA device; use cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise InferTuneError(f"unknown device '{device}': use cpu, cuda or auto")
    return device


def check_execute(spec: RunSpec) -> None:
    """Before any work: pass@1 needs the OS sandbox, or the user's explicit consent to run without it
    (then `spec.execute` becomes "unsafe", so the run and its fingerprint record how the code ran)."""
    if not spec.execute or spec.execute == "unsafe":
        return
    from infer_tune.metrics import sandbox

    if not sandbox.available() and spec.unsafe_execute:
        spec.execute = "unsafe"
        _say_memory_limit("per process")
        return
    _say_memory_limit(sandbox.require().memory_limit)


def _say_memory_limit(where: str) -> None:
    """Where no cgroup holds the generated programs' memory, say so before the run (the row says it too)."""
    if where == "per process":
        import sys

        print("note: no cgroup here: pass@1's memory limit holds per process (a program's children can each "
              "take as much; the row records pass_at_1_memory_limit: per process)", file=sys.stderr)


def check_context_early(spec: RunSpec) -> None:
    """Before the weights load: max_new_tokens alone must leave room for a prompt in the model's
    context (read from a local config.json; prepare_inputs checks the real prompts afterwards)."""
    import json
    from types import SimpleNamespace

    from infer_tune import weights

    if weights.parse(spec.weights).random:
        return  # the architecture's config is read when the model is built; prepare_inputs checks the prompts
    try:
        folder = Path(models.resolve(spec.model, pull=False))
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (InferTuneError, OSError, ValueError):
        return  # not local, or unreadable: the load says why
    if isinstance(config, dict):
        nested = config.get("text_config")
        namespace = SimpleNamespace(**{k: v for k, v in config.items() if k.isidentifier() and k != "text_config"},
                                    text_config=SimpleNamespace(**nested) if isinstance(nested, dict) else None)
        check_context(namespace, 1, spec.workload.max_new_tokens, spec.model, prompt="a prompt (at least 1 token)")


def open_run(spec: RunSpec, progress: Progress | None = None, *, load_suite: bool = True,
             lazy_weights: bool = False) -> OpenRun:
    """Threads and device set, the suite loaded (bad suites fail before the model loads), the model
    loaded, the inputs tokenized, the environment recorded. `lazy_weights`: random weights that would not
    fit are left unfilled (`models.load_random`; the caller compares with `reference_that_fits`)."""
    from infer_tune import env as envinfo
    from infer_tune import paths

    paths.ensure_writable(spec.out_dir, "the runs directory (out_dir)")
    paths.ensure_writable(paths.home(), "INFER_TUNE_HOME")
    n_threads = setup_threads(spec.threads)
    device = resolve_device(spec.device)
    prompts = iter_prompts(spec.workload) if load_suite else None
    if spec.execute and prompts is not None:
        first = next(prompts)  # the suite is not empty (checked when it was opened)
        if not first.extra.get("test"):
            raise ConfigError(f"pass@1 needs a suite with tests (e.g. code); '{spec.workload.suite}' has none")
        prompts = itertools.chain([first], prompts)
    check_execute(spec)  # after the suite's check: bad input gets its one line before any note of the sandbox's
    check_context_early(spec)
    loaded = models.load(spec.model, dtype=spec.dtype, device=device, trust_remote_code=spec.trust_remote_code,
                         weights=spec.weights, lazy=lazy_weights)
    inputs = prepare_inputs(loaded, spec.workload, prompts) if load_suite else None
    ctx = RunContext(device=device, dtype=spec.dtype, threads=n_threads, out_dir=Path(spec.out_dir).expanduser(),
                     env=envinfo.collect_env(n_threads), progress=progress,
                     trust_remote_code=spec.trust_remote_code)
    return OpenRun(loaded=loaded, inputs=inputs, ctx=ctx)


def reference_that_fits(loaded: models.LoadedModel, configs: list, device: str = "cpu"):
    """(configs, plan) for a model loaded unfilled (`models.load_random(lazy=True)`: the model as loaded does not
    fit): no plain baseline is measured; the first row is a reference that fits (bf16, else int8-dynamic, by
    `weights.footprint`), measured first, and every row is compared with it (`SweepPlan(reference="first")`),
    each saying so in `compared_with` and `baseline_skipped`. Every config must build layer by layer from the
    skeleton (a quantized method that needs no activations, alone or first in a stack); any other is refused
    in one line. A model that was built whole: (configs, None), the plain baseline as usual."""
    if loaded.materialized:
        return configs, None
    import sys

    from infer_tune import weights
    from infer_tune.sweep import SweepPlan
    from infer_tune.tuners.quantize import QuantizeConfig
    from infer_tune.tuners.quantize.apply import LAYERWISE_METHODS, builds_layer_by_layer

    def first_part(config):
        parts = config.parts()  # a stack's parts in order; any other config is its own one part
        return parts[0] if parts else None

    for config in configs:
        part = first_part(config)
        if not builds_layer_by_layer(part, device):
            raise ConfigError(f"{loaded.not_loaded}, so only methods built layer by layer run "
                              f"({', '.join(LAYERWISE_METHODS)}, torch backend, alone or first in a stack); "
                              f"'{config.label()}' is not one")
    available = models._available_bytes()
    params = models.count_params(loaded.model)
    needs = {method: weights.footprint(loaded.weights.config, per_param, params=params)
             for method, per_param in (("bf16", 2.0), ("int8-dynamic", 1.0))}
    method = next((m for m, need in needs.items() if weights.fits(need, available)), None)
    if method is None:
        raise ConfigError(f"{loaded.not_loaded}, and neither a bf16 nor an int8 reference fits "
                          f"({needs['int8-dynamic'] / 2**30:.1f} GiB for int8); use a smaller model")
    need = needs[method]
    reference = QuantizeConfig(method=method)
    rest = [c for c in configs if c != reference]
    compared = f"quantize {reference.label()} (measured first in this sweep; the baseline was skipped)"
    print(f"note: {loaded.not_loaded}; the baseline is skipped and every row is compared with {reference.label()} "
          f"(about {need / 2**30:.1f} GiB)", file=sys.stderr)

    def admit(config, workload, inputs, earlier):
        from infer_tune.sweep import Admission

        facts = {"baseline_skipped": loaded.not_loaded,
                 "compared_with": "itself: the reference" if config == reference else compared}
        return Admission(metrics=facts)

    return [reference, *rest], SweepPlan(reference="first", admit=admit)
