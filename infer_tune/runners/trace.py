"""The arrival-trace runner: an open-loop replay of requests that arrive at given times.

Requests arrive on a trace (offsets in seconds from its start), whether or not earlier ones have
finished; a scheduler decides when each is served and with which others. A request's `submit_ns` is
its arrival, so TTFT and e2e include queueing; `start_ns` is when service began (`queue_ms`).

A technique puts `trace` (a list of `TraceRequest`, or a callable `(prepared, inputs, encoded, workload)
-> list[TraceRequest]` called untimed when the runner starts, for traces that depend on the prompts)
and `scheduler` (a `Scheduler`) into `PreparedModel.runner_options`. Without them every prompt arrives
at time 0 and `SerialScheduler` serves them first-come first-served, one at a time. A scheduler may
also have `setup(prepared, trace, encoded, max_new_tokens)`, run after warmup and before the trace
starts (timed apart as `scheduler_setup_s`), and `run_counters() -> dict`, merged into the metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol as TypingProtocol

from infer_tune.metrics import memory
from infer_tune.runners.base import (
    GenerationRun,
    Output,
    Progress,
    Protocol,
    RequestTiming,
    TokenClock,
    register_runner,
)
from infer_tune.runners.generation import collect_rows, eos_ids, generate_once
from infer_tune.runners.prepared import PreparedModel
from infer_tune.workload import encode_batches


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: which prompt, when it arrives (s after the trace starts), how long it may get."""

    prompt_index: int
    arrival_s: float
    max_new_tokens: int | None = None


class Scheduler(TypingProtocol):
    """Serves a trace. `encoded[i]` is prompt i tokenized alone ([1, S] with its attention mask);
    `origin_ns` is the trace's time 0 on `time.perf_counter_ns()`. Returns a timing and an output per
    request, in trace order."""

    name: str

    def serve(self, prepared: PreparedModel, trace: list[TraceRequest], encoded: list[dict], max_new_tokens: int,
              origin_ns: int, progress: Progress | None = None) -> tuple[list[RequestTiming], list[Output]]: ...


def wait_until(deadline_ns: int) -> None:
    """Idle until `deadline_ns` (the next arrival of an open-loop trace: real idle time, not work)."""
    while (left := deadline_ns - time.perf_counter_ns()) > 0:
        time.sleep(min(left / 1e9, 0.05))


class SerialScheduler:
    """First come, first served, one request at a time (no batching)."""

    name = "serial"

    def serve(self, prepared, trace, encoded, max_new_tokens, origin_ns, progress=None):
        eos = set(eos_ids(prepared.model, prepared.tokenizer))
        timings, outputs = [], []
        for k, request in enumerate(sorted(trace, key=lambda r: r.arrival_s)):
            arrival_ns = origin_ns + int(request.arrival_s * 1e9)
            wait_until(arrival_ns)
            clock = TokenClock()
            start_ns, _, generated, natural = generate_once(
                prepared, encoded[request.prompt_index], request.max_new_tokens or max_new_tokens, clock=clock)
            rows, outs = collect_rows(prepared.tokenizer, eos, encoded[request.prompt_index], arrival_ns, clock,
                                      generated, natural, iteration=0, base_index=request.prompt_index,
                                      start_ns=start_ns)
            timings.extend(rows)
            outputs.extend(outs)
            if progress:
                progress("requests", k + 1, len(trace))
        return timings, outputs


@register_runner("trace", passes="whole")
def run_trace(prepared: PreparedModel, inputs, workload, protocol: Protocol,
              progress: Progress | None = None) -> GenerationRun:
    """Warm up on the first prompt, then replay the trace once through the technique's scheduler."""
    options = prepared.runner_options
    scheduler: Scheduler = options.get("scheduler") or SerialScheduler()
    encoded = encode_batches(prepared.tokenizer, inputs.rendered, 1, add_special_tokens=not inputs.templated)
    trace = options.get("trace")
    if callable(trace):
        trace = trace(prepared, inputs, encoded, workload)
    trace = trace or [TraceRequest(i, 0.0) for i in range(len(inputs.prompts))]
    first_call_ms = None
    warmup_start = time.perf_counter()
    for i in range(protocol.warmup):
        submit_ns, token_ns, _, _ = generate_once(prepared, encoded[trace[0].prompt_index], workload.max_new_tokens)
        if i == 0 and token_ns:
            first_call_ms = (token_ns[-1] - submit_ns) / 1e6
    warmup_s = time.perf_counter() - warmup_start
    setup_s = None
    if hasattr(scheduler, "setup"):
        setup_start = time.perf_counter()
        scheduler.setup(prepared, trace, encoded, workload.max_new_tokens)
        setup_s = time.perf_counter() - setup_start
    if prepared.counters is not None:
        prepared.counters.reset()
    rss_before = memory.release_and_reset_peak()
    memory.reset_cuda_peak(prepared.device)
    origin_ns = time.perf_counter_ns()
    timings, outputs = scheduler.serve(prepared, trace, encoded, workload.max_new_tokens, origin_ns, progress)
    end_ns = max((t.token_ns[-1] for t in timings if t.token_ns), default=time.perf_counter_ns())
    counters = prepared.counters.snapshot() if prepared.counters is not None else {}
    counters.update(scheduler=scheduler.name, trace_requests=len(trace),
                    trace_span_s=max((r.arrival_s for r in trace), default=0.0),
                    trace_duration_s=(end_ns - origin_ns) / 1e9)
    if setup_s is not None:
        counters["scheduler_setup_s"] = setup_s
    if hasattr(scheduler, "run_counters"):
        counters.update(scheduler.run_counters())
    return GenerationRun(
        requests=timings,
        outputs=sorted(outputs, key=lambda o: o.prompt_index),
        measured_wall_s=(end_ns - origin_ns) / 1e9,
        iterations=1,
        first_call_ms=first_call_ms,
        warmup_s=warmup_s,
        peak_rss_bytes=memory.peak_rss_bytes(),
        rss_before_bytes=rss_before,
        generated_tokens=sum(len(t.token_ns) for t in timings),
        # the rows a decode step served on average (the roofline's batch: one weight read, that many tokens)
        batch_size=max(1, round(counters.get("mean_batch_size") or 1)),
        counters=counters,
        cuda_peak_bytes=memory.cuda_peak_bytes(prepared.device),
    )
