"""Benchmarks of a live OpenAI-compatible server: closed loop (`bench --endpoint`), one arrival trace,
a request-rate sweep with its saturation knee (`endpoint sim`), and a reference engine on loopback.

The result documents come from `sweep.measure_prepared` with the `endpoint` runner and are saved by
the engine's writer (`sweep.save_rows`: no weights here and no plain baseline, so not `run_configs`),
so they have
the keys of in-process runs: `technique: "endpoint"`, `runner: "endpoint"`, `config` the endpoint
(the name of the key's environment variable, never the key), `env.endpoint` what the server says
about itself. There are no weights in this process: `model_bytes`, `ppl`, the roofline and the
server's memory are null; `client_peak_rss_bytes` is this client's. docs/endpoint.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer_tune import results
from infer_tune.document import ResultDocument
from infer_tune.endpoint.arrivals import poisson_trace
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.probe import ServerInfo, connect
from infer_tune.engines.base import ENDPOINT_ENGINE
from infer_tune.errors import ConfigError
from infer_tune.metrics import deltas, quality, saturation
from infer_tune.runners.base import Progress
from infer_tune.runners.endpoint import request_prompts
from infer_tune.runners.prepared import PreparedModel
from infer_tune.runners.trace import TraceRequest
from infer_tune.scenarios.common import RunSpec
from infer_tune.sweep import Row, measure_prepared, save_rows
from infer_tune.workload import Inputs, Protocol, load_prompts, prepare_inputs

COMPARED_WORKLOAD_KEYS = ("suite", "limit", "seed", "max_new_tokens", "chat_template", "lang", "max_prompt_tokens",
                          "prompt_field", "reference_field")


@dataclass
class RemoteModel:
    """Stands in for a `LoadedModel` when the weights live in a server: a name, where it is served,
    and the local tokenizer when one was given (None: prompts go as chat messages, tokens are
    counted from the stream)."""

    ref: str
    path: str
    tokenizer: Any = None
    model: None = None
    dtype: str | None = None
    device: str = "endpoint"
    weights: None = None  # the server's own weights (never `--weights random`)


@dataclass
class EndpointRun:
    model: RemoteModel
    inputs: Inputs
    config: EndpointConfig
    info: ServerInfo
    env: dict
    # the served weights' bytes when known (a GGUF infer-tune started the server on): model_bytes and the
    # roofline (`roofline_fraction`) of its rows; None for a remote server
    weight_bytes: int | None = None


@dataclass
class SweepOutcome:
    docs: list[ResultDocument]
    knee_rate: float | None
    saturated: list[bool]
    knee_status: str  # within / beyond / below the swept rates (metrics.saturation.knee)
    run_dirs: list[Path] = field(default_factory=list)


def load_tokenizer(ref: str, trust_remote_code: bool = False):
    """The tokenizer of a model reference (checkpoint dir, alias, .gguf or hub id), without its weights."""
    from transformers import AutoTokenizer

    from infer_tune import models
    from infer_tune.errors import ModelError

    location = models.resolve(ref)
    try:
        return AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer of {ref}: {str(exc).splitlines()[0]}") from None


def raw_inputs(spec: RunSpec, prompts) -> Inputs:
    """Without a tokenizer: the suite's first `limit` prompts as written (no chat template, no token cap)."""
    chosen = list(itertools.islice(prompts, spec.workload.limit)) if spec.workload.limit else list(prompts)
    if not chosen:
        raise ConfigError(f"suite '{spec.workload.suite}' has no prompts")
    return Inputs(prompts=chosen, rendered=[p.text for p in chosen], batches=[], templated=False)


