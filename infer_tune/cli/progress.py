"""Progress for a log (CI, a pipe, a file): plain lines instead of rich's live bars, which show only on
a terminal. One line per finished config (`[3/14] quantize int8-dynamic-torch: decode 2.71x · 41s ·
recipe ETA 5m10s`; configs that finish together, the rows of one group of interleaved rounds, print
the ETA on the last line of the burst only, from the configs done so far) and, while a step stays silent (compilation, distillation, a long measurement), a
heartbeat line at most every `heartbeat_s` seconds naming the step and how long it has run.

The sweep reports a finished config as the stage `configs` (done / total of its configs; a first tick
when it starts) and a recipe's overall count as `recipe` right after; the label and key figure of the
config that finished are read from the result it has just saved in `out_dir`, and a baseline saved with
it gets a line of its own (report/leads.py says what each technique is judged on). Configs measured
together in interleaved rounds finish together: the first one's line carries the group's time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from infer_tune.document import ResultDocument

HEARTBEAT_S = 30.0
# a finished config's line waits this long for the recipe's count and for the configs that finish with it (the
# rows of one group of interleaved rounds are built and saved 2-3 s apart: perplexity, BLEU)
FLUSH_S = 10.0


def duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _printable(text: str) -> str:
    return "".join(ch if ch.isprintable() else " " for ch in str(text))


class LineProgress:
    """A `progress(stage, done, total, *info)` callback that prints lines through `emit`.

    `clock` and `start_thread=False` let a test drive it without waiting; `beat()` is what the
    heartbeat thread calls once a second.
    """

    def __init__(self, emit: Callable[[str], None], *, out_dir: Path | str | None = None,
                 heartbeat_s: float = HEARTBEAT_S, clock: Callable[[], float] = time.monotonic,
                 start_thread: bool = True) -> None:
        self.emit, self.clock, self.heartbeat_s = emit, clock, heartbeat_s
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.started = self.last_line = self.previous_finish = clock()
        self.stage: tuple[str, float, float | None] | None = None
        self.stage_started = self.started
        self.recipe: tuple[int, int] | None = None
        self.pending: tuple[float, int, int, list[str]] | None = None  # (when, done, total, what finished)
        self.seen = self._saved_runs()
        self.configs_done: int | None = None  # configs done in the current sweep (None: none started)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True) if start_thread else None

    # -- the callback
    def __call__(self, stage: str, done: float, total: float | None = None, *info) -> None:
        with self.lock:
            now = self.clock()
            if stage == "recipe":  # the count of the config just finished: its line waits for `beat`
                self.recipe = (int(done), int(total or 0))
                return
            # another config finishing at once (a group of interleaved rounds ends together): the line before
            # carries no ETA, which only the last of the burst can estimate
            burst = (stage == "configs" and self.pending is not None and self.configs_done is not None
                     and int(done) > self.configs_done and now - self.pending[0] < FLUSH_S)
            self._flush(now, eta=not burst)
            if stage == "configs":
                done, total = int(done), int(total or 0)
                if self.configs_done is None or done <= self.configs_done:  # a sweep (a recipe's stage) starts
                    self.configs_done = done
                    self.seen = self._saved_runs()
                    if done:
                        self.pending = (now, done, total, [f"{done} config(s) already measured (--resume)"])
                    return
                self.configs_done = done
                self.pending = (now, done, total, self._finished())
                return
            if self.stage is None or self.stage[0] != stage:
                self.stage_started = now
            self.stage = (_printable(stage), done, total)

    # -- lines
    def _flush(self, now: float, eta: bool = True) -> None:
        if self.pending is None:
            return
        when, done, total, what = self.pending
        self.pending = None
        step, self.previous_finish = when - self.previous_finish, when
        count_done, count_total = self.recipe if self.recipe else (done, total)
        elapsed = when - self.started
        left = ""
        if eta and 0 < count_done < count_total:
            left = f" · {'recipe ' if self.recipe else ''}ETA {duration(elapsed / count_done * (count_total - count_done))}"
        *earlier, last = what
        for line in earlier:  # the baseline saved with the first config of its group
            self._line(f"      {line}", now)
        self._line(f"[{done}/{total}] {last} · took {duration(step)} · elapsed {duration(elapsed)}{left}", now)
        self.stage = None

    def _line(self, text: str, now: float) -> None:
        self.last_line = now
        self.emit(text)

    def beat(self) -> None:
        """A finished config's line once its recipe count had time to arrive; a heartbeat when silent."""
        with self.lock:
            now = self.clock()
            if self.pending is not None and now - self.pending[0] >= FLUSH_S:
                self._flush(now)
            if now - self.last_line < self.heartbeat_s:
                return
            if self.stage is not None:
                name, done, total = self.stage
                where = f"{name} {done:g}/{total:g}" if isinstance(total, (int, float)) and total else name
                self._line(f"  ... still working: {where} (this step {duration(now - self.stage_started)}, "
                           f"elapsed {duration(now - self.started)})", now)
            else:
                self._line(f"  ... still working (elapsed {duration(now - self.started)})", now)

    # -- what finished
    def _saved_runs(self) -> set[str]:
        if self.out_dir is None or not self.out_dir.is_dir():
            return set()
        return {p.parent.name for p in self.out_dir.glob("*/result.json")}

    def _finished(self) -> list[str]:
        """`technique label: key figure` of each result saved since the last tick (a baseline saved with
        them first), or a plain word."""
        if self.out_dir is None:
            return ["config done"]
        new = self._saved_runs() - self.seen
        if not new:
            return ["config done"]
        self.seen |= new
        try:
            from infer_tune import results

            docs = results.find_results(self.out_dir)
            fresh = [d for d in docs if d.location is not None and d.location.name in new]
            fresh.sort(key=lambda d: d.technique != "baseline")
            return [_printable(describe(d, docs)) for d in fresh] or ["config done"]
        except Exception:  # noqa: BLE001 - a progress line must never stop a measurement
            return ["config done"]

    # -- the heartbeat thread
    def _run(self) -> None:
        while not self.stop.wait(1.0):
            self.beat()

    def __enter__(self) -> LineProgress:
        if self.thread is not None:
            self.thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=2)
        with self.lock:
            if exc_type is None:  # on an error the command's one `error:` line is what the log ends with
                self._flush(self.clock())


def describe(doc: ResultDocument, docs: list[ResultDocument]) -> str:
    """`technique label: key figures` for a finished result (a baseline: its TPOT and throughput)."""
    from infer_tune.report import leads

    if doc.technique == "baseline":
        tpot, tok_s = doc.tpot_p50_ms, doc.throughput_tok_s
        return (f"baseline: TPOT p50 {'-' if tpot is None else f'{tpot:.1f} ms'}, "
                f"{'-' if tok_s is None else f'{tok_s:.1f}'} tok/s")
    lead = leads.lead_for(doc, docs, leads.declared_columns())
    return f"{doc.technique} {doc.label or ''}: {lead.text()} (vs {lead.vs})"
