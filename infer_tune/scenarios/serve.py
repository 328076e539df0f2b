"""`infer-tune serve`: a recipe's configuration (or `--model` / `--method`) served over HTTP by the slot
engine (docs/endpoint.md, "Serving").

What a configuration becomes is the `slots` engine's business (engines/slots.py): `supports(stack)` refuses
what it does not run with the reason (the server runs only what it runs exactly), `settings(stack)` gives
the weight configs to apply and the slot engine's settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from infer_tune.errors import ConfigError


@dataclass
class ServePlan:
    """What `serve` runs: the model, the weight configs applied in order, and the slot engine's settings."""

    model: str
    weights: list = dataclasses.field(default_factory=list)
    slots: int = 4
    compile: bool = True
    compile_prefill: bool = False
    every_bucket: bool = True
    native_step: bool = False
    speculate: int = 0  # prompt-lookup draft tokens a step (0: none)
    ngram: int = 2
    kv_dtype: str = "fp32"  # the native step's cache: fp32 or int8
    source: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        weights = "+".join(c.label() for c in self.weights) or "model weights as loaded"
        step = "native step" if self.native_step else ("compiled step" if self.compile else "eager step")
        spec = f", prompt-lookup drafts k={self.speculate}" if self.speculate else ""
        kv = f", {self.kv_dtype} KV cache" if self.kv_dtype != "fp32" else ""
        return f"{self.model} ({weights}), {self.slots} slot{'s' if self.slots != 1 else ''}, {step}{spec}{kv}"


def plan_from_config(model: str, config, source: str = "") -> ServePlan:
    """A ServePlan from one technique config (a stack's parts in phase order): the slots engine's settings
    (engines/slots.py), refused with its reason when the engine does not run the stack."""
    from infer_tune.engines.slots import SLOTS as engine  # the registry's entry `serve` runs

    why = engine.supports(config)
    if why:
        raise ConfigError(f"{why} ({config.label()})")
    return ServePlan(model=model, source=source, **engine.settings(config))


def plan_from_recipe(path: str, index: int | None = None, model: str | None = None) -> ServePlan:
    """The plan of a recipe's config: its only one, or `configs[index]` of its first stage."""
    from infer_tune.engines.slots import SLOTS
    from infer_tune.recipe import build_configs, engine_settings, expand_stages, load_recipe

    loaded = load_recipe(path)
    if engine_settings(loaded) is not None:  # a launched server or OpenVINO: run from its own settings
        raise ConfigError(f"recipe {path} names engine {loaded.engine}, run from its own settings: serve runs the "
                          f"{SLOTS.name} engine (measure that one with bench --recipe {path})")
    recipe = expand_stages(loaded)[0]
    configs = build_configs(recipe)
    if not configs:
        raise ConfigError(f"recipe {path} has no configs to serve")
    if index is None and len(configs) > 1:
        raise ConfigError(f"recipe {path} has {len(configs)} configs; pick one to serve with --config INDEX "
                          f"(0 .. {len(configs) - 1})")
    index = 0 if index is None else index
    if not 0 <= index < len(configs):
        raise ConfigError(f"--config must be 0 .. {len(configs) - 1} for recipe {path}, got {index}")
    ref = model or recipe.model
    if not ref:
        raise ConfigError(f"recipe {path} names no model: give --model")
    return plan_from_config(ref, configs[index], source=f"{path} configs[{index}]")


def plan_from_method(model: str, method: str, activations: str = "bf16") -> ServePlan:
    from infer_tune.tuners.quantize import QuantizeConfig

    return plan_from_config(model, QuantizeConfig(method=method, activations=activations),
                            source=f"--method {method}")


@dataclass
class Served:
    """A loaded model behind a started engine, ready for the HTTP server."""

    plan: ServePlan
    engine: object
    tokenizer: object
    served_model: str
    facts: dict
    warm_s: float


def build(plan: ServePlan, *, threads: int | None = None, max_context: int | None = None,
          max_waiting: int = 256, dtype: str = "auto", trust_remote_code: bool = False,
          prefill_chunk: int = 128, prefix_cache: bool = True, cache_mib: float = 1024.0) -> Served:
    """Load the model, apply the weight configs, make the batched-kernel choice for the slots, build the
    engine and warm every bucket (nothing compiles inside a request); the engine is not started."""
    import torch

    from infer_tune import paths
    from infer_tune.runners.generation import eos_ids
    from infer_tune.scenarios.common import OpenRun, RunSpec, open_run
    from infer_tune.tuners import apply
    from infer_tune.tuners.batch.serving import LiveSlots
    from infer_tune.tuners.batch.slots import prepare_model

    if plan.slots < 1:
        raise ConfigError(f"slots must be >= 1, got {plan.slots}")
    spec = RunSpec(model=plan.model, threads=threads, dtype=dtype, out_dir=paths.home() / "serve",
                   trust_remote_code=trust_remote_code, measure_ppl=False)
    run: OpenRun = open_run(spec, load_suite=False)
    loaded, model = run.loaded, run.loaded.model
    facts: dict = {}
    for config in plan.weights:
        prepared = apply(dataclasses.replace(loaded, model=model), config, run.ctx)
        model = prepared.model
        facts.update(prepared.metrics or {})
    model.eval()
    facts.update(prepare_model(model, plan.slots))
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 2048
    context = max_context or min(2048, limit)
    if context < 2 or context > limit:
        raise ConfigError(f"--context must be 2 .. {limit} (the model's positions), got {context}")
    tokenizer = loaded.tokenizer
    engine = LiveSlots(model, eos_ids(model, tokenizer), slots=plan.slots, max_context=context, compile=plan.compile,
                       compile_prefill=plan.compile_prefill, every_bucket=plan.every_bucket,
                       native_step=plan.native_step, max_waiting=max_waiting, prefill_chunk=prefill_chunk,
                       prefix_cache=prefix_cache, cache_mib=cache_mib, speculate=plan.speculate, ngram=plan.ngram,
                       kv_dtype=plan.kv_dtype)
    warm_ids = list(tokenizer("Hello")["input_ids"]) or [0]
    with torch.inference_mode():
        warm_s = engine.warm(warm_ids)
    facts.update(engine.engine.facts)
    served = Path(plan.model).name if Path(plan.model).expanduser().exists() else plan.model
    return Served(plan=plan, engine=engine, tokenizer=tokenizer, served_model=served, facts=facts, warm_s=warm_s)


def serve(served: Served, host: str, port: int, ready, *, sock=None, api_key: str | None = None,
          debug: bool = False) -> None:
    """Serve until SIGINT / SIGTERM: the engine in this (the main) thread, HTTP on another
    (infer_tune/endpoint/serving.py), on `sock` when given (taken before the model loaded)."""
    from infer_tune.endpoint.serving import OpenAIServer, serve_until_signal

    server = OpenAIServer(served.engine, served.tokenizer, served.served_model, max_waiting=served.engine.max_waiting,
                          api_key=api_key)
    try:
        serve_until_signal(server, host, port, ready, sock=sock, debug=debug)
    finally:
        served.engine.stop()
