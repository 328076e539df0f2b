"""`kv-cache`: every cache variant at every context length, with what is specific to caches.

Each context length is one sweep of the engine (`sweep.run_configs`) on real suite text cut to
exactly N tokens: every variant measured against the plain model (whose default cache is `dynamic`)
in interleaved rounds, with the technique's own keys (KV bytes measured and analytic, FLOPs, the
logits' share of peak memory: `tuners.kv_cache.finish_cache`). The sweep then adds what needs all
variants of one length: the per-position latency plot and the compute claim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError
from infer_tune.metrics import kv
from infer_tune.report.plots import per_position_png
from infer_tune.scenarios.common import RunSpec, open_run
from infer_tune.suites import Prompt, SuiteSpec, load_suite
from infer_tune.sweep import SweepPlan, run_configs
from infer_tune.tuners.base import Conclusion, RunContext
from infer_tune.tuners.kv_cache import (
    IMPLS,
    REFERENCE_IMPL,
    WORKLOAD_FACTS_KEY,
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
    docs: list[ResultDocument]
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
        configs = []
        for config in spec.configs(ctx):
            reason = not_applicable_reason(config, run_ctx.device)
            if reason is None:
                configs.append(config)
            else:
                result.not_applicable.append({"impl": config.impl, "context_tokens": ctx, "reason": reason})
        # the engine measures, finishes (the cache keys) and saves every variant; the plan adds what needs
        # all variants of one context length (the compute claim, the latency plot), which the engine saves too
        # what the rows ran, added to each row's workload by the kv-cache technique's finish, before it is saved
        run_ctx.cache[WORKLOAD_FACTS_KEY] = {
            "context_tokens": ctx,
            "prompt_source": "suite text (prompts + references) concatenated and cut to exactly context_tokens tokens"}
        plan = SweepPlan(conclude=lambda docs, _, ctx=ctx: _context_keys(docs, ctx, loaded.ref, n, shape, long_claim,
                                                                        result))
        _, docs = run_configs(loaded, inputs, workload, protocol, configs, run_ctx, resume=resume, measure_ppl=False,
                              plan=plan)
        result.docs.extend(docs)
        result.run_dirs.extend(Path(d.location) for d in docs)
    result.claims.append(long_claim)
    return result


def _context_keys(docs: list[ResultDocument], ctx: int, model: str, n: int, shape: kv.ModelShape, long_claim: dict,
                  result: KVSweepResult) -> Conclusion:
    """What needs every variant of one context length: the compute claim, the rows not applicable, the
    prompt's source, and the per-position latency plot (returned for each result's folder)."""
    claims = [kv.compute_claim(shape, ctx, measured_wall(docs, n)), long_claim]
    result.claims.append(claims[0])
    curves = {d.label.removesuffix(f"-ctx{ctx}"): d.metrics["per_position_ms"] for d in docs}
    png = per_position_png(curves, first_position=ctx + 2, dpi=110,
                           title=f"{model}: per-token latency, {ctx}-token prompt",
                           xlabel="position of the generated token (prompt + generated)")
    not_applicable = [r for r in result.not_applicable if r["context_tokens"] == ctx]
    return Conclusion(files={"latency.png": png},
                      sections={d.run_id: {"claims": claims, "not_applicable": not_applicable} for d in docs})


def measured_wall(docs: list[ResultDocument], new_tokens: int) -> dict | None:
    """e2e p50 of `none` and `dynamic` at one context length, when both ran."""
    e2e = {d.config["impl"]: d.stat("e2e_ms") for d in docs}
    if "none" not in e2e or "dynamic" not in e2e:
        return None
    return {"new_tokens": new_tokens, "e2e_ms_none": e2e["none"], "e2e_ms_dynamic": e2e["dynamic"]}


def run_kv_cache(spec: RunSpec, sweep: KVSweepSpec, progress=None) -> KVSweepResult:
    """The `kv-cache` command: check the context fits before loading weights, then sweep."""
    shape = kv.load_model_config(_resolve_model(spec.model, spec.weights))
    check_context_fits(shape, sweep.context_lengths, sweep.max_new_tokens, spec.model)
    run = open_run(spec, progress, load_suite=False)
    return run_kv_sweep(run.loaded, sweep, spec.protocol, run.ctx, resume=spec.resume)


def _resolve_model(ref: str, weights: str = "pretrained") -> str:
    from infer_tune import models
    from infer_tune import weights as weights_mod

    preset = weights_mod.preset_path(ref) if weights_mod.parse(weights).random else None
    return str(preset) if preset is not None else models.resolve(ref)
