"""`batch sweep` and `batch serve-sim`: batching measured the way serving engines are benchmarked.

The sweep runs the same prompts through padded static batches of each size on the closed-loop
`generation` runner (throughput, latency, padding waste, peak memory, the knee; a size that runs out
of memory or would exceed `memory_limit_bytes` is reported and the sweep goes on). The serving
simulation replays one seeded arrival trace per rate open-loop through the static and the continuous
batcher (`trace` runner) and adds goodput under the SLOs, the highest rate meeting them, plots and
the continuous-batching claim check. Every row of both is measured, completed and saved by the sweep
engine (`sweep.run_configs`): the technique's keys and files come from its registry entry, what the
command's options define (the memory limit, the SLOs) from its `SweepPlan`; nothing here writes a result.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError
from infer_tune.metrics import kv, memory
from infer_tune.metrics.saturation import SLO, goodput
from infer_tune.runners.base import Progress, RequestTiming
from infer_tune.runners.generation import generate_once
from infer_tune.scenarios.common import RunSpec, open_run
from infer_tune.sweep import Admission, SweepPlan, run_configs
from infer_tune.tuners.base import Conclusion, apply
from infer_tune.tuners.batch import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_TIMEOUT_MS,
    BatchConfig,
    analysis,
    arrivals,
    padding,
)
from infer_tune.workload import Inputs, load_prompts


# --------------------------------------------------------------------------- sweep
@dataclass
class SweepSpec:
    """Batch sizes to sweep, and an optional cap on the process's peak memory (bytes)."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    memory_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ConfigError(f"batch_sizes must be integers >= 1, got {self.batch_sizes}")
        self.batch_sizes = sorted(set(self.batch_sizes))
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ConfigError(f"memory_limit_bytes must be > 0, got {self.memory_limit_bytes}")


@dataclass
class SweepResult:
    docs: list[ResultDocument]
    skipped: list[dict]
    knee: int | None
    run_dirs: list[Path]


def run_sweep(spec: RunSpec, sweep: SweepSpec, progress: Progress | None = None) -> SweepResult:
    """Every batch size on the same prompts, measured by the sweep engine one after another against the
    smallest size (the reference for output equality); a size predicted over the memory limit, or that
    runs out of memory, is reported and the sweep goes on."""
    largest = sweep.batch_sizes[-1]
    if spec.workload.limit is not None and spec.workload.limit < largest:
        raise ConfigError(f"limit {spec.workload.limit} is smaller than batch size {largest}; a batch needs as many "
                          "prompts as its size")
    run = open_run(spec, progress)
    loaded, ctx, workload = run.loaded, run.ctx, spec.workload
    if len(run.inputs.prompts) < largest:
        raise ConfigError(f"only {len(run.inputs.prompts)} prompts of '{workload.suite}' fit in max_prompt_tokens="
                          f"{workload.max_prompt_tokens}; batch size {largest} needs {largest}")
    # one untimed token first: safetensors weights are paged in lazily, and the prediction starts from the RSS
    generate_once(apply(loaded, BatchConfig(scheduler="sweep", batch_size=1), ctx), run.inputs.batches[0], 1)
    configs = [BatchConfig(scheduler="sweep", batch_size=size) for size in sweep.batch_sizes]
    plan = SweepPlan(reference="first", admit=MemoryAdmission(loaded, workload.max_new_tokens, sweep.memory_limit_bytes),
                     skip_out_of_memory=True, conclude=lambda docs, _: _memory_limit_keys(docs, sweep.memory_limit_bytes))
    _, docs = run_configs(loaded, run.inputs, workload, spec.protocol, configs, ctx, resume=spec.resume,
                          measure_ppl=False, plan=plan)
    return SweepResult(docs=docs, skipped=[s.to_dict() for s in plan.skipped],
                       knee=docs[0].metrics.get("knee_batch_size") if docs else None,
                       run_dirs=[Path(d.location) for d in docs])


