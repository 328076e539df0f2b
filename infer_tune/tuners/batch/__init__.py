"""Batching: static batches vs continuous (iteration-level) batching on an open-loop arrival trace,
and the closed-loop batch-size sweep.

A `BatchConfig` with scheduler `static` or `continuous` runs on the `trace` runner: its trace is built
when the runner starts (the prompts' single-request greedy lengths are needed first, see
`TraceFactory`), and the scheduler replays it. Scheduler `sweep` rows are measured by the
`batch sweep` scenario on the closed-loop `generation` runner. The commands, metric definitions and
design: docs/batch.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from infer_tune import models
from infer_tune.errors import ConfigError
from infer_tune.runners.prepared import PreparedModel
from infer_tune.runners.trace import TraceRequest
from infer_tune.tuners.base import RunContext, TechniqueConfig, register_technique
from infer_tune.tuners.batch import analysis
from infer_tune.tuners.batch import plots as batch_plots
from infer_tune.tuners.batch.arrivals import TraceRow, check_burstiness, check_rate, trace_plan
from infer_tune.tuners.batch.common import reference_tokens
from infer_tune.tuners.batch.continuous import ContinuousBatcher
from infer_tune.tuners.batch.report import report_columns
from infer_tune.tuners.batch.slots import SlotBatcher, prepare_model
from infer_tune.tuners.batch.static import StaticBatcher

SCHEDULERS = ("static", "continuous", "sweep")
ENGINES = ("transformers", "lean")
DEFAULT_TIMEOUT_MS = 250.0
DEFAULT_MAX_BATCH_TOKENS = 512


@dataclass
class BatchConfig(TechniqueConfig):
    """One batching run: the scheduler, its batch size, and (trace schedulers) the load it is offered.

    engine: `transformers` (static: left-padded `generate` calls; continuous: transformers' manager over a
    paged cache) or `lean` (both schedulers on a static per-slot cache with compiled prefill buckets and a
    compiled batched decode step, slots.py); stacks after quantize like any technique.
    compile_prefill (lean): prompts prefill through compiled length buckets (default off: measured no
    faster than eager here, docs/tune.md). step_buckets (lean): `all` compiles the step for 1, 2, 4 ... batch_size
    rows; `full` for batch_size rows only (one graph: every step computes every slot).
    """

    technique: ClassVar[str] = "batch"

    scheduler: str = "continuous"
    batch_size: int = 8
    rate: float | None = None
    burstiness: float | None = None
    requests: int | None = None
    timeout_ms: float | None = None
    max_batch_tokens: int | None = None
    seed: int = 0
    allow_repeat: bool = False
    engine: str = "transformers"
    compile_prefill: bool = False
    step_buckets: str = "all"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"batch engine must be one of {', '.join(ENGINES)}, got '{self.engine}'")
        if self.step_buckets not in ("all", "full"):
            raise ConfigError(f"batch step_buckets must be 'all' or 'full', got '{self.step_buckets}'")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"batch scheduler must be one of {', '.join(SCHEDULERS)}, got '{self.scheduler}'")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch batch_size must be an integer >= 1, got {self.batch_size}")
        if self.scheduler == "sweep":
            if self.engine != "transformers":
                raise ConfigError("batch engine 'lean' runs the static and continuous schedulers, not 'sweep'")
            return
        if self.rate is None:
            raise ConfigError(f"batch scheduler '{self.scheduler}' needs a rate (requests/s)")
        check_rate(self.rate)
        self.burstiness = 1.0 if self.burstiness is None else float(self.burstiness)
        check_burstiness(self.burstiness)
        if self.requests is not None and self.requests < 1:
            raise ConfigError(f"batch requests must be >= 1, got {self.requests}")
        if self.scheduler == "static":
            self.timeout_ms = DEFAULT_TIMEOUT_MS if self.timeout_ms is None else float(self.timeout_ms)
            if not 0 <= self.timeout_ms < math.inf:
                raise ConfigError(f"batch timeout_ms must be a finite number >= 0, got {self.timeout_ms}")
            if self.max_batch_tokens is not None:
                raise ConfigError("batch max_batch_tokens applies to the continuous scheduler only")
        else:
            self.max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS if self.max_batch_tokens is None else self.max_batch_tokens
            if self.max_batch_tokens < 1:
                raise ConfigError(f"batch max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
            if self.timeout_ms is not None:
                raise ConfigError("batch timeout_ms applies to the static scheduler only")

    def label(self) -> str:
        if self.scheduler == "sweep":
            return f"sweep-b{self.batch_size}"
        return f"{self.scheduler}-b{self.batch_size}-r{self.rate:g}" + (
            f"-k{self.burstiness:g}" if self.burstiness != 1.0 else "") + ("-lean" if self.engine == "lean" else "")


class TraceFactory:
    """Builds a config's trace when the trace runner starts: seeded prompt picks and arrivals, each request's
    output length = its prompt's single-request greedy length (capped at the workload's max_new_tokens).

    The greedy references are computed once per prompt (untimed, memoized in the run context's cache) and
    handed to the scheduler, which counts the requests whose output differs (`output_mismatches`).
    """

    def __init__(self, config: BatchConfig, scheduler, cache: dict, progress=None) -> None:
        self.config, self.scheduler, self.cache, self.progress = config, scheduler, cache, progress
        self.rows: list[TraceRow] = []

    def __call__(self, prepared: PreparedModel, inputs, encoded: list[dict], workload) -> list[TraceRequest]:
        c = self.config
        plan = trace_plan(c.requests or len(encoded), len(encoded), c.rate, burstiness=c.burstiness, seed=c.seed,
                          allow_repeat=c.allow_repeat)
        picks = [p for p, _ in plan]
        refs = reference_tokens(prepared, encoded, picks, workload.max_new_tokens, self.cache, self.progress)
        if hasattr(self.scheduler, "own_references"):  # an engine whose single-request greedy is its own
            self.scheduler.generate_references = refs
            refs = self.scheduler.own_references(prepared, encoded, picks, workload.max_new_tokens, self.cache)
        self.scheduler.references = refs
        self.rows = [TraceRow(p, t, int(encoded[p]["input_ids"].shape[1]), max(len(refs[p]), 1)) for p, t in plan]
        return [TraceRequest(r.prompt_index, r.arrival_s, r.output_tokens) for r in self.rows]


def make_scheduler(config: BatchConfig, shared: dict | None = None):
    if config.engine == "lean":
        return SlotBatcher(config.batch_size, config.scheduler, timeout_ms=config.timeout_ms, shared=shared,
                           compile_prefill=config.compile_prefill, every_bucket=config.step_buckets == "all")
    if config.scheduler == "static":
        return StaticBatcher(config.batch_size, config.timeout_ms)
    return ContinuousBatcher(config.batch_size, config.max_batch_tokens)


def _preflight(loaded: models.LoadedModel, config: BatchConfig, ctx: RunContext) -> None:
    if config.scheduler == "sweep":
        raise ConfigError("batch scheduler 'sweep' is the closed-loop batch-size sweep (infer-tune batch sweep); "
                          "a recipe runs 'static' or 'continuous' on an arrival trace")


def finalize_trace(config: BatchConfig, doc: dict, outputs: list[dict], prepared: PreparedModel, inputs,
                   ctx: RunContext) -> dict[str, bytes] | None:
    """The trace keys of every trace-scheduled row, whichever command or recipe ran it: the trace replayed
    (`trace.jsonl`), each request's output length, the offered rate and the spread of the arrivals."""
    import json

    from infer_tune.tuners.batch.arrivals import interarrival_cv, offered_rate

    factory = prepared.runner_options.get("trace")
    if not isinstance(factory, TraceFactory) or not factory.rows:
        return None
    rows = [r.to_dict() for r in factory.rows]
    times = [r["arrival_s"] for r in rows]
    doc["metrics"].update(offered_rate=offered_rate(times), interarrival_cv=interarrival_cv(times))
    doc["workload"].update(requests=len(rows), rate=config.rate, burstiness=config.burstiness,
                           output_length="each prompt's single-request greedy length, capped at max_new_tokens")
    return {"trace.jsonl": "".join(json.dumps(r) + "\n" for r in rows).encode()}


@register_technique(BatchConfig, runner="trace", preflight=_preflight, measure_ppl=False,
                    summarize=analysis.summarize, plots=batch_plots.sweep_plots, finalize=finalize_trace,
                    objective="throughput",
                    report_columns=report_columns)
def prepare_batch(loaded: models.LoadedModel, config: BatchConfig, ctx: RunContext) -> PreparedModel:
    """The model unchanged; the trace runner gets the trace factory and the scheduler (sweep: nothing)."""
    options: dict = {}
    facts: dict = {}
    if config.scheduler != "sweep":
        if config.engine == "lean":  # before the references: they decode with the kernels the slots will run
            facts = prepare_model(loaded.model, config.batch_size)
        scheduler = make_scheduler(config, ctx.cache)
        options = {"trace": TraceFactory(config, scheduler, ctx.cache, ctx.progress), "scheduler": scheduler}
    return PreparedModel(model=loaded.model, tokenizer=loaded.tokenizer, label=config.label(), device=ctx.device,
                         runner_options=options, metrics=facts)
