"""Replay requests against an endpoint: open loop (an arrival trace) or closed loop, bounded concurrency.

`replay_trace(config, trace, prompts, max_new_tokens)` is the library entry (`batch serve-sim
--endpoint` and the endpoint runner use it): requests are sent at their arrival times (seconds after
the replay starts) whether or not earlier ones finished, with at most `config.concurrency` in flight;
a request that finds every slot taken waits (its `queue_ms`). Returns the client-side timing of every
successful request as a `RequestTiming`, its output, and the failed requests with their kind.

Tokens: `usage.completion_tokens` when the server reports it (and it is not below the number of
text-bearing events), else one token per text-bearing event. Events that arrive in one network read
form one delivery (a step); tokens counted but not streamed as text (end-of-sequence) belong to the
finishing event (`count_tokens`). TTFT is the first delivery with text; ITL the gaps between
deliveries; e2e runs to the last delivery.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from infer_tune.endpoint.client import MAX_PROMPT_TOKENS, StreamRecord, encode_body, stream_request
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.errors import ConfigError

if TYPE_CHECKING:  # imported when used: load-generator workers need only the sending half, not torch
    from infer_tune.runners.base import Output, RequestTiming
    from infer_tune.runners.trace import TraceRequest

Progress = Callable[[str, int, int | None], None]
KEPT_TOKEN_FAILURES = 20  # token-count mismatches kept with their numbers (all are counted)


@dataclass
class Failure:
    """A request that did not complete: which prompt, when it arrived, why (`kind`, see client.FAILURE_KINDS)."""

    prompt_index: int
    arrival_s: float
    kind: str
    message: str
    status: int | None = None


@dataclass
class ReplayResult:
    """What one replay measured: timings and outputs of successful requests (trace order), failures,
    the replay's start and end on `perf_counter_ns` (end: every request answered or failed), and how
    late the client's timer woke for each arrival (`lateness_ms`, open loop: the client's own lag,
    before any wait for a free slot)."""

    timings: list[RequestTiming] = field(default_factory=list)
    outputs: list[Output] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    origin_ns: int = 0
    end_ns: int = 0
    lateness_ms: list[float] = field(default_factory=list)
    token_sources: dict[str, int] = field(default_factory=dict)
    usage_mismatches: int = 0
    multi_token_deliveries: int = 0
    resent: int = 0  # requests sent again after a closed keep-alive connection (StreamRecord.resent)
    token_count_mismatches: int = 0
    token_count_unverified: int = 0
    token_count_failures: list[dict] = field(default_factory=list)
    # the server's prompt cache as its usage reports it (`prompt_tokens_details.cached_tokens`: OpenAI's field,
    # `infer-tune serve`'s and llama-server's): requests that reported it, their prompt tokens, those cached
    cache_reports: int = 0
    cache_prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float | None:
        """Cached / prompt tokens over the requests whose usage said how many were cached (None: none did)."""
        return self.cached_tokens / self.cache_prompt_tokens if self.cache_prompt_tokens else None

    @property
    def wall_s(self) -> float:
        return (self.end_ns - self.origin_ns) / 1e9

    def merge(self, other: ReplayResult) -> None:
        self.timings += other.timings
        self.outputs += other.outputs
        self.failures += other.failures
        self.lateness_ms += other.lateness_ms
        for key, n in other.token_sources.items():
            self.token_sources[key] = self.token_sources.get(key, 0) + n
        self.usage_mismatches += other.usage_mismatches
        self.multi_token_deliveries += other.multi_token_deliveries
        self.resent += other.resent
        self.token_count_mismatches += other.token_count_mismatches
        self.token_count_unverified += other.token_count_unverified
        self.token_count_failures += other.token_count_failures[:KEPT_TOKEN_FAILURES - len(self.token_count_failures)]
        self.cache_reports += other.cache_reports
        self.cache_prompt_tokens += other.cache_prompt_tokens
        self.cached_tokens += other.cached_tokens


def count_tokens(record: StreamRecord) -> tuple[int, str, list[tuple[int, int]]]:
    """(generated tokens, where the count came from, [(time, tokens)] per delivery) of a successful record.

    Text-bearing events of one network read are one delivery. Tokens the server counted but did not
    stream as text (an end-of-sequence token, bytes of an unfinished character) belong to the
    delivery that followed them: the finishing event when it came later, else the last delivery.
    """
    steps: list[list[int]] = []
    for t in record.delivery_ns:
        if steps and steps[-1][0] == t:
            steps[-1][1] += 1
        else:
            steps.append([t, 1])
    events = len(record.delivery_ns)
    reported = (record.usage or {}).get("completion_tokens")
    if isinstance(reported, int) and reported >= events:
        tokens, source = reported, "usage"
    else:
        tokens, source = events, "deltas"
    extra = tokens - events
    if extra and steps:
        if record.finish_ns is not None and record.finish_ns > steps[-1][0]:
            steps.append([record.finish_ns, extra])
        else:
            steps[-1][1] += extra
    return tokens, source, [(t, n) for t, n in steps]


def check_token_count(record: StreamRecord) -> bool | None:
    """The client's count of streamed tokens (one per text event) against the server's
    `usage.completion_tokens`: True when they agree (the server may count one more, its end-of-sequence
    token, when it stopped), False when they differ, None when the server sent no count."""
    reported = (record.usage or {}).get("completion_tokens")
    if not isinstance(reported, int) or isinstance(reported, bool):
        return None
    events = len(record.delivery_ns)
    return reported == events or (reported == events + 1 and record.finish_reason == "stop")


def prompt_text(prompt: str | list[dict]) -> str:
    """A request's prompt as text (a message list: its contents, one per paragraph)."""
    return prompt if isinstance(prompt, str) else "\n\n".join(str(m.get("content", "")) for m in prompt)