class MemoryAdmission:
    """The sweep's `admit` callback: each size's peak memory predicted before it is prepared (the analytic
    bytes of its batch, or the growth measured on the smaller sizes scaled to it, whichever is larger,
    over the current RSS); a size over `memory_limit_bytes` is skipped."""

    def __init__(self, loaded, max_new_tokens: int, memory_limit_bytes: int | None) -> None:
        self.shape = kv.ModelShape.from_config(loaded.model.config)
        self.value_bytes = next(loaded.model.parameters()).element_size()
        self.new_tokens, self.limit = max_new_tokens, memory_limit_bytes
        self.work: dict[int, int] = {}  # batch size -> its padded positions (size x (widest prompt + new tokens))

    def __call__(self, config: BatchConfig, workload, inputs: Inputs, earlier: list[ResultDocument]) -> Admission:
        size, t = config.batch_size, self.new_tokens
        _, width = padding(inputs, t)
        self.work[size] = size * (width + t)
        measured = {d.metrics["batch_size"]: (d.metrics["peak_rss_delta_bytes"], self.work[d.metrics["batch_size"]])
                    for d in earlier if d.metrics.get("batch_size") in self.work}
        predicted = memory.current_rss_bytes() + analysis.predicted_delta(
            size, self.work[size], measured, analysis.analytic_batch_bytes(self.shape, size, width, t, self.value_bytes))
        facts = {"batch_size": size, "predicted_peak_bytes": predicted}
        if self.limit is not None and predicted > self.limit:
            return Admission(facts=facts, skip="over_memory_limit",
                             reason=f"predicted peak {predicted} bytes > memory limit {self.limit}")
        return Admission(metrics={"predicted_peak_bytes": predicted, "memory_limit_bytes": self.limit}, facts=facts)


def _memory_limit_keys(docs: list[ResultDocument], limit: int | None) -> Conclusion:
    """Whether each measured size's peak went over the command's memory limit (a setting of the sweep)."""
    out = Conclusion()
    for doc in docs:
        peak = doc.metric("peak_rss_bytes")
        out.metrics[doc.run_id] = {"memory_limit_bytes": doc.metrics.get("memory_limit_bytes", limit),
                                   "exceeded_memory_limit": limit is not None and peak is not None and peak > limit}
    return out


# --------------------------------------------------------------------------- serving simulation
@dataclass
class ServeSpec:
    """The offered load (rates, requests, burstiness), both batchers' settings and the SLOs."""

    rates: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0, 4.0])
    requests: int = 32
    batch_size: int = 8
    burstiness: float = 1.0
    timeout_ms: float = DEFAULT_TIMEOUT_MS
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    slo: SLO = field(default_factory=SLO)
    slo_target: float = 0.9
    schedulers: tuple[str, ...] = ("static", "continuous")
    allow_repeat: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rates:
            raise ConfigError("rates must name at least one request rate")
        for rate in self.rates:
            arrivals.check_rate(rate)
        self.rates = sorted(set(self.rates))
        arrivals.check_burstiness(self.burstiness)
        if self.requests < 1:
            raise ConfigError(f"requests must be >= 1, got {self.requests}")
        if not 0 < self.slo_target <= 1:
            raise ConfigError(f"slo_target must be in (0, 1], got {self.slo_target}")
        for name in self.schedulers:  # the configs validate the rest (batch size, timeout, token budget)
            self.config(name, self.rates[0])

    def config(self, scheduler: str, rate: float) -> BatchConfig:
        static = scheduler == "static"
        return BatchConfig(scheduler=scheduler, batch_size=self.batch_size, rate=rate, burstiness=self.burstiness,
                           requests=self.requests, timeout_ms=self.timeout_ms if static else None,
                           max_batch_tokens=None if static else self.max_batch_tokens, seed=self.seed,
                           allow_repeat=self.allow_repeat)


@dataclass
class ServeResult:
    docs: list[ResultDocument]
    summary: dict
    run_dirs: list[Path]


def check_prompt_count(spec: RunSpec, serve: ServeSpec) -> None:
    """More requests than the suite's prompts needs `allow_repeat` (checked before the model loads)."""
    available = sum(1 for _ in itertools.islice(load_prompts(spec.workload), serve.requests))  # lazy: stops early
    if serve.requests > available and not serve.allow_repeat:
        raise ConfigError(f"{serve.requests} requests but suite '{spec.workload.suite}' has {available} prompts; "
                          "ask for fewer requests or allow repeats (requests then sample prompts with replacement)")


