"""KV cache: no cache, dynamic, static (optionally compiled), quantized and offloaded caches.

The registry entry only picks how `generate` builds its cache (through `generate_kwargs`); the
model is unchanged. In a stack whose lean, speculate (engine lean) or batch (engine lean) part runs the native
step (`runs_native_step`), the cache is that step's own (infer_tune/native/step.py `NativeCache`, preallocated
and written in place), and the kv-cache part chooses it: impl `static` its fp32 cache, `quantized` with
`kv_backend: native` (8 bits) its int8 cache (each key and value vector of a head stored as int8 with one fp32
scale, a quarter of fp32's bytes; `native_kv_dtype`); any other impl is refused there, and the native backend is
refused without a native step. The sweep over variants and context lengths, with what is specific to caches
(per-position latency curve, KV bytes measured and analytic, FLOPs, drift vs `dynamic`), is the
`kv-cache` scenario (infer_tune.scenarios.kv_cache).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from infer_tune import models
from infer_tune.engines.base import LEAN, SLOTS
from infer_tune.errors import ConfigError
from infer_tune.metrics import kv
from infer_tune.metrics.schema import LEAN_LOOP_KEYS
from infer_tune.runners.generation import eos_ids, split_generate_kwargs
from infer_tune.runners.prepared import PreparedModel
from infer_tune.tuners.base import (
    MeasuredRow,
    Offer,
    RunContext,
    TechniqueConfig,
    TuneAsk,
    Tuning,
    register_technique,
)

IMPLS = ("none", "dynamic", "static", "quantized", "offloaded")
LOSSLESS_IMPLS = ("none", "dynamic", "static", "offloaded")
# bit widths each transformers QuantizedCache backend implements (transformers 5.x)
KV_BACKEND_BITS: dict[str, tuple[int, ...]] = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8), "fp8": (8,), "native": (8,)}
BACKEND_PACKAGE = {"quanto": "optimum.quanto", "hqq": "hqq", "fp8": None, "native": None}
NATIVE = "native"  # the native step's int8 cache (module docstring)
REFERENCE_IMPL = "dynamic"
# RunContext.cache key: facts about the prompt a context-length sweep runs, added to each row's workload by
# `finish_cache` before the row is saved (scenarios/kv_cache.py)
WORKLOAD_FACTS_KEY = "kv_cache.workload_facts"


@dataclass
class KVCacheConfig(TechniqueConfig):
    """One cache variant at one context length."""

    technique: ClassVar[str] = "kv-cache"

    impl: str = "dynamic"
    context_tokens: int | None = None
    kv_bits: int | None = None
    kv_backend: str | None = None
    kv_residual_tokens: int | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ConfigError(f"kv-cache impl must be one of {', '.join(IMPLS)}, got '{self.impl}'")
        if self.context_tokens is not None and self.context_tokens < 1:
            raise ConfigError(f"kv-cache context_tokens must be >= 1, got {self.context_tokens}")
        if self.compile and self.impl != "static":
            raise ConfigError(f"kv-cache compile applies to impl 'static' only, got impl '{self.impl}'")
        if self.impl != "quantized":
            if self.kv_bits is not None or self.kv_backend is not None:
                raise ConfigError(f"kv-cache kv_bits/kv_backend apply to impl 'quantized' only, got '{self.impl}'")
            return
        self.kv_backend = self.kv_backend or "quanto"
        self.kv_bits = 4 if self.kv_bits is None else self.kv_bits
        check_kv_bits(self.kv_bits, self.kv_backend)
        if self.kv_residual_tokens is not None and self.kv_residual_tokens < 1:
            raise ConfigError(f"kv-cache kv_residual_tokens must be >= 1, got {self.kv_residual_tokens}")

    def stacks_with(self, other: TechniqueConfig) -> bool:
        """A cache the native step runs (static fp32, native int8) stacks with a lean part running the native step
        (which otherwise runs a static cache of its own and conflicts with a kv-cache part): the part chooses it."""
        return native_cache_part(self) and runs_native_step(other)

    def label(self) -> str:
        name = self.impl + ("+compile" if self.compile else "")
        if self.impl == "quantized":
            name += f"-{self.kv_backend}{self.kv_bits}"
        return f"{name}-ctx{self.context_tokens}" if self.context_tokens else name


def check_kv_bits(bits: int, backend: str) -> None:
    """Reject a backend or bit width that transformers' QuantizedCache has no path for."""
    if backend not in KV_BACKEND_BITS:
        raise ConfigError(f"KV backend must be one of {', '.join(KV_BACKEND_BITS)}, got '{backend}'")
    allowed = KV_BACKEND_BITS[backend]
    if bits not in allowed:
        others = "; ".join(f"{b}: {', '.join(map(str, v))}" for b, v in KV_BACKEND_BITS.items() if b != backend)
        raise ConfigError(f"{bits}-bit KV: the {backend} KV backend has no {bits}-bit path; it supports "
                          f"{', '.join(map(str, allowed))} (other backends: {others})")
    package = BACKEND_PACKAGE[backend]
    if package is not None:
        import importlib.util

        if importlib.util.find_spec(package.split(".")[0]) is None:
            raise ConfigError(f"KV backend {backend} needs the `{package.split('.')[0]}` package; "
                              f"pip install {'optimum-quanto' if backend == 'quanto' else backend}")


