"""`kv-cache`: every cache variant at every context length, with what is specific to caches.

Each variant is measured by the shared runner (`session.measure_prepared`) on real suite text cut to
exactly N tokens; then come the per-position latency curve and its plot, KV bytes measured from the
cache tensors and the analytic size, analytic FLOPs with and without the cache, drift vs `dynamic`,
the logits' share of peak memory, and the compute claim.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from infer_tune import results
from infer_tune.errors import ConfigError
from infer_tune.metrics import kv
from infer_tune.report.plots import per_position_png
from infer_tune.runners.generation import eos_ids, generate_once, split_generate_kwargs
from infer_tune.runners.prepared import PreparedModel
from infer_tune.scenarios.common import RunSpec, open_run
from infer_tune.session import find_result, measure_prepared, run_fingerprint
from infer_tune.suites import Prompt, SuiteSpec, load_suite
from infer_tune.tuners.base import RunContext, apply
from infer_tune.tuners.kv_cache import (
    IMPLS,
    LOSSLESS_IMPLS,
    REFERENCE_IMPL,
    KVCacheConfig,
    check_kv_bits,
    not_applicable_reason,
)
from infer_tune.workload import Inputs, Protocol, Workload


# --------------------------------------------------------------------------- inputs
def check_context_fits(shape: kv.ModelShape, context_lengths: list[int], max_new_tokens: int, model: str) -> None:
    """Prompt + generated tokens must fit the model's position range."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(context_lengths)
    if shape.max_positions and longest + max_new_tokens > shape.max_positions:
        raise ConfigError(f"context length {longest} + max_new_tokens {max_new_tokens} = "
                          f"{longest + max_new_tokens} tokens exceeds {model}'s maximum of {shape.max_positions} "
                          f"positions; use at most {shape.max_positions - max_new_tokens} prompt tokens")


def suite_token_ids(tokenizer, suite: str, seed: int, tokens: int) -> list[int]:
    """At least `tokens` ids of real suite text (prompts and references, concatenated in suite order)."""
    ids: list[int] = []
    sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    for prompt in load_suite(SuiteSpec(name=suite, seed=seed, max_prompt_chars=10**9)):
        text = prompt.text + (f"\n\n{prompt.reference}" if prompt.reference else "")
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + sep)
        if len(ids) >= tokens:
            return ids
    raise ConfigError(f"suite '{suite}' holds only {len(ids)} tokens of text; ask for at most that many in "
                      f"context or use a larger suite")


# --------------------------------------------------------------------------- cache probe
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


# --------------------------------------------------------------------------- sweep
@dataclass
class KVSweepSpec:
    """Which variants, at which context lengths, generating how many tokens from which text."""

    impls: list[str] = field(default_factory=lambda: list(IMPLS))
    context_lengths: list[int] = field(default_factory=lambda: [128, 512, 1024])
    max_new_tokens: int = 256
    kv_bits: int = 4
    kv_backend: str = "quanto"
    kv_residual_tokens: int | None = None
    compile: bool = False
    suite: str = "chat"
    seed: int = 0

    def __post_init__(self) -> None:
        check_kv_bits(self.kv_bits, self.kv_backend)
        if self.compile and "static" not in self.impls:
            raise ConfigError("compile applies to the static cache; add static to the variants")

    def configs(self, context_tokens: int) -> list[KVCacheConfig]:
        """The reference (`dynamic`) first, always measured, since drift is taken against it."""
        names = [REFERENCE_IMPL] + [n for n in self.impls if n != REFERENCE_IMPL]
        out = []
        for name in names:
            quantized = name == "quantized"
            out.append(KVCacheConfig(impl=name, context_tokens=context_tokens,
                                     kv_bits=self.kv_bits if quantized else None,
                                     kv_backend=self.kv_backend if quantized else None,
                                     kv_residual_tokens=self.kv_residual_tokens if quantized else None,
                                     compile=self.compile and name == "static"))
        return out


@dataclass
class KVSweepResult:
    docs: list[dict]
    not_applicable: list[dict]
    claims: list[dict]
    run_dirs: list[Path]


