"""Multi-process load generation: one replay spread over N worker processes, each with its own event loop.

One Python event loop saturates long before the hundreds to thousands of concurrent streams a served
fleet is benchmarked at, and a saturated client reads its own queue as the server's TTFT. So:
- the trace (the same seeded arrivals as a single-loop replay) is scheduled centrally: request k goes to
  worker k mod N with its absolute arrival time; the concurrency limit is split over the workers;
- every worker opens its own event loop and connection pool (its share of the connections opened before
  the start, as a warm pool of a long-running load generator would be), reports ready, and waits for one shared
  start time on `perf_counter_ns` (CLOCK_MONOTONIC on Linux: one clock for every process of the
  machine), so arrivals, sends and deliveries of all workers are on one clock and merge as they are;
- every worker measures its own saturation while it sends: event-loop lag (a 5 ms sleep's overshoot),
  its CPU share (process time / wall time) and its timers' lateness at the arrivals. `saturation`
  turns them into `client_saturated` and the reason, which the endpoint runner writes into the result.
The single-loop client measures the same (`monitored`), so a saturated run is flagged either way.
Definitions and measured numbers: docs/endpoint.md ("Load generation across processes").
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from infer_tune.endpoint import replay as rp
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.errors import InferTuneError as EndpointError

if TYPE_CHECKING:
    from infer_tune.runners.trace import TraceRequest

STREAMS_PER_WORKER = 128  # concurrent streams one worker's loop is given by default
LAG_PERIOD_S = 0.005
LAG_P50_LIMIT_MS = 2.0  # a loop this late on a typical tick delays a typical timestamp as much
LAG_P99_LIMIT_MS = 20.0
CPU_SHARE_LIMIT = 0.90  # a worker this busy has no slack left for the next read
LATENESS_P50_LIMIT_MS = 2.0
START_MARGIN_NS = 200_000_000  # the shared start lies this far after the last worker reported ready


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_workers(concurrency: int, available: int | None = None) -> int:
    """One worker per STREAMS_PER_WORKER concurrent streams, at most one per core."""
    return max(1, min(available or cores(), math.ceil(concurrency / STREAMS_PER_WORKER)))


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def monitored(coro):
    """Run `coro` while sampling this loop's lag and this process's CPU; (its result, the readings)."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            before = loop.time()
            await asyncio.sleep(LAG_PERIOD_S)
            lags.append(max(0.0, (loop.time() - before - LAG_PERIOD_S) * 1e3))

    watcher = asyncio.ensure_future(watch())
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        result = await coro
    finally:
        stop.set()
        await watcher
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    return result, {"loop_lag_ms_p50": _quantile(lags, 0.5), "loop_lag_ms_p99": _quantile(lags, 0.99),
                    "loop_lag_ms_max": max(lags, default=None), "lag_samples": len(lags),
                    "cpu_share": cpu / wall if wall > 0 else None, "wall_s": wall}


def saturation(workers: list[dict], lateness_ms: Sequence[float] = ()) -> dict:
    """`client_saturated` and why, from the workers' readings (and the arrivals' timer lateness)."""
    reasons = []
    for i, w in enumerate(workers):
        who = f"worker {i}" if len(workers) > 1 else "the client loop"
        if (w.get("loop_lag_ms_p50") or 0) > LAG_P50_LIMIT_MS:
            reasons.append(f"{who}: event-loop lag p50 {w['loop_lag_ms_p50']:.1f} ms > {LAG_P50_LIMIT_MS:g} ms")
        elif (w.get("loop_lag_ms_p99") or 0) > LAG_P99_LIMIT_MS:
            reasons.append(f"{who}: event-loop lag p99 {w['loop_lag_ms_p99']:.1f} ms > {LAG_P99_LIMIT_MS:g} ms")
        if (w.get("cpu_share") or 0) > CPU_SHARE_LIMIT:
            reasons.append(f"{who}: CPU {100 * w['cpu_share']:.0f}% of a core > {100 * CPU_SHARE_LIMIT:.0f}%")
    late = _quantile(list(lateness_ms), 0.5)
    if late is not None and late > LATENESS_P50_LIMIT_MS:
        reasons.append(f"arrivals sent late: p50 {late:.1f} ms > {LATENESS_P50_LIMIT_MS:g} ms")
    return {"client_saturated": bool(reasons), "client_saturation_reason": "; ".join(reasons) or None}