def to_timing(record: StreamRecord, prompt_index: int, submit_ns: int, start_ns: int | None, iteration: int,
              prompt_tokens: int) -> tuple[RequestTiming, str, bool]:
    """The record as a RequestTiming (one timestamp per token), the token-count source, and whether
    the server's usage disagreed with the events it streamed."""
    _, source, steps = count_tokens(record)
    token_ns = [t for t, n in steps for _ in range(n)]
    reported = (record.usage or {}).get("completion_tokens")
    mismatch = isinstance(reported, int) and reported != len(record.delivery_ns)
    step_tokens = None if all(n == 1 for _, n in steps) else [n for _, n in steps]
    from infer_tune.runners.base import RequestTiming

    return (RequestTiming(prompt_index, iteration, prompt_tokens, submit_ns, token_ns, step_tokens, start_ns),
            source, mismatch)


def prompt_token_count(record: StreamRecord, prompt: str | list[dict], tokenizer) -> int:
    """usage.prompt_tokens when reported, else the local tokenizer's count, else 0 (unknown)."""
    reported = (record.usage or {}).get("prompt_tokens")
    if isinstance(reported, int) and not isinstance(reported, bool) and 0 <= reported <= MAX_PROMPT_TOKENS:
        return reported  # a record with any other value failed as invalid_usage (client.check_length)
    if tokenizer is not None:
        return len(tokenizer(prompt_text(prompt), add_special_tokens=False)["input_ids"])
    return 0


def cached_token_count(record: StreamRecord, prompt_tokens: int) -> int | None:
    """usage.prompt_tokens_details.cached_tokens when the server reported a count from 0 to `prompt_tokens`
    (the prompt tokens its cache supplied), else None (not reported, or not a count of this prompt)."""
    details = (record.usage or {}).get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and not isinstance(cached, bool) and 0 <= cached <= prompt_tokens:
        return cached
    return None


# An idle pooled connection is dropped after this many seconds: below the 5 s after which llama-server
# (cpp-httplib) and uvicorn close an idle keep-alive connection, as the OpenAI SDK's client (httpx, 5 s) keeps
# them; aiohttp's own 15 s let a turn sent after a think time reuse a connection the server was closing.
KEEPALIVE_S = 4.0


