"""`lean`: the gpt-fast idea as a technique: static KV cache, the decode step compiled once, a greedy
loop with no per-step Python of `generate()` (loop.py says what is dropped and what is kept).

Runs through its own runner (`lean`, registered here): the closed loop of the generation runner
(warmup, whole passes until the protocol is met, per-token host timestamps, pinned length with the
natural stop recorded) at batch size 1. Its counters split each decode step into the model forward
and the loop's own time (`lean_forward_ms_per_token`, `lean_overhead_ms_per_token`); the overhead
of `generate()` it removes is measured by comparing TPOT against `generate()` on the same weights
(bench/tune_lean.py). Stacks after quantize (`{technique: stack, configs: [{technique: quantize,
method: int4-rtn}, {technique: lean}]}`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from infer_tune.engines.base import LEAN
from infer_tune.errors import ConfigError
from infer_tune.metrics.schema import LEAN_LOOP_KEYS
from infer_tune.models import LoadedModel
from infer_tune.runners.base import GenerationRun, Progress, Protocol, TokenClock, register_runner
from infer_tune.runners.generation import eos_ids, measure_generation
from infer_tune.runners.prepared import PreparedModel
from infer_tune.tuners.base import Offer, RunContext, TechniqueConfig, TuneAsk, Tuning, register_technique
from infer_tune.tuners.lean.loop import LeanCounters, LeanDecoder

ATTENTION = ("native", "sdpa")


@dataclass
class LeanConfig(TechniqueConfig):
    """compile: compile the decode step (captured once, called without guards: loop.py; False: the same
    loop, eager). cpp_wrapper: inductor's C++ wrapper around the compiled step's kernels (compiles
    minutes longer; measured no faster here, loop.py). compile_prefill: with `compile`, prompts prefill
    through compiled length buckets (prefill.py); off by default: measured no faster here (docs/tune.md).
    attention: what the compiled step attends with: `native` (default: the project's decode attention,
    infer_tune/native/attention.py, where the model attends with SDPA and the kernels build) or `sdpa`.
    native_step: the whole decode step in one native call (infer_tune/native/step.py: Llama, Mistral, Qwen2,
    Qwen3 and Gemma 3 models whose layers are int4 with int8 activations); any other model gets the compiled
    (or eager) step, the reason in `lean_native_fallback`."""

    technique: ClassVar[str] = "lean"
    max_batch_size: ClassVar[int] = 1  # one sequence at a time

    compile: bool = True
    cpp_wrapper: bool = False
    compile_prefill: bool = False
    attention: str = "native"
    native_step: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ConfigError(f"lean: attention must be one of {', '.join(ATTENTION)}; got '{self.attention}'")

    def runs_on(self) -> str:
        return LEAN

    def label(self) -> str:
        if self.native_step:
            return "lean+native"
        return "lean" + ("+compile" if self.compile else "") + ("+cpp" if self.compile and self.cpp_wrapper else "") \
            + ("+prefill" if self.compile and self.compile_prefill else "") \
            + ("+sdpa" if self.compile and self.attention == "sdpa" else "")


def native_step_runs() -> bool:
    """Whether the native step (infer_tune/native/step.py) can run here: its kernels build."""
    from infer_tune import native

    return native.available()[0]


def runs_natively(base) -> bool:
    """Whether the native step may run on a model `base` prepared: its activations are int8 (the step's
    kernels are w4a8 / w8a8) and the kernels build here."""
    return any(getattr(part, "activations", None) == "int8" for part in base.parts()) and native_step_runs()


def offer(ask: TuneAsk) -> list[Offer]:
    """What `tune` tries of the lean path. Its own rows: compiled (when compiling is allowed and decode is the
    aim), and eager; both lossless (the same greedy tokens as generate()). On a base that may win (its
    stacks, decode and throughput objectives): the loop compiled (eager with compiling off), the native step
    where it runs on that base (it compiles nothing: beside the base first), and on the first base the
    compiled step with inductor's C++ wrapper (measured faster on some runs, slower on others here). Nothing
    for ttft (the path speeds decode) or goodput: a single stream serves an arrival trace one request at a
    time, as the baseline does (the batch part's engine: lean is how batched stacks use it)."""
    if ask.objective == "goodput" or (ask.on is not None and ask.objective == "ttft"):
        return []
    if ask.on is None:
        out = []
        if ask.compile and ask.objective != "ttft":
            out.append(Offer(LeanConfig(compile=True), lossless=True, compiles=True))
        out.append(Offer(LeanConfig(compile=False), lossless=True))
        return out
    parts = [Offer(LeanConfig(compile=ask.compile), role="part", compiles=ask.compile)]
    if runs_natively(ask.on):  # the whole step in one native call (no compile)
        parts.append(Offer(LeanConfig(native_step=True), role="part"))
    if ask.first and ask.compile:
        parts.append(Offer(LeanConfig(compile=True, cpp_wrapper=True), role="part", compiles=True))
    return parts


# the metrics a lean row carries beyond the core (its namespace: metrics/schema.py)
METRIC_KEYS = dict(LEAN_LOOP_KEYS)


@register_technique(LeanConfig, runner="lean", measure_ppl=False, phase=3, tune=Tuning(offer=offer), metric_keys=METRIC_KEYS,
                    conflicts={"kv-cache": "lean runs its own static cache; drop kv-cache from the stack (its one "
                                           "exception: the native step's int8 cache, kv_backend native)",
                               "speculate": "lean and speculate each run their own decoding loop",
                               "batch": "a batch of slots runs the lean path as the batch part's engine: "
                                        "drop lean and set the batch part's engine: lean"})
def prepare_lean(loaded: LoadedModel, config: LeanConfig, ctx: RunContext) -> PreparedModel:
    """The model unchanged; a decoder that owns its static cache and compiled step."""
    counters = LeanCounters()
    facts: dict = {"lean_compile": config.compile}
    if config.compile:  # fbgemm's prepacked int8 ops break a compiled graph: run traceable kernels instead
        from infer_tune.tuners.quantize.kernel_choice import make_traceable

        swaps = make_traceable(loaded.model, getattr(loaded.model, "infer_tune_kernels", None))
        if swaps:
            facts["lean_kernel_swaps"] = swaps
    from infer_tune.tuners.kv_cache import native_kv_dtype

    decoder = LeanDecoder(loaded.model, compile=config.compile, cpp_wrapper=config.cpp_wrapper, counters=counters,
                          compile_prefill=config.compile and config.compile_prefill,
                          native_attention=config.attention == "native", native_step=config.native_step,
                          kv_dtype=native_kv_dtype(ctx))
    facts["kv_dtype"] = decoder.kv_dtype
    scorer = None
    if decoder.kv_dtype != "fp32":  # the eager forward does not compute what the int8 cache gives: score natively
        import functools

        from infer_tune.native.perplexity import native_rows_nll

        scorer = functools.partial(native_rows_nll, loaded.model, decoder._native_parts, kv_dtype=decoder.kv_dtype)
    return PreparedModel(model=loaded.model, tokenizer=loaded.tokenizer, metrics=facts,
                         label=config.label(), device=ctx.device, counters=counters,
                         runner_options={"lean_decoder": decoder}, runner="lean", scorer=scorer)


@register_runner("lean", passes=True)
def run_lean(prepared: PreparedModel, inputs, workload, protocol: Protocol,
             progress: Progress | None = None) -> GenerationRun:
    """The generation runner's protocol, each request decoded by the lean loop (batch size 1)."""
    import torch

    decoder: LeanDecoder = prepared.runner_options.get("lean_decoder") or LeanDecoder(prepared.model)
    eos = eos_ids(prepared.model, prepared.tokenizer)

    def decode(batch: dict, clock: TokenClock):
        ids = batch["input_ids"].to(prepared.device)
        submit_ns, token_ns, tokens, natural = decoder.generate(ids, workload.max_new_tokens, eos,
                                                                pin_length=protocol.pin_length)
        clock.step_ns, clock.step_tokens = list(token_ns), [1] * len(token_ns)
        return submit_ns, torch.tensor([tokens], dtype=torch.long), [natural]

    # the longest request sizes the one cache when the step attends natively (loop.LeanDecoder.one_cache)
    decoder.reserve(max((b["input_ids"].shape[1] for b in inputs.batches), default=0) + workload.max_new_tokens)
    # compiled: every prompt warms once, so each cache size compiles its step outside the timed passes
    run = measure_generation(prepared, inputs.batches, workload.max_new_tokens, protocol, progress=progress,
                             decode=decode, warm_every_batch=decoder.compile)
    prepared.metrics.update(decoder.facts)  # how the step ran (`lean_step`, cache sizes), for the result
    return run
