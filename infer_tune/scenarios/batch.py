"""`batch sweep` and `batch serve-sim`: batching measured the way serving engines are benchmarked.

The sweep runs the same prompts through padded static batches of each size on the closed-loop
`generation` runner (throughput, latency, padding waste, peak memory, the knee; a size that runs out
of memory or would exceed `memory_limit_bytes` is reported and the sweep goes on). The serving
simulation replays one seeded arrival trace per rate open-loop through the static and the continuous
batcher (`trace` runner) and adds goodput under the SLOs, the highest rate meeting them, plots and
the continuous-batching claim check. Every serving row is measured and saved by the sweep engine
(`session.run_configs`, with the technique's trace keys and `trace.jsonl`), then completed in its own
folder with the goodput under the command's SLOs, the plots and the summary.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from dataclasses import dataclass, field
from pathlib import Path

from infer_tune import results
from infer_tune.errors import ConfigError
from infer_tune.metrics import kv, memory
from infer_tune.metrics.saturation import SLO, goodput
from infer_tune.runners.base import Progress, RequestTiming
from infer_tune.runners.generation import generate_once
from infer_tune.scenarios.common import RunSpec, open_run
from infer_tune.session import find_result, measure_prepared, run_configs, run_fingerprint
from infer_tune.tuners.base import apply
from infer_tune.tuners.batch import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_TIMEOUT_MS,
    BatchConfig,
    analysis,
    arrivals,
)
from infer_tune.tuners.batch import plots as batch_plots
from infer_tune.tuners.batch.common import is_out_of_memory
from infer_tune.workload import Inputs, encode_batches, load_prompts


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
    docs: list[dict]
    skipped: list[dict]
    knee: int | None
    run_dirs: list[Path]


def _padded(inputs: Inputs, max_new_tokens: int) -> tuple[float, int]:
    """(padding share, longest padded prompt) of the batches, with the output length pinned."""
    positions = pads = 0
    width = 0
    for batch in inputs.batches:
        rows, prompt = batch["attention_mask"].shape
        width = max(width, int(prompt))
        positions += int(rows) * (int(prompt) + max_new_tokens)
        pads += int(rows) * int(prompt) - int(batch["attention_mask"].sum())
    return pads / positions if positions else 0.0, width


def run_sweep(spec: RunSpec, sweep: SweepSpec, progress: Progress | None = None) -> SweepResult:
    """Every batch size on the same prompts (the smallest size is the reference for output equality)."""
    largest = sweep.batch_sizes[-1]
    if spec.workload.limit is not None and spec.workload.limit < largest:
        raise ConfigError(f"limit {spec.workload.limit} is smaller than batch size {largest}; a batch needs as many "
                          "prompts as its size")
    run = open_run(spec, progress)
    loaded, ctx, workload, t = run.loaded, run.ctx, spec.workload, spec.workload.max_new_tokens
    if len(run.inputs.prompts) < largest:
        raise ConfigError(f"only {len(run.inputs.prompts)} prompts of '{workload.suite}' fit in max_prompt_tokens="
                          f"{workload.max_prompt_tokens}; batch size {largest} needs {largest}")
    # one untimed token first: safetensors weights are paged in lazily, and the prediction starts from the RSS
    generate_once(apply(loaded, BatchConfig(scheduler="sweep", batch_size=1), ctx), run.inputs.batches[0], 1)
    shape = kv.ModelShape.from_config(loaded.model.config)
    value_bytes = next(loaded.model.parameters()).element_size()
    docs: list[tuple[dict, list[dict]]] = []
    skipped: list[dict] = []
    measured: dict[int, tuple[int, int]] = {}
    reference: tuple[dict, list[dict]] | None = None
    for size in sweep.batch_sizes:
        config = BatchConfig(scheduler="sweep", batch_size=size)
        inputs = Inputs(prompts=run.inputs.prompts, rendered=run.inputs.rendered, templated=run.inputs.templated,
                        batches=encode_batches(loaded.tokenizer, run.inputs.rendered, size,
                                               add_special_tokens=not run.inputs.templated))
        sized = dataclasses.replace(workload, batch_size=size)
        share, width = _padded(inputs, t)
        predicted = memory.current_rss_bytes() + analysis.predicted_delta(
            size, size * (width + t), measured, analysis.analytic_batch_bytes(shape, size, width, t, value_bytes))
        if sweep.memory_limit_bytes is not None and predicted > sweep.memory_limit_bytes:
            skipped.append({"batch_size": size, "status": "over_memory_limit", "predicted_peak_bytes": predicted,
                            "reason": f"predicted peak {predicted} bytes > memory limit {sweep.memory_limit_bytes}"})
            continue
        fp = run_fingerprint(loaded, config.technique, config.to_dict(), sized, ctx.env, protocol=spec.protocol,
                             measure_ppl=False)
        done = find_result(ctx.out_dir, fp) if spec.resume else None
        if done is not None:
            doc, outputs = done, results.load_outputs(done["_path"])
        else:
            prepared = apply(loaded, config, ctx)
            try:
                doc, outputs = measure_prepared(
                    loaded, prepared, inputs, sized, spec.protocol, technique=config.technique,
                    config=config.to_dict(), env=ctx.env, runner="generation", measure_ppl=False,
                    baseline=reference[0] if reference else None,
                    baseline_outputs=reference[1] if reference else None, progress=progress)
            except Exception as exc:  # noqa: BLE001 (only allocation failures are reported; the rest re-raise)
                if not is_out_of_memory(exc):
                    raise
                skipped.append({"batch_size": size, "status": "out_of_memory", "predicted_peak_bytes": predicted,
                                "reason": str(exc).splitlines()[0][:200]})
                del prepared
                gc.collect()
                continue
            m = doc["metrics"]
            m.update(batch_size=size, padding_share=share, predicted_peak_bytes=predicted,
                     memory_limit_bytes=sweep.memory_limit_bytes,
                     exceeded_memory_limit=(sweep.memory_limit_bytes is not None
                                            and m["peak_rss_bytes"] > sweep.memory_limit_bytes))
            m.setdefault("output_mismatches", 0 if reference is None else None)
            doc["_path"] = str(results.save_run(ctx.out_dir, doc, outputs).run_dir)
        reference = reference or (doc, outputs)
        measured[size] = (doc["metrics"]["peak_rss_delta_bytes"], size * (width + t))
        docs.append((doc, outputs))
    return _finish_sweep(docs, skipped, loaded.ref)


def _finish_sweep(docs: list[tuple[dict, list[dict]]], skipped: list[dict], model: str) -> SweepResult:
    throughput = {d["metrics"]["batch_size"]: d["metrics"]["output_throughput_tok_s"] for d, _ in docs}
    knee, gains = analysis.knee(throughput)
    rows = [{"batch_size": d["metrics"]["batch_size"], "throughput": d["metrics"]["output_throughput_tok_s"],
             "e2e_p50_ms": d["metrics"]["e2e_ms"]["p50"], "padding_share": d["metrics"]["padding_share"]}
            for d, _ in docs]
    png = batch_plots.sweep_png(rows, knee, f"{model}: padded static batches, closed loop") if rows else None
    reference = docs[0][0]["metrics"]["batch_size"] if docs else None
    run_dirs = []
    for doc, _ in docs:
        size = doc["metrics"]["batch_size"]
        doc["metrics"].update(knee_batch_size=knee, is_knee=size == knee, reference_batch_size=reference,
                              gain_per_doubling=gains.get(size))
        doc["sweep"] = {"throughput_by_batch_size": {str(k): v for k, v in throughput.items()},
                        "knee_batch_size": knee, "not_measured": skipped}
        results.update_result(doc)  # its folder exists since its measurement: complete it there
        if png:
            results.add_files(doc, {"sweep.png": png})
        run_dirs.append(Path(doc["_path"]))
    return SweepResult(docs=[d for d, _ in docs], skipped=skipped, knee=knee, run_dirs=run_dirs)


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
    docs: list[dict]
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
    _, docs = run_configs(loaded, run.inputs, spec.workload, spec.protocol, configs, ctx, resume=spec.resume,
                          measure_ppl=False)
    return _finish_serve(docs, serve)


def _finish_serve(measured: list[dict], serve: ServeSpec) -> ServeResult:
    """Goodput under the SLOs, the highest rate meeting them, the claim check and the plots; saved into every result."""
    table: dict[str, list[dict]] = {}
    for doc in measured:
        m = doc["metrics"]
        replays = (m.get("rounds") or {}).get("rounds") or 1  # the samples hold every round's replay of the trace
        m.update(goodput(timings_from_samples(doc["samples"]), serve.slo, m["trace_duration_s"] * replays))
        table.setdefault(doc["config"]["scheduler"], []).append(
            {"rate": doc["config"]["rate"], "slo_attainment": m["slo_attainment"], "goodput_req_s": m["goodput_req_s"],
             "busy_share": m.get("busy_share"),
             "throughput": m["output_throughput_tok_s"], "e2e_mean_ms": m["e2e_ms"]["mean"],
             "e2e_p90_ms": m["e2e_ms"]["p90"], "metrics": m})
    summary: dict = {"slo": serve.slo.to_dict(), "slo_target": serve.slo_target, "max_rate_meeting_slo": {
        name: analysis.max_rate_meeting_slo(rows, serve.slo_target) if serve.slo.given else None
        for name, rows in table.items()}}
    claim, by_rate = None, []
    if {"static", "continuous"} <= set(table):
        claim, by_rate = analysis.claims_by_rate({r["rate"]: r["metrics"] for r in table["static"]},
                                                 {r["rate"]: r["metrics"] for r in table["continuous"]})
    summary["claim_check"] = claim
    summary["claim_by_rate"] = by_rate
    files = batch_plots.sweep_plots(measured)
    run_dirs = []
    for doc in measured:
        doc["metrics"]["max_rate_meeting_slo"] = summary["max_rate_meeting_slo"].get(doc["config"]["scheduler"])
        if claim is not None:
            doc["metrics"]["claim_check"] = claim  # the claims table reads it from every result
        doc["serve_summary"] = summary
        # the run folder exists since its measurement (trace.jsonl included): complete it there
        results.update_result(doc)
        results.add_files(doc, files)
        run_dirs.append(Path(doc["_path"]))
    return ServeResult(docs=measured, summary=summary, run_dirs=run_dirs)
