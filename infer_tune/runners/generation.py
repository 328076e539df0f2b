"""Greedy generation with the host timestamp of every generated token.

Timing protocol (DESIGN.md): warmup runs (the first call timed and reported apart), then whole
passes over the workload until both `min_iterations` and `min_duration_s` are met. Output length is
pinned (end-of-sequence is suppressed, as `min_new_tokens == max_new_tokens` does) so that every
configuration decodes the same number of tokens; the step at which greedy decoding *would* have
picked end-of-sequence is recorded, so the natural output for quality is the pinned output cut
there — identical to an unpinned greedy run, without a second generation pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from infer_tune.errors import ConfigError
from infer_tune.metrics import memory
from infer_tune.runners.prepared import PreparedModel


@dataclass
class Protocol:
    """Warmup and repetition rules for a timed measurement."""

    warmup: int = 1
    min_iterations: int = 2
    min_duration_s: float = 5.0
    pin_length: bool = True

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if self.min_iterations < 1:
            raise ConfigError(f"--min-iterations must be >= 1, got {self.min_iterations}")
        if self.min_duration_s < 0:
            raise ConfigError(f"--min-duration must be >= 0 seconds, got {self.min_duration_s}")


@dataclass
class RequestTiming:
    """One request of one iteration: submission time and the host time of every generated token (ns)."""

    prompt_index: int
    iteration: int
    prompt_tokens: int
    submit_ns: int
    token_ns: list[int]

    @property
    def ttft_ms(self) -> float:
        return (self.token_ns[0] - self.submit_ns) / 1e6

    @property
    def e2e_ms(self) -> float:
        return (self.token_ns[-1] - self.submit_ns) / 1e6

    @property
    def itl_ms(self) -> list[float]:
        return [(b - a) / 1e6 for a, b in zip(self.token_ns, self.token_ns[1:])]

    @property
    def tpot_ms(self) -> float | None:
        n = len(self.token_ns)
        return (self.e2e_ms - self.ttft_ms) / (n - 1) if n > 1 else None


@dataclass
class Output:
    """The natural (unpinned-equivalent) greedy output of one prompt."""

    prompt_index: int
    text: str
    token_ids: list[int]
    prompt_tokens: int
    hit_eos: bool


@dataclass
class GenerationRun:
    """Raw measurements of a workload run; statistics are computed by `metrics`."""

    requests: list[RequestTiming]
    outputs: list[Output]
    measured_wall_s: float
    iterations: int
    first_call_ms: float | None
    warmup_s: float
    peak_rss_bytes: int
    rss_before_bytes: int
    generated_tokens: int
    batch_size: int
    extras: dict = field(default_factory=dict)

    def per_position_ms(self) -> list[float]:
        """Mean latency of each decode step, in order (element k: the gap before generated token k+1),
        averaged over the requests that reached that step."""
        sums: list[float] = []
        counts: list[int] = []
        for request in self.requests:
            for k, gap in enumerate(request.itl_ms):
                if k == len(sums):
                    sums.append(0.0)
                    counts.append(0)
                sums[k] += gap
                counts[k] += 1
        return [total / n for total, n in zip(sums, counts)]


class _TokenClock(BaseStreamer):
    """Streamer that records `perf_counter_ns` each time `generate` hands over new tokens."""

    def __init__(self) -> None:
        self.token_ns: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.token_ns.append(time.perf_counter_ns())

    def end(self) -> None:
        pass


class _PinLength(LogitsProcessor):
    """Suppress end-of-sequence so every step decodes, recording where greedy would have stopped."""

    def __init__(self, eos_ids: Sequence[int], prompt_len: int, batch: int) -> None:
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
        self.prompt_len = prompt_len
        self.natural_len: list[int | None] = [None] * batch

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.eos.numel() == 0:
            return scores
        step = input_ids.shape[1] - self.prompt_len
        eos = self.eos.to(scores.device)
        top = scores.argmax(dim=-1)
        hits = torch.isin(top, eos).tolist()
        for row, hit in enumerate(hits):
            if hit and self.natural_len[row] is None:
                self.natural_len[row] = step
        scores[:, eos] = -float("inf")
        return scores


def eos_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
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


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate_once(
    prepared: PreparedModel, batch: dict[str, torch.Tensor], max_new_tokens: int, *, pin_length: bool = True
) -> tuple[int, list[int], torch.Tensor, list[int | None]]:
    """One timed `generate` call on a tokenized batch.

    Returns (submit_ns, token_ns per step, generated ids [B, T], natural length per row or None).
    """
    model, tokenizer = prepared.model, prepared.tokenizer
    input_ids = batch["input_ids"].to(prepared.device)  # [B, S]
    attention_mask = batch["attention_mask"].to(prepared.device)  # [B, S]
    eos = eos_ids(model, tokenizer)
    clock = _TokenClock()
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
    _sync(prepared.device)
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
    _sync(prepared.device)
    generated = out[:, input_ids.shape[1]:]
    natural = pin.natural_len if pin is not None else [None] * input_ids.shape[0]
    return submit_ns, clock.token_ns, generated, natural


def measure_generation(
    prepared: PreparedModel,
    batches: Sequence[dict[str, torch.Tensor]],
    max_new_tokens: int,
    protocol: Protocol,
    *,
    progress: Callable[[str, int, int | None], None] | None = None,
) -> GenerationRun:
    """Warm up, then run every batch repeatedly until the protocol is satisfied.

    `batches` are tokenized, left-padded batches with an attention mask; `progress(stage, done, total)`
    is called after each batch so a CLI can draw a bar (the runner itself prints nothing).
    """
    tokenizer = prepared.tokenizer
    eos = set(eos_ids(prepared.model, tokenizer))
    first_call_ms = None
    warmup_start = time.perf_counter()
    for i in range(protocol.warmup):
        submit_ns, token_ns, _, _ = generate_once(prepared, batches[0], max_new_tokens, pin_length=protocol.pin_length)
        if i == 0 and token_ns:
            first_call_ms = (token_ns[-1] - submit_ns) / 1e6
        if progress:
            progress("warmup", i + 1, protocol.warmup)
    warmup_s = time.perf_counter() - warmup_start

    requests: list[RequestTiming] = []
    outputs: list[Output] = []
    iteration = 0
    measured_ns = 0
    generated_tokens = 0
    rss_before = memory.release_and_reset_peak()
    total_batches = len(batches)
    while iteration < protocol.min_iterations or measured_ns / 1e9 < protocol.min_duration_s:
        base_index = 0
        for b, batch in enumerate(batches):
            start = time.perf_counter_ns()
            submit_ns, token_ns, generated, natural = generate_once(
                prepared, batch, max_new_tokens, pin_length=protocol.pin_length
            )
            measured_ns += time.perf_counter_ns() - start
            rows = generated.shape[0]
            prompt_tokens = batch["attention_mask"].sum(dim=1).tolist()
            for row in range(rows):
                ids = generated[row].tolist()
                if not protocol.pin_length:  # natural run: the row ends at its first end-of-sequence
                    cut = next((k for k, t in enumerate(ids) if t in eos), None)
                    natural_len = cut
                else:
                    natural_len = natural[row]
                n_tokens = len(ids) if protocol.pin_length or natural_len is None else natural_len + 1
                generated_tokens += n_tokens
                requests.append(RequestTiming(
                    prompt_index=base_index + row,
                    iteration=iteration,
                    prompt_tokens=int(prompt_tokens[row]),
                    submit_ns=submit_ns,
                    token_ns=token_ns[:n_tokens],
                ))
                if iteration == 0:
                    keep = ids if natural_len is None else ids[:natural_len]
                    outputs.append(Output(
                        prompt_index=base_index + row,
                        text=tokenizer.decode(keep, skip_special_tokens=True),
                        token_ids=keep,
                        prompt_tokens=int(prompt_tokens[row]),
                        hit_eos=natural_len is not None,
                    ))
            base_index += rows
            if progress:
                progress(f"iteration {iteration + 1}", b + 1, total_batches)
        iteration += 1
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
    )