async def open_connections(session, config: EndpointConfig, count: int) -> None:
    """Open `count` keep-alive connections before the start (GET /models on each), so the timed requests
    do not pay TCP setup: a served fleet's load generator runs on warm pools."""
    headers = config.headers()

    async def one() -> None:
        try:
            async with session.get(f"{config.url}/models", headers=headers) as response:
                await response.read()
        except Exception:  # noqa: BLE001  (a cold connection is only slower; the replay reports real failures)
            pass

    await asyncio.gather(*(one() for _ in range(count)))


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _worker_main(conn, config: EndpointConfig, trace: list[TraceRequest], prompts: list[str], max_new_tokens: int,
                 closed_loop: bool, concurrency: int) -> None:
    """One worker process: open a pool, say ready, wait for the shared start, replay its share, send it back."""

    async def run():
        async with rp.client_session(config) as session:
            await open_connections(session, config, min(concurrency, len(trace)))
            conn.send(("ready", os.getpid()))
            origin_ns = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
            return await monitored(rp.send_all(session, config, trace, prompts, max_new_tokens,
                                               closed_loop=closed_loop, origin_ns=origin_ns, concurrency=concurrency))

    try:
        (result, records), reading = asyncio.run(run())
        conn.send(("done", result.origin_ns, result.end_ns, result.lateness_ms, records, reading))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which raises it)
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def replay_workers(config: EndpointConfig, trace: Sequence[TraceRequest], prompts: Sequence[str], max_new_tokens: int,
                   *, workers: int, closed_loop: bool = False, tokenizer=None, iteration: int = 0,
                   passes: int = 1, timeout_s: float | None = None) -> tuple[rp.ReplayResult, dict]:
    """Replay `trace` over `workers` processes (`passes` times back to back in one launch: closed-loop
    passes, numbered from `iteration`); (the merged result, the client's readings)."""
    import multiprocessing as mp

    single = list(trace)
    trace = single * max(1, passes)
    workers = max(1, min(workers, len(trace) or 1))
    ctx = mp.get_context("spawn")
    parts = [list(range(w, len(trace), workers)) for w in range(workers)]
    shares = _shares(max(config.concurrency, workers), workers)
    pipes, procs = [], []
    for w in range(workers):
        parent, child = ctx.Pipe()
        sub = [trace[k] for k in parts[w]]
        proc = ctx.Process(target=_worker_main, args=(child, config, sub, list(prompts), max_new_tokens, closed_loop,
                                                      shares[w]), daemon=True, name=f"infer-tune-loadgen-{w}")
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    limit = timeout_s or (config.timeout_s * max(1, passes) + max((r.arrival_s for r in trace), default=0.0) + 60)
    try:
        for pipe in pipes:
            _expect(pipe, "ready", 60)
        origin_ns = time.perf_counter_ns() + START_MARGIN_NS
        for pipe in pipes:
            pipe.send(origin_ns)
        answers = [_expect(pipe, "done", limit) for pipe in pipes]
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    result = rp.ReplayResult(origin_ns=origin_ns, end_ns=max(a[2] for a in answers))
    records: list = [None] * len(trace)
    readings = []
    for w, answer in enumerate(answers):
        _, _, _, lateness, part_records, reading = answer
        result.lateness_ms += lateness
        for k, record in zip(parts[w], part_records):
            records[k] = record
        readings.append(dict(reading, requests=len(parts[w]), concurrency=shares[w]))
    n = len(single)
    for p in range(max(1, passes)):
        rp.collect(result, single, records[p * n:(p + 1) * n], prompts, tokenizer, iteration + p)
    return result, {"workers": workers, "worker_readings": readings}


def _expect(pipe, kind: str, timeout: float):
    try:
        if not pipe.poll(timeout):
            raise EndpointError(f"a load-generator worker did not answer within {timeout:.0f} s")
        message = pipe.recv()
    except (EOFError, OSError):
        raise EndpointError("a load-generator worker exited before answering") from None
    if message[0] == "error":
        raise EndpointError(f"a load-generator worker failed: {message[1]}")
    if message[0] != kind:
        raise EndpointError(f"a load-generator worker sent {message[0]!r}, expected {kind!r}")
    return message
