"""Multi-turn sessions against an endpoint: each session's turns in order, with the conversation so far.

A session arrives at its planned time (the arrival process of `endpoint sim`); its first turn is sent
then, and each later turn `think_s` after the previous answer ended, carrying every earlier user turn
and assistant answer: the server's own answers (`history="server"`, the default: what a user of that
server would see) or the conversation's recorded ones (`history="recorded"`: the same prompts whatever
the server answers, so two servers get identical requests). A turn that fails ends its session (the
later turns are not sent: `turns_not_sent`). At most `config.concurrency` requests are in flight.

A turn's `submit_ns` is when it was due (arrival for the first turn, answer + think time after), so
its TTFT includes any wait for a free slot, as in `replay`. Requests are indexed flat: turn k of a
session is request `plan.first_index + k`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from infer_tune.endpoint.client import encode_body, stream_request
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.replay import Progress, ReplayResult, collect
from infer_tune.endpoint.workloads import HISTORY, SessionPlan
from infer_tune.errors import ConfigError


@dataclass
class SessionsResult:
    """The replay's result (timings, outputs, failures by flat request index) and what was sent: the
    messages of every request sent (`sent[index]`), each request's turn (0-based), turns not sent."""

    result: ReplayResult
    sent: dict[int, list[dict]] = field(default_factory=dict)
    turn_of: dict[int, int] = field(default_factory=dict)
    turns_not_sent: int = 0


async def replay_sessions(session, config: EndpointConfig, plans: Sequence[SessionPlan], max_new_tokens: int, *,
                          history: str = "server", tokenizer=None, render=None,
                          progress: Progress | None = None) -> SessionsResult:
    """Run every session of `plans` on `session` (an aiohttp ClientSession); see the module docstring.
    `render(messages) -> str`: the prompt of the completions API (None: chat messages are sent)."""
    from infer_tune.runners.trace import TraceRequest

    if history not in HISTORY:
        raise ConfigError(f"--history must be one of {', '.join(HISTORY)}, got {history!r}")
    headers = config.headers()
    slots = asyncio.Semaphore(config.concurrency)
    out = SessionsResult(ReplayResult())
    entries: dict[int, tuple[TraceRequest, tuple]] = {}
    total = sum(len(p.conversation.users) for p in plans)
    done = 0
    loop = asyncio.get_running_loop()
    origin_ns = out.result.origin_ns = time.perf_counter_ns()
    origin_loop = loop.time()

    async def one(plan: SessionPlan) -> None:
        nonlocal done
        messages: list[dict] = []
        due_s = plan.arrival_s
        await asyncio.sleep(max(0.0, origin_loop + due_s - loop.time()))
        out.result.lateness_ms.append(max(0, time.perf_counter_ns() - origin_ns - int(due_s * 1e9)) / 1e6)
        c = plan.conversation
        for k, user in enumerate(c.users):
            index = plan.first_index + k
            messages = [*messages, {"role": "user", "content": user}]
            prompt = messages if render is None else render(messages)
            due_ns = origin_ns + int(due_s * 1e9)
            async with slots:
                record = await stream_request(session, config, encode_body(config, prompt, max_new_tokens), headers,
                                              max_tokens=max_new_tokens)
            out.sent[index] = list(messages)
            out.turn_of[index] = k
            entries[index] = (TraceRequest(index, due_s), (record, record.start_ns, due_ns), prompt)
            done += 1
            if progress:
                progress("turns", done, total)
            if not record.ok:
                out.turns_not_sent += len(c.users) - k - 1
                return
            end_ns = max([record.start_ns, *record.delivery_ns, *([record.finish_ns] if record.finish_ns else [])])
            answer = record.text if history == "server" else c.replies[k]
            messages = [*messages, {"role": "assistant", "content": answer}]
            if k + 1 < len(c.users):
                due_s = (end_ns - origin_ns) / 1e9 + plan.think_s[k]
                await asyncio.sleep(max(0.0, origin_loop + due_s - loop.time()))

    await asyncio.gather(*(one(p) for p in plans))
    out.result.end_ns = time.perf_counter_ns()
    order = sorted(entries)
    prompts = {i: entries[i][2] for i in order}
    collect(out.result, [entries[i][0] for i in order], [entries[i][1] for i in order], prompts, tokenizer, 0)
    return out
