"""The endpoint runner: the workload sent to an OpenAI-compatible server over HTTP and timed client side.

`PreparedModel.runner_options`: `endpoint` (an `EndpointConfig`, already settled by
`infer_tune.endpoint.probe.connect`), `prompts` (the text sent per prompt index; default: the
prompts as written for the chat API, as rendered for the completions API), `trace` (a list of
`TraceRequest`: one open-loop replay; absent: closed-loop passes over every prompt, repeated per the
protocol, at most `concurrency` in flight) and `slo` (latency limits: adds goodput, see
metrics.saturation). Warmup requests (the first timed apart as `first_call_ms`) go before the
timed region. Failed requests are counted by kind, never raised;
when not one timed request succeeds the run ends with an `EndpointError` (exit 2), nothing written.
`prepared.model` is None: the weights live in the server.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING

from infer_tune.endpoint import loadgen, sessions, workloads
from infer_tune.endpoint import replay as rp  # a module reference: replay imports runners.base (a cycle)
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.probe import EveryRequestFailed
from infer_tune.metrics import memory, saturation
from infer_tune.metrics.stats import summarize
from infer_tune.runners.base import GenerationRun, Progress, Protocol, register_runner
from infer_tune.runners.prepared import PreparedModel
from infer_tune.runners.trace import TraceRequest

if TYPE_CHECKING:
    from infer_tune.endpoint.replay import ReplayResult

KEPT_FAILURES = 20  # failure details kept in the result (all are counted)


def request_prompts(inputs, config: EndpointConfig) -> list[str]:
    """What is sent for each prompt: its text (chat: the server applies its template) or the rendered prompt."""
    return [p.text for p in inputs.prompts] if config.api == "chat" else list(inputs.rendered)


def failure_summary(failures, sent: int, url: str) -> str:
    kinds = Counter(f.kind for f in failures)
    first = {}
    for f in failures:
        first.setdefault(f.kind, f.message)
    parts = ", ".join(f"{n} {kind} ({first[kind]})" for kind, n in kinds.most_common())
    return f"every request to {url} failed ({len(failures)} of {sent}): {parts}"


def first_outputs(result: ReplayResult) -> tuple[list, int]:
    """One output per prompt (its first success, in prompt order) and the number of prompts whose
    outputs differed between requests (greedy decoding should repeat itself)."""
    by_prompt: dict[int, list] = {}
    for output in result.outputs:
        by_prompt.setdefault(output.prompt_index, []).append(output)
    varied = sum(1 for outs in by_prompt.values() if len({o.text for o in outs}) > 1)
    return [outs[0] for _, outs in sorted(by_prompt.items())], varied


async def _timed(session, config: EndpointConfig, trace, prompts, max_new_tokens: int, client: dict, passes: int = 1,
                 **kwargs):
    """One timed replay: over the load generator's worker processes when there are several, else on this
    loop; either way the client's own readings (loop lag, CPU) go into `client`."""
    workers = client["workers"]
    if workers > 1:
        loop = asyncio.get_running_loop()
        kwargs.pop("progress", None)
        kwargs["passes"] = passes
        result, readings = await loop.run_in_executor(None, lambda: loadgen.replay_workers(
            config, trace, prompts, max_new_tokens, workers=workers, **kwargs))
        client["worker_readings"] += readings["worker_readings"]
        return result
    result, reading = await loadgen.monitored(rp.replay(session, config, trace, prompts, max_new_tokens, **kwargs))
    client["worker_readings"].append(dict(reading, requests=len(trace), concurrency=config.concurrency))
    return result


async def _measure(prepared: PreparedModel, prompts: list[str], max_new_tokens: int, protocol: Protocol,
                   progress: Progress | None, client: dict,
                   extra: dict) -> tuple[ReplayResult, int, float | None, float, int, int]:
    config: EndpointConfig = prepared.runner_options["endpoint"]
    trace: list[TraceRequest] | None = prepared.runner_options.get("trace")
    plans = prepared.runner_options.get("sessions")
    first = trace[0].prompt_index if trace else 0
    async with rp.client_session(config) as session:
        warmup_start = time.perf_counter()
        first_call_ms, warm_failures = None, 0
        for i in range(protocol.warmup):
            warm = await rp.replay(session, config, [TraceRequest(first, 0.0)], prompts, max_new_tokens, closed_loop=True)
            warm_failures += len(warm.failures)
            if i == 0 and warm.timings and warm.timings[0].token_ns:
                first_call_ms = warm.timings[0].e2e_ms
        warmup_s = time.perf_counter() - warmup_start
        rss_before = memory.release_and_reset_peak()
        if plans is not None:  # multi-turn: each turn waits for the previous answer, one loop
            done, reading = await loadgen.monitored(sessions.replay_sessions(
                session, config, plans, max_new_tokens, history=prepared.runner_options.get("history", "server"),
                tokenizer=prepared.tokenizer, render=prepared.runner_options.get("render"), progress=progress))
            client["worker_readings"].append(dict(reading, requests=len(done.sent), concurrency=config.concurrency))
            extra["sessions"] = done
            return done.result, 1, first_call_ms, warmup_s, warm_failures, rss_before
        if trace:
            total = await _timed(session, config, trace, prompts, max_new_tokens, client, tokenizer=prepared.tokenizer,
                                 progress=progress)
            return total, 1, first_call_ms, warmup_s, warm_failures, rss_before
        closed = [TraceRequest(i, 0.0) for i in range(len(prompts))]
        total, iterations, wall = rp.ReplayResult(), 0, 0.0
        per_pass = None  # worker processes start once per launch: one pass, then the passes still needed at once
        while client["workers"] > 1 and (iterations < protocol.min_iterations or wall < protocol.min_duration_s):
            passes = 1 if per_pass is None else min(1000, max(
                1, protocol.min_iterations - iterations,
                math.ceil(1.1 * (protocol.min_duration_s - wall) / max(per_pass, 1e-4))))
            one = await _timed(session, config, closed, prompts, max_new_tokens, client, passes=passes,
                               closed_loop=True, tokenizer=prepared.tokenizer, iteration=iterations)
            total.merge(one)
            wall += one.wall_s
            iterations += passes
            per_pass = one.wall_s / passes
            if not one.timings:
                break
        while client["workers"] == 1 and (iterations < protocol.min_iterations or wall < protocol.min_duration_s):
            one = await _timed(session, config, closed, prompts, max_new_tokens, client, closed_loop=True,
                               tokenizer=prepared.tokenizer, iteration=iterations, progress=progress)
            total.merge(one)
            wall += one.wall_s
            iterations += 1
            if not one.timings:  # nothing succeeds: repeating would only repeat the failures
                break
        total.origin_ns, total.end_ns = 0, int(wall * 1e9)
        return total, iterations, first_call_ms, warmup_s, warm_failures, rss_before