def run_kv_sweep(
    loaded,
    spec: KVSweepSpec,
    protocol: Protocol,
    run_ctx: RunContext,
    *,
    resume: bool = False,
) -> KVSweepResult:
    """Measure every variant at every context length; save one result per (impl, context length).

    The results of one context length are saved together once all its variants ran, each with the
    plot of all of them (`latency.png`). With `resume`, a context length whose results are all in
    `run_ctx.out_dir` already is read back instead of measured again.
    """
    device, env, out_dir, progress = run_ctx.device, run_ctx.env, run_ctx.out_dir, run_ctx.progress
    shape = kv.ModelShape.from_config(loaded.model.config)
    check_context_fits(shape, spec.context_lengths, spec.max_new_tokens, loaded.ref)
    n = spec.max_new_tokens
    ids = suite_token_ids(loaded.tokenizer, spec.suite, spec.seed, max(spec.context_lengths))
    long_claim = kv.long_context_claim(shape)
    result = KVSweepResult(docs=[], not_applicable=[], claims=[], run_dirs=[])
    for ctx in spec.context_lengths:
        prompt_ids = torch.tensor([ids[:ctx]])  # [1, ctx]
        batch = {"input_ids": prompt_ids, "attention_mask": torch.ones_like(prompt_ids)}
        text = loaded.tokenizer.decode(ids[:ctx])
        inputs = Inputs(prompts=[Prompt(id=f"{spec.suite}-text-{ctx}-tokens", text=text)], rendered=[text],
                        batches=[batch], templated=False)
        workload = Workload(suite=spec.suite, limit=1, seed=spec.seed, max_new_tokens=n, batch_size=1,
                            chat_template=False, max_prompt_tokens=ctx)
        applicable = [c for c in spec.configs(ctx) if not_applicable_reason(c, device) is None]
        if resume:
            done = [find_result(out_dir, run_fingerprint(loaded, c.technique, c.to_dict(), workload, env,
                                                         protocol=protocol, measure_ppl=False))
                    for c in applicable]
            if done and all(d is not None for d in done):
                result.docs.extend(done)
                result.run_dirs.extend(Path(d["_path"]) for d in done)
                result.claims.append(done[0]["claims"][0])
                result.not_applicable.extend(done[0].get("not_applicable", []))
                continue
        group: list[tuple[KVCacheConfig, dict, list[dict]]] = []
        reference: tuple[dict, list[dict]] | None = None
        for config in spec.configs(ctx):
            reason = not_applicable_reason(config, device)
            if reason is not None:
                result.not_applicable.append({"impl": config.impl, "context_tokens": ctx, "reason": reason})
                continue
            prepared = apply(loaded, config, run_ctx)
            extra: dict[str, Any] = {}
            if config.compile:  # the compiling call is timed apart and kept out of every measurement
                start = time.perf_counter()
                generate_once(prepared, batch, n)
                extra["compile_s"] = time.perf_counter() - start
                extra["compiled"] = getattr(prepared.model, "_compiled_call", None) is not None
            doc, outputs = measure_prepared(
                loaded, prepared, inputs, workload, protocol, technique=config.technique,
                config=config.to_dict(), env=env, baseline=reference[0] if reference else None,
                baseline_outputs=reference[1] if reference else None, measure_ppl=False, per_position=True,
                progress=progress)
            if config.impl == REFERENCE_IMPL:
                reference = (doc, outputs)
            doc["metrics"].update(extra)
            doc["metrics"].update(cache_metrics(config, doc, prepared, batch, shape, n))
            doc["workload"].update(context_tokens=ctx, prompt_source="suite text (prompts + references) "
                                   "concatenated and cut to exactly context_tokens tokens")
            group.append((config, doc, outputs))
        claims = [kv.compute_claim(shape, ctx, measured_wall(group, n)), long_claim]
        result.claims.append(claims[0])
        curves = {c.label().removesuffix(f"-ctx{ctx}"): d["metrics"]["per_position_ms"] for c, d, _ in group}
        png = per_position_png(curves, first_position=ctx + 2, dpi=110,
                               title=f"{loaded.ref}: per-token latency, {ctx}-token prompt",
                               xlabel="position of the generated token (prompt + generated)")
        for _, doc, outputs in group:
            doc["claims"] = claims
            doc["not_applicable"] = [r for r in result.not_applicable if r["context_tokens"] == ctx]
            saved = results.save_run(out_dir, doc, outputs, extra_files={"latency.png": png})
            doc["_path"] = str(saved.run_dir)
            result.docs.append(doc)
            result.run_dirs.append(saved.run_dir)
    result.claims.append(long_claim)
    return result


def cache_metrics(config: KVCacheConfig, doc: dict, prepared: PreparedModel, batch: dict, shape: kv.ModelShape,
                  new_tokens: int) -> dict[str, Any]:
    """The kv-cache result keys (docs/architecture.md, "Result keys") added to what the shared runner measured."""
    m = doc["metrics"]
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


def measured_wall(group: list[tuple[KVCacheConfig, dict, list[dict]]], new_tokens: int) -> dict | None:
    """e2e p50 of `none` and `dynamic` at one context length, when both ran."""
    e2e = {c.impl: d["metrics"]["e2e_ms"]["p50"] for c, d, _ in group}
    if "none" not in e2e or "dynamic" not in e2e:
        return None
    return {"new_tokens": new_tokens, "e2e_ms_none": e2e["none"], "e2e_ms_dynamic": e2e["dynamic"]}


def run_kv_cache(spec: RunSpec, sweep: KVSweepSpec, progress=None) -> KVSweepResult:
    """The `kv-cache` command: check the context fits before loading weights, then sweep."""
    shape = kv.load_model_config(_resolve_model(spec.model))
    check_context_fits(shape, sweep.context_lengths, sweep.max_new_tokens, spec.model)
    run = open_run(spec, progress, load_suite=False)
    with results.runs_lock(run.ctx.out_dir):  # concurrent sweeps into one runs dir queue
        return run_kv_sweep(run.loaded, sweep, spec.protocol, run.ctx, resume=spec.resume)


def _resolve_model(ref: str) -> str:
    from infer_tune import models

    return models.resolve(ref)
