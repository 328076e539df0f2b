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

import time
from dataclasses import dataclass
from typing import ClassVar

from infer_tune.metrics import memory
from infer_tune.models import LoadedModel
from infer_tune.runners.base import GenerationRun, Progress, Protocol, TokenClock, register_runner
from infer_tune.runners.generation import collect_rows, eos_ids
from infer_tune.runners.prepared import PreparedModel
from infer_tune.tuners.base import RunContext, TechniqueConfig, register_technique
from infer_tune.tuners.lean.loop import LeanCounters, LeanDecoder


@dataclass
class LeanConfig(TechniqueConfig):
    """compile: compile the decode step with torch.compile (False: the same loop, eager)."""

    technique: ClassVar[str] = "lean"

    compile: bool = True

    def label(self) -> str:
        return "lean" + ("+compile" if self.compile else "")


@register_technique(LeanConfig, runner="lean", max_batch_size=1, measure_ppl=False)
def prepare_lean(loaded: LoadedModel, config: LeanConfig, ctx: RunContext) -> PreparedModel:
    """The model unchanged; a decoder that owns its static cache and compiled step."""
    counters = LeanCounters()
    facts: dict = {"lean_compile": config.compile}
    if config.compile:  # fbgemm's prepacked int8 ops break a compiled graph: run traceable kernels instead
        from infer_tune.tuners.quantize.kernels import make_traceable

        swaps = make_traceable(loaded.model, getattr(loaded.model, "infer_tune_kernels", None))
        if swaps:
            facts["lean_kernel_swaps"] = swaps
    decoder = LeanDecoder(loaded.model, compile=config.compile, counters=counters)
    return PreparedModel(model=loaded.model, tokenizer=loaded.tokenizer, metrics=facts,
                         label=config.label(), device=ctx.device, counters=counters,
                         runner_options={"lean_decoder": decoder}, runner="lean")


def _one(prepared: PreparedModel, decoder: LeanDecoder, batch: dict, max_new_tokens: int, pin: bool):
    import torch

    ids = batch["input_ids"].to(prepared.device)
    submit_ns, token_ns, tokens, natural = decoder.generate(ids, max_new_tokens, eos_ids(prepared.model,
                                                                                       prepared.tokenizer),
                                                            pin_length=pin)
    clock = TokenClock()
    clock.step_ns, clock.step_tokens = list(token_ns), [1] * len(token_ns)
    return submit_ns, clock, torch.tensor([tokens], dtype=torch.long), [natural]


@register_runner("lean")
def run_lean(prepared: PreparedModel, inputs, workload, protocol: Protocol,
             progress: Progress | None = None) -> GenerationRun:
    """The closed loop of the generation runner, each request decoded by the lean loop (batch size 1)."""
    decoder: LeanDecoder = prepared.runner_options.get("lean_decoder") or LeanDecoder(prepared.model)
    batches, max_new = inputs.batches, workload.max_new_tokens
    tokenizer = prepared.tokenizer
    eos = set(eos_ids(prepared.model, tokenizer))
    first_call_ms = None
    warmup_start = time.perf_counter()
    for i in range(protocol.warmup):
        submit_ns, clock, _, _ = _one(prepared, decoder, batches[0], max_new, protocol.pin_length)
        if i == 0 and clock.step_ns:
            first_call_ms = (clock.step_ns[-1] - submit_ns) / 1e6
        if progress:
            progress("warmup", i + 1, protocol.warmup)
    warmup_s = time.perf_counter() - warmup_start
    if prepared.counters is not None:
        prepared.counters.reset()
    rss_before = memory.release_and_reset_peak()
    requests, outputs = [], []
    iteration, measured_ns, generated_tokens = 0, 0, 0
    while iteration < protocol.min_iterations or measured_ns / 1e9 < protocol.min_duration_s:
        for b, batch in enumerate(batches):
            start = time.perf_counter_ns()
            submit_ns, clock, generated, natural = _one(prepared, decoder, batch, max_new, protocol.pin_length)
            measured_ns += time.perf_counter_ns() - start
            timings, outs = collect_rows(tokenizer, eos, batch, submit_ns, clock, generated, natural,
                                         iteration=iteration, base_index=b, pin_length=protocol.pin_length)
            requests.extend(timings)
            generated_tokens += sum(len(t.token_ns) for t in timings)
            if iteration == 0:
                outputs.extend(outs)
            if progress:
                progress(f"iteration {iteration + 1}", b + 1, len(batches))
        iteration += 1
    counters = prepared.counters.snapshot() if prepared.counters is not None else {}
    return GenerationRun(requests=requests, outputs=outputs, measured_wall_s=measured_ns / 1e9, iterations=iteration,
                         first_call_ms=first_call_ms, warmup_s=warmup_s, peak_rss_bytes=memory.peak_rss_bytes(),
                         rss_before_bytes=rss_before, generated_tokens=generated_tokens, batch_size=1,
                         counters=counters, cuda_peak_bytes=memory.cuda_peak_bytes(prepared.device))
