"""Greedy generation with the host timestamp of every generated token.

Timing protocol (docs/architecture.md, "Measurement protocol"): warmup runs (the first call timed and reported apart), then whole
passes over the workload until both `min_iterations` and `min_duration_s` are met. Output length is
pinned (end-of-sequence is suppressed, as `min_new_tokens == max_new_tokens` does) so that every
configuration decodes the same number of tokens; the step at which greedy decoding *would* have
picked end-of-sequence is recorded, so the natural output for quality is the pinned output cut
there — identical to an unpinned greedy run, without a second generation pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from infer_tune.errors import ConfigError
from infer_tune.metrics import memory
from infer_tune.runners.base import (
    GenerationRun,
    Output,
    Progress,
    Protocol,
    RequestTiming,
    TokenClock,
    register_runner,
    sync,
)
from infer_tune.runners.prepared import PreparedModel


class _PinLength(LogitsProcessor):
    """Suppress end-of-sequence so every step decodes, recording where greedy would have stopped.

    Under assisted generation the processor also sees logits that decide nothing: a draft model's,
    prompt lookup's probe with constant logits, and the target's logits past a rejected draft token.
    So a would-be stop is recorded with the exact prefix it was seen after, the last call at a prefix
    wins (the target's verify pass comes after the draft's calls at the same prefix), and
    `natural_lengths` keeps only stops whose prefix is what was finally generated.
    """

    def __init__(self, eos_ids: Sequence[int], prompt_len: int, batch: int) -> None:
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
        self.prompt_len = prompt_len
        self.stops: list[dict[int, dict[tuple[int, ...], bool]]] = [{} for _ in range(batch)]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.eos.numel() == 0:
            return scores
        step = input_ids.shape[1] - self.prompt_len
        eos = self.eos.to(scores.device)
        top = scores.argmax(dim=-1)
        hits = torch.isin(top, eos).tolist()
        for row, hit in enumerate(hits[: len(self.stops)]):
            seen = self.stops[row].get(step)
            if hit or seen:  # the prefix is read only when it can matter (rarely)
                prefix = tuple(input_ids[row, self.prompt_len:].tolist())
                self.stops[row].setdefault(step, {})[prefix] = bool(hit)
        scores[:, eos] = -float("inf")
        return scores

    def natural_lengths(self, generated: torch.Tensor) -> list[int | None]:
        """Per row, the first step where greedy would have picked end-of-sequence after the tokens
        really generated (`generated`: [B, T]), or None."""
        out: list[int | None] = []
        for row, stops in enumerate(self.stops):
            ids = generated[row].tolist()
            out.append(min((step for step, seen in stops.items() if seen.get(tuple(ids[:step]))), default=None))
        return out


def eos_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    config = getattr(model, "generation_config", None)  # None: no torch model here (an engine's own runner)
    ids = config.eos_token_id if config is not None else None
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def split_generate_kwargs(generate_kwargs: dict) -> tuple[dict, dict]:
    """(GenerationConfig fields, other `generate` kwargs) of a technique's settings.

    Settings that are generation-config fields (use_cache, cache_implementation, ...) belong in the
    config (transformers 5 deprecates passing them beside one); the rest (past_key_values,
    assistant_model, ...) go to `generate` as they are.
    """
    defaults = GenerationConfig()
    config_fields = {k: v for k, v in generate_kwargs.items() if hasattr(defaults, k)}
    return config_fields, {k: v for k, v in generate_kwargs.items() if k not in config_fields}


# one request batch decoded, its token times stamped on the clock: (submit_ns, generated ids [B, T], natural lengths)
Decode = Callable[[dict[str, torch.Tensor], TokenClock], tuple[int, torch.Tensor, list[int | None]]]


def generate_once(
    prepared: PreparedModel, batch: dict[str, torch.Tensor], max_new_tokens: int, *, pin_length: bool = True,
    clock: TokenClock | None = None,
) -> tuple[int, list[int], torch.Tensor, list[int | None]]:
    """One timed `generate` call on a tokenized batch.

    Returns (submit_ns, token_ns per generated token, generated ids [B, T], natural length per row or
    None). Pass a `clock` to read how many tokens each step delivered (`clock.step_tokens`).
    """
    model, tokenizer = prepared.model, prepared.tokenizer
    input_ids = batch["input_ids"].to(prepared.device)  # [B, S]
    attention_mask = batch["attention_mask"].to(prepared.device)  # [B, S]
    eos = eos_ids(model, tokenizer)
    clock = clock if clock is not None else TokenClock()
    processors = LogitsProcessorList()
    pin = None
    if pin_length:
        pin = _PinLength(eos, input_ids.shape[1], input_ids.shape[0])
        processors.append(pin)
    config_fields, kwargs = split_generate_kwargs(prepared.generate_kwargs)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos or None,
        **config_fields,
    )
    sync(prepared.device)
    submit_ns = time.perf_counter_ns()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            logits_processor=processors,
            streamer=clock,
            **kwargs,
        )
    sync(prepared.device)
    generated = out[:, input_ids.shape[1]:]
    natural = pin.natural_lengths(generated) if pin is not None else [None] * input_ids.shape[0]
    return submit_ns, clock.token_ns, generated, natural


def collect_rows(
    tokenizer, eos: set[int], batch: dict[str, torch.Tensor], submit_ns: int, clock: TokenClock,
    generated: torch.Tensor, natural: list[int | None], *, iteration: int, base_index: int,
    pin_length: bool = True, start_ns: int | None = None,
) -> tuple[list[RequestTiming], list[Output]]:
    """Per-row timings and natural outputs of one `generate_once` call (shared by every runner).

    Pinned runs time every generated token and cut the output where greedy would have stopped;
    unpinned runs end each row at its first end-of-sequence token (kept in the timing).
    """
    step_tokens = list(clock.step_tokens) if clock.multi_token else None
    prompt_tokens = batch["attention_mask"].sum(dim=1).tolist()
    timings, outputs = [], []
    for row in range(generated.shape[0]):
        ids = generated[row].tolist()
        if pin_length:
            natural_len = natural[row]
        else:
            natural_len = next((k for k, t in enumerate(ids) if t in eos), None)
        n_tokens = len(ids) if pin_length or natural_len is None else natural_len + 1
        timing = RequestTiming(prompt_index=base_index + row, iteration=iteration,
                               prompt_tokens=int(prompt_tokens[row]), submit_ns=submit_ns,
                               token_ns=clock.token_ns, step_tokens=step_tokens, start_ns=start_ns)
        timings.append(timing.truncated(n_tokens))
        keep = ids if natural_len is None else ids[:natural_len]
        outputs.append(Output(prompt_index=base_index + row, text=tokenizer.decode(keep, skip_special_tokens=True),
                              token_ids=keep, prompt_tokens=int(prompt_tokens[row]),
                              hit_eos=natural_len is not None))
    return timings, outputs


def measure_generation(
    prepared: PreparedModel,
    batches: Sequence[dict[str, torch.Tensor]],
    max_new_tokens: int,
    protocol: Protocol,
    *,
    progress: Progress | None = None,
    decode: Decode | None = None,
    warm_every_batch: bool = False,
) -> GenerationRun:
    """Warm up, then run every batch repeatedly until the protocol is satisfied.

    `batches` are tokenized, left-padded batches with an attention mask; `progress(stage, done, total)`
    is called after each batch so a CLI can draw a bar (the runner itself prints nothing). The
    technique's counters are reset after warmup, so they count the timed passes only. `decode(batch,
    clock) -> (submit_ns, generated ids [B, T], natural length per row)` runs one request batch and
    stamps `clock`; default: one `generate` call (`generate_once`). A runner with its own decode loop
    (the lean path) passes its own and keeps this protocol.
    """
    if decode is None:
        def decode(batch: dict[str, torch.Tensor], clock: TokenClock):
            submit_ns, _, generated, natural = generate_once(prepared, batch, max_new_tokens,
                                                             pin_length=protocol.pin_length, clock=clock)
            return submit_ns, generated, natural
    tokenizer = prepared.tokenizer
    eos = set(eos_ids(prepared.model, tokenizer))
    first_call_ms = None
    warmup_start = time.perf_counter()
    # a compiled step specializes on the cache length (prompt + new tokens): its first warmup runs every
    # prompt once, so no compile lands inside a timed request (generate()'s compile_config, or the caller)
    every_shape = warm_every_batch or "compile_config" in prepared.generate_kwargs
    for i in range(protocol.warmup):
        for j, batch in enumerate(batches if every_shape and i == 0 else batches[:1]):
            clock = TokenClock()
            submit_ns, _, _ = decode(batch, clock)
            if i == 0 and j == 0 and clock.step_ns:
                first_call_ms = (clock.step_ns[-1] - submit_ns) / 1e6
        if progress:
            progress("warmup", i + 1, protocol.warmup)
    warmup_s = time.perf_counter() - warmup_start

    requests: list[RequestTiming] = []
    outputs: list[Output] = []
    iteration = 0
    measured_ns = 0
    generated_tokens = 0
    steps = 0
    if prepared.counters is not None:
        prepared.counters.reset()
    rss_before = memory.release_and_reset_peak()
    memory.reset_cuda_peak(prepared.device)
    total_batches = len(batches)
    while iteration < protocol.min_iterations or measured_ns / 1e9 < protocol.min_duration_s:
        base_index = 0
        for b, batch in enumerate(batches):
            clock = TokenClock()
            start = time.perf_counter_ns()
            submit_ns, generated, natural = decode(batch, clock)
            measured_ns += time.perf_counter_ns() - start
            steps += len(clock.step_ns)
            timings, outs = collect_rows(tokenizer, eos, batch, submit_ns, clock, generated, natural,
                                         iteration=iteration, base_index=base_index, pin_length=protocol.pin_length)
            requests.extend(timings)
            generated_tokens += sum(len(t.token_ns) for t in timings)
            if iteration == 0:
                outputs.extend(outs)
            rows = generated.shape[0]
            base_index += rows
            if progress:
                progress(f"iteration {iteration + 1}", b + 1, total_batches)
        iteration += 1
    counters = prepared.counters.snapshot() if prepared.counters is not None else {}
    counters["generate_steps"] = steps
    return GenerationRun(
        requests=requests,
        outputs=outputs,
        measured_wall_s=measured_ns / 1e9,
        iterations=iteration,
        first_call_ms=first_call_ms,
        warmup_s=warmup_s,
        peak_rss_bytes=memory.peak_rss_bytes(),
        rss_before_bytes=rss_before,
        generated_tokens=generated_tokens,
        batch_size=int(batches[0]["input_ids"].shape[0]) if batches else 0,
        counters=counters,
        cuda_peak_bytes=memory.cuda_peak_bytes(prepared.device),
    )


@register_runner("generation", passes=True)
def run_generation(prepared: PreparedModel, inputs, workload, protocol: Protocol,
                   progress: Progress | None = None) -> GenerationRun:
    """The closed-loop runner: fixed batches, one `generate` call each, repeated per the protocol."""
    return measure_generation(prepared, inputs.batches, workload.max_new_tokens, protocol, progress=progress)


@register_runner("speculative", passes=True)
def run_speculative(prepared: PreparedModel, inputs, workload, protocol: Protocol,
                    progress: Progress | None = None) -> GenerationRun:
    """Multi-token steps (assisted / speculative generation): the closed loop at batch size 1.

    Tokens accepted in one verify step share its timestamp (TokenClock); `itl_ms` is then per step and
    TPOT is the per-token figure. The technique's counters (drafted, accepted...) come back in
    `counters`; `speculative_steps` counts the steps that delivered more than one token.
    """
    if any(int(b["input_ids"].shape[0]) != 1 for b in inputs.batches):
        raise ConfigError("speculative generation runs one request at a time (transformers' assisted "
                          f"generation is batch size 1); got batch size {workload.batch_size}")
    run = measure_generation(prepared, inputs.batches, workload.max_new_tokens, protocol, progress=progress)
    run.counters["multi_token_steps"] = sum(
        1 for r in run.requests for n in (r.step_tokens or []) if n > 1)
    return run
