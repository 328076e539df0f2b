"""The slot engine (slots.py) fed by live requests: what `infer-tune serve` runs (docs/endpoint.md, "Serving").

`LiveSlots` owns one `SlotEngine` and runs the continuous policy of `SlotBatcher` on requests as they come,
in the thread that calls `run()` (`infer-tune serve`: the process's main thread, the HTTP server on another)
or on a thread of its own (`start()`): before every decode step the waiting requests are admitted into the free slots (a batch-1
prefill each, whose greedy token is the request's first), then one batched step decodes a token for every
busy slot (rows 0 .. the highest busy one). A request ends at end-of-sequence (unless `ignore_eos`), at its
`max_tokens`, or when its slot's cache is full (`finish_reason` `length`). Tokens go to the request's
`emit(token, finish_reason)` callback on the engine thread, which must return at once (the server hands
them to its event loop). Greedy decoding only: a request's tokens are the ones this engine decodes for its
prompt alone (`alone`), whichever requests share its steps (the row kernels of `prepare_model`).

Every step bucket (and, compiled, every length bucket) is built and run once in `warm()`, before the
first request, so no compile happens inside a request.

Why the main thread: the native step and the prefill run torch's OpenMP parallel regions, and called from a
thread other than the one that set torch's threads they ran 2-3x slower on a 2-core host (the native step of
SmolLM2 int4 a8, medians of 40 steps in one process: 1 row 5.35 ms in the main thread against 14.67 ms in
another, 4 rows 8.96 against 20.74 ms; a 50-token prefill 70 against 123 ms), which is what a served
request paid when the engine ran on its own thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from infer_tune.tuners.batch.slots import (
    PREFILL_CHUNK,
    SlotBatcher,
    SlotEngine,
    greedy,
    rows_for,
    step_buckets,
)

Emit = Callable[[int | None, str | None], None]


@dataclass
class Sampling:
    """How a request samples its tokens (OpenAI's `temperature`, `top_p`, `top_k` and `seed`): the logits over
    `temperature`, cut to the `top_k` most likely (0: all) and to the smallest set whose probability reaches
    `top_p`, then one draw from the request's own generator, seeded by `seed` (the same seed gives the same
    tokens, whichever requests share the steps: each row's logits are its own) or by the OS when None."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        import secrets

        if not self.temperature > 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"sampling needs temperature > 0, 0 < top_p <= 1, top_k >= 0; got {self}")
        self.generator = torch.Generator().manual_seed(self.seed if self.seed is not None else secrets.randbits(63))

    def pick(self, logits: torch.Tensor) -> int:
        scores = logits.to(torch.float32) / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1:
            ordered, order = torch.sort(scores, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            before = probs.cumsum(-1) - probs  # the probability of the tokens ranked above each
            scores = scores.clone()
            scores[order[before >= self.top_p]] = float("-inf")  # past the nucleus (its first token always stays)
        return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator))


@dataclass
class LiveRequest:
    """One request: its prompt ids, how many tokens at most, and where its tokens go."""

    ids: list[int]
    max_tokens: int
    emit: Emit
    ignore_eos: bool = False
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)
    submitted_ns: int = 0
    cached: int = 0  # prompt tokens whose cache rows the prefix cache gave (prefill skipped)
    sampling: Sampling | None = None  # None: greedy
    # log probabilities asked for (None: not asked; N: the chosen token's and the N most likely): per emitted token
    # (token, its log probability, [(id, log probability)] of the N most likely), from the logits row it was
    # picked from (before temperature or truncation), appended before the token is emitted
    logprobs: int | None = None
    token_logprobs: list = field(default_factory=list)

    def pick(self, logits: torch.Tensor) -> int:
        """The request's next token from its logits [V]: greedy, or sampled."""
        return int(greedy(logits[None])[0]) if self.sampling is None else self.sampling.pick(logits)


class EngineStopped(RuntimeError):
    """The engine is stopping (or its thread failed): no new requests."""