def open_endpoint(spec: RunSpec, config: EndpointConfig, *, model_given: bool) -> EndpointRun:
    """Suite first (bad suites fail fast), the local tokenizer when a model was named, then the endpoint:
    reached, asked what it serves and about itself, its request form settled."""
    from infer_tune import env as envinfo

    prompts = load_prompts(spec.workload)
    tokenizer = load_tokenizer(spec.model, spec.trust_remote_code) if model_given else None
    if tokenizer is None and config.api == "completions" and spec.workload.chat_template:
        raise ConfigError("api 'completions' sends prompts rendered by the model's chat template: name the served "
                          "weights as model (for the tokenizer), or turn chat_template off")
    placeholder = RemoteModel(ref=spec.model, path="", tokenizer=tokenizer)
    inputs = prepare_inputs(placeholder, spec.workload, prompts) if tokenizer is not None else raw_inputs(spec, prompts)
    config, info = connect(config, request_prompts(inputs, config)[0])
    env = envinfo.collect_env(spec.threads)
    env["endpoint"] = info.to_env(config)
    model = RemoteModel(ref=spec.model if model_given else str(config.served_model),
                        path=f"{config.url}#{config.served_model}", tokenizer=tokenizer)
    return EndpointRun(model=model, inputs=inputs, config=config, info=info, env=env)


def subset_baseline(baseline: ResultDocument, baseline_outputs: list[dict],
                    outputs: list[dict]) -> tuple[ResultDocument, list[dict]]:
    """The baseline restricted to the prompts this run answered (failed requests leave gaps), with its
    BLEU / chrF recomputed on that subset so the drift compares the same prompts."""
    wanted = [o["prompt_id"] for o in outputs]
    by_id = {o["prompt_id"]: o for o in baseline_outputs}
    missing = [p for p in wanted if p not in by_id]
    if missing:
        raise ConfigError(f"baseline {baseline.run_id} has no output for prompt(s) {missing[:3]}; "
                          "measure it on the same workload")
    subset = [by_id[p] for p in wanted]
    if len(subset) == len(baseline_outputs):
        return baseline, subset
    scores = quality.reference_scores([o["output"] for o in subset], [o.get("reference") for o in subset])
    return dataclasses.replace(baseline, metrics={**baseline.metrics, **scores}), subset  # in memory, never saved


def check_baseline(baseline: ResultDocument, workload) -> None:
    theirs, ours = baseline.workload, workload.to_dict()
    for key in COMPARED_WORKLOAD_KEYS:
        if theirs.get(key) != ours.get(key):
            raise ConfigError(f"baseline {baseline.run_id} measured another workload: {key} "
                              f"{theirs.get(key)!r} vs {ours.get(key)!r} here")


def measure_endpoint(run: EndpointRun, spec: RunSpec, *, trace: list[TraceRequest] | None = None,
                     protocol: Protocol | None = None, baseline: tuple[ResultDocument, list[dict]] | None = None,
                     slo: dict[str, float] | None = None, extra_config: dict | None = None,
                     label_suffix: str = "", progress: Progress | None = None, engine: str = ENDPOINT_ENGINE,
                     engine_argv: list[str] | None = None) -> tuple[ResultDocument, list[dict]]:
    """One result document of the endpoint (closed loop, or one replay of `trace`), optionally against a
    baseline; with `slo`, goodput and SLO attainment (metrics.saturation). `engine`: the registered engine
    behind it (a server measured as it runs, unless infer-tune launched it: then its argv too)."""
    config = run.config
    prepared = PreparedModel(model=None, tokenizer=run.model.tokenizer, label=config.display_label() + label_suffix,
                             device="endpoint", metrics={"model_bytes": run.weight_bytes},
                             extra_model_bytes=run.weight_bytes or 0,
                             runner_options={"endpoint": config, "trace": trace, "slo": slo})
    config_dict = {**config.to_dict(), **(extra_config or {})}
    doc, outputs = measure_prepared(run.model, prepared, run.inputs, spec.workload, protocol or spec.protocol,
                                    technique="endpoint", config=config_dict, env=run.env, runner="endpoint",
                                    measure_ppl=False, execute=spec.execute, progress=progress, engine=engine,
                                    engine_argv=engine_argv)
    doc.model.update(model_bytes=run.weight_bytes, served_model=config.served_model, tokenizer=run.model.tokenizer is not None)
    if baseline is not None:
        base_doc, base_outputs = subset_baseline(baseline[0], baseline[1], outputs)
        doc.add_metrics(deltas.versus_baseline(doc.metrics, outputs, base_doc, base_outputs),
                        source="the deltas against the baseline file")
        doc.baseline_run_id = baseline[0].run_id
    return doc, outputs