def native_cache_part(config: KVCacheConfig) -> bool:
    """Whether `config` is a cache the native step runs: static (fp32) or the native int8 backend."""
    return (config.impl == "static" and not config.compile) or (config.impl == "quantized"
                                                                 and config.kv_backend == NATIVE)


def native_kv_dtype(ctx: RunContext) -> str:
    """The native step's cache a stack asks for: "int8" where a kv-cache part has the native backend, else
    "fp32"."""
    for part in ctx.stack_parts:
        if isinstance(part, KVCacheConfig) and part.impl == "quantized" and part.kv_backend == NATIVE:
            return "int8"
    return "fp32"


def runs_native_step(part) -> bool:
    """Whether a stack's part runs the native step (the only reader of the native int8 cache)."""
    runs_on = getattr(part, "runs_on", None)  # the lean loop, or the slots over its step
    return bool(getattr(part, "native_step", False)) and callable(runs_on) and runs_on() in (LEAN, SLOTS)


def not_applicable_reason(config: KVCacheConfig, device: str) -> str | None:
    """Why a variant cannot run meaningfully here (None when it can)."""
    if config.impl == "offloaded" and not device.startswith("cuda"):
        return ("offloaded keeps the KV cache in host memory while a GPU computes; on a CPU-only run the "
                "cache already lives in host memory (and transformers' offloading calls CUDA streams)")
    return None


def _preflight(loaded: models.LoadedModel, config: KVCacheConfig, ctx: RunContext) -> None:
    reason = not_applicable_reason(config, ctx.device)
    if reason is not None:
        raise ConfigError(f"kv-cache impl '{config.impl}' is not applicable here: {reason}")


def report_columns(doc: dict, docs: list[dict]):
    """The report's lead: decode speedup against the default dynamic cache of the same session."""
    from infer_tune.report.leads import decode_speedup

    return decode_speedup(doc, docs, vs="dynamic cache (the baseline)")


# --------------------------------------------------------------------------- what a cache row measures
def probe_cache(prepared: PreparedModel, batch: dict[str, torch.Tensor], new_tokens: int) -> dict[str, Any]:
    """One untimed greedy generate that returns its cache: measured KV bytes and the largest logits tensor.

    Without a cache only the logits are of interest, so one step (the prefill) is enough.
    """
    from transformers import GenerationConfig

    model, tokenizer = prepared.model, prepared.tokenizer
    uses_cache = prepared.generate_kwargs.get("use_cache", True)
    steps = new_tokens if uses_cache else 1
    logits_bytes: list[int] = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, _i, out: logits_bytes.append(out.numel() * out.element_size()))
    config_fields, kwargs = split_generate_kwargs(prepared.generate_kwargs)
    config = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids(model, tokenizer) or None,
                              return_dict_in_generate=True, **config_fields)
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=batch["input_ids"].to(prepared.device),
                                 attention_mask=batch["attention_mask"].to(prepared.device),
                                 generation_config=config, **kwargs)
    finally:
        hook.remove()
    # transformers 5 names the field `cache` (reading the old name warns); 4.x named it `past_key_values`
    names = {f.name for f in dataclasses.fields(out)}
    cache = getattr(out, "cache" if "cache" in names else "past_key_values", None)
    return {"kv_cache_bytes": kv.measured_cache_bytes(cache),
            "kv_cache_tokens": int(cache.get_seq_length()) if cache is not None else 0,
            "kv_cache_class": type(cache).__name__ if cache is not None else None,
            "logits_bytes_peak": max(logits_bytes, default=0)}