class LiveSlots:
    """A `SlotEngine` serving requests submitted from any thread (module docstring)."""

    def __init__(self, model: torch.nn.Module, eos: list[int], *, slots: int, max_context: int, compile: bool = True,
                 compile_prefill: bool = False, every_bucket: bool = True, native_step: bool = False,
                 max_waiting: int = 256, prefill_chunk: int = PREFILL_CHUNK, prefix_cache: bool = True,
                 cache_mib: float = 1024.0, speculate: int = 0, ngram: int = 2, kv_dtype: str = "fp32",
                 engine: SlotEngine | None = None) -> None:
        self.model, self.eos, self.slots, self.max_context = model, set(eos), slots, max_context
        # the prefix cache (prefix.py): with the native step, whose prompts run through the same step as decoding
        self.prefix_cache, self.cache_mib = prefix_cache, cache_mib
        self.prefix = None
        # speculative decoding (native step): each decoding slot's prompt-lookup drafts, up to `speculate` a step,
        # verified in the same step as the other slots' rows (`_verify`)
        if speculate < 0 or ngram < 1:
            raise ValueError(f"speculate must be >= 0 and ngram >= 1, got {speculate} and {ngram}")
        self.speculate, self.ngram = speculate, ngram
        # per slot, the drafts its next verify pass may take: `speculate` at admission, then twice what its last
        # pass accepted plus one (a slot whose drafts keep failing costs one extra row a step, not K)
        self.draft_len = [speculate] * slots
        self.spec = {"verify_passes": 0, "drafted": 0, "accepted": 0,
                     "proposed_at": [0] * speculate, "accepted_at": [0] * speculate}
        self.every_bucket, self.max_waiting = every_bucket, max_waiting
        # `engine`: one already built (the batch technique's SlotBatcher replays a trace through this loop)
        self.engine = engine if engine is not None else SlotEngine(
            model, slots, max_context, compile=compile, compile_prefill=compile_prefill, every_bucket=every_bucket,
            native_step=native_step, prefill_chunk=prefill_chunk, kv_dtype=kv_dtype)
        if speculate and not self.engine.native:
            from infer_tune.errors import ConfigError

            why = self.engine.facts.get("lean_native_fallback") or "native_step is off"
            raise ConfigError(f"speculative decoding in the slots verifies in the native step, which does not run "
                              f"here: {why}")
        self._inbox: queue.Queue[LiveRequest] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # requests submitted and not yet in a slot (the inbox and the engine's queue)
        self._busy: list[LiveRequest | None] = [None] * slots
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._own_thread = False  # start()'s thread, joined by stop(); run()'s caller is not waited for
        self.failure: BaseException | None = None
        self._running = False
        self.served = 0
        self.steps = 0
        self.generated = 0

    # ------------------------------------------------------------------ before serving
    def warm(self, prompt: list[int]) -> float:
        """Prefill `prompt` once and run every step bucket (every length bucket when compiled); seconds taken."""
        started = time.perf_counter()
        engine = self.engine
        with torch.inference_mode():
            engine.admit(0, torch.tensor([prompt], dtype=torch.long))
            lengths, calls = (engine.lengths[:1], 1) if engine.native else (engine.lengths, 3 if engine.compile else 1)
            for rows in step_buckets(self.slots, self.every_bucket):
                for length in lengths:
                    for _ in range(calls):
                        engine.step(rows, torch.zeros(rows, dtype=torch.long), length)
            if engine.native:  # a mixed step: the slots' decode rows and a prompt's rows
                engine.positions.zero_()
                engine.mixed(self.slots, torch.zeros(self.slots, dtype=torch.long), [],
                             [(self.slots - 1, torch.tensor(prompt, dtype=torch.long), True)])
        engine.positions.zero_()
        if self.prefix is not None:
            self.prefix.forget_slots()
        return time.perf_counter() - started

    def alone(self, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
        """The tokens this engine decodes for `prompt` alone (slot 0, the smallest step bucket); call only
        while the engine thread is not running (tests, and the single-request references of a bench)."""
        if self._running:
            raise RuntimeError("alone() runs the engine in this thread: stop serving first")
        engine = self.engine
        rows = rows_for(0, self.slots, self.every_bucket)
        limit = self.limit(len(prompt), max_tokens)
        with torch.inference_mode():
            engine.positions.zero_()
            tokens = [int(greedy(engine.admit(0, torch.tensor([prompt], dtype=torch.long))[None])[0])]
            step_in = torch.zeros(rows, dtype=torch.long)
            while (ignore_eos or tokens[-1] not in self.eos) and len(tokens) < limit:
                step_in[0] = tokens[-1]
                tokens.append(int(greedy(engine.step(rows, step_in))[0]))
        engine.positions.zero_()
        if self.prefix is not None:
            self.prefix.forget_slots()
        return tokens

    def limit(self, prompt_tokens: int, max_tokens: int) -> int:
        """Most tokens a request of `prompt_tokens` may decode: `max_tokens`, and what its slot's cache holds."""
        return max(0, min(max_tokens, self.max_context - prompt_tokens))

    # ------------------------------------------------------------------ serving
    def start(self) -> LiveSlots:
        """Serve on a thread of its own (tests; `run()` serves in the calling thread, faster: module docstring)."""
        self._running = True
        self._own_thread = True
        self._thread = threading.Thread(target=self._run, name="infer-tune slots", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        """Serve in the calling thread until `stop()` (from a signal handler or another thread)."""
        self._running = True
        self._thread = threading.current_thread()
        self._run()

    @property
    def alive(self) -> bool:
        return self._running and self._thread is not None and self._thread.is_alive() and self.failure is None

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet in a slot (any thread)."""
        return self._pending

    @property
    def busy_slots(self) -> int:
        """Slots holding a request (any thread: a snapshot)."""
        return sum(r is not None for r in list(self._busy))

    def stats(self) -> dict:
        """What `/metrics` and `/health` report (any thread: a snapshot): requests served, steps run, tokens
        decoded, slots busy, requests waiting, and the prefix cache's counters (None without one)."""
        spec = None
        if self.speculate:
            s = self.spec
            spec = {**s, "draft_tokens": self.speculate, "ngram": self.ngram,
                    "acceptance": s["accepted"] / s["drafted"] if s["drafted"] else 0.0,
                    "acceptance_by_position": [a / p if p else None for a, p in zip(s["accepted_at"], s["proposed_at"])]}
        return {"slots": self.slots, "busy": self.busy_slots, "waiting": self.waiting, "served": self.served,
                "steps": self.steps, "generated_tokens": self.generated,
                "prefix_cache": self.prefix.stats() if self.prefix is not None else None, "speculative": spec}

    def submit(self, request: LiveRequest) -> None:
        """Queue a request (any thread). Raises EngineStopped when the engine no longer serves, and
        queue.Full when `max_waiting` requests already wait: all that wait are counted, those still in the
        inbox and those the engine took into its queue (a request stops waiting when it gets a slot or ends)."""
        if self._stop.is_set() or not self.alive:
            raise EngineStopped("the engine is not serving" + (f": {self.failure}" if self.failure else ""))
        with self._lock:
            if self._pending >= self.max_waiting:
                raise queue.Full
            self._pending += 1
        request.submitted_ns = time.perf_counter_ns()
        self._inbox.put(request)

    def _left_queue(self, n: int = 1) -> None:
        with self._lock:
            self._pending -= n

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the current step; requests still waiting or decoding end with finish_reason `abort`.
        Waits for start()'s thread; never for run()'s caller (the main thread of `serve`, which itself waits
        for the HTTP thread that calls this: joined, every SIGTERM took 10 s)."""
        self._stop.set()
        if self._own_thread and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        waiting: deque[LiveRequest] = deque()
        busy = self._busy
        try:
            with torch.inference_mode():
                self._loop(waiting, busy)
        except BaseException as exc:  # noqa: BLE001 (the thread's failure is reported to every request)
            self.failure = exc
        finally:
            self._running = False
            reason = "error" if self.failure is not None else "abort"
            ended = [*waiting, *(r for r in busy if r is not None), *self._drain()]
            waiting.clear()
            busy[:] = [None] * len(busy)
            with self._lock:
                self._pending = 0
            for request in ended:
                request.emit(None, reason)

    def _drain(self) -> list[LiveRequest]:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def _emit(self, busy: list[LiveRequest | None], nxt: torch.Tensor, slot: int, token: int,
              row: torch.Tensor | None = None) -> None:
        """Hand `token` to the request in `slot` (picked from the logits `row`); a finished request frees its
        slot, else the token is its next step's input."""
        request = busy[slot]
        if request.logprobs is not None and row is not None:
            logp = torch.log_softmax(row.float(), dim=-1)
            top = torch.topk(logp, request.logprobs) if request.logprobs else None
            request.token_logprobs.append((token, float(logp[token]), [] if top is None else
                                           list(zip(top.indices.tolist(), top.values.tolist()))))
        request.tokens.append(token)
        self.generated += 1
        if token in self.eos and not request.ignore_eos:
            finish = "stop"
        elif len(request.tokens) >= request.max_tokens or int(self.engine.positions[slot]) >= self.max_context:
            finish = "length"
        else:
            finish = None
        if finish is not None:  # counted before the finish is handed over: a client's next /metrics sees it
            self.served += 1
        request.emit(token, finish)
        if finish is not None:
            self._release(busy, slot)
        else:
            nxt[slot] = token

    def _release(self, busy: list[LiveRequest | None], slot: int) -> None:
        """Free `slot`; the prefix cache learns what its rows now hold (the ids fed through them, in order)."""
        request, busy[slot] = busy[slot], None
        if self.prefix is not None and request is not None:
            self.prefix.release(slot, (request.ids + request.tokens)[:int(self.engine.positions[slot])])

    def _gather(self, waiting: deque[LiveRequest], busy: list[LiveRequest | None]) -> bool:
        """Move arrived requests into `waiting` (waiting for one, bounded so a stop is seen, when nothing is
        running) and abort the cancelled running ones; False when there is nothing to do this turn."""
        if all(r is None for r in busy) and not waiting:
            try:
                waiting.append(self._inbox.get(timeout=0.1))
            except queue.Empty:
                return False
        waiting.extend(self._drain())
        for slot, request in enumerate(busy):
            if request is not None and request.cancelled:
                request.emit(None, "abort")
                self._release(busy, slot)
        if any(r.cancelled for r in waiting):  # clients that left while waiting give their places back now
            kept = [r for r in waiting if not r.cancelled]
            for request in waiting:
                if request.cancelled:
                    request.emit(None, "abort")
            self._left_queue(len(waiting) - len(kept))
            waiting.clear()
            waiting.extend(kept)
        return True

    def _next_live(self, waiting: deque[LiveRequest]) -> LiveRequest | None:
        """The oldest waiting request not cancelled (the cancelled ones before it are aborted), or None."""
        while waiting:
            request = waiting.popleft()
            self._left_queue()
            if not request.cancelled:
                return request
            request.emit(None, "abort")
        return None

    @staticmethod
    def _picks(logits: torch.Tensor, busy: list[LiveRequest | None], active: list[int]) -> list[int]:
        """Each row's next token: greedy for the whole step at once, a sampled request's from its own row."""
        picks = greedy(logits).tolist()
        for slot in active:
            if busy[slot].sampling is not None:
                picks[slot] = busy[slot].sampling.pick(logits[slot])
        return picks

    def _drafts(self, drafter, busy: list[LiveRequest | None], active: list[int]) -> list[tuple[int, torch.Tensor]]:
        """(slot, [its last token, drafts]) for each decoding slot whose text proposes a continuation: up to
        its `draft_len` drafts (`speculate` at first, then twice what its last pass accepted plus one), fewer
        where the request or the slot's cache has less room."""
        out = []
        for slot in active:
            request = busy[slot]
            if request.sampling is not None:  # drafts are checked against the greedy choice only
                continue
            room = min(request.max_tokens - len(request.tokens),
                       self.max_context - int(self.engine.positions[slot])) - 1
            if room < 1:
                continue
            proposal = drafter.propose(torch.tensor([request.ids + request.tokens]), min(self.draft_len[slot], room))
            if proposal:
                out.append((slot, torch.tensor([request.tokens[-1], *proposal], dtype=torch.long)))
        return out

    def _accept(self, busy: list[LiveRequest | None], nxt: torch.Tensor, slot: int, proposal: list[int],
                chosen: list[int], rows: torch.Tensor | None = None) -> None:
        """Keep the drafts the step chose too, and its own token after them (greedy: the text is the one decoding
        gives without drafts); the slot's rows past them are dropped by where its position stands."""
        from infer_tune.tuners.speculate.lean import leading_matches

        accepted = leading_matches(proposal, chosen)
        self.draft_len[slot] = min(self.speculate, 2 * accepted + 1)
        spec = self.spec
        spec["verify_passes"] += 1
        spec["drafted"] += len(proposal)
        spec["accepted"] += accepted
        for i in range(len(proposal)):
            spec["proposed_at"][i] += 1
            spec["accepted_at"][i] += i < accepted
        start = int(self.engine.positions[slot])
        for i, token in enumerate(proposal[:accepted] + [chosen[accepted]]):
            self.engine.positions[slot] = start + 1 + i  # the rows of its last token and the drafts before this one
            self._emit(busy, nxt, slot, token, None if rows is None else rows[i])
            if busy[slot] is None:
                break

    def _loop(self, waiting: deque[LiveRequest], busy: list[LiveRequest | None]) -> None:
        if self.engine.native:
            self._mixed_loop(waiting, busy)
            return
        engine, size = self.engine, self.slots
        nxt = torch.zeros(size, dtype=torch.long)
        while not self._stop.is_set():
            if not self._gather(waiting, busy):
                continue
            for slot in range(size):
                while busy[slot] is None and (request := self._next_live(waiting)) is not None:
                    busy[slot] = request
                    logits = engine.admit(slot, torch.tensor([request.ids], dtype=torch.long))
                    self._emit(busy, nxt, slot, request.pick(logits), logits)
            active = [s for s in range(size) if busy[s] is not None]
            if not active:
                continue
            rows = rows_for(active[-1], size, self.every_bucket)
            logits = engine.step(rows, nxt[:rows])
            picks = self._picks(logits, busy, active)
            self.steps += 1
            for slot in active:
                self._emit(busy, nxt, slot, picks[slot], logits[slot].reshape(-1))
            free = [slot for slot in range(rows) if busy[slot] is None]
            if free:  # a free row's write position stays inside its row (it writes harmlessly at 0)
                engine.positions[free] = 0

    def _mixed_loop(self, waiting: deque[LiveRequest], busy: list[LiveRequest | None]) -> None:
        """The native engine's loop: every step decodes a token for each decoding slot and, in the same call,
        runs up to `prefill_chunk` prompt tokens of the requests being admitted (oldest first, a long prompt
        over several steps), so a new request's prefill no longer stalls the slots that decode
        (docs/batch.md, "Mixed steps")."""
        engine, size, budget = self.engine, self.slots, self.engine.prefill_chunk
        if self.prefix_cache and self.prefix is None:
            from infer_tune.tuners.batch.prefix import PrefixCache

            self.prefix = PrefixCache(engine._native_cache().tensors(), max_context=self.max_context,
                                      budget_bytes=int(self.cache_mib * 2**20))
        prefix = self.prefix
        drafter = None
        if self.speculate:
            from infer_tune.tuners.speculate.lean import LookupDrafter

            drafter = LookupDrafter(self.ngram, sorted(self.eos))
        nxt = torch.zeros(size, dtype=torch.long)
        done = [0] * size  # per prefilling slot: prompt tokens in its cache
        filling: deque[int] = deque()  # slots being prefilled, oldest first
        while not self._stop.is_set():
            if not self._gather(waiting, busy):
                continue
            free = [slot for slot in range(size) if busy[slot] is None]
            while free and (request := self._next_live(waiting)) is not None:
                slot, reused = prefix.place(request.ids, free) if prefix is not None else (free[0], 0)
                free.remove(slot)
                busy[slot] = request
                request.cached = reused
                self.draft_len[slot] = self.speculate
                engine.positions[slot] = reused  # its prefill starts past the rows the cache gave
                done[slot] = reused
                filling.append(slot)
            for slot in list(filling):
                if busy[slot] is None:
                    filling.remove(slot)
            chunks, left = [], budget
            for slot in filling:
                if left == 0:
                    break
                ids = busy[slot].ids
                n = min(left, len(ids) - done[slot])
                chunks.append((slot, torch.tensor(ids[done[slot]:done[slot] + n], dtype=torch.long),
                               done[slot] + n == len(ids)))
                done[slot] += n
                left -= n
            active = [s for s in range(size) if busy[s] is not None and s not in filling]
            if not active and not chunks:
                continue
            verify = self._drafts(drafter, busy, active) if drafter is not None else []
            if verify:  # a slot with drafts runs its rows in the verify part of the step, not as a decode row
                drafted = {slot for slot, _ in verify}
                active = [s for s in active if s not in drafted]
            rows = rows_for(active[-1], size, self.every_bucket) if active else 0
            for slot in range(rows):  # a free row writes harmlessly past what its slot keeps
                if busy[slot] is None:
                    engine.positions[slot] = prefix.park(slot) if prefix is not None else 0
            logits, firsts = engine.mixed(rows, nxt[:rows], active, chunks, verify)
            self.steps += 1
            if active:
                picks = self._picks(logits, busy, active)
                for slot in active:
                    self._emit(busy, nxt, slot, picks[slot], logits[slot])
            for slot, ids in verify:
                rows_logits = firsts.pop(slot)
                self._accept(busy, nxt, slot, ids[1:].tolist(), greedy(rows_logits).tolist(), rows_logits)
            for slot, first in firsts.items():
                filling.remove(slot)
                self._emit(busy, nxt, slot, busy[slot].pick(first), first)


class LiveBatcher(SlotBatcher):
    """The batch technique's continuous lean scheduler with prompt-lookup drafts (`BatchConfig.speculate`): on the
    native step the trace is replayed through this module's loop (`LiveSlots`), what `serve` runs."""

    def __init__(self, batch_size: int, *, speculate: int, ngram: int = 2, **kwargs) -> None:
        super().__init__(batch_size, "continuous", **kwargs)
        self.speculate, self.ngram = speculate, ngram

    def _serve(self, prepared, trace, encoded, max_new_tokens, origin_ns, progress):
        if self.engine is None:
            self.setup(prepared, trace, encoded, max_new_tokens)
        if not self.engine.native:  # the model is not one the native step runs: no drafts (lean_native_fallback)
            return super()._serve(prepared, trace, encoded, max_new_tokens, origin_ns, progress)
        return self._serve_live(prepared, trace, encoded, max_new_tokens, origin_ns, progress)

    def _serve_live(self, prepared, trace, encoded, max_new_tokens, origin_ns, progress):
        """The trace replayed through `serve`'s own loop (serving.py `LiveSlots._mixed_loop` on this engine, in
        this thread): a feeder thread submits each request at its arrival, the loop admits it in mixed steps and
        each decoding slot's prompt-lookup drafts are verified beside the others' rows; no prefix cache (the
        trace's prompts are distinct; the cache is serving's)."""
        from infer_tune.runners.generation import eos_ids

        eos = eos_ids(prepared.model, prepared.tokenizer)
        live = LiveSlots(prepared.model, eos, slots=self.batch_size, max_context=self.engine.max_cache_len,
                         compile=False, native_step=True, prefix_cache=False, speculate=self.speculate,
                         ngram=self.ngram, engine=self.engine, max_waiting=max(256, len(trace)))
        n = len(trace)
        order = sorted(range(n), key=lambda k: trace[k].arrival_s)
        arrival_ns = [origin_ns + int(r.arrival_s * 1e9) for r in trace]
        tokens: list[list[int]] = [[] for _ in range(n)]
        stamps: list[list[int]] = [[] for _ in range(n)]
        start_ns = [0] * n
        ended = [0]
        lag = [0]

        def emitter(k: int):
            def emit(token, finish) -> None:  # on this (the engine's) thread
                if token is not None:
                    tokens[k].append(token)
                    stamps[k].append(time.perf_counter_ns())
                if finish is not None:
                    ended[0] += 1
                    if progress:
                        progress("requests", ended[0], n)
                    if ended[0] == n:
                        live.stop()
            return emit

        def feed() -> None:
            deadline = time.monotonic() + 60
            while not live.alive and time.monotonic() < deadline:  # run() below makes it alive
                time.sleep(0.001)
            for k in order:
                delay = (arrival_ns[k] - time.perf_counter_ns()) / 1e9
                if delay > 0:
                    time.sleep(delay)  # the trace's own arrival time
                now = time.perf_counter_ns()
                lag[0] = max(lag[0], now - arrival_ns[k])
                start_ns[k] = now
                ids = encoded[trace[k].prompt_index]["input_ids"][0].tolist()
                live.submit(LiveRequest(ids=ids, max_tokens=trace[k].max_new_tokens or max_new_tokens,
                                        emit=emitter(k)))

        feeder = threading.Thread(target=feed, name="infer-tune trace feeder", daemon=True)
        feeder.start()
        live.run()
        feeder.join(10)
        self.engine.positions.zero_()
        if live.failure is not None:
            raise live.failure
        if ended[0] < n:
            raise RuntimeError(f"the replay ended with {ended[0]} of {n} requests done")
        spec = live.stats()["speculative"]
        return self._finish(prepared, trace, encoded, set(eos), arrival_ns, start_ns, stamps, tokens, {
            "forward_steps": live.steps, "max_submit_lag_ms": lag[0] / 1e6, "spec_draft_tokens": self.speculate,
            "spec_drafted": spec["drafted"], "spec_accepted": spec["accepted"], "spec_acceptance": spec["acceptance"],
            "spec_acceptance_by_position": spec["acceptance_by_position"]})
