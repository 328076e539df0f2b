"""Batching: static batches vs continuous (iteration-level) batching on an open-loop arrival trace,
and the closed-loop batch-size sweep.

A `BatchConfig` with scheduler `static` or `continuous` runs on the `trace` runner: its trace is built
when the runner starts (the prompts' single-request greedy lengths are needed first, see
`TraceFactory`), and the scheduler replays it. A scheduler `sweep` row is one size of the closed-loop
batch-size sweep: the sweep engine runs it on the `generation` runner at its own batch size
(`BatchConfig.workload_for`), and `conclude` adds the knee over the sweep's rows. The commands, metric
definitions and design: docs/batch.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from infer_tune import models
from infer_tune.document import ResultDocument
from infer_tune.engines.base import LEAN, SLOTS, TORCH, config_engine, spelled
from infer_tune.errors import ConfigError
from infer_tune.metrics.schema import LEAN_LOOP_KEYS, SLOT_ENGINE_KEYS
from infer_tune.runners.prepared import PreparedModel
from infer_tune.runners.trace import TraceRequest
from infer_tune.tuners.base import (
    Conclusion,
    MeasuredRow,
    Offer,
    RunContext,
    TechniqueConfig,
    TuneAsk,
    Tuning,
    register_technique,
)
from infer_tune.tuners.batch import analysis
from infer_tune.tuners.batch import plots as batch_plots
from infer_tune.tuners.batch.arrivals import TraceRow, check_burstiness, check_rate, trace_plan
from infer_tune.tuners.batch.common import reference_tokens
from infer_tune.tuners.batch.continuous import ContinuousBatcher
from infer_tune.tuners.batch.report import report_columns
from infer_tune.tuners.batch.slots import SlotBatcher, prepare_model
from infer_tune.tuners.batch.static import StaticBatcher

SCHEDULERS = ("static", "continuous", "sweep")
# the in-process engines as this config's `engine` field and its results name them (engines/inprocess.py)
TORCH_ENGINE, LEAN_ENGINE = spelled(TORCH, "batch"), spelled(LEAN, "batch")
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
    rows; `full` for batch_size rows only (one graph: every step computes every slot). native_step (lean): the
    step in one native call where the model is one it runs (infer_tune/native/step.py; else compiled, the
    reason in `lean_native_fallback`). speculate (lean, native_step, continuous): prompt-lookup drafts of up to
    `speculate` tokens per decoding slot (n-grams up to `ngram`), verified in the same native step as the other
    slots' rows: the trace is replayed through `serve`'s engine loop (serving.py `LiveSlots`), mixed steps and all.
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
    engine: str = TORCH_ENGINE
    compile_prefill: bool = False
    step_buckets: str = "all"
    native_step: bool = False
    speculate: int = 0
    ngram: int = 2

    def __post_init__(self) -> None:
        self.engine = config_engine(self.engine, technique="batch", where="batch engine")
        if isinstance(self.speculate, bool) or not isinstance(self.speculate, int) or self.speculate < 0 \
                or isinstance(self.ngram, bool) or not isinstance(self.ngram, int) or self.ngram < 1:
            raise ConfigError(f"batch speculate must be an integer >= 0 and ngram >= 1, got {self.speculate!r}, "
                              f"{self.ngram!r}")
        if self.speculate and not (self.engine == LEAN_ENGINE and self.native_step and self.scheduler == "continuous"):
            raise ConfigError("batch speculate verifies drafts in the native step of the continuous lean engine: "
                              "it needs engine lean, native_step true and scheduler continuous")
        if self.step_buckets not in ("all", "full"):
            raise ConfigError(f"batch step_buckets must be 'all' or 'full', got '{self.step_buckets}'")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"batch scheduler must be one of {', '.join(SCHEDULERS)}, got '{self.scheduler}'")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch batch_size must be an integer >= 1, got {self.batch_size}")
        if self.scheduler == "sweep":
            if self.engine != TORCH_ENGINE:
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

    def workload_for(self, workload):
        """A sweep row runs the workload at its own batch size; trace rows run the sweep's."""
        return dataclasses.replace(workload, batch_size=self.batch_size) if self.scheduler == "sweep" else workload

    def runs_on(self) -> str | None:
        return SLOTS if self.engine == LEAN_ENGINE else None  # engine lean: the slot engine over the lean step

    def label(self) -> str:
        if self.scheduler == "sweep":
            return f"sweep-b{self.batch_size}"
        return f"{self.scheduler}-b{self.batch_size}-r{self.rate:g}" + (
            f"-k{self.burstiness:g}" if self.burstiness != 1.0 else "") + ("-lean" if self.engine == LEAN_ENGINE else "") \
            + ("-native" if self.engine == LEAN_ENGINE and self.native_step else "") \
            + (f"-lookup-k{self.speculate}" + (f"-ngram{self.ngram}" if self.ngram != 2 else "") if self.speculate else "")


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
            refs = self.scheduler.own_references(prepared, encoded, picks, workload.max_new_tokens, self.cache,
                                                 self.progress)
        self.scheduler.references = refs
        self.rows = [TraceRow(p, t, int(encoded[p]["input_ids"].shape[1]), max(len(refs[p]), 1)) for p, t in plan]
        return [TraceRequest(r.prompt_index, r.arrival_s, r.output_tokens) for r in self.rows]