def client_session(config: EndpointConfig):
    """An aiohttp session sized for `config.concurrency` keep-alive connections."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=config.concurrency, ttl_dns_cache=300, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s, sock_connect=config.connect_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)


async def replay(session, config: EndpointConfig, trace: Sequence[TraceRequest], prompts: Sequence[str],
                 max_new_tokens: int, *, closed_loop: bool = False, tokenizer=None, iteration: int = 0,
                 progress: Progress | None = None) -> ReplayResult:
    """Send every request of `trace` on `session` (see module docstring); `closed_loop=True` times each
    request from its own send (no arrival clock), as a closed-loop benchmark does."""
    result, records = await send_all(session, config, trace, prompts, max_new_tokens, closed_loop=closed_loop,
                                     progress=progress)
    return collect(result, trace, records, prompts, tokenizer, iteration)


async def send_all(session, config: EndpointConfig, trace: Sequence[TraceRequest], prompts: Sequence[str],
                   max_new_tokens: int, *, closed_loop: bool = False, progress: Progress | None = None,
                   origin_ns: int | None = None, concurrency: int | None = None
                   ) -> tuple[ReplayResult, list[tuple[StreamRecord, int | None, int]]]:
    """The sending half of `replay`: (the result's clock and lateness, per request (record, start, submit)).
    `origin_ns` (perf_counter_ns, one clock for every process of a machine): the replay's start, waited
    for (the load generator's workers share it); `concurrency`: this caller's share of the slots."""
    headers = config.headers()
    unknown = sorted({r.prompt_index for r in trace if not 0 <= r.prompt_index < len(prompts)})
    if unknown:
        raise ConfigError(f"trace refers to prompt_index {unknown[:5]} but there are {len(prompts)} prompts")
    limits = [r.max_new_tokens or max_new_tokens for r in trace]
    bodies = [encode_body(config, prompts[r.prompt_index], n) for r, n in zip(trace, limits)]
    slots = asyncio.Semaphore(concurrency or config.concurrency)
    result = ReplayResult()
    records: list[tuple[StreamRecord, int | None, int] | None] = [None] * len(trace)
    done = 0
    loop = asyncio.get_running_loop()
    if origin_ns is not None:
        await asyncio.sleep(max(0, origin_ns - time.perf_counter_ns()) / 1e9)
    result.origin_ns = origin_ns if origin_ns is not None else time.perf_counter_ns()
    origin_loop = loop.time() - (time.perf_counter_ns() - result.origin_ns) / 1e9

    async def one(k: int, request: TraceRequest) -> None:
        nonlocal done
        arrival_ns = result.origin_ns + int(request.arrival_s * 1e9)
        if not closed_loop:
            if request.arrival_s > 0:
                await asyncio.sleep(max(0.0, origin_loop + request.arrival_s - loop.time()))
            result.lateness_ms.append(max(0, time.perf_counter_ns() - arrival_ns) / 1e6)
        async with slots:
            record = await stream_request(session, config, bodies[k], headers, max_tokens=limits[k])
        records[k] = (record, None if closed_loop else record.start_ns, record.start_ns if closed_loop else arrival_ns)
        done += 1
        if progress:
            progress("requests", done, len(trace))

    await asyncio.gather(*(one(k, r) for k, r in enumerate(trace)))
    result.end_ns = time.perf_counter_ns()
    return result, records


def collect(result: ReplayResult, trace: Sequence[TraceRequest], records, prompts: Sequence[str], tokenizer,
            iteration: int) -> ReplayResult:
    """The timing half of `replay`: records -> timings, outputs and failures (trace order), into `result`."""
    from infer_tune.runners.base import Output

    for request, entry in zip(trace, records):
        record, start_ns, submit_ns = entry
        result.resent += record.resent
        if not record.ok:
            result.failures.append(Failure(request.prompt_index, request.arrival_s, record.failure, record.message,
                                           record.status))
            continue
        prompt = prompts[request.prompt_index]
        n_prompt = prompt_token_count(record, prompt, tokenizer)
        timing, source, mismatch = to_timing(record, request.prompt_index, submit_ns, start_ns, iteration, n_prompt)
        result.timings.append(timing)
        result.token_sources[source] = result.token_sources.get(source, 0) + 1
        result.usage_mismatches += mismatch
        agreed = check_token_count(record)
        if agreed is None:
            result.token_count_unverified += 1
        elif not agreed:
            result.token_count_mismatches += 1
            if len(result.token_count_failures) < KEPT_TOKEN_FAILURES:
                result.token_count_failures.append({
                    "prompt_index": request.prompt_index, "arrival_s": request.arrival_s,
                    "streamed_tokens": len(record.delivery_ns), "usage_completion_tokens":
                    record.usage["completion_tokens"], "finish_reason": record.finish_reason})
        result.multi_token_deliveries += sum(1 for n in (timing.step_tokens or []) if n > 1)
        cached = cached_token_count(record, n_prompt)
        if cached is not None:
            result.cache_reports += 1
            result.cache_prompt_tokens += n_prompt
            result.cached_tokens += cached
        ids = tokenizer(record.text, add_special_tokens=False)["input_ids"] if tokenizer is not None else []
        result.outputs.append(Output(request.prompt_index, record.text, list(ids), n_prompt,
                                     record.finish_reason == "stop"))
    return result


def replay_trace(config: EndpointConfig, trace: Sequence[TraceRequest], prompts: Sequence[str], max_new_tokens: int,
                 *, closed_loop: bool = False, tokenizer=None, progress: Progress | None = None) -> ReplayResult:
    """Synchronous entry: open a session, replay `trace` once, close the session."""

    async def main() -> ReplayResult:
        async with client_session(config) as session:
            return await replay(session, config, trace, prompts, max_new_tokens, closed_loop=closed_loop,
                                tokenizer=tokenizer, progress=progress)

    return asyncio.run(main())