def timings_from_samples(samples: dict) -> list[RequestTiming]:
    """Per-request timings rebuilt from a saved result's samples (TTFT, e2e and token count are enough for
    the SLO checks), so goodput can be judged again on a stored run."""
    out = []
    for i, (ttft, e2e, n) in enumerate(zip(samples["ttft_ms"], samples["e2e_ms"], samples["output_tokens"])):
        first, last = int(ttft * 1e6), int(e2e * 1e6)
        out.append(RequestTiming(samples["prompt_index"][i], 0, 0, 0, [first] + [last] * (n - 1)))
    return out


def run_serve(spec: RunSpec, serve: ServeSpec, progress: Progress | None = None) -> ServeResult:
    """Every rate x scheduler on the same seeded trace (prompts and output lengths fixed; arrivals per rate)."""
    check_prompt_count(spec, serve)
    run = open_run(spec, progress)
    loaded, ctx = run.loaded, run.ctx
    fitting = len(run.inputs.prompts)
    if serve.requests > fitting and not serve.allow_repeat:
        raise ConfigError(f"{serve.requests} requests but only {fitting} prompts fit in max_prompt_tokens="
                          f"{spec.workload.max_prompt_tokens}; ask for fewer requests or allow repeats")
    configs = [serve.config(name, rate) for rate in serve.rates for name in serve.schedulers]
    summary: dict = {}

    def conclude(docs: list[ResultDocument], _skipped) -> Conclusion:
        conclusion = serve_keys(docs, serve)
        summary.update(conclusion.sections[docs[0].run_id]["serve_summary"] if docs else {})
        return conclusion

    plan = SweepPlan(conclude=conclude)  # the engine saves the conclusion beside each row
    _, docs = run_configs(loaded, run.inputs, spec.workload, spec.protocol, configs, ctx, resume=spec.resume,
                          measure_ppl=False, plan=plan)
    return ServeResult(docs=docs, summary=summary, run_dirs=[Path(d.location) for d in docs])


def serve_keys(measured: list[ResultDocument], serve: ServeSpec) -> Conclusion:
    """Goodput under the command's SLOs, the highest rate meeting them and the claim check of every result
    (keys of the sweep's namespace) and the `serve_summary` section: a `Conclusion` the engine saves beside
    each row."""
    table: dict[str, list[dict]] = {}
    out = Conclusion()
    for doc in measured:
        replays = doc.rounds.get("rounds") or 1  # the samples hold every round's replay of the trace
        out.metrics[doc.run_id] = goodput(timings_from_samples(doc.samples), serve.slo,
                                          doc.metrics["trace_duration_s"] * replays)
        m = {**doc.metrics, **out.metrics[doc.run_id]}
        table.setdefault(doc.config["scheduler"], []).append(
            {"rate": doc.config["rate"], "slo_attainment": m["slo_attainment"], "goodput_req_s": m["goodput_req_s"],
             "busy_share": m.get("busy_share"),
             "throughput": m["output_throughput_tok_s"], "e2e_mean_ms": m["e2e_ms"]["mean"],
             "e2e_p90_ms": m["e2e_ms"]["p90"], "figures": m})
    summary: dict = {"slo": serve.slo.to_dict(), "slo_target": serve.slo_target, "max_rate_meeting_slo": {
        name: analysis.max_rate_meeting_slo(rows, serve.slo_target) if serve.slo.given else None
        for name, rows in table.items()}}
    claim, by_rate = None, []
    if {"static", "continuous"} <= set(table):
        claim, by_rate = analysis.claims_by_rate({r["rate"]: r["figures"] for r in table["static"]},
                                                 {r["rate"]: r["figures"] for r in table["continuous"]})
    summary["claim_check"] = claim
    summary["claim_by_rate"] = by_rate
    for doc in measured:
        out.metrics[doc.run_id].update({
            "max_rate_meeting_slo": summary["max_rate_meeting_slo"].get(doc.config["scheduler"]),
            **({"claim_check": claim} if claim is not None else {})})  # the claims table reads it from every result
        out.sections[doc.run_id] = {"serve_summary": summary}
    return out