def make_scheduler(config: BatchConfig, shared: dict | None = None, kv_dtype: str = "fp32"):
    if config.engine == LEAN_ENGINE and config.speculate:
        from infer_tune.tuners.batch.serving import LiveBatcher  # serve's loop: the drafts are verified there

        return LiveBatcher(config.batch_size, speculate=config.speculate, ngram=config.ngram, shared=shared,
                           compile_prefill=config.compile_prefill, every_bucket=config.step_buckets == "all",
                           native_step=config.native_step, kv_dtype=kv_dtype)
    if config.engine == LEAN_ENGINE:
        return SlotBatcher(config.batch_size, config.scheduler, timeout_ms=config.timeout_ms, shared=shared,
                           compile_prefill=config.compile_prefill, every_bucket=config.step_buckets == "all",
                           native_step=config.native_step, kv_dtype=kv_dtype)
    if kv_dtype != "fp32":
        raise ConfigError(f"the native step's {kv_dtype} KV cache: batch engine '{config.engine}' does not run the "
                          "native step (engine: lean, native_step: true)")
    if config.scheduler == "static":
        return StaticBatcher(config.batch_size, config.timeout_ms)
    return ContinuousBatcher(config.batch_size, config.max_batch_tokens)


def padding(inputs, max_new_tokens: int) -> tuple[float, int]:
    """(padding share, longest padded prompt) of the encoded batches, with the output length pinned."""
    positions = pads = 0
    width = 0
    for batch in inputs.batches:
        rows, prompt = batch["attention_mask"].shape
        width = max(width, int(prompt))
        positions += int(rows) * (int(prompt) + max_new_tokens)
        pads += int(rows) * int(prompt) - int(batch["attention_mask"].sum())
    return pads / positions if positions else 0.0, width


def finish_sweep_row(config: BatchConfig, doc: ResultDocument, inputs) -> None:
    """A batch-size sweep row's own keys: its size and padding waste; the reference row (compared with
    nothing) has no mismatches by definition."""
    share, _ = padding(inputs, doc["workload"]["max_new_tokens"])
    facts = {"batch_size": config.batch_size, "padding_share": share}
    if "output_mismatches" not in doc.metrics:
        facts["output_mismatches"] = 0 if doc.get("baseline_run_id") is None else None
    doc.add_metrics(facts, source="batch's sweep row")