def load_baseline(path: Path | None, spec: RunSpec, model_given: bool) -> tuple[ResultDocument, list[dict]] | None:
    """The baseline document and outputs, checked against the workload (before the endpoint is contacted)."""
    if path is None:
        return None
    if not model_given:
        raise ConfigError("drift against a baseline compares token sequences: name the served weights as model "
                          "(their tokenizer)")
    doc = results.load_result(path)
    check_baseline(doc, spec.workload)
    return doc, results.load_outputs(doc)


def run_endpoint_bench(spec: RunSpec, config: EndpointConfig, *, model_given: bool, baseline: Path | None = None,
                       launched: dict | None = None, progress: Progress | None = None) -> ResultDocument:
    """`bench --endpoint`: closed-loop passes per the protocol; the saved document (its `location` set).
    `launched`: how infer-tune started the server itself (a reference engine), recorded in `env.endpoint`."""
    reference = load_baseline(baseline, spec, model_given)
    run = open_endpoint(spec, config, model_given=model_given)
    if launched:
        run.env["endpoint"]["launched"] = launched
        run.weight_bytes = launched.get("weight_bytes")
    extra = {"engine": launched["engine"], "continuous_batching": launched["continuous_batching"]} if launched else None
    doc, outputs = measure_endpoint(run, spec, baseline=reference, extra_config=extra, progress=progress)
    return save_rows(spec.out_dir, [Row(doc, outputs)])[0]


def run_endpoint_trace(spec: RunSpec, config: EndpointConfig, trace: list[TraceRequest], *, model_given: bool,
                       slo: dict[str, float] | None = None, trace_info: dict | None = None,
                       progress: Progress | None = None) -> ResultDocument:
    """One open-loop replay of `trace` (e.g. `batch serve-sim --endpoint`), saved; goodput under `slo`."""
    run = open_endpoint(spec, config, model_given=model_given)
    doc, outputs = trace_document(run, spec, trace, slo or {}, trace_info or {}, progress)
    return save_rows(spec.out_dir, [Row(doc, outputs)])[0]


def trace_document(run: EndpointRun, spec: RunSpec, trace: list[TraceRequest], slo: dict[str, float],
                   trace_info: dict, progress: Progress | None) -> tuple[ResultDocument, list[dict]]:
    protocol = Protocol(warmup=spec.protocol.warmup, min_iterations=1, min_duration_s=0.0)
    rate = trace_info.get("rate_req_s", "")
    suffix = "" if "rate_req_s" not in trace_info else f" @{'inf' if rate is None else format(rate, 'g')}rps"
    return measure_endpoint(run, spec, trace=trace, protocol=protocol, slo=slo,
                            extra_config={"trace": {**trace_info, "requests": len(trace)}, "slo": dict(slo)},
                            label_suffix=suffix, progress=progress)