def cache_metrics(config: KVCacheConfig, doc: dict, prepared: PreparedModel, batch: dict, shape: kv.ModelShape,
                  new_tokens: int) -> dict[str, Any]:
    """The kv-cache result keys (docs/architecture.md, "Result keys") added to what the shared runner measured."""
    m = doc.metrics
    ctx = int(batch["input_ids"].shape[1])
    probe = probe_cache(prepared, batch, new_tokens)
    bits = m.get("kv_bits")
    cached_tokens = ctx + new_tokens - 1  # the last generated token is never fed back, so never cached
    with_cache = kv.flops_with_cache(shape, ctx, new_tokens)
    without = kv.flops_without_cache(shape, ctx, new_tokens)
    peak = m.get("peak_rss_bytes") or 0
    full_logits = ctx * shape.vocab * 4
    identical = config.impl == REFERENCE_IMPL or m.get("output_mismatches") == 0
    return {
        "impl": config.impl,
        "prompt_tokens": ctx,
        **probe,
        "kv_cache_bytes_analytic": kv.kv_bytes(shape, cached_tokens, bits) if bits else 0,
        "flops_with_cache": with_cache,
        "flops_without_cache": without,
        "flops_executed": without if config.impl == "none" else with_cache,
        "lossless_expected": config.impl in LOSSLESS_IMPLS,
        "identical_to_dynamic": identical,
        "lossless_held": identical if config.impl in LOSSLESS_IMPLS else None,
        "logits_bytes_full_prefill": full_logits,
        "logits_last_token_only": probe["logits_bytes_peak"] < full_logits,
        "logits_share_of_peak_rss": probe["logits_bytes_peak"] / peak if peak else None,
        "kv_share_of_peak_rss": probe["kv_cache_bytes"] / peak if peak else None,
    }


def finish_cache(row: MeasuredRow) -> None:
    """The cache keys of every kv-cache row (and of a stack holding one), whichever command ran it: the
    mean latency of each decode step in order (`per_position_ms`, how the cache's cost grows with the
    context), a probe of the cache on the workload's first request, the analytic size and FLOPs."""
    config, doc, prepared = row.config, row.doc, row.prepared
    if row.ctx.cache.get(WORKLOAD_FACTS_KEY):  # a context-length sweep's prompt (scenarios/kv_cache.py)
        doc.add_workload(row.ctx.cache[WORKLOAD_FACTS_KEY], source="kv-cache's context sweep")
    doc.add_metrics({"per_position_ms": row.run.per_position_ms()}, source="kv-cache's finish")
    shape = kv.ModelShape.from_config(prepared.model.config)
    if prepared.metrics.get("kv_cache_owner") == "native step":  # its own cache: no transformers cache to probe
        ctx = int(row.inputs.batches[0]["input_ids"].shape[1])
        tokens = ctx + int(doc["workload"]["max_new_tokens"]) - 1
        int8 = config.kv_backend == NATIVE
        doc.add_metrics({"impl": config.impl, "prompt_tokens": ctx,
                         "kv_cache_class": f"NativeCache ({'int8' if int8 else 'fp32'})",
                         # int8: int8 values plus one fp32 scale per vector of head_dim values
                         "kv_cache_bytes_analytic": kv.kv_bytes(shape, tokens, 8 + 32 / shape.head_dim if int8 else 32),
                         "kv_cache_bytes_fp32": kv.kv_bytes(shape, tokens, 32), "lossless_expected": not int8},
                        source="kv-cache's finish")
        return None
    doc.add_metrics(cache_metrics(config, doc, prepared, row.inputs.batches[0], shape,
                                  int(doc["workload"]["max_new_tokens"])), source="kv-cache's finish")
    if config.compile:
        doc.add_metrics({"compiled": getattr(prepared.model, "_compiled_call", None) is not None},
                        source="kv-cache's finish")
    return None


def tune_offer(ask: TuneAsk) -> list[Offer]:
    """What `tune` tries of the cache: on the first base that may win, a static cache with the model compiled
    through generate() (decode and throughput objectives, compiling allowed); measured after the base's own
    row says it may win, never beside it (the lean path is the likelier winner). Nothing of its own."""
    if ask.on is None or not ask.first or not ask.compile or ask.objective not in ("decode", "throughput"):
        return []
    return [Offer(KVCacheConfig(impl="static", compile=True), role="part", compiles=True, beside=False)]