def sweep_conclusion(docs: list[ResultDocument], skipped: list) -> Conclusion:
    """The keys that need every batch-size sweep row: throughput by size, the knee, the gain per doubling
    to the next size, the reference (smallest) size and the sizes not measured (`sweep.Skipped`), and the
    figure of throughput by batch size."""
    rows = sorted((d for d in docs if d["config"].get("scheduler") == "sweep"), key=lambda d: d["config"]["batch_size"])
    skipped = [s for s in skipped if getattr(s.config, "scheduler", None) == "sweep"]
    if not rows:
        return Conclusion()
    throughput = {d.metrics["batch_size"]: d.throughput_tok_s for d in rows}
    knee, gains = analysis.knee(throughput)
    reference = rows[0].metrics["batch_size"]
    section = {"throughput_by_batch_size": {str(k): v for k, v in throughput.items()}, "knee_batch_size": knee,
               "not_measured": [s.to_dict() for s in skipped]}
    table = [{"batch_size": d.metrics["batch_size"], "throughput": d.throughput_tok_s,
              "e2e_p50_ms": d.stat("e2e_ms"), "padding_share": d.metrics["padding_share"]}
             for d in rows]
    png = batch_plots.sweep_png(table, knee, f"{rows[0]['model']['ref']}: padded static batches, closed loop")
    return Conclusion(
        files={"sweep.png": png},
        metrics={d["run_id"]: {"knee_batch_size": knee, "is_knee": d.metrics["batch_size"] == knee,
                               "reference_batch_size": reference,
                               "gain_per_doubling": gains.get(d.metrics["batch_size"])} for d in rows},
        sections={d["run_id"]: {"sweep": section} for d in rows})


def conclude(docs: list[ResultDocument], skipped: list) -> Conclusion:
    """Over a sweep's batch rows: the claim (static vs continuous on the same trace, paired by rate), the
    trace rows' latency CDFs and throughput-latency curve, and the batch-size sweep's knee and figure."""
    sized = sweep_conclusion(docs, skipped)
    return Conclusion(claim=analysis.summarize(docs) if docs else None,
                      files={**(batch_plots.sweep_plots(docs) if docs else {}), **sized.files},
                      metrics=sized.metrics, sections=sized.sections)


def finish(row: MeasuredRow) -> dict[str, bytes] | None:
    """The trace keys of every trace-scheduled row, whichever command or recipe ran it: the trace replayed
    (`trace.jsonl`), each request's output length, the offered rate and the spread of the arrivals (a
    batch-size sweep row: its size and padding waste)."""
    import json

    from infer_tune.tuners.batch.arrivals import interarrival_cv, offered_rate

    config, doc, prepared = row.config, row.doc, row.prepared
    if config.scheduler == "sweep":
        finish_sweep_row(config, doc, row.inputs)
        return None
    factory = prepared.runner_options.get("trace")
    if not isinstance(factory, TraceFactory) or not factory.rows:
        return None
    rows = [r.to_dict() for r in factory.rows]
    times = [r["arrival_s"] for r in rows]
    doc.add_metrics({"offered_rate": offered_rate(times), "interarrival_cv": interarrival_cv(times)},
                    source="batch's finish")
    doc["workload"].update(requests=len(rows), rate=config.rate, burstiness=config.burstiness,
                           output_length="each prompt's single-request greedy length, capped at max_new_tokens")
    return {"trace.jsonl": "".join(json.dumps(r) + "\n" for r in rows).encode()}


BATCH_SLOTS = (4, 8)  # slots of tune's batched candidates (the reference serves 4 in parallel)
TUNE_DRAFTS = 8  # prompt-lookup drafts a step of tune's speculative batched candidates (the demo's lookup k)
BURST_RATE = 1000.0  # requests/s: every request of the workload arrives at once, so a row measures capacity


