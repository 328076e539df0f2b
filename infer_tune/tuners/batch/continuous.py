"""Continuous batching through transformers' own manager (`init_continuous_batching`, `add_request`,
`get_result`): iteration-level scheduling over a paged KV cache, in a background thread. At every step
finished requests leave and waiting ones join, up to `max_requests_per_batch` requests and
`max_batch_tokens` tokens per forward pass.

Set-up (cache allocation, one warm request) happens before the trace starts and is reported apart
(`scheduler_setup_s`), never inside TTFT. Each request is submitted at its arrival time; its tokens'
timestamps are the host time of the step that produced them (requests of one step share it), and
`start_ns` is when the manager scheduled its prefill.
"""

from __future__ import annotations

import bisect
import math
import time

from infer_tune.errors import ConfigError
from infer_tune.runners.base import RequestTiming
from infer_tune.runners.generation import eos_ids
from infer_tune.runners.trace import wait_until
from infer_tune.tuners.batch.common import count_mismatches, make_output, pad_id

IMPL = "transformers ContinuousBatchingManager (paged KV cache, iteration-level FIFO scheduler)"
PAGE_SIZE = 64
SAFETY_MARGIN = 0.15  # transformers' FIFO scheduler stops admitting prefills below this free-cache share


def cache_blocks(batch_size: int, longest_sequence: int, page_size: int = PAGE_SIZE) -> int:
    """Pages enough for `batch_size` sequences of `longest_sequence` tokens, above the scheduler's margin."""
    per_request = math.ceil(longest_sequence / page_size) + 1
    return math.ceil(batch_size * per_request / (1 - SAFETY_MARGIN)) + 2