@register_runner("endpoint")
def run_endpoint(prepared: PreparedModel, inputs, workload, protocol: Protocol,
                 progress: Progress | None = None) -> GenerationRun:
    """Warm up, then closed-loop passes (or one trace replay) against the endpoint; see the module docstring."""
    config: EndpointConfig = prepared.runner_options["endpoint"]
    trace = prepared.runner_options.get("trace")
    plans = prepared.runner_options.get("sessions")
    prompts = prepared.runner_options.get("prompts") or request_prompts(inputs, config)
    requests = len(trace) if trace else len(prompts)
    workers = 1 if plans is not None else config.workers or loadgen.default_workers(min(config.concurrency, requests))
    client = {"workers": workers, "workers_requested": config.workers, "cores": loadgen.cores(),
              "worker_readings": []}
    extra: dict = {}
    result, iterations, first_call_ms, warmup_s, warm_failures, rss_before = asyncio.run(
        _measure(prepared, prompts, workload.max_new_tokens, protocol, progress, client, extra))
    client.update(loadgen.saturation(client["worker_readings"], result.lateness_ms))
    sent = len(result.timings) + len(result.failures)
    if not result.timings:
        raise EveryRequestFailed(failure_summary(result.failures, sent, config.url),
                                 frozenset(f.kind for f in result.failures))
    outputs, varied = first_outputs(result)
    sources = set(result.token_sources)
    counters = {
        "requests_sent": sent,
        "requests_ok": len(result.timings),
        "requests_failed": len(result.failures),
        "failure_rate": len(result.failures) / sent,
        "failures_by_kind": dict(Counter(f.kind for f in result.failures)),
        "failures": [asdict(f) for f in result.failures[:KEPT_FAILURES]],
        "warmup_failures": warm_failures,
        "token_count_source": sources.pop() if len(sources) == 1 else "mixed",
        "usage_token_mismatches": result.usage_mismatches,
        "token_count_mismatches": result.token_count_mismatches,
        "token_count_unverified": result.token_count_unverified,
        "token_count_failures": result.token_count_failures,
        "multi_token_deliveries": result.multi_token_deliveries,
        "requests_resent": result.resent,
        "prefix_cache": {"requests_reporting": result.cache_reports, "prompt_tokens": result.cache_prompt_tokens,
                         "cached_tokens": result.cached_tokens, "hit_rate": result.hit_rate},
        "generate_steps": sum(len(t.step_ns()) for t in result.timings),  # deliveries the client saw
        "nondeterministic_outputs": varied,
        "concurrency": config.concurrency,
        "client": client,
        "client_saturated": client["client_saturated"],
        "client_saturation_reason": client["client_saturation_reason"],
        "client_peak_rss_bytes": memory.peak_rss_bytes(),
    }
    slo = prepared.runner_options.get("slo")
    if slo is not None:
        counters.update(saturation.goodput(result.timings, saturation.SLO.from_dict(slo), result.wall_s,
                                           submitted=len(result.timings) + len(result.failures)))
    if "sessions" in extra:
        done = extra["sessions"]
        counters.update(sessions=len(plans), turns_sent=sent, turns_not_sent=done.turns_not_sent,
                        turns=workloads.per_turn(result.timings, done.turn_of),
                        client_lateness_ms=summarize(result.lateness_ms))
    if trace:
        counters.update(trace_requests=len(trace), trace_span_s=max((r.arrival_s for r in trace), default=0.0),
                        client_lateness_ms=summarize(result.lateness_ms))
    return GenerationRun(
        requests=result.timings,
        outputs=outputs,
        measured_wall_s=result.wall_s,
        iterations=iterations,
        first_call_ms=first_call_ms,
        warmup_s=warmup_s,
        # the server's memory is not visible from here: the client's RSS (client_peak_rss_bytes) must not
        # pass for it
        peak_rss_bytes=None,
        rss_before_bytes=None,
        generated_tokens=sum(len(t.token_ns) for t in result.timings),
        batch_size=config.concurrency,
        counters=counters,
    )