# the metrics a kv-cache row carries beyond the core (its namespace: metrics/schema.py)
METRIC_KEYS = {
    **dict.fromkeys(("impl", "kv_bits", "kv_cache_class", "kv_cache_owner", "kv_backend", "compiled", "prompt_tokens"),
                    "the cache that ran"),
    **dict.fromkeys(("kv_cache_bytes", "kv_cache_tokens", "kv_cache_bytes_analytic", "kv_cache_bytes_fp32",
                     "kv_share_of_peak_rss", "logits_bytes_peak", "logits_bytes_full_prefill", "logits_last_token_only",
                     "logits_share_of_peak_rss"), "the cache probe's memory"),
    **dict.fromkeys(("flops_with_cache", "flops_without_cache", "flops_executed"), "analytic FLOPs"),
    **dict.fromkeys(("identical_to_dynamic", "lossless_expected", "lossless_held"), "losslessness"),
    "per_position_ms": "mean latency of each decode step in order",
    **LEAN_LOOP_KEYS,
}


@register_technique(KVCacheConfig, preflight=_preflight, measure_ppl=False, finish=finish_cache, phase=1, report_columns=report_columns, tune=Tuning(offer=tune_offer),
                    metric_keys=METRIC_KEYS)
def apply_kv_cache(loaded: models.LoadedModel, config: KVCacheConfig, ctx: RunContext) -> PreparedModel:
    """Choose how `generate` builds its cache; the model itself is unchanged."""
    model = loaded.model
    device = ctx.device
    reason = not_applicable_reason(config, device)
    if reason is not None:
        raise ConfigError(f"kv-cache impl '{config.impl}' is not applicable here: {reason}")
    kwargs: dict[str, Any] = {}
    if any(runs_native_step(p) for p in ctx.stack_parts):  # the native step's own cache: this part chooses it
        if not native_cache_part(config):
            raise ConfigError(f"kv-cache {config.label()}: the native step runs its own preallocated cache, fp32 "
                              "(impl static) or int8 (impl quantized, kv_backend native); it cannot run this one")
        return PreparedModel(model=model, tokenizer=loaded.tokenizer, generate_kwargs={}, label=config.label(),
                             device=device, metrics={"kv_bits": kv_storage_bits(config, loaded),
                                                     "kv_cache_owner": "native step"})
    if config.impl == "none":
        kwargs["use_cache"] = False
    elif config.impl == "static":
        kwargs["cache_implementation"] = "static"
        # generate sizes a static cache to the largest length seen on this model; size it to this run
        if hasattr(model, "_previous_max_cache_length"):
            del model._previous_max_cache_length
        if config.compile:
            from transformers.generation.configuration_utils import CompileConfig

            compile_config = CompileConfig()
            compile_config._compile_all_devices = True  # generate only auto-compiles on GPUs otherwise
            kwargs["compile_config"] = compile_config
        else:
            kwargs["disable_compile"] = True  # generate would auto-compile a static cache on CUDA
    elif config.impl == "quantized" and config.kv_backend == NATIVE:
        raise ConfigError("kv-cache backend 'native' is the native step's int8 cache: stack it with a part that "
                          "runs the native step (lean, or speculate / batch with engine lean, native_step: true)")
    elif config.impl == "quantized":
        cache_config: dict[str, Any] = {"backend": config.kv_backend}
        if config.kv_backend != "fp8":  # fp8 is per-tensor and takes no group-wise options
            cache_config["nbits"] = config.kv_bits
            if config.kv_residual_tokens is not None:
                cache_config["residual_length"] = config.kv_residual_tokens
        kwargs.update(cache_implementation="quantized", cache_config=cache_config)
    elif config.impl == "offloaded":
        kwargs["cache_implementation"] = "offloaded"
    return PreparedModel(model=model, tokenizer=loaded.tokenizer, generate_kwargs=kwargs,
                         metrics={"kv_bits": kv_storage_bits(config, loaded)}, label=config.label(), device=device)


def kv_storage_bits(config: KVCacheConfig, loaded: models.LoadedModel) -> int | None:
    """Bits per cached value (None when nothing is cached)."""
    if config.impl == "none":
        return None
    if config.impl == "quantized":
        return config.kv_bits
    return next(loaded.model.parameters()).element_size() * 8