def run_endpoint_sweep(spec: RunSpec, config: EndpointConfig, rates: list[float], *, requests: int,
                       model_given: bool, burstiness: float = 1.0, slo: dict[str, float] | None = None,
                       knee_factor: float = 2.0, progress: Progress | None = None) -> SweepOutcome:
    """`endpoint sim`: one seeded arrival trace per rate (same seed, same prompts), each replayed once;
    then the knee marked on every document and a rates plot saved beside each."""
    run = open_endpoint(spec, config, model_given=model_given)
    measured = []
    for rate in sorted(rates):
        trace = poisson_trace(requests, rate, len(run.inputs.prompts), seed=spec.workload.seed, burstiness=burstiness)
        info = {"rate_req_s": None if math.isinf(rate) else rate, "burstiness": burstiness, "seed": spec.workload.seed}
        measured.append(trace_document(run, spec, trace, slo or {}, info, progress))
    knee_rate, saturated, status = saturation.knee(
        sorted(rates), [d.ttft_p50_ms for d, _ in measured],
        [d.metric("request_throughput_req_s") for d, _ in measured], knee_factor)
    png = rates_png([d for d, _ in measured], sorted(rates), knee_rate, f"{config.display_label()}: rate sweep")
    for rate, flag, (doc, _) in zip(sorted(rates), saturated, measured):
        doc.add_metrics({"offered_rate_req_s": None if math.isinf(rate) else rate, "saturated": flag,
                         "knee_rate_req_s": knee_rate, "knee_status": status, "knee_factor": knee_factor,
                         "sweep_rates": [None if math.isinf(r) else r for r in sorted(rates)]}, source="the rate sweep")
    docs = save_rows(spec.out_dir, [Row(doc, outputs, {"rates.png": png}) for doc, outputs in measured])
    return SweepOutcome(docs=docs, knee_rate=knee_rate, saturated=saturated, knee_status=status,
                        run_dirs=[Path(d.location) for d in docs])


def rates_png(docs: list[ResultDocument], rates: list[float], knee_rate: float | None, title: str) -> bytes:
    """Output tokens/s and TTFT p50 / p99 against the offered rate, the knee marked."""
    from infer_tune.report.plots import png_bytes, pyplot

    plt = pyplot()
    xs = [r if not math.isinf(r) else max([x for x in rates if not math.isinf(x)] or [1.0]) * 2 for r in rates]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(xs, [d.throughput_tok_s for d in docs], "o-", label="output tok/s")
    left.set_xlabel("offered rate (requests/s)")
    left.set_ylabel("output tokens/s")
    right = left.twinx()
    for stat, style in (("p50", "s--"), ("p99", "^:")):
        right.plot(xs, [d.stat("ttft_ms", stat) for d in docs], style, color="tab:red", label=f"TTFT {stat}")
    right.set_ylabel("TTFT (ms)")
    if knee_rate is not None:
        left.axvline(knee_rate, color="gray", linestyle="-.", label=f"knee {knee_rate:g} req/s")
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    left.legend(handles=handles, fontsize=7, loc="upper left")
    left.set_title(title)
    left.grid(True, alpha=0.3)
    return png_bytes(fig)


def served_weight_bytes(server) -> int | None:
    """Bytes of the GGUF a started server reads (its weights, as stored: llama.cpp's `--model` file); None for a
    server that was given no GGUF."""
    if "--model" not in server.command:
        return None
    path = Path(server.command[server.command.index("--model") + 1])
    return path.stat().st_size if path.suffix.lower() == ".gguf" and path.is_file() else None


def run_reference(spec: RunSpec, engine: str, config: EndpointConfig, *, continuous_batching: bool = False,
                  extra_args: list[str] | None = None, startup_timeout_s: float = 300.0, parallel: int = 1,
                  progress: Progress | None = None) -> ResultDocument:
    """Start a reference engine on loopback with `spec.model`'s weights, bench it like any endpoint, stop it.
    `parallel`: llama.cpp's server slots (the client keeps at least that many requests in flight)."""
    from infer_tune.endpoint.servers import local_server

    with local_server(engine, spec.model, continuous_batching=continuous_batching, threads=spec.threads,
                      startup_timeout_s=startup_timeout_s, parallel=parallel, extra_args=extra_args or ()) as server:
        config = dataclasses.replace(config, url=server.url, served_model=server.served_model,
                                     label=config.label or (engine if parallel == 1 else f"{engine} x{parallel}"),
                                     concurrency=max(config.concurrency, parallel))
        launched = {"engine": engine, "continuous_batching": continuous_batching or parallel > 1,
                    "parallel": parallel, "command": server.command, "weight_bytes": served_weight_bytes(server)}
        doc = run_endpoint_bench(spec, config, model_given=True, launched=launched, progress=progress)
    return doc