class ContinuousBatcher:
    """Iteration-level scheduling by transformers' continuous-batching manager."""

    name = "continuous"

    def __init__(self, batch_size: int, max_batch_tokens: int) -> None:
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.references: dict[int, list[int]] = {}
        self.timings: list[RequestTiming] = []
        self.outputs: list = []
        self._manager = None
        self._steps: list[tuple[int, int, int, int]] = []  # (end ns, query tokens, real tokens, requests)
        self._stats: dict = {}

    # ------------------------------------------------------------------ set-up (before the trace starts)
    def setup(self, prepared, trace, encoded, max_new_tokens) -> None:
        """Create the manager sized to this trace, start its thread and serve one warm request."""
        from transformers import GenerationConfig

        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            raise ConfigError("continuous batching needs transformers >= 5 (ContinuousBatchingConfig)") from None
        model = prepared.model
        if not hasattr(model, "init_continuous_batching"):
            raise ConfigError(f"{type(model).__name__} has no transformers continuous-batching support")
        eos = eos_ids(model, prepared.tokenizer)
        longest = max(int(encoded[r.prompt_index]["input_ids"].shape[1]) + (r.max_new_tokens or max_new_tokens)
                      for r in trace)
        blocks = cache_blocks(self.batch_size, longest)
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or -1,
                                  pad_token_id=pad_id(prepared.tokenizer))
        cb_config = ContinuousBatchingConfig(
            page_size=PAGE_SIZE, num_blocks=blocks, max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.batch_size, allow_block_sharing=False, auto_switch_to_flash=False,
            scheduler_type="fifo", safety_margin=SAFETY_MARGIN)
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
        original_step = manager._generation_step

        def timed_step() -> None:
            original_step()
            io = manager.batch_processor.inputs_and_outputs
            self._steps.append((time.perf_counter_ns(), int(getattr(io, "num_q_tokens", 0)),
                                int(getattr(io, "total_seqlen_q", 0)), int(getattr(io, "num_request_in_batch", 0))))

        manager._generation_step = timed_step  # the step loop calls this attribute: a timestamp per step
        manager.warmup()
        manager.start()
        self._manager = manager
        self.attn_impl = model.config._attn_implementation
        self.cache_tokens = blocks * PAGE_SIZE
        warm = manager.add_request(encoded[trace[0].prompt_index]["input_ids"][0].tolist(), request_id="warm",
                                   max_new_tokens=2)
        self._collect({warm}, timeout_s=600)
        self._steps.clear()

    def _collect(self, wanted: set[str], timeout_s: float) -> dict:
        results = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < len(wanted):
            result = self._manager.get_result(timeout=0.2)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"continuous batching failed request {result.request_id}: {result.error}")
                results[result.request_id] = result
            elif result is None and not self._manager.is_running():
                raise RuntimeError("transformers' continuous-batching thread stopped before every request finished")
            if time.monotonic() > deadline:
                raise RuntimeError(f"continuous batching: {len(wanted) - len(results)} requests unfinished "
                                   f"after {timeout_s:.0f} s")
        return results

    # ------------------------------------------------------------------ the replay
    def serve(self, prepared, trace, encoded, max_new_tokens, origin_ns, progress=None):
        """Submit each request at its arrival; returns (timings, outputs) in trace order."""
        if self._manager is None:
            self.setup(prepared, trace, encoded, max_new_tokens)
            self._steps.clear()
        eos = set(eos_ids(prepared.model, prepared.tokenizer))
        n = len(trace)
        arrival_ns = [origin_ns + int(r.arrival_s * 1e9) for r in trace]
        lag = 0
        try:
            for k in sorted(range(n), key=lambda i: trace[i].arrival_s):
                wait_until(arrival_ns[k])
                lag = max(lag, time.perf_counter_ns() - arrival_ns[k])
                request = trace[k]
                self._manager.add_request(encoded[request.prompt_index]["input_ids"][0].tolist(), request_id=str(k),
                                          max_new_tokens=request.max_new_tokens or max_new_tokens,
                                          record_timestamps=True)
                if progress:
                    progress("requests submitted", k + 1, n)
            results = self._collect({str(k) for k in range(n)}, timeout_s=3600)
        finally:
            self._manager.stop(block=True, timeout=60)
            self._manager.destroy()
            self._manager = None
        step_ends = [s[0] for s in self._steps]
        timings, outputs = [], []
        for k, request in enumerate(trace):
            result = results[str(k)]
            tokens = list(result.generated_tokens)
            token_ns = [self._step_time(step_ends, t) for t in (result.timestamps or [])]
            prompt_tokens = len(result.prompt_ids)
            timings.append(RequestTiming(request.prompt_index, 0, prompt_tokens, arrival_ns[k], token_ns,
                                         start_ns=int(result.lifespan[0] * 1e9)))
            outputs.append(make_output(prepared.tokenizer, eos, request.prompt_index, prompt_tokens, tokens))
        self.timings, self.outputs = timings, outputs
        computed = sum(s[1] for s in self._steps)
        self._stats = {
            "padding_share": 1 - sum(s[2] for s in self._steps) / computed if computed else None,
            "forward_steps": len(self._steps),
            "mean_batch_size": sum(s[3] for s in self._steps) / len(self._steps) if self._steps else None,
            "max_submit_lag_ms": lag / 1e6,
            "output_mismatches": count_mismatches(outputs, self.references, eos),
        }
        return timings, outputs

    @staticmethod
    def _step_time(step_ends: list[int], stamp_s: float) -> int:
        """The end of the step that produced a token stamped at `stamp_s` (perf_counter seconds)."""
        stamp = int(stamp_s * 1e9)
        i = bisect.bisect_right(step_ends, stamp) - 1
        return step_ends[i] if i >= 0 else stamp

    def run_counters(self) -> dict:
        """Scheduler facts of the last replay (merged into the result's metrics)."""
        return {**self._stats, "continuous_impl": IMPL, "continuous_attn_impl": getattr(self, "attn_impl", None),
                "max_batch_size": self.batch_size, "max_batch_tokens": self.max_batch_tokens,
                "kv_cache_tokens": getattr(self, "cache_tokens", None)}
