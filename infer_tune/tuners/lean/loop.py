"""The lean greedy decode loop: a static KV cache, the decode step compiled once, nothing else per token.

What `generate()` does per step and this loop does not: logits-processor and stopping-criteria
lists, cache bookkeeping objects, streamer calls, `model_kwargs` updates, attention-mask growth.
What it keeps: the same model forward on the same cache layout (asked for the last position's logits
only, as `generate()` asks), fp32 logits of that position,
end-of-sequence suppressed exactly as the generation runner pins length (the step where greedy would
have stopped is recorded), argmax. Greedy output is therefore bit-identical to `generate()` with a
static cache on the same weights (tests/test_tune.py checks it).

Batch size 1, no padding: one sequence, positions from `cache_position`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence

import torch

from infer_tune.runners.prepared import RunCounters

CACHE_BUCKET = 128  # the static cache is sized to a multiple of this, so one compiled graph serves a run


class LeanDecoder:
    """Owns the static cache and the compiled decode step of one model."""

    def __init__(self, model: torch.nn.Module, *, compile: bool = True, counters: RunCounters | None = None) -> None:
        self.model = model
        self.compile = compile
        self.counters = counters if counters is not None else RunCounters()
        self.cache = None
        self.cache_len = 0
        self._step = None
        # only the last position's logits: the prompt's other positions would cost a head matmul each
        forward_params = inspect.signature(model.forward).parameters
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in forward_params else {}

    def _ensure_cache(self, needed: int, device: torch.device) -> None:
        from transformers import StaticCache

        size = -(-needed // CACHE_BUCKET) * CACHE_BUCKET
        if self.cache is None or size > self.cache_len:
            self.cache = StaticCache(config=self.model.config, max_cache_len=size)
            self.cache_len = size
            self._step = None  # a new cache shape: compile again
        else:
            self.cache.reset()
        if self._step is None:
            self._step = torch.compile(self.model, dynamic=False, fullgraph=False) if self.compile else self.model

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_ids: Sequence[int], *,
                 pin_length: bool = True) -> tuple[int, list[int], list[int], int | None]:
        """Greedy-decode `max_new_tokens` after `input_ids` [1, P].

        Returns (submit_ns, token_ns per token, token ids, natural length or None): with `pin_length`,
        end-of-sequence is suppressed and the step where greedy would have picked it is the natural
        length; without, decoding stops after the first end-of-sequence token.
        """
        prompt_len = input_ids.shape[1]
        self._ensure_cache(prompt_len + max_new_tokens, input_ids.device)
        eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=input_ids.device)
        tokens: list[int] = []
        token_ns: list[int] = []
        natural = None
        forward_ns = 0
        submit_ns = time.perf_counter_ns()
        logits = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True,
                            cache_position=torch.arange(prompt_len, device=input_ids.device), **self._extra).logits
        position = torch.tensor([prompt_len], device=input_ids.device)
        for step in range(max_new_tokens):
            scores = logits[:, -1, :].to(copy=True, dtype=torch.float32)  # as generate() takes them
            if eos.numel():
                if pin_length:
                    if natural is None and bool(torch.isin(scores.argmax(-1), eos)):
                        natural = step
                    scores[:, eos] = -float("inf")
            token = scores.argmax(-1)  # [1]
            token_id = int(token)
            token_ns.append(time.perf_counter_ns())
            tokens.append(token_id)
            if not pin_length and eos.numel() and token_id in eos.tolist():
                break
            if step + 1 == max_new_tokens:
                break
            started = time.perf_counter_ns()
            logits = self._step(input_ids=token[:, None], past_key_values=self.cache, use_cache=True,
                                cache_position=position, **self._extra).logits
            forward_ns += time.perf_counter_ns() - started
            position = position + 1
        decode_steps = max(len(tokens) - 1, 0)
        if decode_steps:
            loop_ns = (token_ns[-1] - token_ns[0]) - forward_ns
            self.counters.add("lean_decode_steps", decode_steps)
            self.counters.add("lean_forward_ms", forward_ns / 1e6)
            self.counters.add("lean_loop_overhead_ms", loop_ns / 1e6)
        return submit_ns, token_ns, tokens, natural


class LeanCounters(RunCounters):
    """Adds per-token figures: forward time and the loop's own time per decode step."""

    def snapshot(self) -> dict:
        values = super().snapshot()
        steps = values.get("lean_decode_steps") or 0
        if steps:
            values["lean_forward_ms_per_token"] = values["lean_forward_ms"] / steps
            values["lean_overhead_ms_per_token"] = values["lean_loop_overhead_ms"] / steps
        return values