def tune_offer(ask: TuneAsk) -> list[Offer]:
    """What `tune` tries of batching, for the serving objectives, stacked on a base that may win: continuous
    batching on the lean slot engine (docs/batch.md), as many slots as BATCH_SLOTS. throughput: offered the
    workload's prompts in one burst, so the row's output tok/s is the stack's capacity (the baseline's is
    one request at a time); goodput: offered them as a seeded Poisson trace at `ask.rate` (one request per
    prompt, arrivals and order from `ask.seed`). The slot engine compiles its step: nothing when compiling
    is off. On a base the native step runs on (lean.runs_natively), the same slots with the native step as
    well (they compile nothing), and those with prompt-lookup drafts verified in the step (`speculate`
    TUNE_DRAFTS): whether speculation is on is what the measured goodput or throughput decides (on chat it
    costs a little, on copy-heavy edits it pays; docs/results.md). Nothing of its own, nor for the
    single-stream objectives."""
    from infer_tune.tuners import lean

    if ask.on is None or not ask.compile or ask.objective not in ("throughput", "goodput"):
        return []
    native = lean.runs_natively(ask.on)
    rate = ask.rate if ask.objective == "goodput" else BURST_RATE
    offers = [Offer(BatchConfig(scheduler="continuous", batch_size=n, rate=rate, engine=LEAN_ENGINE, seed=ask.seed,
                                native_step=step), role="part", compiles=not step)
              for step in ((False, True) if native else (False,)) for n in BATCH_SLOTS]
    if native:
        offers += [Offer(BatchConfig(scheduler="continuous", batch_size=n, rate=rate, engine=LEAN_ENGINE, seed=ask.seed,
                                     native_step=True, speculate=TUNE_DRAFTS), role="part", compiles=False)
                   for n in BATCH_SLOTS]
    return offers


# the metrics a batch row carries beyond the core (its namespace: metrics/schema.py)
METRIC_KEYS = {
    **dict.fromkeys(("scheduler", "timeout_ms", "max_batch_tokens", "max_batch_size", "mean_batch_size", "batches",
                     "batches_full", "batches_by_timeout", "batch_log", "busy_share", "forward_steps",
                     "scheduler_setup_s", "max_submit_lag_ms", "continuous_impl", "continuous_attn_impl"),
                    "how the scheduler batched the trace"),
    **dict.fromkeys(("trace_duration_s", "trace_requests", "trace_span_s", "offered_rate", "interarrival_cv"),
                    "the trace replayed"),
    "batch_size": "a batch-size sweep row's size", "padding_share": "share of padded positions",
    "gain_per_doubling": "throughput gain to the next size (the sweep's)",
    "reference_batch_size": "the sweep's reference (smallest) size",
    **SLOT_ENGINE_KEYS, **LEAN_LOOP_KEYS,
}


@register_technique(BatchConfig, runner="trace", measure_ppl=False, finish=finish, conclude=conclude,
                    objective="throughput", report_columns=report_columns, tune=Tuning(offer=tune_offer),
                    metric_keys=METRIC_KEYS)
def prepare_batch(loaded: models.LoadedModel, config: BatchConfig, ctx: RunContext) -> PreparedModel:
    """The model unchanged; the trace runner gets the trace factory and the scheduler (a sweep row: the
    closed-loop `generation` runner at its batch size)."""
    options: dict = {}
    facts: dict = {}
    if config.scheduler != "sweep":
        if config.engine == LEAN_ENGINE:  # before the references: they decode with the kernels the slots will run
            facts = prepare_model(loaded.model, config.batch_size)
        from infer_tune.tuners.kv_cache import native_kv_dtype

        scheduler = make_scheduler(config, ctx.cache, native_kv_dtype(ctx))
        options = {"trace": TraceFactory(config, scheduler, ctx.cache, ctx.progress), "scheduler": scheduler}
    return PreparedModel(model=loaded.model, tokenizer=loaded.tokenizer, label=config.label(), device=ctx.device,
                         runner_options=options, metrics=facts,
                         runner="generation" if config.scheduler == "sweep" else None)
