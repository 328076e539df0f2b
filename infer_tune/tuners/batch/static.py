"""Static batching: requests wait until a batch of B is full (or the oldest waited `timeout_ms`), then the
batch runs as one left-padded `generate` call until its longest request ends; only then can the next
batch start. Requests arriving meanwhile queue.

Every request's tokens are timed as `generate` streams them (a short request's last token comes before
the batch ends), `start_ns` is its batch's start, and `batch_log` records each batch (start, end,
size, steps) so the waiting is visible in the result.
"""

from __future__ import annotations

import time
from collections import deque

from infer_tune.runners.base import RequestTiming, TokenClock
from infer_tune.runners.generation import eos_ids, generate_once
from infer_tune.runners.trace import wait_until
from infer_tune.tuners.batch.common import count_mismatches, cut_at_eos, left_pad, make_output, pad_id


class StaticBatcher:
    """Fixed batches of up to `batch_size` requests, dispatched when full or when the oldest waited `timeout_ms`."""

    name = "static"

    def __init__(self, batch_size: int, timeout_ms: float) -> None:
        self.batch_size = batch_size
        self.timeout_ns = int(timeout_ms * 1e6)
        self.references: dict[int, list[int]] = {}
        self.timings: list[RequestTiming] = []
        self.outputs: list = []
        self.batch_log: list[dict] = []
        self._stats: dict = {}

    def serve(self, prepared, trace, encoded, max_new_tokens, origin_ns, progress=None):
        """Replay `trace` open-loop; returns (timings, outputs) in trace order."""
        eos = set(eos_ids(prepared.model, prepared.tokenizer))
        pad = pad_id(prepared.tokenizer)
        n = len(trace)
        order = sorted(range(n), key=lambda k: trace[k].arrival_s)
        arrival_ns = {k: origin_ns + int(trace[k].arrival_s * 1e9) for k in range(n)}
        timings: list = [None] * n
        outputs: list = [None] * n
        queue: deque[int] = deque()
        self.batch_log = []
        positions = useful = 0
        full = by_timeout = 0
        next_i = done = 0
        while done < n:
            now = time.perf_counter_ns()
            while next_i < n and arrival_ns[order[next_i]] <= now:
                queue.append(order[next_i])
                next_i += 1
            if not queue:
                wait_until(arrival_ns[order[next_i]])
                continue
            deadline = arrival_ns[queue[0]] + self.timeout_ns
            if len(queue) < self.batch_size and now < deadline:
                wait_until(min(deadline, arrival_ns[order[next_i]]) if next_i < n else deadline)
                continue
            full += len(queue) >= self.batch_size
            by_timeout += len(queue) < self.batch_size
            members = [queue.popleft() for _ in range(min(self.batch_size, len(queue)))]
            rows = [encoded[trace[k].prompt_index]["input_ids"][0] for k in members]
            lengths = [trace[k].max_new_tokens or max_new_tokens for k in members]
            batch = left_pad(rows, pad)
            clock = TokenClock()
            start_ns, token_ns, generated, _ = generate_once(prepared, batch, max(lengths), pin_length=False,
                                                             clock=clock)
            steps = int(generated.shape[1])
            for row, (k, limit) in enumerate(zip(members, lengths)):
                tokens = cut_at_eos(generated[row].tolist(), eos, limit)
                prompt_tokens = int(rows[row].numel())
                timings[k] = RequestTiming(trace[k].prompt_index, 0, prompt_tokens, arrival_ns[k],
                                           token_ns[:len(tokens)], start_ns=start_ns)
                outputs[k] = make_output(prepared.tokenizer, eos, trace[k].prompt_index, prompt_tokens, tokens)
                useful += prompt_tokens + len(tokens)
            positions += len(members) * (int(batch["input_ids"].shape[1]) + steps)
            self.batch_log.append({"start_ms": (start_ns - origin_ns) / 1e6,
                                   "end_ms": (token_ns[-1] - origin_ns) / 1e6 if token_ns else None,
                                   "size": len(members), "steps": steps, "members": members})
            done += len(members)
            if progress:
                progress("requests", done, n)
        self.timings, self.outputs = timings, outputs
        busy = sum(b["end_ms"] - b["start_ms"] for b in self.batch_log if b["end_ms"] is not None)
        span = max((b["end_ms"] for b in self.batch_log if b["end_ms"] is not None), default=0.0)
        self._stats = {"busy_share": busy / span if span else None,"padding_share": 1 - useful / positions if positions else None,
                       "batches": len(self.batch_log), "batches_full": full, "batches_by_timeout": by_timeout,
                       "mean_batch_size": n / len(self.batch_log) if self.batch_log else None,
                       "output_mismatches": count_mismatches(outputs, self.references, eos)}
        return timings, outputs

    def run_counters(self) -> dict:
        """Scheduler facts of the last replay (merged into the result's metrics)."""
        return {**self._stats, "batch_log": [{k: v for k, v in b.items() if k != "members"} for b in self.batch_log],
                "timeout_ms": self.timeout_ns / 1e6, "max_batch_size": self.batch_size}
